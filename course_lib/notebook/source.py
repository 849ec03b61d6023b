"""The source or the docstring of a course_lib object, shown in a notebook cell.

The lessons show the code they explain rather than copy it into cells: the library is the source
of truth, so what a student reads is what runs. :func:`show_source` shows the code, highlighted;
:func:`show_doc` shows a docstring as formatted text (its reStructuredText roles and literals
turned into Markdown, so a student does not read ``:func:`~x.y``` markup).
"""

from __future__ import annotations

import inspect
import re

# :func:`~course_lib.a.b` -> `b`; :mod:`course_lib.a` -> `course_lib.a`; :data:`X` -> `X`
_ROLE = re.compile(r":[a-z]+:`(~?)([^`<]*?)(?:\s*<[^>]*>)?`")


def _role(m: re.Match) -> str:
    tilde, target = m.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def doc_markdown(obj, paragraphs: slice | None = None) -> str:
    """``obj``'s docstring (or the text itself, for a string) as Markdown, cleaned of its indentation.

    ``paragraphs`` picks blank-line-separated paragraphs (``slice(1, 4)``: the second to the fourth).
    Roles become code spans (``~`` keeps the last name, as Sphinx shows it), double-backquoted
    literals single ones, and a literal block's ``::`` a colon; indented blocks stay code blocks.
    """
    text = obj if isinstance(obj, str) else inspect.getdoc(obj) or ""
    text = inspect.cleandoc(text)
    if paragraphs is not None:
        text = "\n\n".join(text.split("\n\n")[paragraphs])
    text = _ROLE.sub(_role, text)
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    return re.sub(r"(\S)::$", r"\1:", text, flags=re.M)


def show_source(obj) -> None:
    """Display ``obj``'s source (a function, method or class) as highlighted Python."""
    from IPython.display import Code, display  # IPython only where a notebook shows it

    display(Code(inspect.getsource(obj), language="python"))


def show_doc(obj, paragraphs: slice | None = None) -> None:
    """Display ``obj``'s docstring as formatted text (:func:`doc_markdown`)."""
    from IPython.display import Markdown, display  # IPython only where a notebook shows it

    display(Markdown(doc_markdown(obj, paragraphs)))
