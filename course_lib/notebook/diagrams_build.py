"""Rendering the Mermaid diagrams with mermaid-cli, and checking the committed renderings.

    course images build [NAME ...] [--force]   # `make images` installs mermaid-cli first
    course images check                         # are the committed renderings up to date?
    course images list

The notebook side (showing a diagram) lives in :mod:`course_lib.notebook.diagrams`; this module owns
the files and the command: ``images/diagrams/NAME.mmd`` is rendered by mermaid-cli (``mmdc``, driving a headless
Chromium) to ``rendered/NAME.svg`` and ``rendered/NAME.png``, and ``rendered/manifest.json``
records the SHA-256 of each source, of the shared ``mermaid-config.json`` and of both outputs.
:func:`check` compares those hashes with the files, so a source edited without re-rendering is
noticed without a browser.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from course_lib.notebook.diagrams import (
    CONFIG,
    DIAGRAM_MANIFEST,
    DIAGRAM_SOURCES,
    RENDERED,
    _check_name,
    _root,
    names,
)
from course_lib.utils import atomic_write_bytes

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _text_sha256(path: Path) -> str:
    """Hash of a text file with its line endings normalised, so a CRLF checkout still matches."""
    return _sha256(path.read_bytes().replace(b"\r\n", b"\n"))


def load_manifest(root: Path | None = None) -> dict:
    path = _root(root) / RENDERED / DIAGRAM_MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {"renderer": None, "config_sha256": None, "diagrams": {}}


# ---------------------------------------------------------------- checking the committed files

def is_png(data: bytes) -> bool:
    """A PNG signature followed by an IHDR chunk with a non-zero width and height."""
    if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return False
    return int.from_bytes(data[16:20], "big") > 0 and int.from_bytes(data[20:24], "big") > 0


def is_svg(text: str) -> bool:
    """Well-formed XML whose root element is an <svg> with a non-empty viewBox and some content."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError:
        return False
    return root.tag in ("svg", "{http://www.w3.org/2000/svg}svg") and bool(root.get("viewBox")) and len(root) > 0


def _problems(root: Path) -> list[tuple[str | None, str]]:
    """(diagram name or None, problem) for everything out of date or broken in the renderings."""
    src_dir, out_dir = root / DIAGRAM_SOURCES, root / RENDERED
    if not (out_dir / DIAGRAM_MANIFEST).is_file():
        return [(None, f"{out_dir / DIAGRAM_MANIFEST} is missing: run `make images`")]
    manifest = load_manifest(root)
    problems: list[tuple[str | None, str]] = []
    if manifest.get("config_sha256") != _text_sha256(src_dir / CONFIG):
        problems.append((None, f"{CONFIG} changed since the last rendering: run `make images`"))
    entries = manifest.get("diagrams", {})
    for name in names(root):
        entry = entries.get(name)
        if entry is None:
            problems.append((name, f"{name}: never rendered: run `make images`"))
            continue
        if entry.get("source_sha256") != _text_sha256(src_dir / f"{name}.mmd"):
            problems.append((name, f"{name}: {name}.mmd changed since it was rendered: run `make images`"))
        for ext, valid in (("svg", lambda b: is_svg(b.decode("utf-8", "replace"))), ("png", is_png)):
            path = out_dir / f"{name}.{ext}"
            if not path.is_file():
                problems.append((name, f"{name}: {path} is missing: run `make images`"))
            elif not valid(path.read_bytes()):
                problems.append((name, f"{name}: {path} is not a valid {ext.upper()} file"))
            elif entry.get(f"{ext}_sha256") != _sha256(path.read_bytes()):
                problems.append((name, f"{name}: {path} differs from the recorded rendering (edited by hand?)"))
    for name in sorted(set(entries) - set(names(root))):
        problems.append((None, f"{name}: rendered, but {name}.mmd no longer exists: run `make images`"))
    return problems


def check_diagrams(root: Path | None = None) -> list[str]:
    """Problems with the committed renderings (an empty list when all are up to date)."""
    return [msg for _, msg in _problems(_root(root))]


# ---------------------------------------------------------------- rendering with mermaid-cli

def _find_tool(env: str, candidates: list[str | Path], hint: str) -> str:
    """$env if set, else the first candidate that is an existing file or a command on PATH."""
    if os.environ.get(env):
        candidates = [os.environ[env]]
    for c in candidates:
        found = str(c) if Path(c).is_file() else shutil.which(str(c))
        if found:
            return found
    raise FileNotFoundError(hint)


