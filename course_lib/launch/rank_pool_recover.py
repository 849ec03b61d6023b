"""What a :class:`~course_lib.launch.rank_pool.RankPool` does when a cell goes wrong.

* a hang (the cell ran past its limit): the error names each rank's real state, waiting in which
  collective (the tracker's file), done, or error; the ranks are interrupted and the process group
  is made anew, every rank keeping its variables;
* a dead rank (its process exited or was killed, e.g. gloo aborting on mismatched sizes): the
  error says which rank died and how (exit code or signal, its last output), the others come back,
  the dead rank is started again as a new ipyparallel engine, the process group is made anew, and
  the message names the variables that rank lost and the cells that made them
  (:mod:`course_lib.launch.rank_pool_health`). A rank that died between cells is started again
  before the next cell, ``pull`` or ``push``, with the same message.
"""

from __future__ import annotations

import os
import signal
import time

from course_lib.launch import rank_pool_engine as engine
from course_lib.launch import rank_pool_health as health
from course_lib.launch.rank_pool_view import RankBoard, error_line

GRACE_S = 5.0  # after interrupting the ranks: how long they have to come back
# The collective timeout is the cell limit plus this: the pool sees a hang first, while the ranks
# still wait in their collective (and say which), then they come back when it times out.
PG_MARGIN_S = 2.0
SPARES = 1  # engines started beside the ranks, ready to replace a dead one in a second


class RankPoolError(RuntimeError):
    """A cell failed on some ranks; ``failed`` maps a rank to its error line."""

    def __init__(self, message: str, failed: dict[int, str] | None = None):
        super().__init__(message)
        self.failed = failed or {}


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


class PoolRecovery:
    """The hang and dead-rank handling of RankPool (a mixin: it uses the pool's fields)."""

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
        killed = self._interrupt(ar, targets)
        board.update(ar.metadata, final=True, stopped={r: f"past {limit:g} s, {w}" for r, w in waiting.items()})
        lines = [f"the cell ran past {limit:g} s and was stopped (did a rank skip a collective?)"]
        lines += [f"  rank {r}: {w}" for r, w in waiting.items()]
        lines += [f"  rank {r}: {state}" for r, state in finished.items()]
        kept = "the ranks were interrupted and the process group was made anew; every rank keeps its variables"
        lines += killed or [kept]
        raise RankHangError("\n".join(lines), waiting)

    def _interrupt(self, ar, targets: list[int]) -> list[str]:
        """SIGINT to the ranks still running; wait for them; a new process group for all ranks. A
        rank that does not come back (stuck in C++ past its collective's timeout) is killed and
        started again like a dead one; returns what to tell about that (nothing if all came back)."""
        for r, md in zip(targets, ar.metadata, strict=True):
            if md.get("completed") is None:
                kill(self._pids[r], signal.SIGINT)
        deadline = time.monotonic() + self.timeout + PG_MARGIN_S + GRACE_S  # a collective returns at its timeout
        while self._running(ar, targets) and time.monotonic() < deadline:
            time.sleep(0.1)
        stuck = self._running(ar, targets)
        if not stuck:
            self._regroup()
            return []
        for r in stuck:
            kill(self._pids[r], signal.SIGKILL)
        while any(health.alive(self._pids[r]) for r in stuck) and time.monotonic() < deadline + GRACE_S:
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
            self._parent_pids[r] = health.parent_pid(results[r])
            self._client[self._engines[r]].push({"ranks": None}, block=True)

    # -- dead ranks ------------------------------------------------------------------------------
    def _after_death(self, ar, targets: list[int], dead: list[int], board: RankBoard) -> None:
        """A rank's process died during a cell: let the others come back, start it again, say what was lost."""
        how = {r: health.exit_status(self._dir, self._pids[r]) for r in dead}
        said = {r: health.last_output(self._log_file(r), self._log_from.get(r, 0)) for r in dead}
        live = [(i, r) for i, r in enumerate(targets) if r not in dead]
        # a peer waiting for the dead rank fails at once (connection closed) or at its collective's timeout
        deadline = time.monotonic() + GRACE_S
        while any(ar.metadata[i].get("completed") is None for i, _ in live) and time.monotonic() < deadline:
            time.sleep(0.1)
        stuck = [r for i, r in live if ar.metadata[i].get("completed") is None]
        for r in stuck:
            kill(self._pids[r], signal.SIGINT)
        deadline = time.monotonic() + self.timeout + PG_MARGIN_S + GRACE_S
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
            log(health.lost_message(r, self._names.pop(r, []), self.history))

    def _spares(self) -> list[int]:
        """Registered engines that are no rank and did not die: ready to become one."""
        return sorted(set(self._client.ids) - set(self._engines) - self._retired)

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose process is gone, and how they ended."""
        return {r: health.exit_status(self._dir, pid) for r, pid in enumerate(self._pids) if not health.alive(pid)}

    def status(self) -> list[str]:
        """One line per rank: its pid, alive or how it died; the pool's line first."""
        lines = [(f"{self.placement.line()} · cell limit {self.timeout:g} s · teaching mode "
                 f"{'on' if self.check else 'off'} · {'running' if self.running else 'stopped'}")]
        if self.running:
            dead = self.dead_ranks()
            lines += [f"  rank {r}: pid {pid}, " + (f"DEAD ({dead[r]})" if r in dead else "alive")
                      for r, pid in enumerate(self._pids)]
        return lines

    def _remember_names(self, targets: list[int]) -> None:
        calls = {r: self._client[self._engines[r]].apply_async(health.user_names) for r in targets}
        self._names.update({r: c.get(timeout=30) for r, c in calls.items()})

    def _log_file(self, rank: int) -> str | None:
        """The engine's output file, written by its parent (rank_pool_engine's ``engine`` role)."""
        parent = self._parent_pids.get(rank)
        return None if parent is None else str(self._dir / f"engine.{parent}.log")


def _finished(ar, targets: list[int], skip=()) -> dict[int, str]:
    """Each rank that came back from the cell: 'done' or 'error: Name: message'."""
    out = {}
    for r, md in zip(targets, ar.metadata, strict=True):
        if r in skip or md.get("completed") is None:
            continue
        out[r] = f"error: {error_line(md) or 'failed'}" if md.get("status") == "error" else "done (finished the cell)"
    return out


def kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
