"""Refuse bad launches before anything is spawned, with a message that says what to change.

Checked: the number of processes and nodes, the devices and backend of the ranks
(:mod:`course_lib.launch.placement`, with this machine's GPU count), the script or
module to run, the batch allocation (SLURM/PBS) the launch runs in, the timeouts and strategy
names. A whole training request (data, dtype, memory, resume) is checked by
:func:`course_lib.launch.training.check_request`, which builds on these.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from course_lib.gpt.config import ConfigError
from course_lib.hardware import gpu_count
from course_lib.launch.allocation import check_allocation, detect_allocation
from course_lib.launch.placement import PlanError, RankPlan, plan_ranks


class LaunchConfigError(ConfigError):
    """A launch that cannot work as asked; the message says what to change. A ConfigError (a
    ValueError): ``course train`` reports both the same way."""


def plan(nproc, device: str = "auto", backend: str = "auto", recipe: str = "", nnodes: int = 1,
         same_host: bool = False) -> RankPlan:
    """Each rank's device and the backend on this machine (:func:`placement.plan_ranks` with its GPU
    count): ranks beyond the GPUs share them over gloo; what cannot work is refused here."""
    try:
        n_gpu = 0 if device == "cpu" else gpu_count()  # CPU ranks: no torch import to count GPUs
        return plan_ranks(n_gpu, nproc, device, backend, recipe, nnodes, same_host)
    except PlanError as e:
        raise LaunchConfigError(str(e)) from None


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
