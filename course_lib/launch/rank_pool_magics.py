"""The ``%ranks`` line magic and ``%%ranks`` cell magic (``%load_ext course_lib``): a
:class:`~course_lib.launch.rank_pool.RankPool` driven from notebook cells.

    %ranks start 4 [--backend gloo|nccl] [--device cpu|cuda] [--timeout 30]
    %%ranks                 # the cell on every rank
    %%ranks 0,2             # on ranks 0 and 2 only
    %%ranks --timeout 60    # this cell may run 60 s
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

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from course_lib.launch.placement import LaunchConfigError
from course_lib.launch.rank_pool import DEFAULT_TIMEOUT_S, RankPool
from course_lib.launch.rank_pool_view import flight_table


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line in the notebook, not a SystemExit
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")


def _line_parser() -> _Parser:
    p = _Parser(prog="%ranks", add_help=False)
    p.add_argument("action", choices=("start", "stop", "restart", "status", "teaching", "flight",
                                      "check_replicas"))
    p.add_argument("arg", nargs="?", help="ranks (start), on|off (teaching), the model's name (check_replicas)")
    p.add_argument("--no-check", dest="check", action="store_false", help="start without teaching mode")
    p.add_argument("--optimizer", help="check_replicas: the optimizer's name on the ranks")
    p.add_argument("--batch", help="check_replicas: the name of the batch each rank read")
    p.add_argument("--local", help="check_replicas: the name of the gradients before the sync (local_grads)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds a cell may run, and the collective timeout")
    return p


def _cell_parser() -> _Parser:
    p = _Parser(prog="%%ranks", add_help=False)
    p.add_argument("ranks", nargs="?", default=None, help="e.g. 0,2 (default: every rank)")
    p.add_argument("--timeout", type=float, default=None)
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
        self.pool.run(cell, ranks=parse_ranks(a.ranks), timeout=a.timeout)
        return None

    def _line(self, a):
        if a.action == "start":
            if a.arg is None or not a.arg.isdigit():
                raise UsageError("%ranks start N: how many ranks?")
            a.n = int(a.arg)
            if self.pool is not None and self.pool.running:
                raise UsageError(f"{self.pool.world_size} ranks are running: %ranks stop first, or %ranks restart")
            try:
                self.pool = RankPool(a.n, backend=a.backend, device=a.device, timeout=a.timeout, check=a.check)
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
    ipython.register_magics(RankPoolMagics)
