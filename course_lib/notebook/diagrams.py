"""The course's Mermaid diagrams in notebooks: the committed renderings, or rendered live.

Each diagram is a Mermaid source ``images/diagrams/NAME.mmd``, rendered to
``images/diagrams/rendered/NAME.svg`` and ``.png`` by :mod:`course_lib.notebook.diagrams_build`. The
renderings are committed, so a notebook shows them offline, on Colab and on GitHub::

    from course_lib.notebook import diagrams
    diagrams.show("dp_step")                       # the committed rendering
    src = diagrams.mermaid_source("broadcast")     # edit it ...
    diagrams.show("broadcast", source=src.replace("rank 3", "rank 7"))   # ... rendered live

The sources and renderings travel inside the package too (``course_lib/_diagrams`` links to
``images/diagrams``; the wheel carries copies), so all of this works from a plain
``pip install`` with no clone, as on Colab.

Live rendering goes through mermaid-py (the mermaid.ink web service, or $MERMAID_INK_SERVER).
When that fails (offline, say) the committed image is shown instead, or, for an edited source
that has no rendering, the source itself, each time with a note saying why.
"""

from __future__ import annotations

import base64
import os
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from html import escape
from pathlib import Path
from urllib.parse import urlparse

from course_lib.utils import PACKAGE_DIR, repo_root

DIAGRAM_SOURCES = Path("images") / "diagrams"  # relative to the repository root
RENDERED = DIAGRAM_SOURCES / "rendered"
CONFIG = "mermaid-config.json"
DIAGRAM_MANIFEST = "manifest.json"
PACKAGED = PACKAGE_DIR / "_diagrams"  # a link to images/diagrams; in a wheel, a copy (package data)


def _root(root: Path | None) -> Path:
    """The clone to build renderings in (``course images build`` needs the repository)."""
    root = root or repo_root()
    if root is None:
        raise FileNotFoundError("rendering diagrams needs a clone of the course repository (images/diagrams/)")
    return Path(root)


def _folder(root: Path | None) -> Path:
    """Where the sources are: ``root/images/diagrams``, a clone's, or else the package's copy."""
    root = root or repo_root()
    folder = Path(root) / DIAGRAM_SOURCES if root is not None else PACKAGED
    if not folder.is_dir():
        raise FileNotFoundError(f"no diagram sources in {folder}: reinstall course-lib, or restore images/diagrams/")
    return folder


def names(root: Path | None = None) -> list[str]:
    """The diagram names: the stems of ``images/diagrams/*.mmd``."""
    return sorted(p.stem for p in _folder(root).glob("*.mmd"))


def _check_name(name: str, root: Path | None) -> None:
    known = names(root)
    if name not in known:
        raise ValueError(f"no diagram named {name!r}; the diagrams are: {', '.join(known)}")


def mermaid_source(name: str, root: Path | None = None) -> str:
    """The Mermaid text of diagram ``name``: copy it, edit it, pass it to ``show(name, source=...)``."""
    _check_name(name, root)
    return (_folder(root) / f"{name}.mmd").read_text(encoding="utf-8")


# ---------------------------------------------------------------- showing in notebooks

class LiveRenderError(RuntimeError):
    """mermaid-py could not render a diagram (offline, server error, bad syntax)."""


@dataclass(frozen=True, repr=False)
class Figure:
    """What ``show`` displays: an SVG/PNG or the Mermaid source, plus a note."""

    name: str
    how: str  # "committed", "live" or "source"
    svg: str | None = None
    png: bytes | None = None
    source: str | None = None
    note: str = ""

    def __repr__(self) -> str:
        return f"[diagram {self.name}: {self.how}] {self.note}".strip()

    def _repr_html_(self) -> str:
        alt = f'alt="diagram: {escape(self.name)}"'
        if self.svg is not None:
            m = re.search(r'viewBox="[-\d.]+ [-\d.]+ ([\d.]+)', self.svg)
            width = f' width="{round(float(m.group(1)))}"' if m else ""
            data = base64.b64encode(self.svg.encode()).decode()
            body = f'<img {alt}{width} style="max-width:100%;height:auto" src="data:image/svg+xml;base64,{data}"/>'
        elif self.png is not None:
            data = base64.b64encode(self.png).decode()
            body = f'<img {alt} style="max-width:100%" src="data:image/png;base64,{data}"/>'
        else:
            body = f'<pre class="diagram-source">{escape(self.source or "")}</pre>'
        note = f'<div class="diagram-note" style="font-size:90%;color:#8a4b08">{escape(self.note)}</div>' if self.note else ""
        return f'<figure class="course-diagram" data-how="{self.how}" style="margin:0">{note}{body}</figure>'

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        bundle = {"text/html": self._repr_html_(), "text/plain": repr(self)}
        if self.png is not None:
            bundle["image/png"] = base64.b64encode(self.png).decode()
        return bundle


