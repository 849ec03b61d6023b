"""``course exercises build``: otter assign, made deterministic, with a manifest to detect staleness.

From ``instructor/NN_topic/NN_topic.ipynb`` it writes the student release to ``exercises/NN_topic/``
(committed) and the autograder release to ``build/exercises/NN_topic/`` (gitignored). otter writes
random cell ids and a time-stamped zip; we replace both with deterministic ones, so a rebuild of
an unchanged source reproduces the release byte for byte, and the manifest (hash of the source and
of every released file) lets ``check`` tell a stale or hand-edited release from a fresh one.

The autograder zip is made ready for Gradescope: its ``environment.yml`` adds the CPU build of
torch and the libraries the tests use, and the zip carries this package as a wheel that its
``setup.sh`` installs (``--no-deps``: the environment has the rest), because the grading config
loads ``course_lib.exercises.CellTimeLimit`` and the tests import ``course_lib``.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path

from course_lib.exercises.colab import setup_cell_problems
from course_lib.exercises.layout import MANIFEST, ZIP_NAME, Exercise, sha256
from course_lib.exercises.layout import quiet as silenced
from course_lib.utils import PACKAGE_DIR, repo_root

BUILD_FORMAT = 2  # bump when the post-processing below changes, so every release reads as stale
ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip entry can hold: no build time in a release


def otter_version() -> str:
    return version("otter-grader")


def source_problems(ex: Exercise) -> list[str]:
    """What is wrong with an instructor source before we even run otter: outputs committed, a test
    that otter would write back unreadable on Python 3.10/3.11."""
    # nbformat (0.15 s) only where a notebook is read: importing course_lib.exercises stays light
    import nbformat

    nb = nbformat.read(ex.source, as_version=4)
    problems, in_tests = [], False
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count")):
            problems.append(f"{ex.source}: cell {i} has outputs; clear them before committing "
                            "(Jupyter: Edit > Clear Outputs of All Cells)")
        if cell.cell_type == "raw":
            in_tests = {"# BEGIN TESTS": True, "# END TESTS": False}.get(cell.source.strip(), in_tests)
        elif in_tests and cell.cell_type == "code":
            problems += [f"{ex.source}: cell {i}, line {line}: {why}"
                         for line, why in _unportable_test_code(cell.source)]
    return problems


def _unportable_test_code(source: str) -> list[tuple[int, str]]:
    """Where a test cell would not survive otter's round trip on every Python the course supports.

    otter assign writes each test back with ``ast.unparse``. From Python 3.12 (PEP 701) that puts a
    string inside an f-string's braces in the f-string's own quotes, ``f'found {r['A']}'``, which
    Python 3.10 and 3.11 cannot read: a release built on 3.12+ would then fail to load its tests on
    a student's 3.11, and it differs byte for byte from one built on 3.11. The answer: bind the value
    to a name before the f-string.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # otter reports it, with its own context
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FormattedValue):
            for inner in ast.walk(node.value):
                if isinstance(inner, ast.JoinedStr) or (isinstance(inner, ast.Constant)
                                                        and isinstance(inner.value, (str, bytes))):
                    found.append((node.lineno, f"a string inside an f-string's braces, {{{ast.unparse(node.value)}}}: "
                                               "otter writes the test back with ast.unparse, which on Python 3.12+ "
                                               "puts the f-string's own quotes there, and Python 3.10 and 3.11 "
                                               "cannot read that; bind the value to a name before the f-string"))
                    break
    return sorted(set(found))


def _normalise_notebook(path: Path, name: str) -> None:
    """Replace otter's random cell ids with ids derived from the cell's place and content."""
    # nbformat (0.15 s) only where a notebook is read: importing course_lib.exercises stays light
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        digest = hashlib.sha1(f"{name}/{i}/{cell.cell_type}/{cell.source}".encode()).hexdigest()
        cell["id"] = digest[:12]
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")


TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # the CPU build: no CUDA downloads on Gradescope
GRADING_REQUIREMENTS = ("torch==2.13.0", "numpy", "pandas", "psutil", "tqdm", "matplotlib")


