"""What happened to the ranks of a :class:`~course_lib.launch.rank_pool.RankPool`: alive or dead
(and how: exit code or signal, the last lines it wrote), the variables each rank holds, and, after
a dead rank was started again, which variables it lost and which cells made them.

Each engine runs under a small parent (``rank_pool_engine``'s ``engine`` role) that waits for it
and writes its exit status to ``DIR/exit.PID``: ipyparallel only sees that an engine is gone, not
why, and keeps its output in ``DIR/engine.PARENT_PID.log`` (ipyparallel deletes its own log of a
dead engine). C++ aborts (gloo's ``EnforceNotMet`` on mismatched sizes) land there; the last lines
that are not ipyparallel's own log are shown.
"""

from __future__ import annotations

import ast
import re
import signal
import time
from pathlib import Path

import psutil

# Names every rank has from the start (rank_pool_engine.setup) or from IPython itself.
PRESET = frozenset({"torch", "dist", "RANK", "WORLD_SIZE", "DEVICE", "ranks", "In", "Out", "exit", "quit",
                    "get_ipython"})
_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[.,]\d+ \[(IPEngine|KernelNanny|IPKernelApp|IPController)[^\n]*")
_LOG_TAGS = ("[IPEngine", "[KernelNanny", "[IPKernelApp")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ECHO = re.compile(r"^\s*(-*>?\s*\d+\s|Cell In\[|File .*:\d+, in |-{20,}|\w+(Error|Exception)\b.*Traceback)")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def parent_pid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


def pool_processes(run_dir: Path) -> list[psutil.Process]:
    """This process's descendants that belong to the pool of ``run_dir``: every engine process (its
    parent, the engine, and the nanny ipyparallel starts beside each engine) has ``COURSE_RANKS_DIR``
    set to it."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.environ().get("COURSE_RANKS_DIR") == str(run_dir):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def exit_status(run_dir: Path, pid: int) -> str:
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
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def log_size(log_file: str | None) -> int:
    try:
        return Path(log_file).stat().st_size if log_file else 0
    except OSError:
        return 0


def last_output(log_file: str | None, since: int = 0, lines: int = 6) -> str:
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


def user_names() -> list[str]:
    """The names a student defined on this rank (runs in the rank)."""
    from IPython import get_ipython  # the engine is an IPython kernel

    ns = get_ipython().user_ns
    preset = ns.get("_course_preset", PRESET)
    return sorted(n for n in ns if not n.startswith("_") and n not in preset and n not in PRESET)


def assigned(code: str) -> set[str]:
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


def lost_message(rank: int, lost: list[str], history: list[tuple[str, list[int], str]]) -> str:
    """What a restarted rank lost, each name with the last cell that bound it on that rank
    (history is (label, ranks, code) per cell), and how to get it back."""
    if not lost:
        return f"rank {rank} had no variables of its own to lose"
    made = {}
    for label, ranks, code in history:
        if rank in ranks:
            made.update(dict.fromkeys(assigned(code) & set(lost), label))
    names = ", ".join(f"{n} ({made.get(n, 'pushed')})" for n in lost)
    return (f"rank {rank} LOST its variables {names}: run those cells again on rank {rank} (%%ranks {rank}), "
            f"or on every rank where they call collectives; ranks.push(...) what was pushed")
