"""Refuse bad launches before anything is spawned, with a message that says what to change.

Checked: the number of processes and nodes, GPUs asked for versus GPUs present, the script or
module to run, the batch allocation (SLURM/PBS) the launch runs in, the timeouts and strategy
names. A whole training request (data, dtype, memory, resume) is checked by
:func:`course_lib.launch.training.check_request`, which builds on these.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from course_lib.gpt.config import ConfigError
from course_lib.hardware import default_nproc, gpu_count
from course_lib.launch.allocation import check_allocation, detect_allocation


class LaunchConfigError(ConfigError):
    """A launch that cannot work as asked; the message says what to change. A ConfigError (a
    ValueError): ``course train`` reports both the same way."""


def resolve_device(device: str, nproc=None) -> str:
    """'auto' -> 'cuda' when this machine has a GPU for each of ``nproc`` ranks, else 'cpu'.

    More ranks than GPUs (2 ranks on Colab's one T4, say) run as CPU processes with gloo, with a
    one-line note on stderr: the course's multi-rank demos work anywhere. An explicit 'cuda' is
    never changed (:func:`resolve_nproc` refuses too many ranks for it).
    """
    if device not in ("auto", "cpu", "cuda"):
        raise LaunchConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device != "auto":
        return device
    n_gpu = gpu_count()
    ranks = int(nproc) if isinstance(nproc, str) and nproc.isdigit() else nproc
    if n_gpu and isinstance(ranks, int) and not isinstance(ranks, bool) and ranks > n_gpu:
        print(f"note: {ranks} ranks but {n_gpu} GPU(s) here: the ranks run as CPU processes (gloo)", file=sys.stderr)
        return "cpu"
    return "cuda" if n_gpu > 0 else "cpu"


def resolve_nproc(nproc, device: str) -> int:
    """Ranks per node: an int >= 1, or 'auto' (one per GPU, else 2 CPU ranks)."""
    if nproc == "auto":
        return default_nproc(device)
    if isinstance(nproc, str) and nproc.isdigit():
        nproc = int(nproc)
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        raise LaunchConfigError(f"nproc must be a whole number >= 1 or 'auto', got {nproc!r}")
    if nproc < 1:
        raise LaunchConfigError(f"nproc must be >= 1 (processes per node), got {nproc}")
    if device == "cuda":
        n_gpu = gpu_count()
        if n_gpu == 0:
            raise LaunchConfigError("device='cuda' but this machine has no GPU; use device='cpu' "
                                    "(gloo) or run on a GPU machine")
        if nproc > n_gpu:
            raise LaunchConfigError(
                f"{nproc} GPU ranks asked for but this machine has {n_gpu} GPU(s); use "
                f"nproc<={n_gpu} (one rank per GPU) or device='cpu'")
    return nproc


def check_nnodes(nnodes) -> int:
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise LaunchConfigError(f"nnodes must be a whole number >= 1, got {nnodes!r}")
    return nnodes


def check_timeout(name: str, value, allow_none: bool = True) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise LaunchConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


def resolve_target(target, module: bool | None = None) -> tuple[str, bool]:
    """(target, is_module): a .py path that exists, or an importable module name."""
    target = os.fspath(target)
    looks_like_path = target.endswith(".py") or os.sep in target
    if module is None:
        module = not looks_like_path and not Path(target).is_file()
    if not module:
        if not Path(target).is_file():
            raise LaunchConfigError(f"script {target!r} does not exist (working directory "
                                    f"{os.getcwd()}); give the path of a .py file")
        return str(Path(target).resolve()), False
    try:
        found = importlib.util.find_spec(target) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise LaunchConfigError(f"{target!r} is neither a file nor an importable module; give a "
                                "script path (ending in .py) or a module name like course_lib.gpt.train")
    return target, True


def check_scheduler(nnodes: int, nproc_per_node: int, device: str, env=None) -> None:
    try:
        check_allocation(nnodes, nproc_per_node, device == "cuda", detect_allocation(env))
    except ValueError as e:
        raise LaunchConfigError(str(e)) from None


def check_strategy(name: str) -> None:
    from course_lib.parallel.strategy import STRATEGIES  # why: imports torch; launching a plain script needs none

    if name not in STRATEGIES:
        raise LaunchConfigError(f"unknown strategy {name!r}; choose one of {sorted(STRATEGIES)}")
