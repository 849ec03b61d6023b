"""The course website (``make book``), built from the smoke-executed lessons and read in Chromium.

    python -m pytest tests/test_book.py          # make browser-deps installs chromium

Builds the site with course_lib.notebook.book from the notebooks test_notebooks.py executed (see
conftest.py), serves it over HTTP and checks as a reader would: every page loads and has the
notebook's title, every figure and diagram renders, no widget shows as its Python repr, every
link inside the site leads to a page (and anchor) that exists, and the search box finds a lesson.
Screenshots go to test-artifacts/book/.
"""

from __future__ import annotations

import functools
import http.server
import json
import re
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from browser_lab import CHROMIUM, RAW_REPRS

from course_lib.utils import free_port, repo_root

ROOT = repo_root()
ARTIFACTS = ROOT / "test-artifacts" / "book"
LESSONS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))

pytestmark = [pytest.mark.browser, pytest.mark.slow]
if CHROMIUM is None:
    pytestmark.append(pytest.mark.skip(reason="chromium is not installed: sudo apt-get install chromium"))


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.hrefs.append(a["href"])


def _parse(path: Path) -> _Links:
    p = _Links()
    p.feed(path.read_text(encoding="utf-8"))
    return p


def broken_links(html_dir: Path) -> list[str]:
    """Links between the site's pages whose target file or anchor does not exist."""
    pages = {path: _parse(path) for path in html_dir.rglob("*.html")}
    bad = []
    for path, parsed in pages.items():
        for href in parsed.hrefs:
            url = urlparse(href)
            if url.scheme or href.startswith(("mailto:", "javascript:")):
                continue  # outside the site
            target = (path.parent / unquote(url.path)).resolve() if url.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                bad.append(f"{path.relative_to(html_dir)}: {href} (no such file)")
            elif url.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(url.fragment) not in ids:
                    bad.append(f"{path.relative_to(html_dir)}: {href} (no such anchor)")
    return bad


def test_broken_links_are_found(tmp_path):
    (tmp_path / "a.html").write_text('<a href="b.html#x">b</a><a href="c.html">c</a><a href="b.html#y">y</a>'
                                     '<a href="https://example.org/z">z</a>')
    (tmp_path / "b.html").write_text('<h1 id="x">b</h1>')
    assert broken_links(tmp_path) == ["a.html: c.html (no such file)", "a.html: b.html#y (no such anchor)"]


def test_cache_key_follows_code_not_prose_and_outputs_are_merged():
    import nbformat

    from course_lib.notebook import book

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 1. X"), nbformat.v4.new_code_cell("print(1)")]
    ran = nbformat.from_dict(json.loads(json.dumps(nb)))
    ran.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    edited = nbformat.from_dict(json.loads(json.dumps(nb)))
    edited.cells[0].source = "# 1. X, reworded"
    assert book.source_key(edited, smoke=False) == book.source_key(nb, smoke=False)
    assert book.source_key(nb, smoke=True) != book.source_key(nb, smoke=False)
    merged = book.with_outputs(edited, ran)
    assert merged.cells[0].source == "# 1. X, reworded" and merged.cells[1].outputs[0].text == "1\n"
    edited.cells[1].source = "print(2)"
    assert book.source_key(edited, smoke=False) != book.source_key(nb, smoke=False)


def test_front_page_is_the_readme_course_table():
    from course_lib.notebook import book

    page = book.front_page((ROOT / "README.md").read_text(), [f"{s}.ipynb" for s in LESSONS])
    for stem in LESSONS:
        assert f"| [{stem}](notebooks/{stem}.ipynb) |" in page and f"\nnotebooks/{stem}\n" in page
    assert page.startswith("# ") and "```{toctree}" in page


@pytest.fixture(scope="module")
def site(tmp_path_factory, smoke_executed):
    from course_lib.notebook import book

    html = book.build_book(smoke=True, out=tmp_path_factory.mktemp("book"), executed_dir=smoke_executed, quiet=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(html))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield html, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


JS_PAGE = """(raw) => ({
  title: document.title,
  text: document.querySelector('main, article, body').innerText,
  raw: raw.filter(r => document.body.innerText.includes(r)),
  images: Array.from(document.querySelectorAll('article img, main img'))
    .filter(img => img.src.startsWith(location.origin) || img.src.startsWith('data:'))
    .map(img => ({src: img.src.slice(0, 80), alt: img.alt, ok: img.complete && img.naturalWidth > 0})),
  search: !!document.querySelector('form[action*="search"], input[name="q"]'),
})"""


@pytest.mark.timeout(600)
def test_course_website(site, browser):  # the session's Chromium (conftest.py)
    html, base = site
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert broken_links(html) == []
    problems, figures, diagrams = [], {}, 0
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    try:
        for stem in ["index", *(f"notebooks/{s}" for s in LESSONS)]:
            response = page.goto(f"{base}/{stem}.html", wait_until="load")
            assert response is not None and response.ok, f"{stem}.html: HTTP {response and response.status}"
            info = page.evaluate(JS_PAGE, list(RAW_REPRS))
            page.screenshot(path=str(ARTIFACTS / f"{stem.replace('/', '-')}.png"), full_page=True)
            figures[stem] = len(info["images"])
            diagrams += sum(i["alt"].startswith("diagram: ") for i in info["images"])
            problems += [f"{stem}: raw widget text {r!r}" for r in info["raw"]]
            problems += [f"{stem}: figure did not render {i['src']}" for i in info["images"] if not i["ok"]]
            if not info["search"]:
                problems.append(f"{stem}: no search box")
            if stem == "index":  # the README's course table, every lesson linked
                for s in LESSONS:
                    assert page.locator(f'a[href="notebooks/{s}.html"]').count() >= 1, f"index: no link to {s}"
            else:
                number = int(Path(stem).name[:2])
                assert re.match(rf"{number}\. ", info["title"]), f"{stem}: title {info['title']!r}"
        page.goto(f"{base}/search.html?q=all-reduce", wait_until="load")
        page.wait_for_selector("#search-results li, .search li", timeout=30_000)
        hits = page.locator("#search-results li, .search li").count()
        page.screenshot(path=str(ARTIFACTS / "search.png"))
    finally:
        page.close()
    assert not problems, "\n".join(problems)
    assert hits >= 2, "the search box found fewer than 2 pages about all-reduce"
    assert sum(figures.values()) >= 2 * len(LESSONS), f"too few figures on the pages: {figures}"
    assert diagrams >= 5, f"only {diagrams} Mermaid diagrams rendered on the site"
