"""Small helpers shared across course_lib: free ports, paths to shipped data, atomic writes, the one
call of ``init_process_group``, the one rule for a timeout in seconds and for a count, progress bars (the trainer's
and the launcher's), the traceback a notebook shows for the course's errors, and where the course is published (the pip spec a Colab setup cell installs,
Colab links and badges), which lessons and exercises share."""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
import socket
import sys
import tempfile
import traceback
import types
import warnings
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import BinaryIO

PACKAGE_DIR = Path(__file__).resolve().parent
INSTALL_SPEC_VAR = "COURSE_INSTALL_SPEC"  # overrides install_spec() in every setup cell

# Where the course lives on GitHub: the Colab badges, the Colab install cell and the links to
# committed images are built from these two names (install_spec, colab_badge below). PLACEHOLDER: the real
# organisation/repository is not known yet; change it here, then run
# `python tools/notebooks.py sync` to rewrite the badges and setup cells of the notebooks.
GITHUB_REPO = "course-org/parallel-dl-course"
GITHUB_BRANCH = "main"


def without_hidden_tail(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without the frames at its end whose code says ``__tracebackhide__ = True`` (the
    course's own functions that raised); it keeps its first frame. The earlier hidden frames stay:
    IPython skips those itself."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    while len(entries) > 1 and entries[-1].tb_frame.f_locals.get("__tracebackhide__"):
        entries.pop()
    rebuilt = None
    for entry in reversed(entries):  # a traceback is a linked list from the outermost call
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt


def traceback_to_caller(exc: BaseException) -> list[str]:
    """IPython's ``_render_traceback_`` for the course's errors: the traceback ends at the
    student's call, not in the course's frames that raised (marked ``__tracebackhide__``).
    IPython itself leaves out such frames except the last one, where the error was raised, which
    is the course's own. Set it as a class attribute: ``_render_traceback_ = traceback_to_caller``."""
    # IPython is the caller: it is imported wherever this runs
    from IPython import get_ipython

    shell, tb = get_ipython(), without_hidden_tail(exc.__traceback__)
    if shell is None:  # not called by IPython after all: Python's own format, the same frames
        return traceback.format_exception(type(exc), exc, tb)
    return shell.InteractiveTB.structured_traceback(type(exc), exc, tb)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def repo_root() -> Path | None:
    """The clone's top folder when running from a source checkout, else None."""
    root = PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() and (root / "data").is_dir() else None


def shipped_file(name: str) -> Path:
    """Path of a file shipped with the package (``data/NAME`` in a clone, package data in a wheel).

    A clone's ``data/`` is preferred; an installed wheel carries the same files in
    ``course_lib/_data/``.
    """
    candidates = []
    root = repo_root()
    if root is not None:
        candidates.append(root / "data" / name)
    candidates.append(PACKAGE_DIR / "_data" / name)
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"shipped data file {name!r} not found (looked in {', '.join(map(str, candidates))}); "
        "reinstall the package or restore data/ from the repository"
    )


def default_data_dir() -> Path:
    """Where prepared datasets go: ``data/`` in a clone, else ``$COURSE_DATA_DIR`` or ~/.cache."""
    env = os.environ.get("COURSE_DATA_DIR")
    if env:
        return Path(env)
    root = repo_root()
    if root is not None:
        return root / "data"
    return Path.home() / ".cache" / "course_lib" / "data"


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], mode: int = 0o644) -> None:
    """Write a file so a crash leaves either the old file or the new one, never a torn one.

    ``write(f)`` fills a temporary file in the same folder; it is fsynced, renamed over ``path``
    (``os.replace`` is atomic on POSIX), and the folder is fsynced so the rename itself is durable.
    ``mode``: mkstemp makes the file private (0600); an ordinary file is 0644.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """:func:`atomic_write` of ``data``."""
    atomic_write(path, lambda f: f.write(data))


def init_process_group(backend: str, *, timeout_s: float | None = None, device=None, **rendezvous) -> None:
    """The course's one call of ``torch.distributed.init_process_group``.

    ``rendezvous``: ``init_method=``, ``rank=``, ``world_size=`` (none: ``env://``, what torchrun
    sets). ``timeout_s``: the collective timeout. ``device``: this rank's device; NCCL binds its
    communicator to it (``device_id``, where the installed torch takes it: feature-detected).
    """
    import torch
    import torch.distributed as dist  # here: importing course_lib.utils must not import torch

    kwargs = dict(rendezvous)
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    if backend == "nccl" and device is not None and \
            "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = torch.device(device)
    with _stdout_to_stderr():
        dist.init_process_group(backend, **kwargs)


@contextmanager
def _stdout_to_stderr():
    """File descriptor 1 goes to stderr inside: gloo in torch 2.8 and 2.9 prints "[Gloo] Rank r is
    connected to k peer ranks ..." on every rank's stdout as the group connects (seen here), which
    would mix into what the program prints (a rank's output, a notebook cell's)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no file descriptor 1 here: nothing to protect
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


