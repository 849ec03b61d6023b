"""Watching a launch: the launcher's loop, and what it reads of the ranks while they run.

The loop (:func:`supervise`) starts the agents, streams output, notices failures and stops
everything. One loop serves torchrun (one agent, or several on this host standing in for nodes)
and mpiexec. It polls every 50 ms: new output lines, new rank errors, agents that exited, the
wall-clock limit. It returns an :class:`Outcome`; on KeyboardInterrupt it stops the run (SIGTERM,
then SIGKILL) and re-raises, and in every case no process of the run is left when it returns.

What it reads (per-rank output, rank states, failures, where a hung rank waits, the trainer's
metrics.csv for a progress bar) are files that the ranks write (``RUN_DIR/logs``, see
:mod:`course_lib.launch.bootstrap`), so it works the same for torchrun, mpiexec and several local
agents, and nothing is lost if a rank or the launcher dies.
"""

from __future__ import annotations

import codecs
import csv
import glob
import json
import linecache
import math
import os
import re
import signal
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import psutil

from course_lib.launch.bootstrap import diagnose
from course_lib.launch.procs import ProcessTree, signal_name, spawn
from course_lib.utils import progress_bar  # ipywidgets only once a notebook bar is shown

# --- what the ranks write: output, states, failures, where a rank waits ---------------------------

_RANK_FILE = re.compile(r"rank(\d+)\.(out|err)$")
_FRAME = re.compile(r'File "(.+?)", line (\d+)(?:,)? in (\S+)')
# torchrun's summary: "Root Cause (first observed failure): [0]: ... rank : 1 (local_rank: 1)
# exitcode : -9 (pid: 123)"; mpiexec (hydra): "PID 123 RUNNING AT host ... EXIT CODE: 9".
_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
_HYDRA_FAILURE = re.compile(r"PID (\d+) RUNNING AT \S+\s*\n=\s+EXIT CODE: (\d+)")
_LAUNCHER_FRAME = re.compile(r'^  File "(<frozen runpy>|.*course_lib/launch/bootstrap\.py)", line \d+ in ')
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "broadcast", "barrier", "reduce", "gather", "scatter",
                "all_to_all", "all_to_all_single", "send", "recv", "monitored_barrier",
                "init_process_group", "allreduce", "Allreduce", "bcast", "Barrier", "Bcast")