def build_diagrams(only: list[str] | None = None, force: bool = False, root: Path | None = None, jobs: int = 2) -> list[str]:
    """Render the stale diagrams (or ``only`` those, or all with ``force``); return the names rendered."""
    root = _root(root)
    for name in only or []:
        _check_name(name, root)
    mmdc = _find_tool("COURSE_MMDC", [root / ".tools/mermaid/node_modules/.bin/mmdc", "mmdc"],
                      "mermaid-cli (mmdc) not found: run `make images`, which installs it into .tools/mermaid, "
                      "or point $COURSE_MMDC at an mmdc executable")
    chromium = _find_tool("COURSE_CHROMIUM", ["chromium", "chromium-browser", "google-chrome"],
                          "Chromium not found: `make browser-deps` (Debian: apt-get install chromium), "
                          "or point $COURSE_CHROMIUM at a Chrome/Chromium executable")
    version = subprocess.run([mmdc, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    manifest = load_manifest(root)
    config_sha = _text_sha256(root / DIAGRAM_SOURCES / CONFIG)
    renderer = f"@mermaid-js/mermaid-cli {version}"
    if manifest.get("config_sha256") != config_sha or manifest.get("renderer") != renderer:
        force = True  # a new config or a new mermaid-cli changes every rendering
    if only:
        todo = sorted(set(only))
    elif force:
        todo = names(root)
    else:
        todo = sorted({name for name, _ in _problems(root) if name is not None})
    out_dir = root / RENDERED
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="course-images-") as tmp:
        puppeteer = Path(tmp) / "puppeteer.json"
        puppeteer.write_text(json.dumps({"executablePath": chromium, "args": CHROMIUM_ARGS}))

        def render(name: str) -> tuple[str, dict]:
            src = root / DIAGRAM_SOURCES / f"{name}.mmd"
            common = [mmdc, "--quiet", "-i", str(src), "-p", str(puppeteer), "-c", str(root / DIAGRAM_SOURCES / CONFIG),
                      "-b", "white"]
            outs = {}
            for ext, extra in (("svg", ["--svgId", name]), ("png", ["--scale", "2"])):
                target = Path(tmp) / f"{name}.{ext}"
                proc = subprocess.run(common + ["-o", str(target)] + extra, capture_output=True, text=True, check=False)
                if proc.returncode != 0 or not target.is_file():
                    raise RuntimeError(f"mmdc failed on {src}:\n{proc.stderr.strip() or proc.stdout.strip()}")
                outs[ext] = target.read_bytes()
            return name, outs

        manifest.update(renderer=renderer, config_sha256=config_sha)
        entries = manifest.setdefault("diagrams", {})
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            for name, outs in tqdm(pool.map(render, todo), total=len(todo), desc="rendering diagrams", unit="diagram"):
                for ext, data in outs.items():
                    atomic_write_bytes(out_dir / f"{name}.{ext}", data)
                entries[name] = {"source_sha256": _text_sha256(root / DIAGRAM_SOURCES / f"{name}.mmd"),
                                 "svg_sha256": _sha256(outs["svg"]), "png_sha256": _sha256(outs["png"])}
                # written after every diagram: an interrupted build keeps what it finished
                atomic_write_bytes(out_dir / DIAGRAM_MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    for name in sorted(set(entries) - set(names(root))):  # sources deleted since the last build
        del entries[name]
        for ext in ("svg", "png"):
            (out_dir / f"{name}.{ext}").unlink(missing_ok=True)
    atomic_write_bytes(out_dir / DIAGRAM_MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return todo


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="course images", description="Render and check the Mermaid diagrams.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="render stale diagrams to SVG and PNG (needs mermaid-cli and Chromium)")
    b.add_argument("names", nargs="*", help="render only these (default: every stale one)")
    b.add_argument("--force", action="store_true", help="re-render every diagram")
    b.add_argument("--jobs", type=int, default=2, help="diagrams rendered at once (default 2)")
    sub.add_parser("check", help="exit 1 when a rendering is missing or older than its source")
    sub.add_parser("list", help="list the diagrams")
    args = p.parse_args(argv)
    if args.cmd == "list":
        print("\n".join(names()))
        return 0
    if args.cmd == "build":
        try:
            done = build_diagrams(args.names or None, force=args.force, jobs=args.jobs)
        except (FileNotFoundError, RuntimeError, ValueError) as e:
            print(f"course images: {e}", file=sys.stderr)
            return 1
        print(f"rendered {len(done)} diagram(s) into {RENDERED}/" if done else "all diagrams are up to date")
    try:
        problems = check_diagrams()
    except FileNotFoundError as e:  # an installed package: nothing to check against
        print(f"course images: {e}", file=sys.stderr)
        return 1
    for line in problems:
        print(line, file=sys.stderr)
    if args.cmd == "check" and not problems:
        print(f"{len(names())} diagrams, all renderings up to date")
    return 1 if problems else 0
