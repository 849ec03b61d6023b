"""Checkpoints of a run directory: ``last.pt`` (every eval) and ``best.pt`` (lowest val loss).

A checkpoint holds everything an exact resume needs: model and optimizer state (full, as the
Strategy returns it), the gradient scaler, the iteration, the best val loss, the config, the
dataset's meta (so sampling needs no data folder) and the RNG states of every rank (torch, CUDA,
Python and the data sampler's generator). It is written atomically -- temp file in the same
folder, fsync, rename, fsync the folder -- so a crash leaves the previous checkpoint intact. It is
read back only after every entry of its zip archive has matched its CRC-32 (a damaged file is
refused, not loaded), with ``torch.load(weights_only=True)``, which unpickles tensors and plain
containers only.
"""

from __future__ import annotations

import os
import random
import shutil
import zipfile
from pathlib import Path
from typing import BinaryIO

import torch

from course_lib.utils import atomic_write

LAST, BEST = "last.pt", "best.pt"
FORMAT_VERSION = 1
_CHUNK = 1 << 20  # bytes per read while checking an entry: few calls, little memory


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


def _what_to_do(path: Path) -> str:
    """The way out of a damaged ``path``: its run's other checkpoint (best.pt for last.pt and the
    other way round) where that is another file, else a copy or a new run."""
    again = f"start the run again (course train --overwrite --out_dir={path.parent})"
    if path.name not in (LAST, BEST):
        return "restore it from a copy, or train again"
    other = path.with_name(BEST if path.name == LAST else LAST)
    if not other.is_file():
        return f"restore it from a copy, or {again}"
    if os.path.samefile(path, other):  # a new best is one file under both names (copy_checkpoint)
        return f"{other.name} is the same file, so it is damaged too: restore it from a copy, or {again}"
    if other.name == BEST:  # a resume reads last.pt: best.pt must take its place
        use = f"resume from it (cp {other} {path}, then course train --resume --out_dir={path.parent})"
    else:
        use = f"resume from it (course train --resume --out_dir={path.parent})"
    return (f"the run's other checkpoint {other} is another file and may be intact: sample from it "
            f"(course sample --out_dir={path.parent} --ckpt={other.stem}) or {use}; or {again}")


def _verify(f: BinaryIO, path: Path) -> None:
    """Raise CheckpointError unless ``f`` (``path`` opened for reading) is a whole zip archive whose
    every entry reads back and matches its CRC-32. zipfile checks a CRC when an entry is read to
    its end, so each entry is read through, in chunks."""
    try:
        archive = zipfile.ZipFile(f)
    except Exception:  # BadZipFile mostly; a damaged directory fails in other ways too
        f.seek(0)
        if f.read(4) == b"PK\x03\x04":  # how a zip archive starts: its directory, at the end, is what is missing
            problem = "is truncated or damaged at its end (a zip archive whose directory cannot be read)"
        else:  # empty, something else, or torch's legacy format, which has no checksums to check
            problem = ("is not a zip archive, the format save_checkpoint (torch.save) writes and the "
                       "only one whose contents can be checked")
        raise CheckpointError(f"cannot read checkpoint: {path} {problem}; it is corrupt (or not a "
                              f"checkpoint at all): {_what_to_do(path)}") from None
    with archive:
        for info in archive.infolist():
            try:
                with archive.open(info) as entry:
                    while entry.read(_CHUNK):
                        pass
            # BadZipFile for a CRC or a local header; a flipped bit in the directory entry can also
            # give EOFError (a size), NotImplementedError (the compression) or RuntimeError (the
            # encryption flag): each means this entry is damaged
            except Exception as e:
                raise CheckpointError(f"checkpoint {path} is corrupt: its entry {info.filename!r} is damaged "
                                      f"({e.__class__.__name__}: {e}); {_what_to_do(path)}") from e


def _still_named(path: Path, f: BinaryIO) -> bool:
    """Does ``path`` still name the file open as ``f``? (A rename over it makes it another file.)"""
    try:
        return os.path.samestat(os.fstat(f.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def load_checkpoint(path: str | os.PathLike, map_location="cpu", mmap: bool = False) -> dict:
    """The checkpoint at ``path``, checked first: raises CheckpointError, naming the file (and the
    damaged entry) and what to do, for a missing, truncated, damaged or non-zip file, one that
    ``torch.load(weights_only=True)`` refuses, and one of another ``FORMAT_VERSION``.

    torch.save writes a zip archive whose entries carry CRC-32s, but torch.load checks none of
    them: a flipped bit (a bad disk, a copy gone wrong) would load as a silently wrong weight,
    optimizer moment or RNG state. So every entry is read and checked before unpickling. That
    reads the whole file once more, which is acceptable: a resume or a sample reads all of it
    anyway (and the second read usually comes from the page cache). Only an ``mmap=True`` load
    that uses a few fields (the launcher's resume check) pays for a read it would have skipped.

    The check and the load read one open file, so a checkpoint renamed over ``path`` meanwhile (a
    run saving while ``course sample`` reads) cannot slip in unchecked; ``mmap=True`` makes torch
    open ``path`` again, so there a file replaced in between is refused.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; train first (course train --out_dir={path.parent})")
    with open(path, "rb") as f:
        _verify(f, path)
        f.seek(0)
        try:
            ckpt = torch.load(path if mmap else f, map_location=map_location, weights_only=True, mmap=mmap)
        except Exception as e:  # intact, but not what weights_only unpickles (or another torch's format)
            raise CheckpointError(f"cannot read checkpoint {path} ({e.__class__.__name__}: {e}); it is "
                                  "not a course_lib checkpoint, or torch cannot read it") from e
        if mmap and not _still_named(path, f):
            raise CheckpointError(f"checkpoint {path} was replaced while it was read (a run saving it?); "
                                  "load it again")
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