def _render_live(text: str, timeout: float) -> tuple[str, bytes]:
    """(svg, png) of ``text`` from mermaid.ink through mermaid-py; LiveRenderError on any failure."""
    server = os.environ.get("MERMAID_INK_SERVER", "https://mermaid.ink")

    def work() -> tuple[str, bytes]:
        import mermaid  # mermaid-py: 0.6 s of import (requests, ...), only for live rendering

        url = urlparse(server)
        # fail fast when offline: mermaid-py's own requests have no timeout
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        try:
            m = mermaid.Mermaid(text)
        except mermaid.MermaidError as e:  # the service answered, but rejected the diagram
            raise LiveRenderError(str(e).splitlines()[0]) from None
        return m.svg_response.text, m.img_response.content

    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(work).result(timeout=timeout)
    except LiveRenderError:
        raise
    except FuturesTimeout:
        raise LiveRenderError(f"no answer from {server} within {timeout:g} s") from None
    except ImportError:
        raise LiveRenderError("mermaid-py is not installed (pip install mermaid-py)") from None
    except OSError as e:  # DNS, refused connection, and every requests error
        raise LiveRenderError(f"cannot reach {server} ({type(e).__name__}: {e}); are you offline?") from None
    finally:
        pool.shutdown(wait=False)


def _committed(name: str, folder: Path, note: str = "") -> Figure:
    svg, png = folder / "rendered" / f"{name}.svg", folder / "rendered" / f"{name}.png"
    if not (svg.is_file() and png.is_file()):
        raise FileNotFoundError(f"diagram {name!r} has no rendering in {folder / 'rendered'}: run `make images`")
    return Figure(name, "committed", svg=svg.read_text(encoding="utf-8"), png=png.read_bytes(), note=note)


def diagram(name: str, source: str | None = None, live: bool = False, timeout: float = 10.0,
            root: Path | None = None) -> Figure:
    """The Figure :func:`show` displays: ``.how`` says which way it was made, ``.note`` why."""
    _check_name(name, root)
    folder = _folder(root)
    committed_src = (folder / f"{name}.mmd").read_text(encoding="utf-8")
    edited = source is not None and source.strip() != committed_src.strip()
    text = source if source is not None else committed_src
    if not (live or edited):
        return _committed(name, folder)
    try:
        svg, png = _render_live(text, timeout)
        return Figure(name, "live", svg=svg, png=png, note="Rendered live by mermaid.ink through mermaid-py.")
    except LiveRenderError as e:
        reason = str(e)
    if edited:
        return Figure(name, "source", source=source, note=(
            f"Live rendering failed: {reason} Your edited source is shown instead: paste it into "
            f"https://mermaid.live, or save it as images/diagrams/{name}.mmd and run `make images`."))
    return _committed(name, folder, note=f"Live rendering failed: {reason} Showing the committed rendering instead.")


def show(name: str, source: str | None = None, live: bool = False, timeout: float = 10.0) -> None:
    """Display diagram ``name`` in a notebook (:func:`diagram` gives the object instead).

    By default the committed rendering (no network needed). ``live=True`` renders the committed
    source through mermaid-py instead; ``source=`` renders your edited Mermaid text. When live
    rendering fails (offline, or the service rejects the text) the committed image is shown, or
    for an edited source the source itself, with a note saying what happened.
    """
    from IPython.display import display  # IPython only when shown: `course images` imports this module

    display(diagram(name, source=source, live=live, timeout=timeout))