class LogTail:
    """Follows one growing file and returns its new complete lines (or its new text as is)."""

    def __init__(self, path: str):
        self.path, self.pos, self.partial = path, 0, b""
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character may span two reads

    def _read(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return b""
        self.pos += len(data)
        return data

    def read_text(self, final: bool = False) -> str:
        """Everything new, unchanged: carriage returns (a redrawn progress bar) included."""
        return self.decoder.decode(self._read(), final=final)

    def read_lines(self, final: bool = False) -> list[str]:
        data = self._read()
        *lines, partial = (self.partial + data).split(b"\n")
        # A progress bar redraws its line with "\r": keep what a terminal would show, the last.
        self.partial = partial[partial.rfind(b"\r", 0, len(partial) - 1) + 1:]
        if self.partial and (final or len(self.partial) > 8192):
            lines.append(self.partial)
            self.partial = b""
        lines = [line.rstrip(b"\r") for line in lines]
        return [line[line.rfind(b"\r") + 1:].decode("utf-8", "replace") for line in lines]


class OutputStreamer:
    """Prints new rank output live: stdout of the ranks in ``show``, stderr of every rank.

    Lines are prefixed ``[rankK]``; stderr goes to ``err`` (shown red in a notebook). ``raw``:
    rank 0's output is copied unchanged instead (a terminal then shows its progress bar as that
    process draws it).
    """

    def __init__(self, log_dir: str, show: Iterable[int] | str = (0,), out=None, err=None, raw: bool = False):
        self.log_dir, self.raw = log_dir, raw
        self.show = show if show == "all" else set(show)
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.tails: dict[str, LogTail] = {}

    def poll(self, final: bool = False) -> None:
        for path in glob.glob(os.path.join(glob.escape(self.log_dir), "rank*.*")):
            if _RANK_FILE.search(path) and path not in self.tails:
                self.tails[path] = LogTail(path)
        wrote = set()
        for path in sorted(self.tails):
            rank_s, kind = _RANK_FILE.search(path).groups()
            rank = int(rank_s)
            if kind == "out" and self.show != "all" and rank not in self.show:
                self.tails[path].read_lines(final)  # keep the offset moving; the file keeps it all
                continue
            stream = self.out if kind == "out" else self.err
            if self.raw and rank == 0:
                text = self.tails[path].read_text(final)
                if text:
                    stream.write(text)
                    wrote.add(stream)
                continue
            for line in self.tails[path].read_lines(final):
                if kind == "err" and _LAUNCHER_FRAME.search(line):
                    continue  # stack dumps: the launcher's own frames say nothing to the user
                stream.write(f"[rank{rank}] {line}\n")
                wrote.add(stream)
        for stream in wrote:
            stream.flush()


def _read_json_files(log_dir: str, pattern: str, skip: str | None = None) -> dict[int, dict]:
    found = {}
    for path in glob.glob(os.path.join(glob.escape(log_dir), pattern)):
        if skip and path.endswith(skip):
            continue
        try:
            with open(path) as f:
                d = json.load(f)
            found[int(d["rank"])] = d
        except (OSError, ValueError, KeyError):
            continue  # being written: read it next time
    return found


def read_status(log_dir: str) -> dict[int, dict]:
    """rank -> {'state': running|done|failed, 'pid', 'exitcode', ...} from rank{K}.json."""
    return _read_json_files(log_dir, "rank*.json", skip=".error.json")


def read_errors(log_dir: str) -> dict[int, dict]:
    """rank -> {'type', 'message', 'traceback', 'kind', 'hint', 'time'} from rank{K}.error.json."""
    return _read_json_files(log_dir, "rank*.error.json")


def read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def launcher_exit_codes(agent_err: str, status: dict[int, dict]) -> dict[int, int]:
    """rank -> exit code as reported by torchrun's or mpiexec's failure summary."""
    codes = {int(r): int(c) for r, c in _TORCHRUN_FAILURE.findall(agent_err)}
    by_pid = {s.get("pid"): r for r, s in status.items()}
    for pid, code in _HYDRA_FAILURE.findall(agent_err):
        if int(pid) in by_pid:
            code = int(code)
            codes[by_pid[int(pid)]] = -code if code in (6, 9, 11, 15) else code
    return codes


def _is_user_file(path: str) -> bool:
    return not (path.startswith("<") or "site-packages" in path or "/lib/python3" in path
                or path.endswith(os.path.join("launch", "bootstrap.py")))


def where(text: str) -> str | None:
    """'cell.py:5: dist.all_reduce(t) (in all_reduce)' from a traceback or a faulthandler dump.

    Tracebacks list the innermost call last, faulthandler dumps list it first; both name the
    user's line and, when it is waiting in one, the torch.distributed / MPI call.
    """
    if "most recent call first" in text:
        # One block per thread; the main thread is the one running the user's code via runpy, else
        # the thread that wrote the dump (a SIGUSR1 handler runs in the main thread).
        blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
        text = next((b for b in blocks if "_run_code" in b or "bootstrap.py" in b),
                    next((b for b in blocks if b.lstrip().startswith("Current thread")), blocks[0]))
        frames = list(reversed([(f, int(n), fn) for f, n, fn in _FRAME.findall(text)]))
    else:
        frames = [(f, int(n), fn) for f, n, fn in _FRAME.findall(text)]
    user = [fr for fr in frames if _is_user_file(fr[0])]
    if not user:
        return None
    path, line, _ = user[-1]
    inner = frames[frames.index(user[-1]) + 1:]
    call = next((fn for _, _, fn in inner if fn in _COLLECTIVES), None)
    linecache.checkcache(path)
    code = linecache.getline(path, line).strip()
    if call is None:  # a compiled call (mpi4py) leaves no frame: read the name off the line
        call = next((c for c in _COLLECTIVES if re.search(rf"\b{c}\(", code)), None)
    out = f"{os.path.basename(path)}:{line}" + (f": {code}" if code else "")
    return out + (f" (in {call})" if call else "")


def dump_stacks(log_dir: str, ranks: Iterable[int]) -> list[int]:
    """Ask running ranks to print their Python stacks (SIGUSR1 -> faulthandler) into rankK.err."""
    status, asked = read_status(log_dir), []
    for r in ranks:
        pid = status.get(r, {}).get("pid")
        if pid and status[r].get("state") == "running":
            try:
                # the pid must still be that rank (started shortly before it wrote its status)
                if not 0 <= status[r]["started"] - psutil.Process(pid).create_time() < 60:
                    continue
                os.kill(pid, signal.SIGUSR1)
                asked.append(r)
            except (ProcessLookupError, PermissionError, psutil.Error, KeyError):
                pass
    return asked


def last_dump(err_text: str) -> str | None:
    """The last faulthandler dump in a rank's stderr, if any."""
    i = err_text.rfind("Current thread")
    if i < 0:
        i = err_text.rfind("most recent call first")
    if i < 0:
        return None
    start = err_text.rfind("Thread 0x", 0, i)
    return err_text[start if start >= 0 else i:]


class MetricsProgress:
    """A tqdm bar that follows ``metrics.csv`` as the trainer appends to it."""

    STEP_COLUMNS = ("iter", "step", "iteration")

    def __init__(self, path: str, total: int | None, desc: str = "train", file=None):
        self.path, self.size = path, -1
        self.bar = progress_bar(total=total, desc=desc, unit="it", dynamic_ncols=True, file=file)

    def poll(self) -> None:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return
        if size == self.size:
            return
        self.size = size
        with open(self.path, newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows:
            return
        last = rows[-1]
        col = next((c for c in self.STEP_COLUMNS if c in last), None)
        try:
            n = int(float(last[col])) + 1 if col else len(rows)
        except (TypeError, ValueError):
            n = len(rows)
        self.bar.n = min(n, self.bar.total) if self.bar.total else n
        shown = {k: f"{float(last[k]):.4f}" for k in ("loss", "train_loss", "val_loss")
                 if last.get(k) not in (None, "")}
        if shown:
            self.bar.set_postfix(shown, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.poll()
        self.bar.close()


# --- the launcher's loop --------------------------------------------------------------------------


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
        return signal_name(self.exitcode)


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
    streamer = OutputStreamer(log_dir, show, out, err, raw=raw)
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
            for rank, e in sorted(read_errors(log_dir).items()):
                if rank in announced:
                    continue
                announced.add(rank)
                if len(announced) == 1:
                    err.write(f"[launch] rank {rank} failed: {e['type']}: {e['message'].splitlines()[0] if e['message'] else ''}\n")
                    err.flush()
                if e.get("kind") == "collective_timeout" and not dumped:
                    # Where are the others? Their stacks go to their stderr (the failed rank
                    # waits half a second before exiting so they are still there to ask).
                    dumped = bool(dump_stacks(log_dir, [r for r in read_status(log_dir) if r != rank]))
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
                running = [r for r, s in read_status(log_dir).items() if s.get("state") == "running"]
                if dump_stacks(log_dir, running):
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
    status = read_status(log_dir)
    errors = read_errors(log_dir)
    agent_err = "\n".join(read_text(f"{a.log_prefix}.err") for a in agents)
    codes = launcher_exit_codes(agent_err, status)
    ranks = sorted(set(status) | set(errors) | set(codes))
    stdout = {r: read_text(os.path.join(log_dir, f"rank{r}.out")) for r in ranks}
    stderr = {r: read_text(os.path.join(log_dir, f"rank{r}.err")) for r in ranks}
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
                            e.get("traceback"), e.get("hint", ""), where(e.get("traceback") or ""))
            t = e.get("time", math.inf)
        elif code:
            kind = "killed" if code < 0 else "exit"
            sig = signal_name(code)
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
        dump = last_dump(stderr.get(r, ""))
        at = where(dump) if dump else None
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
            dump = last_dump(stderr.get(r, ""))
            at = where(dump) if dump else None
            lines.append(f"  rank {r} was still running" + (f" at {at}" if at else ""))
        else:
            lines.append(f"  rank {r} had {'finished' if s.get('state') == 'done' else 'failed'} "
                         f"(exit code {s.get('exitcode')})")
    if any(s.get("state") != "running" for s in status.values()):
        lines.append("  a rank that finished or failed while others wait in a collective leaves them "
                     "hanging: every rank must call the same collectives")
    return "\n".join(lines)
