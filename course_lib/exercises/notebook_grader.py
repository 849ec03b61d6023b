"""The ``grader`` of an exercise notebook: otter's ``Notebook``, whose ``check`` reports show every
character of their messages.

    grader = NotebookGrader("01_collectives.ipynb")   # the setup cell (course_lib.exercises.colab)
    grader.check("q1_ring_all_reduce")                 # a report, as HTML in a notebook

otter's own HTML report (otter-grader 7.0, ``TestFile._repr_html_``) puts a failure message into a
``<pre>`` element without escaping it, so whatever looks like a tag vanishes from the notebook: a
traceback's ``File "Cell In[3]", line 2, in <lambda>`` shows as ``File "Cell In[3]", line 2, in``,
and ``<listcomp>``, ``<module>``, cloudpickle's ``<dynamic-code>`` or a message's ``<class 'list'>``
vanish the same way. A
:class:`CheckReport` shows otter's text report (``repr``, what a terminal prints) as HTML instead,
escaped, its first line in green when every test case passed and in red otherwise. Everything else
about the grader is otter's: grading, logging, ``check_all``, ``export``.
"""

from __future__ import annotations

import html
import sys
from typing import Any

import otter


class CheckReport:
    """What ``grader.check`` returns: otter's result for one question (``.result``, a ``TestFile``;
    its attributes read through, e.g. ``.passed_all``), displayed with its messages escaped."""

    def __init__(self, result: Any):
        self.result = result

    def __getattr__(self, name: str) -> Any:
        if name == "result":  # not set yet (a copy being made): no lookup through itself
            raise AttributeError(name)
        return getattr(self.result, name)

    def __repr__(self) -> str:
        return repr(self.result)

    def _repr_html_(self) -> str:
        head, _, rest = repr(self.result).partition("\n")
        colour = "#1a7f37" if self.result.passed_all else "#c62828"
        # monospace, as a terminal shows it: a traceback's ^^^ marks stand under what they mark
        return (f"<pre style='font-family: monospace'><strong style='color: {colour}'>{html.escape(head)}</strong>"
                + (f"\n{html.escape(rest)}" if rest else "") + "</pre>")


class NotebookGrader(otter.Notebook):
    """``otter.Notebook`` whose :meth:`check` returns a :class:`CheckReport`."""

    def check(self, question: str, global_env: dict[str, Any] | None = None) -> CheckReport | None:
        """otter's check of ``question`` against ``global_env`` (default: the caller's globals, the
        notebook's, as otter takes them)."""
        if global_env is None:  # otter looks two frames up from its own: here, one is ours
            global_env = sys._getframe(1).f_globals
        result = super().check(question, global_env)
        return None if result is None else CheckReport(result)