# --- progress bars that leave their final line in a saved notebook -------------------------------

@functools.cache
def _notebook_bar():
    """The notebook bar class (built on first use: tqdm.notebook imports ipywidgets)."""
    # ipywidgets (through tqdm.notebook) only in a notebook: workers and terminals never load it
    from IPython.display import display
    from tqdm.notebook import tqdm as tqdm_notebook

    class NotebookBar(tqdm_notebook):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, display=False, **kwargs)
            self.handle = None if self.disable else display(self._bundle(), raw=True, display_id=True)
            self.displayed = True

        def _bundle(self) -> dict:
            bundle = dict(self.container._repr_mimebundle_())
            bundle["text/plain"] = str(self)  # the bar as tqdm prints it in a terminal
            return bundle

        def close(self):
            closed = self.disable
            super().close()
            if not closed and self.handle is not None:
                self.handle.update(self._bundle(), raw=True)

    return NotebookBar


def in_notebook() -> bool:
    """True in a Jupyter kernel that tqdm draws widget bars in (tqdm.autonotebook's own test)."""
    if "ipykernel.zmqshell" not in sys.modules:  # a terminal or a worker: skip importing ipywidgets
        return False
    # only now: tqdm.notebook imports ipywidgets
    from tqdm import autonotebook, notebook

    return autonotebook.tqdm is notebook.tqdm


def progress_bar(*args, **kwargs):
    """A tqdm bar (same arguments); in a notebook, one whose saved output is its final line.

        bar = progress_bar(total=2000, desc="shakespeare-char")   # tqdm's arguments
        ...; bar.update(1); ...; bar.close()

    In a terminal this is tqdm's text bar. In a Jupyter kernel tqdm draws an ipywidgets bar, and the
    output it leaves holds only a reference to that widget and the bar's text *at the moment it was
    shown*, "0%|          | 0/2000": so a reopened notebook, GitHub's viewer or a static website show a
    finished run as not started. Here the bar is shown with a display id, and ``close()`` replaces
    that output's ``text/plain`` with the finished line (what ``str(bar)`` prints), keeping the
    widget for the live session.
    """
    # tqdm here: every entry point imports this module, and most never draw a bar
    from tqdm import TqdmExperimentalWarning

    with warnings.catch_warnings():  # tqdm.autonotebook warns that it picked the notebook bar
        warnings.simplefilter("ignore", TqdmExperimentalWarning)
        if kwargs.get("disable") or kwargs.get("file") not in (None, sys.stdout, sys.stderr) or not in_notebook():
            # tqdm.auto picks its bar when imported: only here, outside a notebook
            from tqdm.auto import tqdm

            return tqdm(*args, **kwargs)
        return _notebook_bar()(*args, **kwargs)


# -- where the course is published -----------------------------------------------------------------

def in_colab(environ: Mapping[str, str] | None = None) -> bool:
    """True inside a Google Colab kernel (the same test the setup cell uses)."""
    env = os.environ if environ is None else environ
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in env


