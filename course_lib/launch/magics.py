"""The course's notebook magics (``%load_ext course_lib`` registers them all): ``%%torchrun`` and
``%%mpirun`` run a cell once on N new ranks; ``%ranks`` / ``%%ranks`` drive a
:class:`~course_lib.launch.rank_pool.RankPool`, ranks that live across cells.

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

``%ranks`` and ``%%ranks``: the pool's ranks keep their variables from cell to cell.

    %ranks start 4 [--backend gloo|nccl] [--device cpu|cuda] [--timeout 30]
    %%ranks                 # the cell on every rank
    %%ranks 0,2             # on ranks 0 and 2 only
    %%ranks --timeout 60    # this cell may run 60 s, and wait that long in a collective
    %ranks status | restart | stop
    %ranks teaching on|off  # teaching mode: every collective compared across ranks first (default on)
    %ranks flight           # each rank's last collectives, side by side (the flight recorder)
    %ranks check_replicas model [--optimizer opt] [--batch x] [--local g]   # are the replicas equal?

``%ranks start`` defines ``ranks`` in the notebook: the pool, for ``ranks.pull("t")`` (one value
per rank) and ``ranks.push(x=...)`` / ``ranks.push_each(x=[...])``.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
from contextlib import contextmanager
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, magics_class

from course_lib.launch.api import LaunchError, default_run_dir, launch
from course_lib.launch.bootstrap import CHECK_ENV
from course_lib.launch.mpi import mpirun
from course_lib.launch.placement import LaunchConfigError
from course_lib.launch.rank_pool import DEFAULT_TIMEOUT_S, RankPool
from course_lib.launch.rank_pool_view import flight_table
from course_lib.utils import check_seconds


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # IPython shows UsageError as one line in the notebook instead of exiting
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")


def _seconds(text: str) -> float:
    """A --timeout or --time-limit: utils.check_seconds's rule, named as the student typed it."""
    try:
        return check_seconds("seconds", float(text), allow_none=False)
    except ValueError:  # not a number, or not a finite one > 0
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None


# -- %%torchrun and %%mpirun: a cell run once on N new ranks -----------------------------------------
def _show_ranks(text: str):
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
    p.add_argument("--timeout", type=_seconds, default=60.0, help="collective timeout, seconds")
    p.add_argument("--time-limit", type=_seconds, help="wall-clock limit for the cell, seconds")
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
    p.add_argument("--time-limit", "--timeout", type=_seconds, dest="time_limit",
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


@contextmanager
def _cell_file(run_dir: Path, cell: str):
    """RUN_DIR/cell.py holding the cell, for the launcher (which checks that its script exists). If the
    launch is refused (LaunchConfigError), what was made for it goes again: the folders this made, or
    the cell.py it replaced comes back. A refused cell leaves nothing behind."""
    made = next((p for p in reversed((run_dir, *run_dir.parents)) if not p.exists()), None)
    path = run_dir / "cell.py"
    before = path.read_bytes() if path.is_file() else None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(cell)
    except OSError as e:  # a file, read-only or mistyped: one line, as launch() says it
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise LaunchConfigError(f"cannot write the run directory {run_dir} ({e.strerror or e}); "
                                "choose another --run-dir") from None
    try:
        yield path
    except LaunchConfigError:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        elif before is not None:
            path.write_bytes(before)
        else:
            path.unlink(missing_ok=True)
        raise


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
        env, show_ranks = _env(a.env) | ({CHECK_ENV: "1"} if a.check else {}), _show_ranks(a.ranks)
        run_dir = Path(a.run_dir) if a.run_dir else default_run_dir("torchrun")
        try:
            with _cell_file(run_dir, cell) as script:
                result = launch(script, nproc=nproc, nnodes=a.nnodes, module=False, device=a.device,
                                backend=a.backend, timeout=a.time_limit, collective_timeout=a.timeout, env=env,
                                run_dir=run_dir, init_process_group=True, show_ranks=show_ranks, rdzv=a.rdzv,
                                nccl_debug=a.nccl_debug, nccl_debug_subsys=a.nccl_debug_subsys,
                                nccl_debug_file=a.nccl_debug_file)
        except LaunchConfigError as e:
            raise UsageError(str(e)) from None
        self._finish("torchrun", result)

    @cell_magic
    def mpirun(self, line: str, cell: str):
        """%%mpirun -n N [--time-limit S] [--ranks all|0,1]"""
        a = mpirun_parser().parse_args(shlex.split(line))
        env, show_ranks = _env(a.env), _show_ranks(a.ranks)
        run_dir = Path(a.run_dir) if a.run_dir else default_run_dir("mpirun")
        try:
            with _cell_file(run_dir, cell) as script:
                result = mpirun(script, n=a.np, module=False, timeout=a.time_limit, env=env, run_dir=run_dir,
                                show_ranks=show_ranks)
        except LaunchConfigError as e:
            raise UsageError(str(e)) from None
        self._finish("mpirun", result)


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{flag} takes a number of processes or 'auto', got {text!r}") from None


# -- %ranks and %%ranks: a RankPool driven from notebook cells --------------------------------------
def _line_parser() -> _Parser:
    p = _Parser(prog="%ranks", add_help=False)
    p.add_argument("action", choices=("start", "stop", "restart", "status", "teaching", "flight",
                                      "check_replicas"))
    p.add_argument("arg", nargs="?", help="ranks (start), on|off (teaching), the model's name (check_replicas)")
    p.add_argument("--optimizer", help="check_replicas: the optimizer's name on the ranks")
    p.add_argument("--batch", help="check_replicas: the name of the batch each rank read")
    p.add_argument("--local", help="check_replicas: the name of the gradients before the sync (local_grads)")
    # start's own options: None when not given, so that another action given one refuses it
    p.add_argument("--no-check", dest="check", action="store_false", default=None,
                   help="start without teaching mode")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"))
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--timeout", type=_seconds, help="seconds a cell may run, and the collective timeout")
    return p


START_ONLY = {"check": "--no-check", "backend": "--backend", "device": "--device", "timeout": "--timeout"}


def _cell_parser() -> _Parser:
    p = _Parser(prog="%%ranks", add_help=False)
    p.add_argument("ranks", nargs="?", default=None, help="e.g. 0,2 (default: every rank)")
    p.add_argument("--timeout", type=_seconds, default=None,
                   help="seconds this cell may run, and its collective timeout (default: the pool's)")
    return p


def parse_ranks(text: str | None) -> list[int] | None:
    if text in (None, "", "all"):
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"%%ranks: ranks are whole numbers separated by commas, e.g. 0,2 (got {text!r})") from None


