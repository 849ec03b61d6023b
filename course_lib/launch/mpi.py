"""mpirun(): run a script or module on N MPI ranks through ``mpiexec`` (mpi4py in the ranks).

On a laptop or Colab ``mpiexec`` comes from the PyPI ``mpich`` wheel, next to this Python in
the virtual environment's bin/; on a cluster it is the system's (``module load mpi``), found on
PATH. The mpiexec must belong to the MPI library that mpi4py loads in the ranks (asked in a
subprocess, so the launcher never starts MPI itself): an Open MPI mpiexec starting ranks that
load MPICH gives N copies of rank 0. :func:`find_mpiexec` takes the matching one and refuses a
mismatch before anything starts; Open MPI run as root gets its documented switches. Each rank runs :mod:`course_lib.launch.bootstrap` first, so output, failures and
interrupts are handled as for torchrun (see :mod:`course_lib.launch.supervise`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import course_lib.launch.checks as checks
import course_lib.launch.torchrun as torchrun
from course_lib.launch.api import (
    LaunchResult,
    _prepare_run_dir,
    base_env,
    default_run_dir,
)
from course_lib.launch.supervise import Agent, supervise
from course_lib.utils import check_count, check_seconds

MPICH, OPEN_MPI = "MPICH", "Open MPI"
# torchrun's rank variables, which a process that is itself a rank (or a notebook that set them for a
# one-process group) holds: inherited, every MPI rank read RANK=0 and WORLD_SIZE=1 before its own
# PMI_RANK (bootstrap.RANK_ENVS), and all of them were rank 0, writing one rank's log files.
TORCH_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
# Another launcher's rank variables that bootstrap reads before Open MPI's OMPI_COMM_WORLD_*, and which
# Open MPI does not overwrite (Hydra does): a kernel started by `srun --mpi=pmi2` (batchspawner) holds
# PMI_RANK=0 and PMI_SIZE=1 (Slurm's mpi/pmi2 plugin sets them in every task), so every Open MPI rank
# was rank 0 of 1 again.
_INHERITED_RANK_VARS = (*TORCH_RANK_VARS, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
# mpi4py.rc: load the MPI library without starting MPI (MPI_Get_library_version may be called
# before MPI_Init: MPI 4.1 standard, section 9.1.1), in a process of its own, as each rank would.
_LIBRARY_PROBE = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False; "
                  "from mpi4py import MPI; print(MPI.Get_library_version())")


def family(text: str) -> str | None:
    """MPICH or Open MPI from a library version string or an ``mpiexec --version`` banner.

    MPICH's mpiexec is Hydra ("HYDRA build details"); Open MPI's says "Open MPI", "OpenRTE"
    (v4 and older) or "prte" (v5 runs PRRTE). Intel MPI and MVAPICH derive from MPICH (Hydra, and
    mpi4py loads them through the MPICH ABI).
    """
    low = text.lower()
    if "open mpi" in low or "openrte" in low or re.search(r"\bprte\b", low):
        return OPEN_MPI
    if "mpich" in low or "hydra" in low or "intel(r) mpi" in low or "mvapich" in low:
        return MPICH
    return None


def library_family(env: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """(family, first line of MPI_Get_library_version) of the MPI library mpi4py loads with ``env``
    (``MPI4PY_LIBMPI`` chooses it; else the venv's mpich wheel comes first, then the system's)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _LIBRARY_PROBE], capture_output=True, text=True,
                              env=dict(os.environ if env is None else env), timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise checks.LaunchConfigError(f"cannot ask mpi4py which MPI it loads: {e}") from None
    if proc.returncode != 0:
        raise checks.LaunchConfigError(
            "mpi4py cannot load an MPI library (pip install mpi4py mpich, or load your cluster's MPI): "
            + (proc.stderr.strip().splitlines() or ["no message"])[-1])
    line = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
    return family(proc.stdout), line


def launcher_family(mpiexec: str) -> str | None:
    try:
        proc = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return family(proc.stdout + proc.stderr)


def candidates() -> list[str]:
    """Every mpiexec in reach: the venv's (mpich wheel) first, then each one on PATH."""
    found = []
    local = Path(sys.executable).parent / "mpiexec"
    if local.is_file():
        found.append(str(local))
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        path = Path(folder or ".") / "mpiexec"
        if path.is_file() and os.access(path, os.X_OK) and path.resolve() not in {Path(f).resolve() for f in found}:
            found.append(str(path))
    return found