def course_wheel(dest: Path) -> Path:
    """Build this package's wheel into ``dest``, from a clean copy of the clone's package (a
    build in the clone itself could pick up stale modules from an old ``build/lib``)."""
    root = repo_root()
    if root is None or not (root / "pyproject.toml").is_file():
        raise FileNotFoundError("building the autograder needs a clone of the course repository "
                                "(its pyproject.toml) to make the course_lib wheel")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="course_wheel_src_") as src:
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(root / name, Path(src) / name)
        shutil.copytree(root / "course_lib", Path(src) / "course_lib",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(dest), src], check=True, capture_output=True)
    wheels = sorted(dest.glob("course_lib-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip wheel wrote {len(wheels)} course_lib wheels into {dest}, expected 1")
    return wheels[0]


def _gradescope_files(entries: dict[str, bytes], wheel: Path) -> dict[str, bytes]:
    """otter's environment.yml and setup.sh, plus torch (CPU), the tests' libraries and the wheel."""
    env = entries["environment.yml"].decode()
    marker = "  - pip:\n"
    if marker not in env:
        raise RuntimeError("otter's environment.yml has no pip section; update _gradescope_files")
    extra = "".join(f"      - {line}\n" for line in (f"--extra-index-url {TORCH_INDEX}", *GRADING_REQUIREMENTS))
    env = env.replace(marker, marker + extra, 1)
    setup = entries["setup.sh"].decode().rstrip("\n") + (
        "\n\n# course_lib (the tests and the CellTimeLimit plugin import it), without its other "
        "dependencies\n"
        f"mamba run -n otter-env pip install --no-deps /autograder/source/{wheel.name}\n")
    return {**entries, "environment.yml": env.encode(), "setup.sh": setup.encode(),
            wheel.name: wheel.read_bytes()}


def _normalise_zip(src: Path, dest: Path, wheel: Path | None = None) -> None:
    """Rewrite otter's time-stamped zip with sorted entries and a fixed date (and, given the
    course wheel, ready for Gradescope)."""
    with zipfile.ZipFile(src) as zin:
        entries = {info.filename: zin.read(info) for info in zin.infolist() if not info.is_dir()}
    if wheel is not None:
        entries = _gradescope_files(entries, wheel)
    entries = sorted(entries.items())
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED) as zout:
        for filename, data in entries:
            info = zipfile.ZipInfo(filename, date_time=ZIP_DATE)
            mode = 0o755 if filename == "run_autograder" else 0o644
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(info, data)


def _released(release: Path) -> dict[str, Path]:
    """The files of a student release that the build wrote (the notebook and tests/)."""
    return {p.relative_to(release).as_posix(): p for p in sorted(release.rglob("*"))
            if p.is_file() and p.name != MANIFEST and "__pycache__" not in p.parts
            and not any(part.startswith(".") for part in p.relative_to(release).parts)}


def _manifest(ex: Exercise, release: Path) -> dict:
    files = {rel: sha256(p) for rel, p in _released(release).items()}
    return {
        "exercise": ex.name,
        "source": ex.source.name,
        "source_sha256": sha256(ex.source),
        "otter_grader": otter_version(),
        "build_format": BUILD_FORMAT,
        "files": files,
    }


