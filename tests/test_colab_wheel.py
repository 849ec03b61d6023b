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
test-artifacts/notebook_times.json and each executed lesson to test-artifacts/executed-smoke/
(the browser and book tests reuse them); a failing notebook is saved with its outputs in
test-artifacts/executed/ for reading.

The notebooks run three at a time (``AT_ONCE``), each in its own kernel, in the background from
the module's first notebook test on; each test waits for its own notebook and checks it. A
notebook is mostly one process waiting for another (its kernel, its ranks, a launcher), so three
of them share two cores well: on the course's 2-core machine this module took 279 s one notebook
after the other, 158 s two at a time, and three at a time was 23-32 s faster again than two
(measured beside other work). The seconds recorded are each notebook's own, beside others
(``how`` says so). Lesson 12 starts first (``FIRST``): most of its time is its four hangs, each
waiting out the 4-s cell limit of smoke mode, idle time the other notebooks fill. Its ordinary
cells take 0.1-0.2 s each, well under that limit, beside two others as alone (it ran alone
before, 37 s of this module's time).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import zipfile
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from test_notebook_grader import shown
from wheel_env import build_wheel, clean_env, site_packages, venv_with_wheel

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
SMOKE_EXECUTED = ARTIFACTS / "executed-smoke"  # reused by test_browser.py and test_book.py (conftest.py)
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# the student releases: a notebook with its public tests/ beside it (not the autograder release)
RELEASES = sorted(p for p in ROOT.glob("exercises/**/*.ipynb")
                  if (p.parent / "tests").is_dir() and "autograder" not in p.parts and ".ipynb_checkpoints" not in p.parts)
KERNEL = "course-wheel"
# run after the setup cell: its Colab branch ran pip on COURSE_INSTALL_SPEC, and pip succeeded
PIP_CHECK = ("assert COURSE_INSTALL_SPEC == os.environ['COURSE_INSTALL_SPEC'] and _exit_code == 0, "
             "'the setup cell did not pip-install the wheel'")
CELL_TIMEOUT = 180  # s per cell in smoke mode: a guard against hangs, not a speed target
AT_ONCE = 3  # notebooks run at the same time (module docstring)
FIRST = ("12_debugging",)  # started before the rest: mostly waiting (the module docstring)

@dataclass(frozen=True)
class Colab:
    wheel: Path
    python: Path  # the fresh environment's interpreter
    jupyter_path: Path  # holds the kernel spec of that interpreter
    base: Path  # per-notebook folders and homes go here
    mpl_cache: Path
    tmp: Path  # the kernels' temporary folders (short: multiprocessing puts sockets there)

    def env(self, home: Path) -> dict[str, str]:
        """A kernel's environment: Colab's switch, a fresh HOME and temporary folder (a kernel killed
        at the end leaves its files there, not in /tmp), the wheel as the install spec."""
        env = clean_env(dict(os.environ))
        env.pop("MPLBACKEND", None)
        home.mkdir(parents=True)
        (self.tmp / home.name).mkdir()
        env.update({
            "HOME": str(home), "TMPDIR": str(self.tmp / home.name), "COLAB_RELEASE_TAG": "course-test-wheel",
            "COURSE_SMOKE": "1",
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
def colab(tmp_path_factory):
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
    tmp = Path(tempfile.mkdtemp(prefix="colab_"))
    yield Colab(wheel, python, base / "jupyter", base, base / "mpl-cache", tmp)
    shutil.rmtree(tmp, ignore_errors=True)


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
    how = f"from the wheel, Colab switch set, {AT_ONCE} notebooks at a time"
    times[name] = {"seconds": None if seconds is None else round(seconds, 1), "passed": ok,
                   "when": time.strftime("%Y-%m-%d %H:%M:%S"), "how": how}
    path.write_text(json.dumps(times, indent=2, sort_keys=True) + "\n")


def _run_notebook(colab: Colab, notebook: Path, with_files: bool, allow_errors: bool):
    """Run ``notebook`` in an empty folder of its own (plus its folder's files when
    ``with_files``) with a fresh home; (the executed notebook, seconds, the CellExecutionError or None)."""
    from nbclient.exceptions import CellExecutionError

    from course_lib.exercises.runner import NotebookRunner

    stem = notebook.stem
    folder = colab.base / "run" / stem
    if with_files:
        shutil.copytree(notebook.parent, folder)
    else:
        folder.mkdir(parents=True)
        shutil.copy2(notebook, folder)
    nb = nbformat.read(folder / notebook.name, as_version=4)
    # %pip reports a failed install only in its output: this test's copy checks its exit status
    setup = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells.insert(setup + 1, nbformat.v4.new_code_cell(PIP_CHECK))
    # "immediate": the kernel's process group is killed once the last cell is done. A graceful
    # shutdown waits 2.5 s in every notebook that started ranks (ipykernel waits for its children,
    # and multiprocessing's resource tracker ignores SIGTERM), then jupyter_client kills it anyway.
    client = NotebookRunner(nb, timeout=CELL_TIMEOUT, kernel_name=KERNEL, allow_errors=allow_errors,
                            shutdown_kernel="immediate", resources={"metadata": {"path": str(folder)}})
    t0 = time.perf_counter()
    try:
        client.execute(env=colab.env(colab.base / "home" / stem))
    except CellExecutionError as e:
        return nb, time.perf_counter() - t0, e
    return nb, time.perf_counter() - t0, None


@pytest.fixture(scope="module")
def executions(colab, request):
    """{notebook: Future of _run_notebook's result} for every notebook test selected in this session,
    run ``AT_ONCE`` at a time, ``FIRST`` first, then in test order."""
    kinds = {test_lesson_runs_from_the_wheel.__name__: (False, False),
             test_student_release_runs_from_the_wheel.__name__: (True, True)}  # (with_files, allow_errors)
    wanted = {}
    for item in request.session.items:
        if item.path == Path(__file__) and getattr(item, "originalname", None) in kinds:
            wanted.setdefault(item.callspec.params["path"], kinds[item.originalname])
    order = sorted(wanted, key=lambda p: p.stem not in FIRST)
    futures = {p: Future() for p in order}
    free, cv, stop = [AT_ONCE], threading.Condition(), threading.Event()
    env = pytest.MonkeyPatch()
    env.setenv("JUPYTER_PATH", str(colab.jupyter_path))  # where nbclient finds the kernel spec

    def run(path: Path) -> None:
        try:
            futures[path].set_result(_run_notebook(colab, path, *wanted[path]))
        except BaseException as e:  # noqa: BLE001 - the notebook's test reports it
            futures[path].set_exception(e)
        finally:
            with cv:
                free[0] += 1
                cv.notify_all()

    def schedule() -> None:
        threads = []
        for path in order:
            with cv:
                cv.wait_for(lambda: free[0] > 0 or stop.is_set())
                if stop.is_set():
                    futures[path].cancel()
                    continue
                free[0] -= 1
            futures[path].set_running_or_notify_cancel()
            threads.append(threading.Thread(target=run, args=(path,), name=f"notebook {path.stem}"))
            threads[-1].start()
        for t in threads:
            t.join()

    scheduler = threading.Thread(target=schedule, name="notebooks", daemon=True)
    scheduler.start()
    try:
        yield futures
    finally:
        stop.set()  # after a failure with -x: start nothing more, let the running ones end
        with cv:
            cv.notify_all()
        scheduler.join()
        env.undo()


def _executed(executions, notebook: Path):
    """The executed notebook of ``notebook`` (its run in the background, waited for here)."""
    nb, seconds, error = executions[notebook].result()
    if error is not None:
        (ARTIFACTS / "executed").mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, ARTIFACTS / "executed" / notebook.name)
        _record_time(notebook.name, None, False)
        raise error
    _record_time(notebook.name, seconds, True)
    print(f"{notebook.name}: {seconds:.1f} s from the wheel in smoke mode")
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code"), "every code cell ran"
    return nb, seconds


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_runs_from_the_wheel(executions, path):
    from course_lib.notebook import book

    nb, seconds = _executed(executions, path)
    nb.cells = [c for c in nb.cells if c.source != PIP_CHECK]  # the notebook as written, with its outputs
    book.store(nb, path, SMOKE_EXECUTED, smoke=True, seconds=seconds)


def _errors(cell) -> list[str]:
    return [f"{o['ename']}: {o['evalue']}" for o in cell.get("outputs", []) if o.get("output_type") == "error"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", RELEASES, ids=lambda p: p.stem)
def test_student_release_runs_from_the_wheel(executions, path):
    """The blank release as a student opens it: the setup cell installs the package and copies
    the public tests out of it (offline), ``grader`` exists, and every ``grader.check`` cell
    runs to its report. The unanswered questions' own cells may raise (``...`` returns None)."""
    nb, _ = _executed(executions, path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    setup, checks = code[0], [c for c in code if c.source.lstrip().startswith("grader.check(")]
    assert _errors(setup) == [] and _errors(code[1]) == [], "the setup cell failed"
    assert checks, "no grader.check cell"
    for cell in checks:
        assert _errors(cell) == [], f"{cell.source}: {_errors(cell)}"
        (report,) = [o for o in cell.outputs if o.get("output_type") == "execute_result"] or [None]
        assert report is not None, f"{cell.source}: no report"
        # the report as HTML shows every character of the text report (course_lib.exercises.notebook_grader)
        html, text = report["data"]["text/html"], report["data"]["text/plain"]
        assert shown(html).text == text, (cell.source, html, text)
        # a blank answer fails a check that says what it expected, not the test's own code on None
        # (grading.returned: "dispatch(...) returned None (does the function return its result?)")
        last = text.strip().splitlines()[-1].strip()
        assert "All test cases passed" in text or last.startswith("AssertionError: "), (cell.source, text)
    assert not [e for c in code for e in _errors(c) if e.startswith("NameError: name 'grader'")]
