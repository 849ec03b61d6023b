"""Colab from a wheel: every lesson and every student release runs from a pip-installed package.

    python -m pytest tests/test_colab_wheel.py -q                 # builds the wheel, runs every notebook
    python -m pytest tests/test_colab_wheel.py -q -m "not slow"   # the wheel's contents only (seconds)

As Colab does it: the course is built into a wheel and installed in a fresh virtual environment
outside the clone (tests/wheel_env.py; the dependencies are this interpreter's, no network), and
each notebook is copied alone into an empty folder and run there by a kernel of that environment,
with a fresh home directory and Colab's switch set (``COLAB_RELEASE_TAG``). The notebook's own
setup cell then runs its Colab branch: ``COURSE_INSTALL_SPEC`` points it at the local wheel
(``course-lib[colab] @ file:///...``, offline), which
tests the override that a fork or a mirror of the course would use. Nothing of the clone is
importable or readable: a notebook that needs prepared data, a diagram or a benchmark must get it
from the installed package.

This is the course's one execution of the lessons (smoke mode, ``COURSE_SMOKE=1``): it proves both
that the notebooks run and that they run from the wheel. It writes the seconds each took to
test-artifacts/notebook_times.json; a failing notebook is saved with its outputs in
test-artifacts/executed/ for reading.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from wheel_env import build_wheel, clean_env, site_packages, venv_with_wheel

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# the student releases: a notebook with its public tests/ beside it (not the autograder release)
RELEASES = sorted(p for p in ROOT.glob("exercises/**/*.ipynb")
                  if (p.parent / "tests").is_dir() and "autograder" not in p.parts and ".ipynb_checkpoints" not in p.parts)
KERNEL = "course-wheel"
# run after the setup cell: its Colab branch ran pip on COURSE_INSTALL_SPEC, and pip succeeded
PIP_CHECK = ("assert COURSE_INSTALL_SPEC == os.environ['COURSE_INSTALL_SPEC'] and _exit_code == 0, "
             "'the setup cell did not pip-install the wheel'")
CELL_TIMEOUT = 180  # s per cell in smoke mode: a guard against hangs, not a speed target

@dataclass(frozen=True)
class Colab:
    wheel: Path
    python: Path  # the fresh environment's interpreter
    jupyter_path: Path  # holds the kernel spec of that interpreter
    base: Path  # per-notebook folders and homes go here
    mpl_cache: Path

    def env(self, home: Path) -> dict[str, str]:
        """A kernel's environment: Colab's switch, a fresh HOME, the wheel as the install spec."""
        env = clean_env(dict(os.environ))
        env.pop("MPLBACKEND", None)
        home.mkdir(parents=True)
        env.update({
            "HOME": str(home), "COLAB_RELEASE_TAG": "course-test-wheel", "COURSE_SMOKE": "1",
            "COURSE_INSTALL_SPEC": f"course-lib[colab] @ {self.wheel.as_uri()}",
            # offline; the dependencies and extras were resolved once, in the test below
            "PIP_NO_INDEX": "1", "PIP_NO_DEPS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PATH": os.pathsep.join([str(self.python.parent), env.get("PATH", "")]),  # its scripts, mpiexec
            # matplotlib's font cache only (seconds to rebuild per notebook): shared, not course state
            "MPLCONFIGDIR": str(self.mpl_cache),
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",  # quiets a debugger warning in kernels
        })
        return env


@pytest.fixture(scope="module")
def colab(tmp_path_factory) -> Colab:
    base = tmp_path_factory.mktemp("colab")
    t0 = time.perf_counter()
    wheel = build_wheel(ROOT, base / "wheel")
    python = venv_with_wheel(base / "venv", wheel)
    spec_dir = base / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "course-lib from the wheel", "language": "python"}))
    print(f"wheel built and installed in {time.perf_counter() - t0:.1f} s")
    return Colab(wheel, python, base / "jupyter", base, base / "mpl-cache")


def _wheel_files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as z:
        return {name: z.read(name) for name in z.namelist()}


def test_wheel_carries_data_diagrams_public_tests_and_the_strategy_comparison(colab):
    files = _wheel_files(colab.wheel)
    for name in ("tinyshakespeare.txt", "gpt2.tiktoken"):
        assert files[f"course_lib/_data/{name}"] == (ROOT / "data" / name).read_bytes()
    # images/diagrams is the source of truth; the wheel carries every file of it, byte for byte
    diagrams = {p.relative_to(ROOT / "images" / "diagrams").as_posix(): p.read_bytes()
                for p in (ROOT / "images" / "diagrams").rglob("*") if p.is_file()}
    packaged = {n.removeprefix("course_lib/_diagrams/"): b for n, b in files.items()
                if n.startswith("course_lib/_diagrams/")}
    assert packaged == diagrams
    assert any(n.endswith(".mmd") for n in packaged) and "rendered/manifest.json" in packaged
    # the exercises' public tests, as in the student releases; nothing of the solutions
    public = {p.relative_to(ROOT).as_posix(): p.read_bytes() for p in ROOT.glob("exercises/*/**/*.py")
              if p.parent.name == "tests" and "autograder" not in p.parts}
    shipped = {n.removeprefix("course_lib/_course/"): b for n, b in files.items()
               if n.startswith("course_lib/_course/") and n.endswith(".py")}
    assert public and shipped == public
    assert not [n for n in files if n.startswith("course_lib/_course/") and (n.endswith(".ipynb") or "autograder" in n)]
    assert "course_lib/experiments/strategy_comparison.py" in files
    assert not [n for n in files if n.split("/")[0] in ("tests", "benchmarks", "notebooks", "exercises")]


def test_installed_package_is_the_wheel_and_works_without_the_clone(colab, tmp_path):
    home = tmp_path / "home"
    env = colab.env(home)
    probe = (
        "import json, course_lib\n"
        "from course_lib.utils import repo_root, shipped_file\n"
        "from course_lib.notebook import diagrams\n"
        "from course_lib.gpt import data\n"
        "out = data.prepare('shakespeare_char', quiet=True)\n"
        "from course_lib.exercises import fetch_student_tests\n"
        f"tests = [p.name for p in fetch_student_tests({RELEASES[0].stem!r}, 'fetched')]\n"
        "print(json.dumps({'file': course_lib.__file__, 'root': str(repo_root()), 'data': str(out),\n"
        "                  'text': str(shipped_file('tinyshakespeare.txt')), 'tests': tests,\n"
        "                  'names': diagrams.names(), 'fig': diagrams.diagram('dp_step').how,\n"
        "                  'src': diagrams.mermaid_source('broadcast')}))\n")
    out = subprocess.run([str(colab.python), "-c", probe], check=False, cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    site = site_packages(colab.python)
    assert Path(got["file"]).is_relative_to(site) and got["root"] == "None"  # the wheel, not the clone
    assert Path(got["text"]) == site / "course_lib" / "_data" / "tinyshakespeare.txt"  # a file, not a link
    assert not Path(got["text"]).is_symlink()
    assert Path(got["data"]) == home / ".cache" / "course_lib" / "data" / "shakespeare_char"
    assert got["names"] == sorted(p.stem for p in (ROOT / "images" / "diagrams").glob("*.mmd"))
    assert got["fig"] == "committed"
    release_tests = RELEASES[0].parent / "tests"  # copied offline from the package, hashes checked
    assert sorted(got["tests"]) == sorted(p.name for p in release_tests.glob("*.py")) != []
    assert all((tmp_path / "fetched" / n).read_bytes() == (release_tests / n).read_bytes() for n in got["tests"])
    assert got["src"] == (ROOT / "images" / "diagrams" / "broadcast.mmd").read_text()
    # what the setup cell asks pip for resolves offline: the package, its dependencies, the colab extra
    env.pop("PIP_NO_DEPS")
    pip = subprocess.run([str(colab.python), "-m", "pip", "install", "--dry-run", "--report", "-", "--quiet",
                          env["COURSE_INSTALL_SPEC"]], check=False, cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    requested = {r["metadata"]["name"] for r in json.loads(pip.stdout)["install"]}
    assert requested <= {"course-lib"}, requested  # everything else already satisfied
    cli = subprocess.run([str(colab.python.parent / "course"), "data", "prepare", "shakespeare_char"], check=False,
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and "already prepared" in cli.stdout, cli.stdout + cli.stderr


# ------------------------------------------------------------------ every notebook, as on Colab

def _record_time(name: str, seconds: float | None, ok: bool) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "notebook_times.json"
    try:
        times = json.loads(path.read_text())
    except (OSError, ValueError):
        times = {}
    times[name] = {"seconds": None if seconds is None else round(seconds, 1), "passed": ok,
                   "when": time.strftime("%Y-%m-%d %H:%M:%S"), "how": "from the wheel, Colab switch set"}
    path.write_text(json.dumps(times, indent=2, sort_keys=True) + "\n")


def _execute_alone(colab: Colab, notebook: Path, monkeypatch, with_files: Path | None = None,
                   allow_errors: bool = False):
    """Run ``notebook`` in an empty folder of its own (plus ``with_files``' contents) with a
    fresh home; return the executed notebook."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    stem = notebook.stem
    folder = colab.base / "run" / stem
    if with_files is not None:
        shutil.copytree(with_files, folder)
    else:
        folder.mkdir(parents=True)
        shutil.copy2(notebook, folder)
    monkeypatch.setenv("JUPYTER_PATH", str(colab.jupyter_path))  # where nbclient finds the kernel spec
    nb = nbformat.read(folder / notebook.name, as_version=4)
    # %pip reports a failed install only in its output: this test's copy checks its exit status
    setup = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells.insert(setup + 1, nbformat.v4.new_code_cell(PIP_CHECK))
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name=KERNEL, allow_errors=allow_errors,
                            resources={"metadata": {"path": str(folder)}})
    t0 = time.perf_counter()
    try:
        client.execute(env=colab.env(colab.base / "home" / stem))
    except CellExecutionError:
        (ARTIFACTS / "executed").mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, ARTIFACTS / "executed" / notebook.name)
        _record_time(notebook.name, None, False)
        raise
    seconds = time.perf_counter() - t0
    _record_time(notebook.name, seconds, True)
    print(f"{notebook.name}: {seconds:.1f} s from the wheel in smoke mode")
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code"), "every code cell ran"
    return nb


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_runs_from_the_wheel(colab, path, monkeypatch):
    _execute_alone(colab, path, monkeypatch)


def _errors(cell) -> list[str]:
    return [f"{o['ename']}: {o['evalue']}" for o in cell.get("outputs", []) if o.get("output_type") == "error"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", RELEASES, ids=lambda p: p.stem)
def test_student_release_runs_from_the_wheel(colab, path, monkeypatch):
    """The blank release as a student opens it: the setup cell installs the package and copies
    the public tests out of it (offline), ``grader`` exists, and every ``grader.check`` cell
    runs to its report. The unanswered questions' own cells may raise (``...`` returns None)."""
    nb = _execute_alone(colab, path, monkeypatch, with_files=path.parent, allow_errors=True)
    code = [c for c in nb.cells if c.cell_type == "code"]
    setup, checks = code[0], [c for c in code if c.source.lstrip().startswith("grader.check(")]
    assert _errors(setup) == [] and _errors(code[1]) == [], "the setup cell failed"
    assert checks, "no grader.check cell"
    for cell in checks:
        assert _errors(cell) == [], f"{cell.source}: {_errors(cell)}"
        assert any(o.get("output_type") == "execute_result" for o in cell.outputs), f"{cell.source}: no report"
    assert not [e for c in code for e in _errors(c) if e.startswith("NameError: name 'grader'")]