def build_exercise(ex: Exercise, run_tests: bool = False, quiet: bool = True, wheel: Path | None = None) -> Path:
    """Run ``otter assign`` on ``ex``: the student release replaces ``ex.release``, the autograder
    release ``ex.build``. ``wheel``: the course_lib wheel for the Gradescope zip (built here
    when not given). ``run_tests`` makes otter run the tests against the solution while
    building (slow; ``course exercises build --verify`` and tests/test_exercises.py grade instead).
    """
    # otter-grader is the optional `grading` extra: imported only where it grades or assigns
    from otter.assign import main as otter_assign

    problems = source_problems(ex) + setup_cell_problems(ex)
    if problems:
        raise ValueError("\n".join(problems))
    with tempfile.TemporaryDirectory(prefix=f"course_assign_{ex.name}_") as tmp:
        wheel = wheel or course_wheel(Path(tmp) / "wheel")
        work = Path(tmp) / ex.name
        work.mkdir()
        shutil.copy2(ex.source, work / ex.source.name)
        out = work / "dist"
        with silenced(quiet):
            otter_assign(str(work / ex.source.name), str(out), no_pdfs=True, no_run_tests=not run_tests)
        zips = sorted((out / "autograder").glob("*.zip"))
        if len(zips) != 1:
            raise RuntimeError(f"otter assign wrote {len(zips)} autograder zips for {ex.name}, expected 1")
        _normalise_zip(zips[0], out / "autograder" / ZIP_NAME, wheel)
        zips[0].unlink()
        for nb_path in out.rglob("*.ipynb"):
            _normalise_notebook(nb_path, ex.name)
        student = out / "student"
        (student / MANIFEST).write_text(json.dumps(_manifest(ex, student), indent=2, sort_keys=True) + "\n",
                                        encoding="utf-8")
        # Swap in each release only once it is complete: a failed build leaves the old ones.
        for built, target in ((student, ex.release), (out / "autograder", ex.build)):
            staged = target.with_name(f".{target.name}.new")
            shutil.rmtree(staged, ignore_errors=True)
            staged.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(built, staged)
            shutil.rmtree(target, ignore_errors=True)
            staged.rename(target)
    return ex.release


def zip_package_differences(autograder_zip: Path, package: Path = PACKAGE_DIR) -> list[str]:
    """The modules of ``package`` (this course_lib) that the course wheel bundled in
    ``autograder_zip`` holds otherwise, or lacks (or holds and the clone does not). Local grading
    imports the installed course_lib; Gradescope installs the bundled one, so an autograder zip
    built before a change to course_lib grades there with the old grading helpers."""
    with zipfile.ZipFile(autograder_zip) as outer:
        wheels = [n for n in outer.namelist() if n.startswith("course_lib-") and n.endswith(".whl")]
        if not wheels:
            return []  # no wheel: not a Gradescope zip
        with zipfile.ZipFile(io.BytesIO(outer.read(wheels[0]))) as wheel:
            bundled = {n: wheel.read(n) for n in wheel.namelist() if n.startswith("course_lib/") and n.endswith(".py")}
    root = package.parent
    changed = [n for n, data in bundled.items() if not (root / n).is_file() or (root / n).read_bytes() != data]
    added = [n for p in package.rglob("*.py")  # (rglob does not enter _course's links: those are in bundled)
             if "__pycache__" not in p.parts and (n := p.relative_to(root).as_posix()) not in bundled]
    return sorted(changed + added)


def check_exercise(ex: Exercise) -> list[str]:
    """Reasons ``ex.release`` does not match its source (empty list: up to date). Without the
    private source (a public clone) only the release itself is checked: built by this format and
    otter version, and every file as the build wrote it."""
    manifest_path = ex.release / MANIFEST
    if not manifest_path.is_file():
        return [f"{ex.name}: no {manifest_path}; run `course exercises build {ex.name}`"]
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    problems = []
    rebuild = f"run `course exercises build {ex.name}` (or make exercises)"
    if ex.source.is_file() and manifest.get("source_sha256") != sha256(ex.source):
        problems.append(f"{ex.name}: {ex.source.name} changed since its release was built; {rebuild}")
    if manifest.get("build_format") != BUILD_FORMAT:
        problems.append(f"{ex.name}: the release was built by an older course_lib.exercises; {rebuild}")
    if manifest.get("otter_grader") != otter_version():
        problems.append(f"{ex.name}: the release was built with otter-grader {manifest.get('otter_grader')}, "
                        f"this is {otter_version()}; {rebuild}")
    present = _released(ex.release)
    for rel, digest in manifest.get("files", {}).items():
        if rel not in present:
            problems.append(f"{ex.name}: {rel} is missing from the release; {rebuild}")
        elif sha256(present[rel]) != digest:
            problems.append(f"{ex.name}: {rel} differs from what the build wrote (edited by "
                            f"hand?); generated files are never edited: {rebuild}")
    for rel in sorted(set(present) - set(manifest.get("files", {}))):
        problems.append(f"{ex.name}: {rel} was not written by the build; remove it or {rebuild}")
    return problems
