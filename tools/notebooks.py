"""python tools/notebooks.py clear [--check] [NOTEBOOK ...]

Housekeeping for the course notebooks (``make notebooks-clear`` runs ``clear``):

    python tools/notebooks.py clear            # strip outputs, execution counts, widget state
    python tools/notebooks.py clear --check    # exit 1 if a notebook still has any (CI, tests)
    python tools/notebooks.py sync             # rewrite badges + Colab setup cells (notebooks/)
    python tools/notebooks.py new 04_zero_and_fsdp "ZeRO and FSDP"   # a notebook skeleton

Without NOTEBOOK arguments ``clear`` covers notebooks/*.ipynb and instructor/*/*.ipynb (the
exercise sources; their generated releases in exercises/ are left alone). ``sync`` is for when course_lib.utils.GITHUB_REPO
changes: every lesson notebook's Colab badge and first code cell are generated from it by
course_lib.notebook.smoke, and tests/test_notebooks.py checks that they match.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a clone without installing

from course_lib import utils
from course_lib.notebook import smoke

CELL_METADATA_KEYS = ("execution", "ExecuteTime", "collapsed", "scrolled")
BADGE_RE = re.compile(r'<a href="https://colab\.research\.google\.com/[^"]*"[^>]*>.*?</a>', re.DOTALL)


def _shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def course_notebooks(root: Path = ROOT) -> list[Path]:
    """Every notebook the course commits by hand: lessons and exercise sources (not releases)."""
    return sorted(root.glob("notebooks/*.ipynb")) + sorted(root.glob("instructor/*/*.ipynb"))


def dirt(nb) -> list[str]:
    """What keeps ``nb`` from being committed: outputs, execution counts, saved widget state."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
            found.append(f"cell {i} has outputs or an execution count")
        if any(k in cell.get("metadata", {}) for k in CELL_METADATA_KEYS):
            found.append(f"cell {i} has execution/view metadata")
    if "widgets" in nb.metadata:
        found.append("saved widget state in the notebook metadata")
    return found


def clear(nb) -> bool:
    """Strip ``nb`` in place (nbconvert's ClearOutputPreprocessor plus widget state); True if changed."""
    from nbconvert.preprocessors import (
        ClearOutputPreprocessor,  # imported here: nbconvert is slow to load
    )

    if not dirt(nb):
        return False
    ClearOutputPreprocessor(remove_metadata_fields=set(CELL_METADATA_KEYS)).preprocess(nb, {})
    nb.metadata.pop("widgets", None)
    return True


def sync(nb, path_in_repo: str) -> bool:
    """Put the current Colab badge and setup cell into a lesson notebook; True if changed."""
    badge = utils.colab_badge(path_in_repo)
    first_md = next(c for c in nb.cells if c.cell_type == "markdown")
    new_md = BADGE_RE.sub(badge, first_md.source, count=1) if BADGE_RE.search(first_md.source) \
        else f"{badge}\n\n{first_md.source}"
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    changed = new_md != first_md.source or first_code.source != smoke.colab_setup_cell()
    first_md.source, first_code.source = new_md, smoke.colab_setup_cell()
    return changed


def skeleton(stem: str, title: str):
    """A new lesson notebook with every part tests/test_notebooks.py requires."""
    v4 = nbformat.v4
    nb = v4.new_notebook(metadata={"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                                  "name": "python3"}, "language_info": {"name": "python"}})
    nb.cells = [
        v4.new_markdown_cell(f"{utils.colab_badge(f'notebooks/{stem}.ipynb')}\n\n# {title}\n\nOne paragraph: why this lesson."),
        v4.new_markdown_cell("## Learning goals\n\nAfter this notebook you can\n\n- ...\n- ..."),
        v4.new_code_cell(smoke.colab_setup_cell()),
        v4.new_code_cell("from course_lib.notebook.smoke import smoke_or\n\nn_steps = smoke_or(1000, 10)  # lesson size, test size"),
        v4.new_markdown_cell("## Summary\n\n- ...\n- ..."),
    ]
    return nb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/notebooks.py", description=__doc__.split("\n\n")[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("clear", help="strip outputs, execution counts and widget state")
    c.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook needs clearing")
    c.add_argument("paths", nargs="*", type=Path)
    sub.add_parser("sync", help="rewrite the Colab badge and setup cell of notebooks/*.ipynb")
    n = sub.add_parser("new", help="write notebooks/STEM.ipynb from the skeleton")
    n.add_argument("stem", help="file name without .ipynb, e.g. 04_zero_and_fsdp")
    n.add_argument("title")
    args = p.parse_args(argv)

    if args.cmd == "new":
        path = ROOT / "notebooks" / f"{args.stem}.ipynb"
        if path.exists():
            print(f"{path} exists; not overwriting it", file=sys.stderr)
            return 1
        nbformat.write(skeleton(args.stem, args.title), path)
        print(f"wrote {path.relative_to(ROOT)}")
        return 0
    paths = [p.resolve() for p in getattr(args, "paths", [])] or (
        course_notebooks() if args.cmd == "clear" else sorted(ROOT.glob("notebooks/*.ipynb")))
    bad = 0
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if args.cmd == "clear" and args.check:
            for problem in dirt(nb):
                print(f"{_shown(path)}: {problem}")
                bad = 1
            continue
        changed = clear(nb) if args.cmd == "clear" else sync(nb, path.relative_to(ROOT).as_posix())
        if changed:
            nbformat.write(nb, path)
            print(f"{args.cmd}: {_shown(path)}")
    if args.cmd == "clear" and args.check and bad:
        print("run `make notebooks-clear` (python tools/notebooks.py clear) and commit again", file=sys.stderr)
    return bad


if __name__ == "__main__":
    sys.exit(main())
