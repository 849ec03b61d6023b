"""Refuse bad launches before anything is spawned, with a message that says what to change.

Checked here: the number of nodes, the script or module to run, the timeouts and strategy names.
The number of ranks, their devices and the backend are checked where they are decided
(:func:`course_lib.launch.placement.plan`), the batch job (SLURM/PBS) the launch runs in by
:func:`course_lib.launch.allocation.check_scheduler`. A whole training request (data, dtype,
memory, resume) is checked by :func:`course_lib.launch.training.check_request`, which builds on these.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from course_lib.launch.placement import LaunchConfigError
from course_lib.registry import STRATEGIES


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
                                "script path (ending in .py) or a module name like course_lib.trainer.loop")
    return target, True


def check_strategy(name: str) -> None:
    if name not in STRATEGIES:
        raise LaunchConfigError(f"unknown strategy {name!r}; choose one of {sorted(STRATEGIES)}")
