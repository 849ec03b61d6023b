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

from course_lib.analysis.dp_recipes import global_batch_size
from course_lib.gpt.config import ConfigError, TrainConfig
from course_lib.utils import atomic_write

LAST, BEST = "last.pt", "best.pt"
FORMAT_VERSION = 1
# Fields a resumed run may change: where and how it runs, how often it reports, and how long.
RESUME_MAY_CHANGE = frozenset({"out_dir", "init_from", "max_iters", "eval_interval", "log_interval", "eval_iters",
                               "device", "compile", "strategy", "threads", "timeout_s", "run_name", "data_dir",
                               "recompute", "grad_comm_dtype",  # memory and wire format, not the model
                               # the layout: any, if the global batch stays the same (check_layout_change)
                               "nproc", "tp", "pp", "cp", "ep", "ep_dispatch", "sequence_parallel", "pp_schedule", "batch_size",
                               "gradient_accumulation_steps"})


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


def check_resumable(saved: dict, cfg: TrainConfig, path: str | os.PathLike = "checkpoint",
                    iter_num: int = 0) -> None:
    """Raise ConfigError naming every field that differs from the checkpoint's config and may not
    (and if the checkpoint, at ``iter_num``, is already past ``max_iters``)."""
    if cfg.max_iters < iter_num:
        raise ConfigError(f"{path} is at iteration {iter_num}, past max_iters={cfg.max_iters}; "
                          f"pass --max_iters={iter_num} or more to continue it")
    default = TrainConfig().to_dict()  # a field newer than the checkpoint had its default value then
    diffs = [(k, saved.get(k, default[k]), v) for k, v in cfg.to_dict().items()
             if k not in RESUME_MAY_CHANGE and saved.get(k, default[k]) != v]
    if diffs:
        changed = "; ".join(f"{k}: checkpoint has {a!r}, now {b!r}" for k, a, b in diffs)
        fix = " ".join(f"--{k}={a}" for k, a, _ in diffs)
        raise ConfigError(f"cannot resume {path} with this config ({changed}); "
                          f"pass {fix} to continue that run, or start a new one in another --out_dir")


def _global_batch(cfg: dict, world_size: int) -> int:
    """:func:`~course_lib.analysis.dp_recipes.global_batch_size` of a config dict (dp = ranks / (tp pp cp))."""
    mp = cfg.get("tp", 1) * cfg.get("pp", 1) * cfg.get("cp", 1)
    return global_batch_size(cfg["batch_size"], cfg["gradient_accumulation_steps"], world_size // mp)


def check_layout_change(saved: dict, saved_world: int, cfg: TrainConfig, world_size: int,
                        path: str | os.PathLike = "checkpoint") -> None:
    """A checkpoint resumes under another layout (ranks, tp, pp, cp, strategy, micro-batching)
    when the global batch per step is the same: the full state has one format, the data sampler
    draws the same samples, and the step's gradient is the mean over the same global batch. With
    dropout the ranks' random streams would differ, so the number of ranks must stay."""
    before, now = _global_batch(saved, saved_world), _global_batch(cfg.to_dict(), world_size)
    if before != now:
        raise ConfigError(f"{path} trained with a global batch of {before} sequences per step, this layout has "
                          f"{now} (batch_size x gradient_accumulation_steps x dp); choose batch_size and "
                          f"gradient_accumulation_steps so that they give {before}")
    if saved_world != world_size and cfg.dropout:
        raise CheckpointError(f"{path} was written by {saved_world} ranks, this run has {world_size}; with "
                              f"dropout={cfg.dropout} the random streams differ: resume with --nproc={saved_world}")


def check_resume(ck: dict, cfg: TrainConfig, path: str | os.PathLike, world_size: int) -> None:
    """Can ``cfg`` on ``world_size`` ranks continue checkpoint ``ck``? (checked by the launcher
    before spawning, and again by each worker, which may have been started some other way).
    The fields must match (but for the layout's), and the global batch (check_layout_change)."""
    check_resumable(ck["config"], cfg, path, ck["iter_num"])
    check_layout_change(ck["config"], ck["world_size"], cfg, world_size, path)


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
    is the same on every rank, the others matter only for dropout (check_layout_change)."""
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
    random.setstate(state["python"])
    data_generator.set_state(state["data"].cpu())
