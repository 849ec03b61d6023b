"""mpirun(): run a script or module on N MPI ranks through ``mpiexec`` (mpi4py in the ranks).

On a laptop or Colab ``mpiexec`` comes from the PyPI ``mpich`` wheel, next to this Python in
the virtual environment's bin/; on a cluster it is the system's (``module load mpi``), found on
PATH. Each rank runs :mod:`course_lib.launch.bootstrap` first, so output, failures and
interrupts are handled as for torchrun (see :mod:`course_lib.launch.supervise`).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from course_lib.launch import checks, torchrun
from course_lib.launch.api import (
    LaunchResult,
    _prepare_run_dir,
    base_env,
    default_run_dir,
)
from course_lib.launch.supervise import Agent, supervise


def find_mpiexec() -> str:
    """The venv's mpiexec (mpich wheel) if there is one, else the first on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.is_file():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        raise checks.LaunchConfigError(
            "mpiexec not found: `pip install mpich` (laptop, Colab) or load your cluster's MPI "
            "(module load mpi), then restart the kernel")
    return found


def is_hydra(mpiexec: str) -> bool:
    """MPICH's process manager (Hydra) ships hydra_pmi_proxy next to mpiexec."""
    return (Path(mpiexec).resolve().parent / "hydra_pmi_proxy").exists() or \
        (Path(mpiexec).parent / "hydra_pmi_proxy").exists()


def mpiexec_argv(n: int, run_dir: str, target: str, args: Sequence[str], *, module: bool,
                 mpiexec: str | None = None, local: bool = True) -> list[str]:
    """``mpiexec -n N python -m course_lib.launch.bootstrap --mpi ... TARGET ARGS``."""
    mpiexec = mpiexec or find_mpiexec()
    argv = [mpiexec, "-n", str(n)]
    if local and is_hydra(mpiexec):
        # fork the ranks here, even inside a SLURM job (Hydra would otherwise use srun)
        argv += ["-launcher", "fork"]
    return argv + [sys.executable, *torchrun.bootstrap_args(run_dir, target, args, module=module, mpi=True)]


def mpirun(target, args: Sequence[str] = (), *, n: int = 2, module: bool | None = None,
           timeout: float | None = None, env: Mapping[str, str] | None = None, run_dir=None,
           show_ranks: Sequence[int] | str = (0,), grace: float = 3.0, check: bool = False,
           out=None, err=None) -> LaunchResult:
    """Run ``target`` on ``n`` MPI ranks; returns a LaunchResult like :func:`launch`.

    MPI has no collective timeout of its own: ``timeout`` (wall clock) is what ends a hang.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise checks.LaunchConfigError(f"n must be a whole number >= 1 (MPI ranks), got {n!r}")
    timeout = checks.check_timeout("timeout", timeout)
    target, is_module = checks.resolve_target(target, module)
    mpiexec = find_mpiexec()
    run_dir = _prepare_run_dir(run_dir or default_run_dir("mpirun"))
    log_dir = str(run_dir / "logs")
    run_id = torchrun.new_run_id()
    full_env = base_env(env, n, run_id, local=True)
    argv = mpiexec_argv(n, str(run_dir), target, args, module=is_module, mpiexec=mpiexec)
    o = supervise([Agent(argv, f"{log_dir}/mpiexec")], full_env, log_dir, show=show_ranks,
                  timeout=timeout, grace=grace, out=out, err=err)
    result = LaunchResult(o.returncode, run_dir, n, 1, o.stdout, o.stderr, o.failure, o.timed_out,
                          o.error, o.duration_s, argv)
    if check:
        result.raise_for_status()
    return result
