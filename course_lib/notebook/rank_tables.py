"""Each rank's copy of a buffer as one table, the values that changed since the last step marked.

    from course_lib.notebook.rank_tables import BufferSteps
    steps = BufferSteps()
    steps.show(ranks.pull("data"), "start")            # a table: a row per rank, a column per value
    ...                                                 # a %%ranks cell runs one step
    steps.show(ranks.pull("data"), "broadcast")        # changed values are highlighted

For the cells of lesson 02 that step through collectives with a live
:class:`~course_lib.launch.rank_pool.RankPool`, where each step's effect on every rank should be
seen at a glance rather than read from N printouts.
"""

from __future__ import annotations

import html

import pandas as pd

CHANGED = "background-color:#ffe08a;font-weight:bold"


class BufferSteps:
    """The tables of one walk through a collective; remembers the last one to mark changes."""

    def __init__(self):
        self.previous: pd.DataFrame | None = None
        self.history: list[tuple[str, pd.DataFrame]] = []

    def table(self, values) -> pd.DataFrame:
        rows = [[float(x) for x in (v.reshape(-1).tolist() if hasattr(v, "reshape") else v)] for v in values]
        return pd.DataFrame(rows, index=[f"rank {r}" for r in range(len(rows))])

    def show(self, values, title: str, against=None) -> StepTable:
        """This step's table (Jupyter shows it styled); the plain table is kept in ``history``.
        Changes are marked against ``against`` (values, e.g. each rank's buffer before a
        collective), by default against the table shown last."""
        frame = self.table(values)
        base = self.table(against) if against is not None else self.previous
        before = base if base is not None and base.shape == frame.shape else frame
        self.previous = frame
        self.history.append((title, frame))
        return StepTable(title, frame, frame.ne(before))


class StepTable:
    """A table with its changed cells marked: HTML in a notebook, text elsewhere (``*`` marks)."""

    def __init__(self, title: str, frame: pd.DataFrame, changed: pd.DataFrame):
        self.title, self.frame, self.changed = title, frame, changed

    def _repr_html_(self) -> str:
        # inline styles, not a <style> block: a reopened (untrusted) notebook strips <style> tags
        cell = "padding:2px 8px;text-align:right;"
        head = "".join(f'<th style="{cell}">{c}</th>' for c in self.frame.columns)
        rows = "".join(
            f'<tr><th style="{cell}">{html.escape(str(label))}</th>' + "".join(
                f'<td style="{cell}{CHANGED if changed else ""}">{value:g}</td>'
                for value, changed in zip(values, flags, strict=True)) + "</tr>"
            for label, values, flags in zip(self.frame.index, self.frame.to_numpy(), self.changed.to_numpy(),
                                            strict=True))
        return (f'<table class="course-step-table"><caption>{html.escape(self.title)}</caption>'
                f'<thead><tr><th></th>{head}</tr></thead><tbody>{rows}</tbody></table>')

    def __repr__(self) -> str:
        marked = self.frame.map(lambda v: f"{v:g}").where(~self.changed, self.frame.map(lambda v: f"*{v:g}"))
        return f"{self.title}\n{marked.to_string()}"
