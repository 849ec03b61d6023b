"""``course exercises build``: otter assign, made deterministic, with a manifest to detect staleness.

otter writes random cell ids and a time-stamped zip; we replace both with deterministic ones, so a
rebuild of an unchanged source reproduces dist/ byte for byte, and the manifest (hash of the
source and of every generated file) lets ``check`` tell a stale or hand-edited dist/ from a fresh
one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import zipfile
from pathlib import Path

from course_lib.exercises.colab import setup_cell_problems
from course_lib.exercises.layout import MANIFEST, ZIP_NAME, Exercise, sha256
from course_lib.exercises.layout import quiet as silenced

BUILD_FORMAT = 1  # bump when the post-processing below changes, so every dist/ reads as stale
ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip entry can hold: no build time in dist/


def otter_version() -> str:
    from importlib.metadata import version

    return version("otter-grader")


def source_problems(ex: Exercise) -> list[str]:
    """What is wrong with an instructor source before we even run otter (outputs committed...)."""
    import nbformat

    nb = nbformat.read(ex.source, as_version=4)
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count")):
            problems.append(f"{ex.source}: cell {i} has outputs; clear them before committing "
                            "(Jupyter: Edit > Clear Outputs of All Cells)")
    return problems


def _normalise_notebook(path: Path, name: str) -> None:
    """Replace otter's random cell ids with ids derived from the cell's place and content."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        digest = hashlib.sha1(f"{name}/{i}/{cell.cell_type}/{cell.source}".encode()).hexdigest()
        cell["id"] = digest[:12]
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")


def _normalise_zip(src: Path, dest: Path) -> None:
    """Rewrite otter's time-stamped zip with sorted entries and a fixed date."""
    with zipfile.ZipFile(src) as zin:
        entries = sorted((info.filename, zin.read(info)) for info in zin.infolist() if not info.is_dir())
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED) as zout:
        for filename, data in entries:
            info = zipfile.ZipInfo(filename, date_time=ZIP_DATE)
            mode = 0o755 if filename == "run_autograder" else 0o644
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(info, data)


def _manifest(ex: Exercise, dist: Path) -> dict:
    files = {p.relative_to(dist).as_posix(): sha256(p)
             for p in sorted(dist.rglob("*")) if p.is_file() and p.name != MANIFEST}
    return {
        "exercise": ex.name,
        "source": ex.source.name,
        "source_sha256": sha256(ex.source),
        "otter_grader": otter_version(),
        "build_format": BUILD_FORMAT,
        "files": files,
    }


def build(ex: Exercise, run_tests: bool = False, quiet: bool = True) -> Path:
    """Run ``otter assign`` on ``ex`` and replace ``ex.dist`` with its normalised output.

    ``run_tests`` makes otter run the tests against the solution notebook while building (slow;
    ``course exercises build --verify`` and tests/test_exercises.py grade the releases instead).
    """
    from otter.assign import main as otter_assign

    problems = source_problems(ex) + setup_cell_problems(ex)
    if problems:
        raise ValueError("\n".join(problems))
    with tempfile.TemporaryDirectory(prefix=f"course_assign_{ex.name}_") as tmp:
        work = Path(tmp) / ex.name
        work.mkdir()
        shutil.copy2(ex.source, work / ex.source.name)
        out = work / "dist"
        with silenced(quiet):
            otter_assign(str(work / ex.source.name), str(out), no_pdfs=True, no_run_tests=not run_tests)
        zips = sorted((out / "autograder").glob("*.zip"))
        if len(zips) != 1:
            raise RuntimeError(f"otter assign wrote {len(zips)} autograder zips for {ex.name}, expected 1")
        _normalise_zip(zips[0], out / "autograder" / ZIP_NAME)
        zips[0].unlink()
        for nb_path in out.rglob("*.ipynb"):
            _normalise_notebook(nb_path, ex.name)
        manifest = _manifest(ex, out)
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        # Swap in the new dist/ only once it is complete: a failed build leaves the old one.
        staged = ex.dir / ".dist.new"
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(out, staged)
    shutil.rmtree(ex.dist, ignore_errors=True)
    staged.rename(ex.dist)
    return ex.dist


def check(ex: Exercise) -> list[str]:
    """Reasons ``ex.dist`` does not match its source (empty list: up to date)."""
    manifest_path = ex.dist / MANIFEST
    if not manifest_path.is_file():
        return [f"{ex.name}: no {manifest_path.relative_to(ex.dir)}; run `course exercises build {ex.name}`"]
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    problems = []
    rebuild = f"run `course exercises build {ex.name}` (or make exercises)"
    if manifest.get("source_sha256") != sha256(ex.source):
        problems.append(f"{ex.name}: {ex.source.name} changed since dist/ was built; {rebuild}")
    if manifest.get("build_format") != BUILD_FORMAT:
        problems.append(f"{ex.name}: dist/ was built by an older course_lib.exercises; {rebuild}")
    if manifest.get("otter_grader") != otter_version():
        problems.append(f"{ex.name}: dist/ was built with otter-grader {manifest.get('otter_grader')}, "
                        f"this is {otter_version()}; {rebuild}")
    present = {p.relative_to(ex.dist).as_posix(): p for p in ex.dist.rglob("*")
               if p.is_file() and p.name != MANIFEST}
    for rel, digest in manifest.get("files", {}).items():
        if rel not in present:
            problems.append(f"{ex.name}: dist/{rel} is missing; {rebuild}")
        elif sha256(present[rel]) != digest:
            problems.append(f"{ex.name}: dist/{rel} differs from what the build wrote (edited by "
                            f"hand?); generated files are never edited: {rebuild}")
    for rel in sorted(set(present) - set(manifest.get("files", {}))):
        problems.append(f"{ex.name}: dist/{rel} was not written by the build; remove it or {rebuild}")
    return problems
