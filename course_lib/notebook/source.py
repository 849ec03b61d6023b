"""The source of a course_lib function or class, shown highlighted in a notebook cell.

The lessons show the code they explain rather than copy it into cells: the library is the source
of truth, so what a student reads is what runs.
"""

from __future__ import annotations

import inspect


def show_source(obj) -> None:
    """Display ``obj``'s source (a function, method or class) as highlighted Python."""
    from IPython.display import Code, display  # IPython only where a notebook shows it

    display(Code(inspect.getsource(obj), language="python"))
