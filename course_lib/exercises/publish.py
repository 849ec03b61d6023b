"""``course exercises publish OUT`` (what students get, apart) and ``course exercises new NAME``
(a new exercise source from a template).

The sources in ``instructor/`` hold the solutions and the hidden tests; they are public in this
repository (exercises/README.md). What students are handed is generated from the built releases:
``publish`` copies each student release (notebook, public tests, manifest) and the course data
into a tree of its own, with a README that links each notebook for Colab. Nothing else goes in,
so an instructor who keeps private sources can publish this tree anywhere.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from course_lib.exercises.build import check_exercise
from course_lib.exercises.colab import colab_badge_line, exercise_setup_cell
from course_lib.exercises.layout import MANIFEST, Exercise

NAME = re.compile(r"\d\d_[a-z][a-z0-9_]*")


def published_files(ex: Exercise) -> list[Path]:
    """The files of ``ex``'s student release that its manifest lists, and the manifest."""
    manifest = json.loads((ex.release / MANIFEST).read_text(encoding="utf-8"))
    return [ex.release / rel for rel in sorted(manifest["files"])] + [ex.release / MANIFEST]


def publish(exercises: list[Exercise], out: str | Path, data: Path | None = None) -> list[Path]:
    """Write the student tree into ``out``: ``exercises/NN_topic/`` (student notebook, public
    tests, manifest) for each exercise, ``data/`` (the files of ``data``, if given) and README.md.
    Refuses a stale release (build it first) and an ``out`` that is not empty."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; publish into a new folder")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; publish into a new folder")
    stale = [msg for ex in exercises for msg in check_exercise(ex)]
    if stale:
        raise ValueError("stale student releases; run `course exercises build` first:\n" + "\n".join(stale))
    written = []
    for ex in exercises:
        for src in published_files(ex):
            dest = out / "exercises" / ex.name / src.relative_to(ex.release)
            dest.parent.mkdir(parents=True, exist_ok=True)
            written.append(Path(shutil.copy2(src, dest)))
    if data is not None and Path(data).is_dir():  # its files, not what `course data prepare` made in it
        (out / "data").mkdir(parents=True)
        written += [Path(shutil.copy2(p, out / "data" / p.name)) for p in sorted(Path(data).iterdir()) if p.is_file()]
    lines = ["# Exercises", "",
             ("Open a notebook in Colab from its badge, or in Jupyter next to its `tests/` folder. "
              "On Colab the first code cell installs the course package and copies the public tests "
              "(`grader.check`) next to the notebook: no clone is needed."), ""]
    for ex in exercises:
        lines += [f"- `{ex.name}`: {colab_badge_line(ex.name)}"]
    (out / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return written + [out / "README.md"]


def _template(name: str) -> list:
    # nbformat (0.15 s) only where a notebook is read: importing course_lib.exercises stays light
    import nbformat

    md, code, raw = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell, nbformat.v4.new_raw_cell
    title = name.split("_", 1)[1].replace("_", " ")
    return [
        md(f"{colab_badge_line(name)}\n\n# Exercise {int(name[:2])}: {title}\n\n"
           "This exercise follows lesson NN of the course (say which). Replace this template's "
           "question with your own."),
        raw(f"# ASSIGNMENT CONFIG\nname: {name}\ninit_cell: false\nexport_cell: false\n"
            "check_all_cell: false\nrun_tests: false\ntests:\n  files: true\n  ok_format: false\n"
            "generate:\n  show_stdout: true\n  plugins:\n    - course_lib.exercises.CellTimeLimit:\n"
            "        cell_timeout: 60"),
        code(exercise_setup_cell(name)),
        raw("# BEGIN QUESTION\nname: q1_mean\npoints: [1, 3]"),
        md("## Question 1: the mean (4 points: 1 public, 3 hidden)\n\nWrite `mean(values)`: the "
           "arithmetic mean of a non-empty list of numbers."),
        raw("# BEGIN SOLUTION"),
        code("def mean(values):\n    return sum(values) / len(values)  # SOLUTION\n\n\nmean([1, 2, 3, 4])"),
        raw("# END SOLUTION"),
        raw("# BEGIN TESTS"),
        code("def test_four_numbers(mean):\n"
             "    import importlib.util as _iu\n"
             "    _spec = _iu.find_spec(\"course_lib.exercises.grading\")\n"
             "    grading = _iu.module_from_spec(_spec)\n"
             "    _spec.loader.exec_module(grading)  # a fresh copy: no notebook cell can have patched it\n"
             "    grading.isolated(lambda: grading.assert_number(mean([1, 2, 3, 4]), 2.5, \"mean([1, 2, 3, 4])\"))"),
        code("# HIDDEN\n"
             "def test_drawn_lists(mean):\n"
             "    import importlib.util as _iu\n"
             "    _spec = _iu.find_spec(\"course_lib.exercises.grading\")\n"
             "    grading = _iu.module_from_spec(_spec)\n"
             "    _spec.loader.exec_module(grading)  # a fresh copy: no notebook cell can have patched it\n"
             "    draws = grading.fresh_copy(\"course_lib.exercises.draws\")  # inputs drawn at grading time\n"
             "    rng = draws.rng(\"q1_mean\")\n"
             "    lists = [[rng.randint(-100, 100) for _ in range(rng.randint(1, 20))] for _ in range(5)]\n\n"
             "    def check():\n"
             "        for values in lists:\n"
             "            grading.assert_number(mean(values), sum(values) / len(values), f\"mean({values})\")\n\n"
             "    grading.isolated(check)"),
        raw("# END TESTS"),
        raw("# END QUESTION"),
    ]


def new_exercise(name: str, root: str | Path) -> Path:
    """Write ``root/NAME/NAME.ipynb``: a source in the course's format (badge, assignment
    config, setup cell, one question with its solution, a public and a hidden test)."""
    # nbformat (0.15 s) only where a notebook is read: importing course_lib.exercises stays light
    import nbformat

    if not NAME.fullmatch(name):
        raise ValueError(f"exercise names look like NN_topic (two digits, lowercase), got {name!r}")
    path = Path(root) / name / f"{name}.ipynb"
    if path.exists():
        raise FileExistsError(f"{path} exists already")
    nb = nbformat.v4.new_notebook()
    nb.cells = _template(name)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    return path
