"""Checkpoints of a run directory: ``last.pt`` (every eval) and ``best.pt`` (lowest val loss).

A checkpoint holds everything an exact resume needs: model and optimizer state (full, as the
Strategy returns it), the gradient scaler, the iteration, the best val loss, the config, the
dataset's meta (so sampling needs no data folder) and the RNG states of every rank (torch, CUDA,
Python and the data sampler's generator). It is written atomically -- temp file in the same
folder, fsync, rename, fsync the folder -- so a crash leaves the previous checkpoint intact, and
read with ``torch.load(weights_only=True)``, which unpickles tensors and plain containers only.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch

from course_lib.utils import atomic_write

LAST, BEST = "last.pt", "best.pt"
FORMAT_VERSION = 1
class CheckpointError(RuntimeError):
    """A missing, unreadable or incompatible checkpoint; the message says what to do."""


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """``torch.save`` to a temp file next to ``path``, fsync, then rename over ``path``."""
    atomic_write(path, lambda f: torch.save(state, f))


def copy_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Make ``dst`` the same checkpoint as ``src`` atomically: a hard link (no copy) renamed into
    place; a later rename over ``src`` leaves ``dst`` pointing at the old file."""
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # a file system without hard links
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, dst)
    _fsync_dir(dst.parent)


def load_checkpoint(path: str | os.PathLike, map_location="cpu", mmap: bool = False) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; train first (course train --out_dir={path.parent})")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # truncated or not a torch file
        raise CheckpointError(f"cannot read checkpoint {path} ({e.__class__.__name__}: {e}); it is corrupt, "
                              "resume from another run or start again") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a course_lib checkpoint (format {FORMAT_VERSION})")
    return ckpt


def rng_state(data_state: torch.Tensor) -> dict:
    """This rank's random state: torch (CPU and CUDA), Python's, and the data sampler's
    (``data_state``: the sampler generator's state that redraws the pending batch)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "python": random.getstate(),
        "data": data_state,
    }


def set_rng_state(state: dict, data_generator: torch.Generator) -> None:
    """``state``: this rank's, or (another number of ranks) rank 0's: the data sampler's stream
    is the same on every rank, the others matter only for dropout
    (course_lib.trainer.config.check_layout_change)."""
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
    random.setstate(state["python"])
    data_generator.set_state(state["data"].cpu())
