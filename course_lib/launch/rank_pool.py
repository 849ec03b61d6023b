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
hangs turned into errors. Interrupting the kernel interrupts the ranks. ``%ranks stop`` (or the
kernel's end, however it ends) leaves no process behind.

When a cell goes wrong:

* a hang (the cell ran past ``timeout`` seconds: one rank skipped a collective): the cell is
  stopped and the error names each rank's real state, waiting in which collective (the tracker's
  file), done, or error; the ranks are interrupted and the process group is made anew, every
  rank keeping its variables;
* an exception on one rank shows that rank's traceback and leaves the others as they were;
* a dead rank (its process exited or was killed, e.g. gloo aborting on mismatched sizes): the
  error says which rank died and how (exit code or signal, its last output), the others come back,
  the dead rank is started again as a new ipyparallel engine (a spare, ready beside the ranks),
  the process group is made anew, and the message names the variables that rank lost and the
  cells that made them. A rank that died between cells is started again before the next cell,
  ``pull`` or ``push``, with the same message.

How a rank died: each engine runs under a small parent (``rank_pool_engine``'s ``engine`` role)
that waits for it and writes its exit status to ``DIR/exit.PID``: ipyparallel only sees that an
engine is gone, not why, and keeps its output in ``DIR/engine.PARENT_PID.log`` (ipyparallel
deletes its own log of a dead engine). C++ aborts (gloo's ``EnforceNotMet`` on mismatched sizes)
land there; the last lines that are not ipyparallel's own log are shown.

The ``%ranks`` magics are in :mod:`course_lib.launch.magics`, what runs in the ranks in
:mod:`course_lib.launch.rank_pool_engine`, how a cell's output is shown in
:mod:`course_lib.launch.rank_pool_view`.
"""

from __future__ import annotations

import ast
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil

from course_lib.hardware import gpu_count, threads_per_rank
from course_lib.launch import rank_pool_engine as engine
from course_lib.launch.placement import LaunchConfigError, RankPlan, plan_ranks
from course_lib.launch.procs import kill_quietly, pid_alive, signal_name, signal_quietly
from course_lib.launch.rank_pool_view import RankBoard, error_line
from course_lib.utils import check_count, check_seconds

DEFAULT_TIMEOUT_S = 30.0
OUTPUT_WAIT_S = 5.0  # after a cell's replies: the most the pool waits for the rest of its output
GRACE_S = 5.0  # after interrupting the ranks: how long they have to come back
# The collective timeout is the cell limit plus this: the pool sees a hang first, while the ranks
# still wait in their collective (and say which), then they come back when it times out.
PG_MARGIN_S = 2.0
SPARES = 1  # engines started beside the ranks, ready to replace a dead one in a second
# The controller's heartbeat, in ms (ipyparallel's default: 3000). An engine counts as registered
# only at the first heartbeat after it connects, so %ranks start waited about one period for its
# last engine: 1 s instead of 3 s makes a 2-rank pool start in about 6 s instead of 9.5 on 2 cores.
# An engine is still declared lost only after 10 missed beats (10 s; its heart answers from a
# thread of its own, whatever its cell is doing).
HEARTBEAT_MS = 1000
__all__ = ["DEFAULT_TIMEOUT_S", "GRACE_S", "PG_MARGIN_S", "RankDiedError", "RankHangError", "RankPool",
           "RankPoolError"]

# Names every rank has from the start (rank_pool_engine.setup) or from IPython itself.
_PRESET = frozenset({"torch", "dist", "RANK", "WORLD_SIZE", "DEVICE", "ranks", "In", "Out", "exit", "quit",
                     "get_ipython"})
# What a rank's output file holds besides what the rank wrote: ipyparallel's log lines, colours,
# IPython's echo of a traceback (shown already, from the reply)
_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[.,]\d+ \[(IPEngine|KernelNanny|IPKernelApp|IPController)[^\n]*")
_LOG_TAGS = ("[IPEngine", "[KernelNanny", "[IPKernelApp")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ECHO = re.compile(r"^\s*(-*>?\s*\d+\s|Cell In\[|File .*:\d+, in |-{20,}|\w+(Error|Exception)\b.*Traceback)")


class RankPoolError(RuntimeError):
    """A cell failed on some ranks; ``failed`` maps a rank to its error line."""

    def __init__(self, message: str, failed: dict[int, str] | None = None):
        super().__init__(message)
        self.failed = failed or {}

    def _render_traceback_(self):  # IPython: the message; each rank's own traceback is in its box above,
        return [f"{type(self).__name__}: {self}"]  # the course's frames (magic, pool) say nothing new


class RankDiedError(RankPoolError):
    """A rank's process died; ``died`` maps a rank to how (exit code or signal). It was started
    again and the process group made anew; its variables are lost (the message names them)."""

    def __init__(self, message: str, died: dict[int, str]):
        super().__init__(message)
        self.died = died


class RankHangError(RankPoolError):
    """A cell ran past its time limit; ``waiting`` maps a rank to the collective it waited in."""

    def __init__(self, message: str, waiting: dict[int, str]):
        super().__init__(message)
        self.waiting = waiting


class RankPool:
    """``world_size`` persistent ranks; see the module docstring. ``timeout``: seconds a cell may
    run, and the process group's collective timeout (plus ``PG_MARGIN_S``); ``run(timeout=...)``
    sets both for one cell (the group keeps that timeout until the next cell sets its own)."""

    def __init__(self, world_size: int, backend: str = "auto", device: str = "auto",
                 timeout: float = DEFAULT_TIMEOUT_S, threads: int | None = None, gpus: int | None = None,
                 check: bool = True):
        self.timeout = check_seconds("timeout", timeout, False, LaunchConfigError)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= 64:
            raise LaunchConfigError(f"the number of ranks must be a whole number from 1 to 64, got {world_size!r}")
        if gpus is None:
            gpus = gpu_count()
        # the same decision as course train and %%torchrun (gloo on CPU, NCCL with a GPU per rank,
        # gloo on shared GPUs), refused here, before anything starts, if it cannot work
        self.placement: RankPlan = plan_ranks(gpus, nproc=world_size, device=device, backend=backend,
                                              recipe="%ranks")
        self.world_size = world_size
        if threads is None:
            threads = threads_per_rank(world_size)
        self.threads = check_count("threads", threads, LaunchConfigError)
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
        if self.running:  # a second cluster would replace the first, whose processes stop() then no longer knows
            raise RankPoolError(f"the pool is running already ({self.world_size} ranks): restart() starts it "
                                "again, stop() first for another one")
        # ipyparallel (0.25 s) only when ranks start, not on %load_ext course_lib
        import ipyparallel as ipp

        self._dir = Path(tempfile.mkdtemp(prefix="course_ranks_"))
        entry = [sys.executable, "-m", "course_lib.launch.rank_pool_engine"]
        # one spare engine, torch imported, waits to replace a rank that dies (restart_ranks)
        cluster = ipp.Cluster(n=self.world_size + SPARES, log_level=40, profile_dir=str(self._dir / "profile"),
                              cluster_id="ranks", shutdown_atexit=True,
                              controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}"])
        cluster.config.LocalControllerLauncher.controller_cmd = [*entry, "controller"]
        # the controller removes the folder if the kernel is killed (rank_pool_engine._watch_parent)
        cluster.config.LocalControllerLauncher.environment = {"COURSE_RANKS_DIR": str(self._dir)}
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
            self._parent_pids = {r: _parent_pid(pid) for r, pid in enumerate(self._pids)}
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
            leftover = [p for p in _pool_processes(self._dir) if p.pid not in self._pids]
            for pid in self._pids:  # the ranks first: their parents then exit at once (a spare on SIGTERM)
                signal_quietly(pid, signal.SIGKILL)
            try:
                self._cluster.stop_cluster_sync()
            except Exception:  # noqa: BLE001, S110 - stopping is best effort; the kill below is not
                pass
            for pid in self._pids:
                signal_quietly(pid, signal.SIGKILL)
            kill_quietly(leftover)  # the nannies, and whatever else of the pool is left (psutil: no reused pid)
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

    def status(self) -> list[str]:
        """One line per rank: its pid, alive or how it died; the pool's line first."""
        lines = [(f"{self.placement.line()} · cell limit {self.timeout:g} s · teaching mode "
                 f"{'on' if self.check else 'off'} · {'running' if self.running else 'stopped'}")]
        if self.running:
            dead = self.dead_ranks()
            lines += [f"  rank {r}: pid {pid}, " + (f"DEAD ({dead[r]})" if r in dead else "alive")
                      for r, pid in enumerate(self._pids)]
        return lines

    # -- running cells -------------------------------------------------------------------------
    def run(self, code: str, ranks=None, timeout: float | None = None, show: bool = True) -> None:
        """Run ``code`` on ``ranks`` (default all), showing each rank's output as it comes
        (``show=False``: only if a rank writes to stderr or fails). ``timeout``: this cell's limit
        instead of the pool's; its collectives may wait as long (they time out ``PG_MARGIN_S``
        later), so a longer limit lets an all_reduce wait for a rank that computes longer."""
        limit = self.timeout if timeout is None else check_seconds("timeout", timeout, error=LaunchConfigError)
        targets = self._targets(ranks)  # after every check: it may start a dead rank again
        prompt = _prompt()
        self.history.append((f"In [{prompt}]" if prompt is not None else f"#{len(self.history) + 1}", targets, code))
        # the cell's number (a rank's traceback then says "Cell In[7]" for the notebook's In [7]) and
        # its collective timeout. Not waited for: each engine runs it before the cell (one queue),
        # and a rank that does not answer is the cell's time limit's business, below
        self._client[[self._engines[r] for r in targets]].apply_async(engine.before_cell, prompt,
                                                                      limit + PG_MARGIN_S)
        self._log_from = {r: _log_size(self._log_file(r)) for r in targets}  # this cell's output starts there
        for r in targets:
            self._op_file(r).unlink(missing_ok=True)
        ar = self._client[[self._engines[r] for r in targets]].execute(code, block=False, silent=False)
        board = RankBoard(targets, quiet=not show)
        start = time.monotonic()
        try:
            while not ar.ready():
                board.update(ar.metadata)
                dead = [r for r in targets if not pid_alive(self._pids[r])]
                if dead:
                    self._after_death(ar, targets, dead, board, limit)
                if time.monotonic() - start > limit:
                    self._after_hang(ar, targets, limit, board)
                time.sleep(0.1)
            dead = [r for r in targets if not pid_alive(self._pids[r])]
            if dead:
                self._after_death(ar, targets, dead, board, limit)
            # a rank's stdout travels on IOPub and can arrive after its reply: wait for it, or the
            # last lines of a cell (all of a short one) would be missing from the board
            ar.wait_for_output(OUTPUT_WAIT_S)
        except KeyboardInterrupt:
            running = self._running(ar, targets)
            for line in self._interrupt(ar, targets, limit):
                print(line)
            board.update(ar.metadata, final=True, stopped=dict.fromkeys(running, "interrupted"))
            raise KeyboardInterrupt(f"interrupted rank(s) {running}; the process group was made anew") from None
        finally:
            # also after a hang, a death or an interrupt (every rank answers again by then): what a
            # rank defined before it was stopped is its own, and a later restart must name it as lost
            if self.running:  # not if a dead rank could not be started again (the pool stopped)
                self._remember_names(targets)
        board.update(ar.metadata, final=True)
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
        targets = self._targets(ranks)
        self._client[[self._engines[r] for r in targets]].push(values, block=True)
        self._add_names(targets, values)

    def push_each(self, **per_rank) -> None:
        """Define each name on every rank, rank r getting ``values[r]``."""
        for name, values in per_rank.items():
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                raise ValueError(f"{name}: give one value per rank, such as [a, b] for 2 ranks, got {values!r}")
            if len(values) != self.world_size:
                raise ValueError(f"{name}: {len(values)} values for {self.world_size} ranks")
        targets = self._targets(None)  # as push: a rank that died since the last cell is started again first
        for r in targets:
            self._client[self._engines[r]].push({k: v[r] for k, v in per_rank.items()}, block=True)
        self._add_names(targets, per_rank)

    # -- a cell past its limit: interrupt the ranks, a new process group --------------------------
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
        finished = _finished(ar, targets, skip=running)
        killed = self._interrupt(ar, targets, limit)
        board.update(ar.metadata, final=True, stopped={r: f"past {limit:g} s, {w}" for r, w in waiting.items()})
        lines = [f"the cell ran past {limit:g} s and was stopped (did a rank skip a collective?)"]
        lines += [f"  rank {r}: {w}" for r, w in waiting.items()]
        lines += [f"  rank {r}: {state}" for r, state in finished.items()]
        kept = "the ranks were interrupted and the process group was made anew; every rank keeps its variables"
        lines += killed or [kept]
        raise RankHangError("\n".join(lines), waiting)

    def _interrupt(self, ar, targets: list[int], limit: float) -> list[str]:
        """SIGINT to the ranks still running; wait for them; a new process group for all ranks. A
        rank that does not come back (stuck in C++ past its collective's timeout) is killed and
        started again like a dead one; returns what to tell about that (nothing if all came back)."""
        for r, md in zip(targets, ar.metadata, strict=True):
            if md.get("completed") is None:
                signal_quietly(self._pids[r], signal.SIGINT)
        # a collective returns at its timeout: the cell's, or the pool's where torch could not set it
        deadline = time.monotonic() + max(limit, self.timeout) + PG_MARGIN_S + GRACE_S
        while self._running(ar, targets) and time.monotonic() < deadline:
            time.sleep(0.1)
        stuck = self._running(ar, targets)
        if not stuck:
            self._regroup()
            return []
        for r in stuck:
            signal_quietly(self._pids[r], signal.SIGKILL)
        while any(pid_alive(self._pids[r]) for r in stuck) and time.monotonic() < deadline + GRACE_S:
            time.sleep(0.05)
        lines = [f"rank {r} did not come back from the interrupt and was killed" for r in stuck]
        self.restart_ranks(stuck, lines.append)
        return lines

    def _regroup(self, fresh: tuple[int, ...] = ()) -> None:
        """A new process group for every rank; the ranks in ``fresh`` are new engines to set up."""
        self._groups += 1
        timeout = self.timeout + PG_MARGIN_S
        calls = [self._client[self._engines[r]].apply_async(
            *((engine.setup, r, self.world_size, self.placement.backend, self.placement.devices[r], self._store(),
               str(self._op_file(r)), timeout, self.threads, self.check, self._groups) if r in fresh else
              (engine.regroup, self.placement.backend, self._store(), r, self.world_size, timeout,
               self.placement.devices[r], self.check, self._groups))) for r in range(self.world_size)]
        results = [c.get(timeout=120) for c in calls]
        for r in fresh:
            self._pids[r] = results[r]
            self._parent_pids[r] = _parent_pid(results[r])
            self._client[self._engines[r]].push({"ranks": None}, block=True)

    # -- dead ranks ------------------------------------------------------------------------------
    def _after_death(self, ar, targets: list[int], dead: list[int], board: RankBoard, limit: float) -> None:
        """A rank's process died during a cell: let the others come back, start it again, say what was lost."""
        how = {r: _exit_status(self._dir, self._pids[r]) for r in dead}
        said = {r: _last_output(self._log_file(r), self._log_from.get(r, 0)) for r in dead}
        live = [(i, r) for i, r in enumerate(targets) if r not in dead]
        # a peer waiting for the dead rank fails at once (connection closed) or at its collective's timeout
        deadline = time.monotonic() + GRACE_S
        while any(ar.metadata[i].get("completed") is None for i, _ in live) and time.monotonic() < deadline:
            time.sleep(0.1)
        stuck = [r for i, r in live if ar.metadata[i].get("completed") is None]
        for r in stuck:
            signal_quietly(self._pids[r], signal.SIGINT)
        deadline = time.monotonic() + max(limit, self.timeout) + PG_MARGIN_S + GRACE_S  # as _interrupt's
        while any(ar.metadata[i].get("completed") is None for i, _ in live) and time.monotonic() < deadline:
            time.sleep(0.1)
        board.update(ar.metadata, final=True, stopped={r: f"DIED, {how[r]}" for r in dead})
        lines = [f"rank {r} DIED ({how[r]}) while running the cell" + (
            "; its last output:\n" + "\n".join(f"    {x}" for x in said[r].splitlines()) if said[r] else "")
            for r in dead]
        lines += [f"  rank {r}: {state}" for r, state in _finished(ar, targets, dead).items()]
        self.restart_ranks(dead, lines.append)
        raise RankDiedError("\n".join(lines), how)

    def restart_ranks(self, dead: list[int], log=print) -> None:
        """Start the ranks in ``dead`` again as new engines, make the process group anew, say what was lost."""
        self._retired.update(self._engines[r] for r in dead)
        deadline = time.monotonic() + 120
        started = False
        while len(spares := self._spares()) < len(dead):
            if not started:  # no spare ready (two deaths in a row): start what is missing
                self._cluster.start_engines_sync(n=len(dead) - len(spares))
                started = True
            if time.monotonic() > deadline:
                self.stop()
                raise RankPoolError("a dead rank could not be started again; the pool was stopped: %ranks start N")
            time.sleep(0.1)
        for r, e in zip(dead, spares, strict=False):
            self._engines[r] = e
        self._cluster.start_engines_sync(n=len(dead))  # the next spares; they register while we go on
        self._regroup(fresh=tuple(dead))
        log(f"rank(s) {', '.join(map(str, dead))} started again; the process group was made anew "
            f"(the other ranks keep their variables)")
        for r in dead:
            log(_lost_message(r, self._names.pop(r, []), self.history))

    def _spares(self) -> list[int]:
        """Registered engines that are no rank and did not die: ready to become one."""
        return sorted(set(self._client.ids) - set(self._engines) - self._retired)

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose process is gone, and how they ended."""
        return {r: _exit_status(self._dir, pid) for r, pid in enumerate(self._pids) if not pid_alive(pid)}

    # -- helpers ---------------------------------------------------------------------------------
    def _targets(self, ranks) -> list[int]:
        if not self.running:
            raise RankPoolError("the pool is not running: %ranks start N (or pool.start())")
        if isinstance(ranks, int) and not isinstance(ranks, bool):  # one rank: ranks=1 means [1]
            ranks = [ranks]
        if ranks is not None and (isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable)):
            raise LaunchConfigError(f"ranks must be a rank or a list of ranks such as [0, 1], got {ranks!r}")
        ranks = list(range(self.world_size)) if ranks is None else sorted(set(ranks))
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.world_size)]
        if bad or not ranks:
            raise LaunchConfigError(f"ranks must be between 0 and {self.world_size - 1}, got {ranks}")
        dead = self.dead_ranks()  # checked first: a refused call starts nothing
        if dead:  # died since the last cell (killed from outside, out of memory): start it again first
            print("\n".join(f"rank {r} DIED since the last cell ({how})" for r, how in dead.items()))
            self.restart_ranks(list(dead))
        return ranks

    def _apply_each(self, fn_name: str, args_of) -> list:
        fn = getattr(engine, fn_name)
        results = [self._client[self._engines[r]].apply_async(fn, *args_of(r)) for r in range(self.world_size)]
        return [ar.get(timeout=120) for ar in results]

    def _store(self) -> str:
        return str(self._dir / f"store{self._groups}")

    def _op_file(self, rank: int) -> Path:
        return self._dir / f"rank{rank}.op"

    def _remember_names(self, targets: list[int]) -> None:
        calls = {r: self._client[self._engines[r]].apply_async(_user_names) for r in targets}
        self._names.update({r: c.get(timeout=30) for r, c in calls.items()})

    def _add_names(self, targets: list[int], names) -> None:
        """Pushed names join each rank's variables (those of the last cell): a restart names them as lost."""
        for r in targets:
            self._names[r] = sorted(set(self._names.get(r, [])) | set(names))

    def _log_file(self, rank: int) -> str | None:
        """The engine's output file, written by its parent (rank_pool_engine's ``engine`` role)."""
        parent = self._parent_pids.get(rank)
        return None if parent is None else str(self._dir / f"engine.{parent}.log")


def _prompt() -> int | None:
    """The notebook's prompt number of the running cell (7 for In [7]) inside IPython, else None
    (the pool then counts its cells itself: '#3'). It is the cell's place in the input history,
    stored before it runs: ``shell.execution_count`` is already the next prompt while a cell runs
    (IPython 9)."""
    try:
        from IPython import get_ipython  # only to number cells as the notebook does

        shell = get_ipython()
    except ImportError:
        shell = None
    return None if shell is None else len(shell.history_manager.input_hist_raw) - 1


def _lookup(name: str):
    # IPython where this runs, on an engine (apply_sync); a RankPool driven from plain Python needs none
    from IPython import get_ipython

    ns = get_ipython().user_ns
    return (True, ns[name]) if name in ns else (False, None)


def _finished(ar, targets: list[int], skip=()) -> dict[int, str]:
    """Each rank that came back from the cell: 'done' or 'error: Name: message'."""
    out = {}
    for r, md in zip(targets, ar.metadata, strict=True):
        if r in skip or md.get("completed") is None:
            continue
        out[r] = f"error: {error_line(md) or 'failed'}" if md.get("status") == "error" else "done (finished the cell)"
    return out


# -- the ranks' processes: alive or dead and how, what they last wrote, the variables they hold --
def _parent_pid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


def _pool_processes(run_dir: Path) -> list[psutil.Process]:
    """This process's descendants that belong to the pool of ``run_dir``: every process of the pool
    (the controller and its schedulers; each engine's parent, the engine, and the nanny ipyparallel
    starts beside it) has ``COURSE_RANKS_DIR`` set to it."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.environ().get("COURSE_RANKS_DIR") == str(run_dir):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _exit_status(run_dir: Path, pid: int) -> str:
    """'exit code 3', 'signal SIGABRT' or 'exit status unknown' (the engine's parent writes it)."""
    path = Path(run_dir) / f"exit.{pid}"
    for _ in range(20):  # the parent writes it right after the engine exits
        try:
            code = int(path.read_text())
            break
        except (OSError, ValueError):
            time.sleep(0.05)
    else:
        return "exit status unknown"
    if code < 0:
        name = signal_name(code)
        return name if name.startswith("signal ") else f"signal {name}"
    return f"exit code {code}"


def _log_size(log_file: str | None) -> int:
    try:
        return Path(log_file).stat().st_size if log_file else 0
    except OSError:
        return 0


def _last_output(log_file: str | None, since: int = 0, lines: int = 6) -> str:
    """The last lines an engine wrote to its stderr/stdout after byte ``since`` (C++ aborts land
    there), without ipyparallel's log lines and without IPython's echo of the traceback."""
    if not log_file:
        return ""
    try:
        with open(log_file, "rb") as f:
            f.seek(since)
            text = _ANSI.sub("", f.read().decode(errors="replace"))
    except OSError:
        return ""
    text = _LOG_LINE.sub("\n", text)  # a log line may start in the middle of another line
    kept = [line for line in text.splitlines() if line.strip() not in ("", "what():") and not line.startswith(_LOG_TAGS)
            and not _ECHO.match(line)]
    return "\n".join(kept[-lines:])


def _user_names() -> list[str]:
    """The names a student defined on this rank (runs in the rank)."""
    from IPython import get_ipython  # the engine is an IPython kernel

    ns = get_ipython().user_ns
    preset = ns.get("_course_preset", _PRESET)
    return sorted(n for n in ns if not n.startswith("_") and n not in preset and n not in _PRESET)


def _assigned(code: str) -> set[str]:
    """The names a cell binds (assignments, for targets, imports, def, class), read from its AST."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _lost_message(rank: int, lost: list[str], history: list[tuple[str, list[int], str]]) -> str:
    """What a restarted rank lost, each name with the last cell that bound it on that rank
    (history is (label, ranks, code) per cell), and how to get it back."""
    if not lost:
        return f"rank {rank} had no variables of its own to lose"
    made = {}
    for label, ranks, code in history:
        if rank in ranks:
            made.update(dict.fromkeys(_assigned(code) & set(lost), label))
    names = ", ".join(f"{n} ({made.get(n, 'pushed')})" for n in lost)
    return (f"rank {rank} LOST its variables {names}: run those cells again on rank {rank} (%%ranks {rank}), "
            f"or on every rank where they call collectives; ranks.push(...) what was pushed")
