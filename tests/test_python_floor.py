"""pyproject.toml's ``requires-python`` floor holds for the code: nothing in the package, its tools,
tests, benchmarks or the notebooks' cells needs a newer Python than the floor.

The suite runs on one Python here (3.11); students' do not (Colab: 3.13, hubs: 3.10 and up). vermin
reads the code and knows in which release each piece of syntax and each standard-library name
arrived (``typing.Self``: 3.11), so the floor is checked without an interpreter of that version.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

from test_notebooks import cell_python

ROOT = Path(__file__).resolve().parents[1]

# vermin's false positives here, each a name of ours that it takes for the standard library's
NOT_THE_STDLIB = [
    "str.decode",  # bytes.decode on a subprocess's output, read as Python 2's str.decode
    "copy.replace",  # a local string named ``copy`` (tests/test_notebooks.py), not the copy module
]


def python_floor() -> str:
    """'3.10' from ``requires-python = ">=3.10"`` (read as text: tomllib is 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    (floor,) = re.findall(r'^requires-python\s*=\s*">=\s*(\d+\.\d+)"', text, flags=re.M)
    return floor


def notebook_cells_as_files(notebooks: list[Path], dest: Path) -> list[Path]:
    """Each notebook's code cells as one .py file in ``dest``: IPython's %magic and !shell lines
    translated to Python (``cell_python``), cell magics (%%torchrun, %%bash: not Python) left out."""
    out = []
    for nb_path in notebooks:
        cells = [c for c in json.loads(nb_path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
        sources = ["".join(c["source"]) for c in cells]
        path = dest / f"{nb_path.parent.name}__{nb_path.stem}.py"
        path.write_text("\n".join(cell_python(s) for s in sources if not s.lstrip().startswith("%%")),
                        encoding="utf-8")
        out.append(path)
    return out


def vermin(paths: list[Path], floor: str) -> subprocess.CompletedProcess:
    excludes = [a for name in NOT_THE_STDLIB for a in ("--exclude", name)]
    command = [sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())",  # it has no __main__
               f"--target={floor}-", "--violations", "--no-tips", "--eval-annotations", *excludes]
    return subprocess.run([*command, *map(str, paths)], capture_output=True, text=True, cwd=ROOT, timeout=300)


def needs_newer(proc: subprocess.CompletedProcess) -> bool:
    """vermin found code newer than the floor, or code it could not parse (then unchecked: on
    Python 3.11 that includes a 3.12 f-string, which vermin reports as an error and exits 0)."""
    return proc.returncode != 0 or any(ln.strip().startswith("error:") for ln in proc.stdout.splitlines())


def test_the_floor_is_the_oldest_python_the_code_runs_on(tmp_path):
    floor = python_floor()
    assert floor == "3.10"  # the README's and the hubs' floor; change both together
    cells = notebook_cells_as_files(sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("instructor/*/*.ipynb"),
                                            *ROOT.glob("exercises/*/*.ipynb")]), tmp_path)
    assert len(cells) >= 13 + 2 * 9, cells  # 13 lessons, 9 exercises (source and release)
    proc = vermin([ROOT / "course_lib", ROOT / "tools", ROOT / "tests", ROOT / "benchmarks",
                   ROOT / "instructor", *cells], floor)
    assert not needs_newer(proc), proc.stdout + proc.stderr  # vermin lists each violation with the release it needs


def test_the_check_sees_code_newer_than_the_floor(tmp_path):
    """What the test above must catch: the 3.11 import that kept course_lib.trainer.metrics from
    importing on 3.10, a 3.12 f-string, and a 3.11 import in a notebook's code cell."""
    (tmp_path / "meter.py").write_text("from typing import Self\n\n\nclass M:\n    def __enter__(self) -> Self:\n"
                                       "        return self\n")
    (tmp_path / "fstring.py").write_text("r = {'A': 1}\nprint(f'{r['A']}')\n")
    (tmp_path / "nb").mkdir()
    (tmp_path / "nb" / "x.ipynb").write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": ["import tomllib"]},
        {"cell_type": "code", "source": ["%%bash\n", "echo $HOME\n"]},
        {"cell_type": "code", "source": ["%matplotlib inline\n", "!ls\n", "import tomllib\n"]}]}))
    for name in ("meter.py", "fstring.py"):
        proc = vermin([tmp_path / name], "3.10")
        assert needs_newer(proc) and name in proc.stdout, proc.stdout
    (cells,) = notebook_cells_as_files([tmp_path / "nb" / "x.ipynb"], tmp_path)
    assert "%" not in cells.read_text() and "echo" not in cells.read_text()  # Python only
    proc = vermin([cells], "3.10")
    assert needs_newer(proc) and "tomllib" in proc.stdout, proc.stdout
