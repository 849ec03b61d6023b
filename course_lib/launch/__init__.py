"""Launching distributed work from Python and from notebook cells.

    %load_ext course_lib
    %%torchrun -n 2            # the cell runs on 2 ranks, process group ready
    %%mpirun -n 4              # the cell runs on 4 MPI ranks (mpi4py)
    %ranks start 4             # 4 ranks that live across cells; then %%ranks cells, ranks.pull("t")

    from course_lib.launch import launch, launch_training, notebook_launcher, mpirun

Modules:

    api         launch(target, args, LaunchSpec), LaunchResult: any script or module on N ranks, supervised
    training    the one training path: run_training behind launch_training() and ``course train`` (cli)
    checks      the one home of every check, run before anything is spawned: check_launch
                (a LaunchSpec), check_request and CHECKS (a training request)
    mpi         mpirun(): the same for MPI ranks (mpi4py), with the mpiexec of mpi4py's MPI library
    ranks       the one local rank runner (run_local): N processes started clean from a fork
                server, a function sent by value, one rendezvous, one barrier; behind
                notebook_launcher, run_ranks and the grading helpers
    rank_child  what each of those local ranks runs: join, call, send back value or traceback
    forked      notebook_launcher(): a notebook function on N local CPU ranks (via ranks)
    spawn       run_ranks(fn, nproc, *args): a function on N local gloo processes, for the tests,
                the lessons and the exercises (via ranks)
    magics      the notebook magics: %%torchrun and %%mpirun; the rank pool's
                %ranks start|stop|restart|status|teaching|flight|check_replicas and %%ranks [0,2]
    placement   where ranks run: the device of each rank and the backend, decided before any start; the SLURM
                or PBS job this process runs in, and what a launch may ask of it
    rank_pool   RankPool: persistent ranks across cells (ipyparallel engines + a process group); what
                it does on a hang or a dead rank (each rank's state, restart, regroup, the variables lost)
    rank_pool_engine   what runs in those ranks: setup, the collective tracker, the parent watch
    rank_pool_view     a cell's output grouped by rank, redrawn while it runs
    cluster     ``course submit``: SLURM and PBS batch scripts
    slurm_local a real two-node SLURM on this machine, to try ``course submit`` (make slurm-local)
    torchrun    the torchrun command lines, and the agent (torchrun with its stores on loopback only)
    bootstrap   what each rank runs first (logs, process group, the target)
    supervise   watching a launch: the launcher's loop (wait, stop on the first failure, explain it) and what
                it reads of the ranks (per-rank output, rank states, where a hung rank waits, metrics.csv)
    procs       process trees: spawn with a parent-death signal, stop them all

Names are imported lazily: importing this package is cheap, which matters because every rank
imports it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "launch": "course_lib.launch.api",
    "LaunchResult": "course_lib.launch.api",
    "LaunchSpec": "course_lib.launch.api",
    "LaunchError": "course_lib.launch.api",
    "LaunchConfigError": "course_lib.launch.placement",
    "launch_training": "course_lib.launch.training",
    "mpirun": "course_lib.launch.mpi",
    "notebook_launcher": "course_lib.launch.forked",
    "NotebookLaunchError": "course_lib.launch.forked",
    "RankFailure": "course_lib.launch.supervise",
    "RankPool": "course_lib.launch.rank_pool",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'course_lib.launch' has no attribute {name!r}")
