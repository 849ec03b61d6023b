"""Showing a run: text tables, and one step of the trace (or all of them) as HTML.

The notebook's slider over these steps is :func:`course_lib.notebook.pram_slider.step_slider`.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

__all__ = ["all_steps_html", "format_table", "render_step", "work_time_table"]

_READ, _WRITE, _BOTH = "#cfe2ff", "#ffd8a8", "#e5c7ff"


def format_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """Rows of dicts as an aligned text table (numbers right-aligned, with thousands commas)."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())

    def cell(v: Any) -> str:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return str(v)
        return f"{v:,}" if isinstance(v, int) else f"{v:,.4g}"

    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) in ("", None) for r in rows)
               for c in columns]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(vals, widths, numeric)).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, body)])


def work_time_table(results: Sequence) -> str:
    """Several runs side by side: program, model, steps (time), work, processors and the
    cost ``steps * processors`` (work-efficient when cost stays within a constant of work)."""
    return format_table([{"program": r.program, "model": r.model, "steps": r.steps,
                          "work": r.work, "processors": r.processors,
                          "cost (steps x processors)": r.steps * r.processors} for r in results])


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def render_step(result, step: int, arrays: Sequence[str] | None = None) -> str:
    """HTML for one step of a traced run: each array's cells after the step, cells read in
    blue, written in orange (both: purple), with the processors that touched them on hover.
    ``step=-1`` shows the initial memory."""
    if result.trace is None:
        raise ValueError("this result has no trace; run it with trace=True")
    if not -1 <= step < len(result.trace):
        raise IndexError(f"step {step} is outside 0..{len(result.trace) - 1} (or -1 for the start)")
    mem = result.memory
    if step == -1:
        cells, reads, writes = result.initial.cells, {}, {}
        title = "initial memory"
    else:
        t = result.trace[step]
        cells, reads, writes = t.memory, t.reads, t.writes
        title = f"after step {step + 1} of {len(result.trace)} ({result.model})"  # counted from 1
    # a long row (a wide array: one table row per array row) scrolls inside the output instead of being cut off.
    # width 0 and min-width 100%: the box takes its container's width but adds nothing to the
    # container's smallest width, so a widget's flex box cannot grow to the table and clip it
    parts = [f"<div><b>{html.escape(result.program)}</b>: {title}</div>",
             "<div style='overflow-x:auto;width:0;min-width:100%'>",
             "<table style='border-collapse:collapse;font-family:monospace'>"]
    for name in arrays or list(mem):
        shape, size = mem.shapes[name], mem.size(name)
        if not size:  # an empty array: its name alone
            parts.append(f"<tr><td style='padding:2px 6px'><b>{html.escape(name)}</b></td></tr>")
            continue
        width = shape[-1] if shape else 1  # one table row per row of the array: G[p, N] as p rows
        for first in range(mem.bases[name], mem.bases[name] + size, width):
            label = name if len(shape) < 2 else mem.location(first).rsplit(",", 1)[0] + "]"  # G[1, 0] -> G[1]
            row = [f"<td style='padding:2px 6px'><b>{html.escape(label)}</b></td>"]
            for a in range(first, first + width):
                r, w = reads.get(a, ()), writes.get(a, ())
                color = _BOTH if r and w else _READ if r else _WRITE if w else "white"
                tip = "; ".join(x for x in (f"read by {list(r)}" if r else "",
                                            f"written by {list(w)}" if w else "") if x)
                row.append(f"<td title='{html.escape(mem.location(a))} {tip}' style='border:1px "
                           f"solid #999;padding:2px 6px;background:{color}'>{_fmt(cells[a])}</td>")
            parts.append("<tr>" + "".join(row) + "</tr>")
    parts.append("</table></div>")
    return "\n".join(parts)


def all_steps_html(result, arrays: Sequence[str] | None = None) -> str:
    """Every step of a traced run one below the other: what the slider shows, without a kernel."""
    return "\n".join(render_step(result, step, arrays) for step in range(-1, len(result.trace or [])))
