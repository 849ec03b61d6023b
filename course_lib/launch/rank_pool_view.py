"""RankBoard: a cell's output on each rank of a :class:`~course_lib.launch.rank_pool.RankPool`,
grouped by rank and updated while the cell runs.

In a notebook it is one output, redrawn in place: a box per rank with its stdout, its stderr (in
red) and, if it raised, its traceback; the plain-text version (what a terminal, nbconvert or a
grader sees) is the same boxes as text. Outside IPython each line is printed once it ends (or
the cell does), prefixed ``[rank K]``.
"""

from __future__ import annotations

import html
import re
import sys

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STYLE = ("font-family:monospace;font-size:12px;border:1px solid #ccc;border-radius:4px;margin:2px 0;"
          "padding:2px 6px;white-space:pre-wrap")


class _Boards:
    """What IPython displays: ``_repr_html_`` for notebooks, ``__repr__`` as text/plain."""

    def __init__(self, parts: dict[int, tuple[str, str, str]], running: set[int], stopped: dict[int, str]):
        self.parts, self.running, self.stopped = parts, running, stopped

    def _head(self, rank: int) -> str:
        tb = self.parts[rank][2]
        if rank in self.stopped:
            return f"rank {rank} · stopped ({self.stopped[rank]})"
        state = "running" if rank in self.running else ("error" if tb else "done")
        return f"rank {rank} · {state}"

    def __repr__(self) -> str:
        blocks = []
        for rank, (out, err, tb) in self.parts.items():
            body = "".join(x if x.endswith("\n") or not x else x + "\n" for x in (out, err, tb))
            blocks.append(f"── {self._head(rank)} ──\n{body}")
        return "".join(blocks).rstrip("\n")

    def _repr_html_(self) -> str:
        cells = []
        for rank, (out, err, tb) in self.parts.items():
            colour = "#c00" if tb else ("#888" if rank in self.running else "#2a7")
            body = html.escape(out) + (f'<span style="color:#c00">{html.escape(err + tb)}</span>' if err or tb else "")
            cells.append(f'<div class="course-rank" data-rank="{rank}" style="{_STYLE}">'
                         f'<b style="color:{colour}">{html.escape(self._head(rank))}</b>\n{body}</div>')
        return '<div class="course-rank-board">' + "".join(cells) + "</div>"


class RankBoard:
    """Follows the per-rank metadata of an ipyparallel result (stdout, stderr, error, completed)."""

    def __init__(self, ranks: list[int], out=None, quiet: bool = False):
        self.ranks, self.quiet = ranks, quiet
        # how much of each rank's stdout, stderr, traceback and 'stopped' line is printed: counted
        # apart, as stderr arriving between two stdout lines goes in the middle of their concatenation
        self._seen: dict[int, tuple[int, ...]] = dict.fromkeys(ranks, (0, 0, 0, 0))
        self._last = None
        self._handle = None
        self._out = out
        self._notebook = out is None and _in_kernel()

    def update(self, metadata, final: bool = False, stopped: dict[int, str] | None = None) -> None:
        """Redraw from ipyparallel's per-rank metadata; ``stopped``: ranks the pool interrupted, and
        why (their KeyboardInterrupt traceback is not shown: it says nothing about the cell)."""
        parts, running, stopped = {}, set(), stopped or {}
        for rank, md in zip(self.ranks, metadata, strict=True):
            err = md.get("error")
            tb = _ANSI.sub("", err.traceback) if err is not None and err.traceback else error_line(md)
            if rank in stopped:
                tb = ""
            parts[rank] = (md.get("stdout") or "", md.get("stderr") or "", tb)
            if md.get("completed") is None and not final:
                running.add(rank)
        if self.quiet and not any(err or tb for _, err, tb in parts.values()) and not stopped:
            return  # quiet: nothing to show unless something went wrong
        # final too: a rank that completed before the last update may still hold an unfinished line
        key = (repr(parts), tuple(sorted(running)), repr(stopped), final)
        if key == self._last:
            return
        self._last = key
        if self._notebook:
            self._show(_Boards(parts, running, stopped))
        else:
            self._print_new(parts, stopped, final)

    def _show(self, boards: _Boards) -> None:
        # IPython's display only in a notebook: the terminal view prints
        from IPython.display import display

        if self._handle is None:
            self._handle = display(boards, display_id=True)
        else:
            self._handle.update(boards)

    def _print_new(self, parts, stopped: dict[int, str], final: bool) -> None:
        out = self._out or sys.stdout
        for rank, (stdout, stderr, tb) in parts.items():
            texts = (stdout, stderr, tb, f"stopped ({stopped[rank]})\n" if rank in stopped else "")
            # each line once it ends, or once the cell does: the start of a print(..., end="") printed
            # as a line would split it in two "[rank K]" lines when the rest arrives
            printed = []
            for text, seen in zip(texts, self._seen[rank], strict=True):
                end = len(text) if final else max(seen, text.rfind("\n") + 1)
                for line in text[seen:end].splitlines():
                    out.write(f"[rank {rank}] {line}\n")
                printed.append(end)
            self._seen[rank] = tuple(printed)
        out.flush()


def error_line(md: dict) -> str:
    """'Name: message' of a rank's exception in ipyparallel's metadata ('' when it raised none)."""
    err = md.get("error")
    return _ANSI.sub("", f"{err.ename}: {err.evalue}") if err is not None else ""


def _in_kernel() -> bool:
    try:
        # IPython may be missing in a plain Python process (the terminal view)
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def flight_table(records: dict[int, list[dict]], last: int = 12) -> str:
    """Each rank's last collectives side by side, one row per call (``G.N``: call N of process
    group G; the pool makes a new group after a hang or a dead rank): the flight-recorder view."""
    keys = sorted({(e["group"], e["seq"]) for entries in records.values() for e in entries})[-last:]
    cells = {(r, e["group"], e["seq"]): f"{e['what']} · {e['state']}" for r, entries in records.items() for e in entries}
    width = max([len(c) for c in cells.values()] + [12])
    head = "call  " + "  ".join(f"{f'rank {r}':<{width}}" for r in records)
    rows = [f"{f'{g}.{s}':<5} " + "  ".join(f"{cells.get((r, g, s), '-'):<{width}}" for r in records) for g, s in keys]
    return "\n".join([head, *rows]) if rows else "no collective recorded yet"
