"""RankPool: ranks that live across notebook cells, with a process group already set up.

    %load_ext course_lib
    %ranks start 4                      # 4 ranks, gloo on CPU (NCCL with a GPU per rank)
    %%ranks
    t = torch.ones(2) * (RANK + 1)      # runs on every rank; variables stay on each rank
    dist.all_reduce(t)
    ranks.pull("t")                     # one value per rank, back in the kernel

Each rank is an ipyparallel engine (a persistent IPython kernel of its own, started fresh, so it
does not matter what the notebook's kernel did before: CUDA, a backward, threads). The pool adds
what a classroom needs and ipyparallel does not know about: the default process group and the
rank's device, one line saying what was chosen, output grouped by rank and streamed live, and
hangs turned into errors. A cell that runs past ``timeout`` seconds (one rank skipped a
collective) is stopped: the error names the ranks that were waiting and in which collective, the
ranks are interrupted, and the process group is made anew; every rank keeps its variables. An
exception on one rank shows that rank's traceback and leaves the others as they were. Interrupting
the kernel interrupts the ranks. ``%ranks stop`` (or the kernel's end, however it ends) leaves no
process behind. The magics are in :mod:`course_lib.launch.rank_pool_magics`, what runs in the
ranks in :mod:`course_lib.launch.rank_pool_engine`.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

from course_lib.hardware import gpu_count, threads_per_rank
from course_lib.launch import rank_pool_engine as engine
from course_lib.launch import rank_pool_health as health
from course_lib.launch.placement import LaunchConfigError, RankPlan, plan_ranks
from course_lib.launch.rank_pool_recover import (
    GRACE_S,
    PG_MARGIN_S,
    SPARES,
    PoolRecovery,
    RankDiedError,
    RankHangError,
    RankPoolError,
    kill,
)
from course_lib.launch.rank_pool_view import RankBoard, error_line

DEFAULT_TIMEOUT_S = 30.0
OUTPUT_WAIT_S = 5.0  # after a cell's replies: the most the pool waits for the rest of its output
# The controller's heartbeat, in ms (ipyparallel's default: 3000). An engine counts as registered
# only at the first heartbeat after it connects, so %ranks start waited about one period for its
# last engine: 1 s instead of 3 s makes a 2-rank pool start in about 6 s instead of 9.5 on 2 cores.
# An engine is still declared lost only after 10 missed beats (10 s; its heart answers from a
# thread of its own, whatever its cell is doing).
HEARTBEAT_MS = 1000
__all__ = ["DEFAULT_TIMEOUT_S", "GRACE_S", "PG_MARGIN_S", "RankDiedError", "RankHangError", "RankPool",
           "RankPoolError"]


class RankPool(PoolRecovery):
    """``world_size`` persistent ranks; see the module docstring. ``timeout``: seconds a cell may
    run, and the process group's collective timeout."""

    def __init__(self, world_size: int, backend: str = "auto", device: str = "auto",
                 timeout: float = DEFAULT_TIMEOUT_S, threads: int | None = None, gpus: int | None = None,
                 check: bool = True):
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise LaunchConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= 64:
            raise LaunchConfigError(f"the number of ranks must be a whole number from 1 to 64, got {world_size!r}")
        if gpus is None:
            gpus = gpu_count()
        # the same decision as course train and %%torchrun (gloo on CPU, NCCL with a GPU per rank,
        # gloo on shared GPUs), refused here, before anything starts, if it cannot work
        self.placement: RankPlan = plan_ranks(gpus, nproc=world_size, device=device, backend=backend,
                                              recipe="%ranks")
        self.world_size, self.timeout = world_size, float(timeout)
        if threads is None:
            threads = threads_per_rank(world_size)
        self.threads = threads
        self._cluster = self._client = None
        self._dir: Path | None = None
        self._pids: list[int] = []
        self._parent_pids: dict[int, int | None] = {}  # rank -> the pid of its engine's parent (rank_pool_engine)
        self._groups = 0
        self._log_from: dict[int, int] = {}
        self.check = check  # teaching mode: collectives compared across ranks (parallel.collective_check)
        self.history: list[tuple[str, list[int], str]] = []  # (label, ranks, code) of each cell run
        self._names: dict[int, list[str]] = {}  # each rank's variables after the last cell

    # -- life cycle --------------------------------------------------------------------------
    def start(self, log=print) -> RankPool:
        # ipyparallel (0.25 s) only when ranks start, not on %load_ext course_lib
        import ipyparallel as ipp

        self._dir = Path(tempfile.mkdtemp(prefix="course_ranks_"))
        entry = [sys.executable, "-m", "course_lib.launch.rank_pool_engine"]
        # one spare engine, torch imported, waits to replace a rank that dies (rank_pool_recover)
        cluster = ipp.Cluster(n=self.world_size + SPARES, log_level=40, profile_dir=str(self._dir / "profile"),
                              cluster_id="ranks", shutdown_atexit=True,
                              controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}"])
        cluster.config.LocalControllerLauncher.controller_cmd = [*entry, "controller"]
        cluster.config.LocalEngineSetLauncher.engine_cmd = [*entry, "engine"]
        cluster.config.LocalEngineSetLauncher.environment = {"OMP_NUM_THREADS": str(self.threads),
                                                             "COURSE_RANKS_DIR": str(self._dir)}
        self._cluster = cluster
        try:
            cluster.start_cluster_sync()
            self._client = cluster.connect_client_sync()
            # no progress widget: its saved state would read "0/N" in a reopened notebook
            self._client.wait_for_engines(self.world_size, timeout=120, interactive=False)
            self._engines = sorted(self._client.ids)[: self.world_size]  # rank r is engine _engines[r]
            self._retired: set[int] = set()  # engines of ranks that died
            self._pids = self._apply_each("setup", lambda r: (
                r, self.world_size, self.placement.backend, self.placement.devices[r], self._store(),
                str(self._op_file(r)), self.timeout + PG_MARGIN_S, self.threads, self.check))
            self._client[self._engines].push({"ranks": None}, block=True)
            self.history, self._names = [], {}
            self._parent_pids = {r: health.parent_pid(pid) for r, pid in enumerate(self._pids)}
        except BaseException:
            self.stop()
            raise
        log(f"{self.placement.line()} · cell limit {self.timeout:g} s · started")
        return self

    def stop(self) -> None:
        """Stop every rank and the controller; nothing is left running."""
        if self._cluster is not None:
            # found now: once its engine is gone, a nanny is no child of ours, and it lingers for
            # 3 s trying to tell the stopped controller that its engine exited
            leftover = [p for p in health.pool_processes(self._dir) if p.pid not in self._pids]
            for pid in self._pids:  # the ranks first: their parents then exit at once (a spare on SIGTERM)
                kill(pid, signal.SIGKILL)
            try:
                self._cluster.stop_cluster_sync()
            except Exception:  # noqa: BLE001, S110 - stopping is best effort; the kill below is not
                pass
            for pid in self._pids:
                kill(pid, signal.SIGKILL)
            for p in leftover:  # the nannies, and whatever else of the pool is left (psutil: no reused pid)
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
        if self._client is not None:
            self._client.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._cluster = self._client = self._dir = None
        self._pids = []

    def restart(self, log=print) -> RankPool:
        """Stop and start again (the ranks' variables are lost)."""
        self.stop()
        return self.start(log)

    @property
    def running(self) -> bool:
        return self._client is not None

    def __enter__(self):
        return self if self.running else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- running cells -------------------------------------------------------------------------
    def run(self, code: str, ranks=None, timeout: float | None = None, show: bool = True) -> None:
        """Run ``code`` on ``ranks`` (default all), showing each rank's output as it comes
        (``show=False``: only if a rank writes to stderr or fails)."""
        targets = self._targets(ranks)
        limit = self.timeout if timeout is None else float(timeout)
        self.history.append((_cell_label(len(self.history)), targets, code))
        self._log_from = {r: health.log_size(self._log_file(r)) for r in targets}  # this cell's output starts there
        for r in targets:
            self._op_file(r).unlink(missing_ok=True)
        ar = self._client[[self._engines[r] for r in targets]].execute(code, block=False, silent=False)
        board = RankBoard(targets, quiet=not show)
        start = time.monotonic()
        try:
            while not ar.ready():
                board.update(ar.metadata)
                dead = [r for r in targets if not health.alive(self._pids[r])]
                if dead:
                    self._after_death(ar, targets, dead, board)
                if time.monotonic() - start > limit:
                    self._after_hang(ar, targets, limit, board)
                time.sleep(0.1)
            dead = [r for r in targets if not health.alive(self._pids[r])]
            if dead:
                self._after_death(ar, targets, dead, board)
            # a rank's stdout travels on IOPub and can arrive after its reply: wait for it, or the
            # last lines of a cell (all of a short one) would be missing from the board
            ar.wait_for_output(OUTPUT_WAIT_S)
        except KeyboardInterrupt:
            running = self._running(ar, targets)
            for line in self._interrupt(ar, targets):
                print(line)
            board.update(ar.metadata, final=True, stopped=dict.fromkeys(running, "interrupted"))
            raise KeyboardInterrupt(f"interrupted rank(s) {running}; the process group was made anew") from None
        board.update(ar.metadata, final=True)
        self._remember_names(targets)
        failed = {r: error_line(md) or "failed" for r, md in zip(targets, ar.metadata, strict=True)
                  if md.get("status") == "error"}
        if failed:
            same = len(failed) > 1 and len(set(failed.values())) == 1
            who = (f"ranks {', '.join(map(str, failed))}: {next(iter(failed.values()))}" if same else
                   ", ".join(f"rank {r}: {line}" for r, line in failed.items()))
            ok = [r for r in targets if r not in failed]
            raise RankPoolError(f"{who} (traceback above); " + (f"ranks {ok} finished and are usable"
                                                                 if ok else "the pool is still usable"), failed)

    # -- teaching mode and checks ------------------------------------------------------------------
    def set_check(self, on: bool) -> None:
        """Teaching mode on or off on every rank (it must be the same on all: it is an exchange)."""
        self._client[[self._engines[r] for r in self._targets(None)]].apply_sync(engine.set_check, on)
        self.check = on

    def flight(self) -> dict[int, list[dict]]:
        """Each rank's flight recorder: its last collectives, oldest first (parallel.collective_check)."""
        targets = self._targets(None)
        return dict(zip(targets, self._client[[self._engines[r] for r in targets]].apply_sync(engine.flight),
                        strict=True))

    def check_replicas(self, model: str | None = None, optimizer: str | None = None, batch: str | None = None,
                       local: str | None = None):
        """:func:`course_lib.parallel.replicas.check_replicas` on every rank, with the ranks' own
        variables of these names; returns the report (the same on every rank)."""
        names = {"model": model, "optimizer": optimizer, "batch": batch, "local": local}
        args = ", ".join(f"{k}={v}" for k, v in names.items() if v)
        self.run("from course_lib.parallel.replicas import check_replicas as _course_check\n"
                 f"_course_report = _course_check({args})", show=False)
        return self.pull("_course_report", ranks=[0])[0]

    # -- moving values -------------------------------------------------------------------------
    def pull(self, name: str, ranks=None) -> list:
        """The value of ``name`` on each rank (in rank order)."""
        targets = self._targets(ranks)
        found = self._client[[self._engines[r] for r in targets]].apply_sync(_lookup, name)
        missing = [r for r, (ok, _) in zip(targets, found, strict=True) if not ok]
        if missing:
            raise KeyError(f"{name!r} is not defined on rank(s) {missing}")
        return [value for _, value in found]

    def push(self, ranks=None, **values) -> None:
        """Define each name on the ranks, the same value on every rank."""
        self._client[[self._engines[r] for r in self._targets(ranks)]].push(values, block=True)

    def push_each(self, **per_rank) -> None:
        """Define each name on every rank, rank r getting ``values[r]``."""
        for name, values in per_rank.items():
            if len(values) != self.world_size:
                raise ValueError(f"{name}: {len(values)} values for {self.world_size} ranks")
        for r in range(self.world_size):
            self._client[self._engines[r]].push({k: v[r] for k, v in per_rank.items()}, block=True)

    # -- helpers ---------------------------------------------------------------------------------
    def _targets(self, ranks) -> list[int]:
        if not self.running:
            raise RankPoolError("the pool is not running: %ranks start N (or pool.start())")
        dead = self.dead_ranks()
        if dead:  # died since the last cell (killed from outside, out of memory): start it again first
            print("\n".join(f"rank {r} DIED since the last cell ({how})" for r, how in dead.items()))
            self.restart_ranks(list(dead))
        ranks = list(range(self.world_size)) if ranks is None else sorted(set(ranks))
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.world_size)]
        if bad or not ranks:
            raise LaunchConfigError(f"ranks must be between 0 and {self.world_size - 1}, got {ranks}")
        return ranks

    def _apply_each(self, fn_name: str, args_of) -> list:
        fn = getattr(engine, fn_name)
        results = [self._client[self._engines[r]].apply_async(fn, *args_of(r)) for r in range(self.world_size)]
        return [ar.get(timeout=120) for ar in results]

    def _store(self) -> str:
        return str(self._dir / f"store{self._groups}")

    def _op_file(self, rank: int) -> Path:
        return self._dir / f"rank{rank}.op"


def _cell_label(index: int) -> str:
    """'In [7]' (the notebook's cell number) inside IPython, else '#3' (the pool's own count)."""
    try:
        from IPython import get_ipython  # only to number cells as the notebook does

        shell = get_ipython()
    except ImportError:
        shell = None
    return f"In [{shell.execution_count}]" if shell is not None else f"#{index + 1}"


def _lookup(name: str):
    # IPython where this runs, on an engine (apply_sync); a RankPool driven from plain Python needs none
    from IPython import get_ipython

    ns = get_ipython().user_ns
    return (True, ns[name]) if name in ns else (False, None)
