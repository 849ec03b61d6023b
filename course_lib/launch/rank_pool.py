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

from course_lib.hardware import gpu_count, threads_per_rank
from course_lib.launch import rank_pool_engine as engine
from course_lib.launch.placement import LaunchConfigError, RankPlan, plan_ranks
from course_lib.launch.rank_pool_view import RankBoard, error_line

DEFAULT_TIMEOUT_S = 30.0
GRACE_S = 5.0  # after interrupting the ranks: how long they have to come back
# The collective timeout is the cell limit plus this: the pool sees a hang first, while the ranks
# still wait in their collective (and say which), then they come back when it times out.
PG_MARGIN_S = 2.0


class RankPoolError(RuntimeError):
    """A cell failed on some ranks; ``failed`` maps a rank to its error line."""

    def __init__(self, message: str, failed: dict[int, str] | None = None):
        super().__init__(message)
        self.failed = failed or {}


class RankHangError(RankPoolError):
    """A cell ran past its time limit; ``waiting`` maps a rank to the collective it waited in."""

    def __init__(self, message: str, waiting: dict[int, str]):
        super().__init__(message)
        self.waiting = waiting


class RankPool:
    """``world_size`` persistent ranks; see the module docstring. ``timeout``: seconds a cell may
    run, and the process group's collective timeout."""

    def __init__(self, world_size: int, backend: str = "auto", device: str = "auto",
                 timeout: float = DEFAULT_TIMEOUT_S, threads: int | None = None, gpus: int | None = None):
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
        self._groups = 0

    # -- life cycle --------------------------------------------------------------------------
    def start(self, log=print) -> RankPool:
        # ipyparallel (0.25 s) only when ranks start, not on %load_ext course_lib
        import ipyparallel as ipp

        self._dir = Path(tempfile.mkdtemp(prefix="course_ranks_"))
        entry = [sys.executable, "-m", "course_lib.launch.rank_pool_engine"]
        cluster = ipp.Cluster(n=self.world_size, log_level=40, profile_dir=str(self._dir / "profile"),
                              cluster_id="ranks", shutdown_atexit=True)
        cluster.config.LocalControllerLauncher.controller_cmd = [*entry, "controller"]
        cluster.config.LocalEngineSetLauncher.engine_cmd = [*entry, "engine"]
        cluster.config.LocalEngineSetLauncher.environment = {"OMP_NUM_THREADS": str(self.threads)}
        self._cluster = cluster
        try:
            cluster.start_cluster_sync()
            self._client = cluster.connect_client_sync()
            # no progress widget: its saved state would read "0/N" in a reopened notebook
            self._client.wait_for_engines(self.world_size, timeout=120, interactive=False)
            self._engines = sorted(self._client.ids)[: self.world_size]  # rank r is engine _engines[r]
            self._pids = self._apply_each("setup", lambda r: (
                r, self.world_size, self.placement.backend, self.placement.devices[r], self._store(),
                str(self._op_file(r)), self.timeout + PG_MARGIN_S, self.threads))
            self._client[self._engines].push({"ranks": None}, block=True)
        except BaseException:
            self.stop()
            raise
        log(f"{self.placement.line()} · cell limit {self.timeout:g} s · started")
        return self

    def stop(self) -> None:
        """Stop every rank and the controller; nothing is left running."""
        if self._cluster is not None:
            try:
                self._cluster.stop_cluster_sync()
            except Exception:  # noqa: BLE001, S110 - stopping is best effort; the kill below is not
                pass
            for pid in self._pids:
                _kill(pid, signal.SIGKILL)
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
        for r in targets:
            self._op_file(r).unlink(missing_ok=True)
        ar = self._client[[self._engines[r] for r in targets]].execute(code, block=False, silent=False)
        board = RankBoard(targets, quiet=not show)
        start = time.monotonic()
        try:
            while not ar.ready():
                board.update(ar.metadata)
                if time.monotonic() - start > limit:
                    self._after_hang(ar, targets, limit, board)
                time.sleep(0.1)
        except KeyboardInterrupt:
            running = self._running(ar, targets)
            self._interrupt(ar, targets)
            board.update(ar.metadata, final=True, stopped=dict.fromkeys(running, "interrupted"))
            raise KeyboardInterrupt(f"interrupted rank(s) {running}; the process group was made anew") from None
        board.update(ar.metadata, final=True)
        failed = {r: error_line(md) or "failed" for r, md in zip(targets, ar.metadata, strict=True)
                  if md.get("status") == "error"}
        if failed:
            who = ", ".join(f"rank {r}: {line}" for r, line in failed.items())
            ok = [r for r in targets if r not in failed]
            raise RankPoolError(f"{who} (traceback above); " + (f"ranks {ok} finished and are usable"
                                                                 if ok else "the pool is still usable"), failed)

    @staticmethod
    def _running(ar, targets: list[int]) -> list[int]:
        return [r for r, md in zip(targets, ar.metadata, strict=True) if md.get("completed") is None]

    def _after_hang(self, ar, targets: list[int], limit: float, board: RankBoard) -> None:
        running = self._running(ar, targets)
        now, waiting = time.time(), {}
        for r in running:
            try:
                op, since, peer = self._op_file(r).read_text().rstrip("\n").split("\t")
                waiting[r] = f"waiting in {op}" + (f" (peer {peer})" if peer else "") + f" for {now - float(since):.1f} s"
            except (OSError, ValueError):
                waiting[r] = "running, not in a collective"
        self._interrupt(ar, targets)
        board.update(ar.metadata, final=True, stopped={r: f"past {limit:g} s, {w}" for r, w in waiting.items()})
        done = [r for r in targets if r not in running]
        lines = [f"the cell ran past {limit:g} s and was stopped (did a rank skip a collective?)"]
        lines += [f"  rank {r}: {w}" for r, w in waiting.items()]
        if done:
            lines.append(f"  finished the cell: rank(s) {', '.join(map(str, done))}")
        lines.append("the ranks were interrupted and the process group was made anew; every rank keeps its variables")
        raise RankHangError("\n".join(lines), waiting)

    def _interrupt(self, ar, targets: list[int]) -> None:
        """SIGINT to the ranks still running; wait for them; a new process group for all ranks."""
        for r, md in zip(targets, ar.metadata, strict=True):
            if md.get("completed") is None:
                _kill(self._pids[r], signal.SIGINT)
        deadline = time.monotonic() + self.timeout + PG_MARGIN_S + GRACE_S  # a collective returns at its timeout
        while not ar.ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not ar.ready():
            self.stop()
            raise RankPoolError("some ranks did not stop after an interrupt; the pool was stopped: "
                                "%ranks start (or pool.start()) begins a new one")
        self._groups += 1
        self._apply_each("regroup", lambda r: (self.placement.backend, self._store(), r, self.world_size,
                                               self.timeout + PG_MARGIN_S, self.placement.devices[r]))

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


def _lookup(name: str):
    # IPython where this runs, on an engine (apply_sync); a RankPool driven from plain Python needs none
    from IPython import get_ipython

    ns = get_ipython().user_ns
    return (True, ns[name]) if name in ns else (False, None)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