@magics_class
class RankPoolMagics(Magics):
    """Holds the notebook's pool (one per kernel)."""

    pool: RankPool | None = None

    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None):
        if cell is None:
            return self._line(_line_parser().parse_args(shlex.split(line)))
        a = _cell_parser().parse_args(shlex.split(line))
        if self.pool is None or not self.pool.running:
            raise UsageError("no ranks are running: %ranks start N first")
        try:
            self.pool.run(cell, ranks=parse_ranks(a.ranks), timeout=a.timeout)
        except LaunchConfigError as e:  # ranks that are not in the pool: one line, nothing run
            raise UsageError(f"%%ranks: {e}") from None
        return None

    def _line(self, a):
        given = [flag for name, flag in START_ONLY.items() if getattr(a, name) is not None]
        if a.action != "start" and given:  # it would do nothing: the pool keeps what start gave it
            raise UsageError(f"%ranks {a.action} takes no {', '.join(given)}: only %ranks start does "
                             "(%ranks stop, then %ranks start N with them)")
        if a.action == "start":
            if a.arg is None or not a.arg.isdigit():
                raise UsageError("%ranks start N: how many ranks?")
            a.n = int(a.arg)
            if self.pool is not None and self.pool.running:
                raise UsageError(f"{self.pool.world_size} ranks are running: %ranks stop first, or %ranks restart")
            try:
                self.pool = RankPool(a.n, backend=a.backend or "auto", device=a.device or "auto",
                                     timeout=a.timeout or DEFAULT_TIMEOUT_S, check=a.check is not False)
            except (LaunchConfigError, ValueError) as e:  # a PlanError too: devices that cannot work
                raise UsageError(str(e)) from None
            self.pool.start()
            self.shell.user_ns["ranks"] = self.pool
        elif self.pool is None:
            raise UsageError("no ranks were started: %ranks start N")
        elif a.action == "stop":
            self.pool.stop()
            print("ranks stopped")
        elif a.action == "restart":
            self.pool.restart()
        elif a.action == "status":
            print("\n".join(self.pool.status()))
        elif a.action == "teaching":
            if a.arg not in ("on", "off"):
                raise UsageError("%ranks teaching on|off")
            self.pool.set_check(a.arg == "on")
            print(f"teaching mode {a.arg}: collectives are {'' if a.arg == 'on' else 'not '}compared across ranks")
        elif a.action == "flight":
            print(flight_table(self.pool.flight()))
        else:
            if a.arg is None and not (a.optimizer or a.batch):
                raise UsageError("%ranks check_replicas MODEL [--optimizer OPT] [--batch X] [--local GRADS]")
            print(self.pool.check_replicas(a.arg, a.optimizer, a.batch, a.local))


def register(ipython) -> None:
    ipython.register_magics(LaunchMagics)
    ipython.register_magics(RankPoolMagics)
