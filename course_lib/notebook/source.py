"""The source or the docstring of a course_lib object, shown in a notebook cell.

The lessons show the code they explain rather than copy it into cells: the library is the source
of truth, so what a student reads is what runs. :func:`show_source` shows the code, highlighted;
:func:`show_doc` shows a docstring as formatted text (its reStructuredText roles and literals
turned into Markdown, so a student does not read ``:func:`~x.y``` markup).
"""

from __future__ import annotations

import ast
import inspect
import linecache
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


def _class_in_cell(cls) -> str | None:
    """The source of a class defined in a notebook cell, found through its methods' code.

    Before Python 3.13, ``inspect.getsource`` looks for a class in its module's file, and a
    notebook's ``__main__`` has none; but each method's code names the cell it was compiled from
    (IPython keeps the cells in linecache), and that cell holds the ``class`` statement.
    """
    for attr in vars(cls).values():
        func = inspect.unwrap(getattr(attr, "__func__", getattr(attr, "fget", attr)))
        code = getattr(func, "__code__", None)
        lines = linecache.getlines(code.co_filename) if code is not None else []
        if not lines:  # not a function, or one made from a string (a dataclass's __init__)
            continue
        try:
            tree = ast.parse("".join(lines))
        except SyntaxError:  # a cell kept as typed, with IPython's magics: not Python
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls.__name__ and \
                    node.lineno <= code.co_firstlineno <= node.end_lineno:
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                return "".join(lines[start - 1:node.end_lineno])
    return None


def _source(obj) -> str:
    """``obj``'s source: ``inspect.getsource``, which also finds a class defined in a notebook."""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        found = _class_in_cell(obj) if inspect.isclass(obj) else None
        if found is None:
            raise
        return found


def show_source(obj) -> None:
    """Display ``obj``'s source (a function, method or class) as highlighted Python."""
    from IPython.display import Code, display  # IPython only where a notebook shows it

    display(Code(_source(obj), language="python"))


def show_doc(obj, paragraphs: slice | None = None) -> None:
    """Display ``obj``'s docstring as formatted text (:func:`doc_markdown`)."""
    from IPython.display import Markdown, display  # IPython only where a notebook shows it

    display(Markdown(doc_markdown(obj, paragraphs)))
