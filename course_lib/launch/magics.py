"""The ``%%torchrun`` and ``%%mpirun`` cell magics (``%load_ext course_lib``).

    %%torchrun -n 2 --timeout 30
    t = torch.ones(2) * (RANK + 1)
    dist.all_reduce(t)
    print(RANK, WORLD_SIZE, t)

The cell is saved as ``RUN_DIR/cell.py`` and run as a script on every rank through torchrun
(:func:`course_lib.launch.launch`) with ``torch``, ``dist``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and ``DEVICE`` (this rank's device) defined and the default process group
initialised (gloo on CPU, NCCL with one rank per GPU, gloo for ranks sharing a GPU; one line says
which before the ranks start; ``--timeout`` is its collective timeout; ``--check``: teaching
mode, every collective compared across ranks first, :mod:`course_lib.parallel.collective_check`). Every rank's output is shown, prefixed ``[rankK]``
(``--ranks 0`` for rank 0 only; errors are always shown). A failure raises LaunchError naming
the rank; the stop button stops every process. ``%%mpirun -n N`` runs the cell on N MPI ranks
with ``MPI``, ``comm`` (COMM_WORLD), ``RANK`` and ``WORLD_SIZE`` defined. The last result is
kept in the notebook as ``torchrun_result`` / ``mpirun_result``.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class

from course_lib.launch.api import LaunchError, default_run_dir, launch
from course_lib.launch.bootstrap import CHECK_ENV
from course_lib.launch.mpi import mpirun
from course_lib.launch.placement import LaunchConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # IPython shows UsageError as one line instead of exiting
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")


def _ranks(text: str):
    if text == "all":
        return "all"
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--ranks must be 'all' or a list like 0,1; got {text!r}") from None


def torchrun_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%%torchrun", add_help=False)
    p.add_argument("-n", "--nproc", default="auto", help="ranks per node, or auto")
    p.add_argument("--nnodes", type=int, default=1, help="torchrun agents on this host, as nodes")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    p.add_argument("--time-limit", type=float, help="wall-clock limit for the cell, seconds")
    p.add_argument("--ranks", default="all", help="whose stdout to show: all, or e.g. 0 or 0,1")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="auto: NCCL for one rank per GPU, gloo for CPU ranks and ranks sharing a GPU")
    p.add_argument("--check", action="store_true",
                   help="teaching mode: every collective compared across ranks before it runs")
    p.add_argument("--rdzv", default="c10d", choices=["c10d", "static"])
    p.add_argument("--run-dir")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--nccl-debug", choices=["VERSION", "WARN", "INFO", "TRACE"])
    p.add_argument("--nccl-debug-subsys")
    p.add_argument("--nccl-debug-file")
    return p


def mpirun_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%%mpirun", add_help=False)
    p.add_argument("-n", "--np", type=int, default=2, help="MPI ranks")
    p.add_argument("--time-limit", "--timeout", type=float, dest="time_limit",
                   help="wall-clock limit, seconds (MPI has no collective timeout)")
    p.add_argument("--ranks", default="all")
    p.add_argument("--run-dir")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    return p


def _env(pairs):
    env = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise UsageError(f"--env takes KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def _write_cell(run_dir: Path, cell: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "cell.py"
    path.write_text(cell)
    return path


@magics_class
class LaunchMagics(Magics):
    def _finish(self, name: str, result):
        self.shell.user_ns[f"{name}_result"] = result
        if not result.ok:
            raise LaunchError(result.error or f"failed with exit code {result.returncode}", result)

    @cell_magic
    def torchrun(self, line: str, cell: str):
        """%%torchrun -n N [--nnodes M] [--timeout S] [--time-limit S] [--ranks all|0,1] ..."""
        a = torchrun_parser().parse_args(shlex.split(line))
        nproc = a.nproc if a.nproc == "auto" else _int(a.nproc, "-n")
        run_dir = Path(a.run_dir) if a.run_dir else default_run_dir("torchrun")
        try:
            result = launch(_write_cell(run_dir, cell), nproc=nproc, nnodes=a.nnodes, module=False,
                            device=a.device, backend=a.backend, timeout=a.time_limit, collective_timeout=a.timeout,
                            env=_env(a.env) | ({CHECK_ENV: "1"} if a.check else {}), run_dir=run_dir, init_process_group=True,
                            show_ranks=_ranks(a.ranks), rdzv=a.rdzv, nccl_debug=a.nccl_debug,
                            nccl_debug_subsys=a.nccl_debug_subsys, nccl_debug_file=a.nccl_debug_file)
        except LaunchConfigError as e:
            raise UsageError(str(e)) from None
        self._finish("torchrun", result)

    @cell_magic
    def mpirun(self, line: str, cell: str):
        """%%mpirun -n N [--time-limit S] [--ranks all|0,1]"""
        a = mpirun_parser().parse_args(shlex.split(line))
        run_dir = Path(a.run_dir) if a.run_dir else default_run_dir("mpirun")
        try:
            result = mpirun(_write_cell(run_dir, cell),
                            n=a.np, module=False, timeout=a.time_limit, env=_env(a.env),
                            run_dir=run_dir, show_ranks=_ranks(a.ranks))
        except LaunchConfigError as e:
            raise UsageError(str(e)) from None
        self._finish("mpirun", result)


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{flag} takes a number of processes or 'auto', got {text!r}") from None


def register(ipython) -> None:
    ipython.register_magics(LaunchMagics)
