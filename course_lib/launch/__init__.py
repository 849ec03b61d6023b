"""Launching distributed work from Python and from notebook cells.

    %load_ext course_lib
    %%torchrun -n 2            # the cell runs on 2 ranks, process group ready
    %%mpirun -n 4              # the cell runs on 4 MPI ranks (mpi4py)

    from course_lib.launch import launch, launch_training, notebook_launcher, mpirun

Modules: :mod:`.api` (launch, LaunchResult), :mod:`.training` (the one training path:
check_request, run_training behind launch_training and ``course train``), :mod:`.train_cli`
(``course train``), :mod:`.demo` (``make demo``),
:mod:`.mpi` (mpirun), :mod:`.notebook` (notebook_launcher: fork N processes running a notebook function),
:mod:`.magics`, :mod:`.cluster` (SLURM/PBS), :mod:`.torchrun` (command lines),
:mod:`.procs` (process trees), :mod:`.supervise` and :mod:`.monitor` (the launcher's loop),
:mod:`.bootstrap` (what each rank runs first), :mod:`.agent` (torchrun on loopback),
:mod:`.checks` (input validation). Names are imported lazily: importing this package is cheap,
which matters because every rank imports it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "launch": "course_lib.launch.api",
    "LaunchResult": "course_lib.launch.api",
    "LaunchError": "course_lib.launch.api",
    "LaunchConfigError": "course_lib.launch.checks",
    "launch_training": "course_lib.launch.training",
    "mpirun": "course_lib.launch.mpi",
    "notebook_launcher": "course_lib.launch.notebook",
    "NotebookLaunchError": "course_lib.launch.notebook",
    "RankFailure": "course_lib.launch.supervise",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'course_lib.launch' has no attribute {name!r}")