def find_mpiexec(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(mpiexec, family): the first mpiexec of the MPI that mpi4py loads with ``env``.

    An mpiexec of another MPI starts N processes that do not know each other: each one is rank 0
    of 1. That is refused here, with what to do, before anything starts.
    """
    found = candidates()
    if not found:
        raise checks.LaunchConfigError(
            "mpiexec not found: `pip install mpich` (laptop, Colab) or load your cluster's MPI "
            "(module load mpi), then restart the kernel")
    lib, version = library_family(env)
    launchers = {m: launcher_family(m) for m in found}
    for mpiexec, fam in launchers.items():
        if fam is not None and fam == lib:
            return mpiexec, fam
    seen = "; ".join(f"{m} ({fam or 'unknown MPI'})" for m, fam in launchers.items())
    hint = ("pip install mpich (its mpiexec goes next to this Python)" if lib == MPICH else
            "install or load that MPI's mpiexec (e.g. apt-get install openmpi-bin, module load openmpi)")
    raise checks.LaunchConfigError(
        f"mpi4py loads {lib or 'an unknown MPI'} ({version!r}) but no mpiexec of it was found, only: {seen}. "
        f"An mpiexec of another MPI would start copies of rank 0 that never meet. Either {hint}, or point "
        "mpi4py at the library of the mpiexec you have: MPI4PY_LIBMPI=/path/to/libmpi.so (mpi4py docs, "
        "'Environment variables')")


def is_hydra(mpiexec: str) -> bool:
    """MPICH's process manager (Hydra) ships hydra_pmi_proxy next to mpiexec."""
    return (Path(mpiexec).resolve().parent / "hydra_pmi_proxy").exists() or \
        (Path(mpiexec).parent / "hydra_pmi_proxy").exists()


def launcher_options(fam: str, local: bool = True) -> tuple[list[str], dict[str, str]]:
    """(mpiexec options, environment) for ranks on this host with an MPI of family ``fam``.

    MPICH (Hydra): ``-launcher fork`` starts the ranks here even inside a SLURM job (Hydra would
    otherwise use srun). Open MPI: ``--oversubscribe`` allows more ranks than cores (else it
    refuses: "not enough slots"), and as root its two documented switches (mpirun(1), "Running
    as root": OMPI_ALLOW_RUN_AS_ROOT and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM) instead of refusing.
    """
    if fam == OPEN_MPI:
        env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}
        return (["--oversubscribe"] if local else []), env
    return (["-launcher", "fork"] if local else []), {}


def mpiexec_argv(n: int, run_dir: str, target: str, args: Sequence[str], *, module: bool,
                 mpiexec: str, fam: str = MPICH, local: bool = True) -> list[str]:
    """``mpiexec -n N python -m course_lib.launch.bootstrap --mpi ... TARGET ARGS``."""
    options, _ = launcher_options(fam, local)
    return [mpiexec, "-n", str(n), *options, sys.executable,
            *torchrun.bootstrap_args(run_dir, target, args, module=module, mpi=True)]


def mpirun(target, args: Sequence[str] = (), *, n: int = 2, module: bool | None = None,
           timeout: float | None = None, env: Mapping[str, str] | None = None, run_dir=None,
           show_ranks: Sequence[int] | str = (0,), grace: float = 3.0, check: bool = False,
           out=None, err=None) -> LaunchResult:
    """Run ``target`` on ``n`` MPI ranks; returns a LaunchResult like :func:`launch`.

    MPI has no collective timeout of its own: ``timeout`` (wall clock) is what ends a hang. The
    ranks get this process's environment without torchrun's rank variables (RANK, WORLD_SIZE, ...)
    or another launcher's (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID) unless ``env`` sets them: each rank's
    own are MPI's.
    """
    check_count("n (MPI ranks)", n, error=checks.LaunchConfigError)
    timeout = check_seconds("timeout", timeout, error=checks.LaunchConfigError)
    checks.check_show_ranks_and_env(show_ranks, env)
    grace = check_seconds("grace", grace, False, checks.LaunchConfigError, allow_zero=True)
    target, is_module = checks.resolve_target(target, module)
    run_id = torchrun.new_run_id()
    full_env = base_env(env, n, run_id, local=True)
    for name in _INHERITED_RANK_VARS:  # this process's own, if it is a rank: bootstrap reads them first
        if name not in (env or {}):
            full_env.pop(name, None)
    mpiexec, fam = find_mpiexec(full_env)  # the one that matches mpi4py's library, else refused here
    full_env.update(launcher_options(fam)[1])
    run_dir = _prepare_run_dir(run_dir or default_run_dir("mpirun"))
    log_dir = str(run_dir / "logs")
    argv = mpiexec_argv(n, str(run_dir), target, args, module=is_module, mpiexec=mpiexec, fam=fam)
    o = supervise([Agent(argv, f"{log_dir}/mpiexec")], full_env, log_dir, show=show_ranks,
                  timeout=timeout, grace=grace, out=out, err=err)
    result = LaunchResult(o.returncode, run_dir, n, 1, o.stdout, o.stderr, o.failure, o.timed_out,
                          o.error, o.duration_s, argv)
    if check:
        result.raise_for_status()
    return result
