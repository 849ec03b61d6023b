"""The launcher's loop: start the agents, stream output, notice failures, stop everything.

One loop serves torchrun (one agent, or several on this host standing in for nodes) and
mpiexec. It polls every 50 ms: new output lines, new rank errors, agents that exited, the
wall-clock limit. It returns an :class:`Outcome`; on KeyboardInterrupt it stops the run (SIGTERM,
then SIGKILL) and re-raises, and in every case no process of the run is left when it returns.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from course_lib.launch import monitor
from course_lib.launch.bootstrap import diagnose
from course_lib.launch.procs import ProcessTree, spawn


@dataclass
class Agent:
    argv: list[str]
    log_prefix: str  # its own stdout/stderr go to {log_prefix}.out / .err


@dataclass
class RankFailure:
    """The rank whose failure ended the run (the root cause, not the ranks stopped after it)."""

    rank: int
    exitcode: int | None
    kind: str  # error | collective_timeout | peer_exited | killed | exit
    message: str
    traceback: str | None = None
    hint: str = ""
    where: str | None = None

    @property
    def signal(self) -> str | None:
        return monitor.signal_name(self.exitcode)


@dataclass
class Outcome:
    returncode: int
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    failure: RankFailure | None = None
    timed_out: bool = False
    error: str | None = None
    duration_s: float = 0.0


def _stop(trees: list[ProcessTree], grace: float) -> int:
    """Stop every tree (SIGTERM, then SIGKILL after ``grace``); a second Ctrl-C kills at once."""
    killed = 0
    for t in trees:
        while True:
            try:
                killed += len(t.terminate(grace))
                break
            except KeyboardInterrupt:
                grace = 0.0
    return killed


def supervise(agents: Sequence[Agent], env: Mapping[str, str], log_dir: str, *, show=(0,),
              timeout: float | None = None, grace: float = 5.0, collective_timeout: float = 60.0,
              progress=None, raw: bool = False, out=None, err=None, poll_s: float = 0.05) -> Outcome:
    out, err = out or sys.stdout, err or sys.stderr
    streamer = monitor.OutputStreamer(log_dir, show, out, err, raw=raw)
    start = time.monotonic()
    trees: list[ProcessTree] = []
    announced: set[int] = set()
    dumped = False
    timed_out = False
    first_exit: float | None = None
    try:
        for a in agents:
            with open(f"{a.log_prefix}.out", "wb") as fo, open(f"{a.log_prefix}.err", "wb") as fe:
                trees.append(ProcessTree(spawn(a.argv, env=env, stdout=fo, stderr=fe)))
        last_refresh = 0.0
        while True:
            streamer.poll()
            if progress is not None:
                progress.poll()
            for rank, e in sorted(monitor.read_errors(log_dir).items()):
                if rank in announced:
                    continue
                announced.add(rank)
                if len(announced) == 1:
                    err.write(f"[launch] rank {rank} failed: {e['type']}: {e['message'].splitlines()[0] if e['message'] else ''}\n")
                    err.flush()
                if e.get("kind") == "collective_timeout" and not dumped:
                    # Where are the others? Their stacks go to their stderr (the failed rank
                    # waits half a second before exiting so they are still there to ask).
                    dumped = bool(monitor.dump_stacks(log_dir, [r for r in monitor.read_status(log_dir) if r != rank]))
            rcs = [t.popen.poll() for t in trees]
            now = time.monotonic()
            if all(rc is not None for rc in rcs):
                break
            if any(rc is not None for rc in rcs) and first_exit is None:
                first_exit = now
            if first_exit is not None and any(rc not in (None, 0) for rc in rcs) \
                    and now - first_exit > grace + 2.0:
                break  # one local "node" failed; the others would wait for it: stop them below
            if timeout is not None and now - start > timeout:
                timed_out = True
                running = [r for r, s in monitor.read_status(log_dir).items() if s.get("state") == "running"]
                if monitor.dump_stacks(log_dir, running):
                    time.sleep(0.5)
                break
            if now - last_refresh > 0.25:
                for t in trees:
                    t.refresh()
                last_refresh = now
            time.sleep(poll_s)
    except KeyboardInterrupt:
        t0 = time.monotonic()
        n = _stop(trees, min(grace, 3.0))
        err.write(f"[launch] interrupted: run stopped in {time.monotonic() - t0:.1f} s"
                  f"{f' ({n} process(es) had to be killed)' if n else ''}; logs in {log_dir}\n")
        err.flush()
        raise
    finally:
        _stop(trees, grace)
        streamer.poll(final=True)
        if progress is not None:
            progress.close()
    return _outcome(trees, agents, log_dir, start, timed_out, timeout, collective_timeout)


def _outcome(trees, agents, log_dir, start, timed_out, timeout, collective_timeout) -> Outcome:
    status = monitor.read_status(log_dir)
    errors = monitor.read_errors(log_dir)
    agent_err = "\n".join(monitor.read_text(f"{a.log_prefix}.err") for a in agents)
    codes = monitor.launcher_exit_codes(agent_err, status)
    ranks = sorted(set(status) | set(errors) | set(codes))
    stdout = {r: monitor.read_text(os.path.join(log_dir, f"rank{r}.out")) for r in ranks}
    stderr = {r: monitor.read_text(os.path.join(log_dir, f"rank{r}.err")) for r in ranks}
    rcs = [t.popen.returncode for t in trees]
    returncode = 124 if timed_out else next((rc for rc in rcs if rc), 0)
    failure = None if timed_out else pick_failure(status, errors, codes)
    if returncode == 0 and failure is not None:
        returncode = 1
    error = None
    if timed_out:
        error = _timeout_message(timeout, status, stderr)
    elif failure is not None:
        error = _failure_message(failure, status, stderr, collective_timeout)
    elif returncode != 0:
        tail = "\n".join(agent_err.strip().splitlines()[-15:])
        error = f"the launcher exited with code {returncode} before any rank reported:\n{tail}"
    if error:
        error += f"\nlogs: {log_dir}"
    return Outcome(returncode, stdout, stderr, failure, timed_out, error,
                   time.monotonic() - start)


def pick_failure(status: dict, errors: dict, codes: dict) -> RankFailure | None:
    """The root cause: a real error or a kill beats a collective timeout beats a peer exiting;
    ranks stopped with SIGTERM by the launcher after the failure come last."""
    found = []
    for r in sorted(set(status) | set(errors) | set(codes)):
        code = codes.get(r, status.get(r, {}).get("exitcode"))
        e = errors.get(r)
        if e is not None:
            kind = e.get("kind", "error")
            f = RankFailure(r, code if code is not None else 1, kind, f"{e['type']}: {e['message']}",
                            e.get("traceback"), e.get("hint", ""), monitor.where(e.get("traceback") or ""))
            t = e.get("time", math.inf)
        elif code:
            kind = "killed" if code < 0 else "exit"
            sig = monitor.signal_name(code)
            f = RankFailure(r, code, kind, f"killed by {sig}" if sig else f"exited with code {code}")
            t = math.inf
        else:
            continue
        prio = {"error": 0, "exit": 0, "killed": 0, "collective_timeout": 1, "peer_exited": 2}.get(kind, 0)
        if kind == "killed" and f.signal == "SIGTERM":
            prio = 3
        found.append((prio, t, r, f))
    return min(found, key=lambda x: x[:3])[3] if found else None


def _others(failed: int, status: dict, stderr: dict) -> list[str]:
    lines = []
    for r in sorted(status):
        if r == failed:
            continue
        s = status[r]
        dump = monitor.last_dump(stderr.get(r, ""))
        at = monitor.where(dump) if dump else None
        if s.get("state") == "done":
            lines.append(f"  rank {r} had already finished (exit code 0) without joining")
        elif s.get("state") == "failed":
            lines.append(f"  rank {r} had exited with code {s.get('exitcode')}")
        elif at:
            lines.append(f"  rank {r} did not join: it was at {at}")
        else:
            lines.append(f"  rank {r} did not join (still running)")
    return lines


def _failure_message(f: RankFailure, status, stderr, collective_timeout) -> str:
    how = f"killed by {f.signal}" if f.signal else f"exit code {f.exitcode}"
    msg = f"rank {f.rank} failed ({how}): {f.message.splitlines()[0] if f.kind != 'killed' else 'no Python error'}"
    if f.where:
        msg += f"\n  at {f.where}"
    hint = f.hint
    if not hint and f.kind in ("killed", "exit"):  # e.g. NCCL's watchdog aborts on a timeout
        hint = diagnose(stderr.get(f.rank, "")[-4000:], "run", collective_timeout)[1]
    if hint:
        msg += f"\n  {hint}"
    if f.kind in ("collective_timeout", "peer_exited"):
        msg += "\n" + "\n".join(_others(f.rank, status, stderr))
    return msg


def _timeout_message(timeout, status, stderr) -> str:
    lines = [f"timed out after {timeout:g} s (the launch's wall-clock limit); stopped every rank"]
    for r in sorted(status):
        s = status[r]
        if s.get("state") == "running":
            dump = monitor.last_dump(stderr.get(r, ""))
            at = monitor.where(dump) if dump else None
            lines.append(f"  rank {r} was still running" + (f" at {at}" if at else ""))
        else:
            lines.append(f"  rank {r} had {'finished' if s.get('state') == 'done' else 'failed'} "
                         f"(exit code {s.get('exitcode')})")
    if any(s.get("state") != "running" for s in status.values()):
        lines.append("  a rank that finished or failed while others wait in a collective leaves them "
                     "hanging: every rank must call the same collectives")
    return "\n".join(lines)
