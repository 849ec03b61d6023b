"""A static copy of a widget's state in the same output, for every viewer that has no kernel.

    from course_lib.notebook.static import with_snapshot
    with_snapshot(box)             # a cell ending in it shows the live widget, and saves its state as HTML

A Jupyter output holds one *mimebundle*: the same thing in several formats, and each viewer picks
the richest one it can show (the nbformat spec, "display_data"). An ipywidget's bundle has only
``application/vnd.jupyter.widget-view+json`` (a reference to a model that lives in the kernel) and
``text/plain`` (its Python repr, ``VBox(children=(FloatSlider(...``). A reopened notebook whose
kernel is gone, GitHub's viewer and a static website cannot show the model, so they show the repr.

:func:`snapshot_bundle` adds ``text/html`` (and ``text/plain``) rendered from the widget tree as it
is now: HTML and Label widgets as their text, Image widgets as inline PNGs, Output widgets as
what they captured, and each control as ``description: value``. The live session still picks
the widget (its renderer ranks first); everyone else gets the last state instead of the repr.
For a display that changes (a training run), show it with ``display(..., display_id=True)`` and
``handle.update(...)`` when it is done, so the saved copy is the final state.
"""

from __future__ import annotations

import base64
from html import escape
from html.parser import HTMLParser

from IPython.utils.capture import capture_output

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class _Text(HTMLParser):
    """The visible text of an HTML fragment, one line per block element."""

    BLOCKS = {"div", "p", "br", "tr", "li", "table", "h1", "h2", "h3", "h4", "pre"}

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag in self.BLOCKS:
            self.parts.append("\n")
        elif tag in ("td", "th"):
            self.parts.append("  ")

    def handle_data(self, data):
        self.parts.append(data)


def html_text(fragment: str) -> str:
    """``fragment`` as plain text: tags dropped, blank lines removed."""
    parser = _Text()
    parser.feed(fragment)
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    return "\n".join(line for line in lines if line)


def _value_text(w) -> str:
    """What a control shows as its value: the chosen label, or the number in its readout format."""
    label = getattr(w, "label", None)
    if label and hasattr(w, "options"):  # Dropdown, ToggleButtons, SelectionSlider
        return str(label)  # (a SelectionSlider still on its first option has the label '')
    value = w.value
    fmt = getattr(w, "readout_format", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and fmt:
        try:
            return format(value, fmt)
        except ValueError:
            pass
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _output_html(outputs) -> str:
    """The outputs an Output widget captured (its ``outputs`` are nbformat dicts)."""
    parts = []
    for out in outputs:
        data = out.get("data", {})
        if out.get("output_type") == "stream":
            parts.append(f"<pre>{escape(out.get('text', ''))}</pre>")
        elif "image/png" in data:
            parts.append(f'<img alt="figure" src="data:image/png;base64,{data["image/png"]}"/>')
        elif "text/html" in data:
            parts.append(data["text/html"])
        elif "text/plain" in data:
            parts.append(f"<pre>{escape(data['text/plain'])}</pre>")
    return "".join(parts)


def _call_html(widget) -> str:
    """What ``interactive``'s function prints and displays for the current controls.

    Its Output widget is filled in the browser, so the kernel's copy is empty: the function is
    called once more here, with its output captured (the explorers of the notebooks only print).
    """
    with capture_output() as captured:
        value = widget.f(**widget.kwargs)
    outputs = [{"output_type": "stream", "text": captured.stdout}] if captured.stdout else []
    outputs += [{"output_type": "display_data", "data": o.data} for o in captured.outputs]
    if value is not None:
        outputs.append({"output_type": "display_data", "data": {"text/plain": repr(value)}})
    return _output_html(outputs)


def snapshot_html(widget) -> str:
    """The widget tree as static HTML (boxes as flex rows or columns, controls as text)."""
    import ipywidgets as w  # only here: importing course_lib must not import ipywidgets

    if isinstance(widget, w.interactive):  # controls, then what the function shows for them
        controls = "".join(snapshot_html(child) for child in widget.children if child is not widget.out)
        return f'<div style="display:flex;flex-direction:column;gap:4px">{controls}{_call_html(widget)}</div>'
    if isinstance(widget, w.Box):  # HBox, VBox
        row = isinstance(widget, w.HBox)
        style = "display:flex;gap:12px;align-items:flex-start;flex-wrap:wrap" if row else \
            "display:flex;flex-direction:column;gap:4px"
        inner = "".join(snapshot_html(child) for child in widget.children)
        return f'<div style="{style}">{inner}</div>'
    if isinstance(widget, (w.HTML, w.HTMLMath)):
        return f"<div>{widget.value}</div>"
    if isinstance(widget, w.Label):
        return f"<div>{escape(widget.value)}</div>"
    if isinstance(widget, w.Image):
        if not widget.value:
            return ""
        src = base64.b64encode(widget.value).decode()
        return f'<img alt="figure" src="data:image/{escape(widget.format)};base64,{src}"/>'
    if isinstance(widget, w.Output):
        return _output_html(widget.outputs)
    if isinstance(widget, w.Button):
        return ""
    if hasattr(widget, "value"):  # sliders, dropdowns, toggles, checkboxes, progress bars
        name = escape(getattr(widget, "description", "") or "")
        fixed = " <i>(fixed)</i>" if getattr(widget, "disabled", False) else ""
        return f"<div>{name + ': ' if name else ''}<b>{escape(_value_text(widget))}</b>{fixed}</div>"
    return ""


def snapshot_bundle(widget, png: bytes | None = None) -> dict:
    """The widget's own mimebundle plus its current state as ``text/html`` and ``text/plain``.

    ``png``, if given, is added as ``image/png`` too (the figure alone, for viewers that prefer it).
    """
    bundle = dict(widget._repr_mimebundle_())
    html = snapshot_html(widget)
    bundle["text/html"] = f'<div class="course-widget-snapshot">{html}</div>'
    bundle["text/plain"] = html_text(html) or bundle.get("text/plain", "")
    if png is not None:
        bundle["image/png"] = base64.b64encode(png).decode()
    return bundle


class with_snapshot:  # noqa: N801 - used like a function in notebooks
    """Display ``widget`` (any ipywidget) with a static copy of its state in the same output.

    ``html``, if given, is the static copy instead of :func:`snapshot_html` (e.g. every step of a
    step slider, where the widget alone can show only one).
    """

    def __init__(self, widget, html: str | None = None):
        self.widget, self.html = widget, html

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        bundle = snapshot_bundle(self.widget)
        if self.html is not None:
            bundle["text/html"] = f'<div class="course-widget-snapshot">{self.html}</div>'
            bundle["text/plain"] = html_text(self.html)
        return bundle