def install_spec(repo: str = GITHUB_REPO, branch: str = GITHUB_BRANCH) -> str:
    """What pip installs on Colab unless ``$COURSE_INSTALL_SPEC`` says otherwise: the package
    straight from the course repository, with the ``colab`` extra.

    That extra is ``mpich`` (Colab has no MPI of its own, and ``%%mpirun`` needs the ``mpiexec``
    and libmpi of the PyPI MPICH wheel) and ``grading`` (otter-grader, for the exercises).
    """
    return f"course-lib[colab] @ git+https://github.com/{repo}@{branch}"


def with_extra(spec: str, extra: str) -> str:
    """A pip requirement with one more extra: ``course-lib[colab] @ URL`` -> ``course-lib[colab,frameworks] @ URL``
    (the lessons that need an optional extra install it on Colab from the same source)."""
    m = re.match(r"\s*([A-Za-z0-9._-]+)(?:\s*\[([^\]]*)\])?(.*)$", spec, re.DOTALL)
    if not m:
        raise ValueError(f"not a pip requirement: {spec!r}")
    extras = [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]
    return f"{m.group(1)}[{','.join(extras + ([] if extra in extras else [extra]))}]{m.group(3)}"


def colab_url(notebook: str, repo: str = GITHUB_REPO, branch: str = GITHUB_BRANCH) -> str:
    """Colab's address for a notebook of the repository, e.g. ``notebooks/01_setup_and_hardware.ipynb``."""
    path = PurePosixPath(notebook)
    if path.is_absolute() or ".." in path.parts or path.suffix != ".ipynb":
        raise ValueError(f"give the notebook's path inside the repository (e.g. notebooks/01_x.ipynb), got {notebook!r}")
    return f"https://colab.research.google.com/github/{repo}/blob/{branch}/{path}"


def colab_badge(notebook: str, repo: str = GITHUB_REPO, branch: str = GITHUB_BRANCH) -> str:
    """The markdown "Open in Colab" badge that starts each notebook's first cell."""
    return (f'<a href="{colab_url(notebook, repo, branch)}" target="_parent">'
            '<img src="https://colab.research.google.com/assets/colab-badge.svg" alt="Open In Colab"/></a>')


def colab_install_lines(repo: str = GITHUB_REPO, branch: str = GITHUB_BRANCH, then: tuple[str, ...] = ()) -> str:
    """The install part of every setup cell (lessons and exercises): on Colab, pip-install
    ``$COURSE_INSTALL_SPEC`` or else the spec on the cell's own line, then run ``then`` (more
    lines of the Colab branch); elsewhere nothing."""
    return "\n".join([
        "import os, sys",
        f'COURSE_INSTALL_SPEC = os.environ.get("{INSTALL_SPEC_VAR}") or "{install_spec(repo, branch)}"',
        'if "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ:',
        '    %pip install --quiet "{COURSE_INSTALL_SPEC}"',
        *(f"    {line}" for line in then),
    ])


def check_seconds(name: str, value, allow_none: bool = True, error: type[Exception] = ValueError,
                  allow_zero: bool = False) -> float | None:
    """A timeout or time limit: a finite number of seconds > 0 (>= 0 where ``allow_zero``, e.g. the
    grace before a kill), or None where ``allow_none``, else ``error`` (the caller's kind: the
    launcher's LaunchConfigError). The one rule for every front-end."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
        raise error(f"{name} must be a number of seconds {'>=' if allow_zero else '>'} 0, got {value!r}")
    return float(value)


def check_port(name: str, value, error: type[Exception] = ValueError) -> int:
    """A TCP port: a whole number from 1 to 65535 (a digit string is read as one), else ``error``."""
    port = int(value) if isinstance(value, str) and value.isdigit() else value
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise error(f"{name} must be a port from 1 to 65535, got {value!r}")
    return port


def check_count(name: str, value, error: type[Exception] = ValueError, minimum: int = 1) -> int:
    """A count (threads, samples, tokens, a parallel degree): a whole number (an int, not a float
    or a bool) >= ``minimum``, else ``error`` naming it. The one rule for every count."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return value
