"""Test helpers: the course package as a wheel, installed in a fresh virtual environment.

    from wheel_env import build_wheel, venv_with_wheel     # in a test (pytest puts tests/ on sys.path)
    wheel = build_wheel(ROOT, tmp / "wheel")
    python = venv_with_wheel(tmp / "venv", wheel)        # its python imports course_lib from the wheel

Offline and quick (seconds): the wheel is built with the setuptools already installed (no build
isolation, no index), from a copy of the source tree so that a stale ``build/`` folder of the
clone cannot leak into it. The new environment gets no copy of torch and the other dependencies:
a ``.pth`` file lists the running interpreter's site-packages, as plain path lines, which Python
appends to ``sys.path`` without running that folder's own ``.pth`` files, so the clone's editable
install of course_lib (an import hook started from such a file) stays out, while the wheel,
installed into the environment's own site-packages, comes first on ``sys.path``. The files that
the MPICH wheel installs outside site-packages (``bin/mpiexec``, ``lib/libmpi.so``, found next to
the interpreter by course_lib and mpi4py) are linked into the new environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

# What a build reads: the package (with its links into data/, images/ and exercises/), the project files.
SOURCE_TREE = ("pyproject.toml", "README.md", "course_lib", "data", "images", "exercises")


def clean_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what would point a process at the clone (PYTHONPATH, a data folder)."""
    return {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONHOME", "COURSE_DATA_DIR", "VIRTUAL_ENV")}


def build_wheel(root: Path, out_dir: Path) -> Path:
    """Build the course wheel from ``root`` into ``out_dir``; its path."""
    src = out_dir / "src"
    src.mkdir(parents=True)
    for name in SOURCE_TREE:
        path = root / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--wheel-dir", str(out_dir), str(src)],
                   check=True, cwd=out_dir, env=clean_env(dict(os.environ)), timeout=300)
    wheels = sorted(out_dir.glob("course_lib-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def site_packages(python: Path) -> Path:
    """The purelib folder of the environment whose interpreter is ``python``."""
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True, timeout=60)
    return Path(out.stdout.strip())


def venv_with_wheel(venv: Path, wheel: Path) -> Path:
    """A new virtual environment at ``venv`` with ``wheel`` installed and the running
    interpreter's dependencies visible; the path of its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # pip of this interpreter installs into the new environment before it sees any other packages
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=300)
    _link_prefix_files(venv, "mpich")
    here = sysconfig.get_paths()
    lines = dict.fromkeys([here["purelib"], here["platlib"]])  # plain paths: no code runs from them
    (site_packages(python) / "_course_test_dependencies.pth").write_text("\n".join(lines) + "\n")
    return python


def _link_prefix_files(venv: Path, distribution: str) -> None:
    """Link the files that ``distribution`` installed under this interpreter's prefix but outside
    site-packages (scripts, shared libraries) into the same places under ``venv``."""
    from importlib import metadata

    try:
        files = metadata.files(distribution) or []
    except metadata.PackageNotFoundError:
        return
    prefix, site = Path(sys.prefix).resolve(), Path(sysconfig.get_paths()["purelib"]).resolve()
    for file in files:
        path = Path(file.locate()).resolve()
        if path.is_relative_to(site) or not path.is_relative_to(prefix) or not path.is_file():
            continue
        target = venv / path.relative_to(prefix)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)
