"""The course notebooks: committed clean, links intact, no copied library code, lesson structure,
and the Colab setup cell.

    python -m pytest tests/test_notebooks.py                 # static checks (seconds)
    python -m pytest tests/test_colab_wheel.py               # every lesson run top to bottom

Running the lessons lives in tests/test_colab_wheel.py: each notebook runs there in smoke mode
from the installed wheel, as on Colab, which proves both that it runs and that it needs no clone.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import textwrap
from pathlib import Path
from urllib.parse import unquote, urlparse

import nbformat
import pytest

from course_lib import utils
from course_lib.notebook import smoke
from course_lib.utils import repo_root

ROOT = repo_root()
NOTEBOOKS_DIR = ROOT / "notebooks"

_spec = importlib.util.spec_from_file_location("course_notebook_tools", ROOT / "tools" / "notebooks.py")
nbtools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nbtools)

LESSONS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
ALL = nbtools.course_notebooks(ROOT)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _read(path: Path):
    return nbformat.read(path, as_version=4)


# ------------------------------------------------------------------ (a) committed without outputs

@pytest.mark.parametrize("path", ALL, ids=_rel)
def test_committed_without_outputs(path):
    nb = _read(path)
    nbformat.validate(nb)
    assert nbtools.dirt(nb) == [], f"{_rel(path)}: run `make notebooks-clear` before committing"


def test_clear_tool_strips_a_run_notebook(tmp_path):
    nb = nbtools.skeleton("99_x", "X")
    nb.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    nb.cells[3].execution_count = 4
    nb.cells[3].metadata["execution"] = {"iopub.execute_input": "2024-01-01T00:00:00"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    path = tmp_path / "x.ipynb"
    nbformat.write(nb, path)
    assert len(nbtools.dirt(nb)) == 3
    assert nbtools.main(["clear", "--check", str(path)]) == 1
    assert nbtools.main(["clear", str(path)]) == 0
    cleaned = _read(path)
    assert nbtools.dirt(cleaned) == [] and cleaned.cells[3].source == nb.cells[3].source
    assert nbtools.main(["clear", "--check", str(path)]) == 0


# ------------------------------------------------------------------ (b) every referenced file exists

MD_TARGET = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_TARGET = re.compile(r"""<(?:img|a|source|video)\b[^>]*?\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
SHOW_CALL = re.compile(r"""diagrams\.(?:show|diagram|mermaid_source)\(\s*["']([\w-]+)["']""")


def missing_references(nb, folder: Path) -> list[str]:
    """Local files that markdown links/images or diagrams.show(...) calls name but that do not exist."""
    from course_lib.notebook import diagrams

    missing = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            for target in MD_TARGET.findall(cell.source) + HTML_TARGET.findall(cell.source):
                url = urlparse(target)
                if url.scheme or url.netloc or not url.path:  # web links, mailto:, data:, #anchors
                    continue
                if url.path.startswith("/"):
                    missing.append(f"cell {i}: {target} is absolute; use a path relative to the notebook")
                elif not (folder / unquote(url.path)).exists():
                    missing.append(f"cell {i}: {target} does not exist")
        elif cell.cell_type == "code":
            for name in SHOW_CALL.findall(cell.source):
                if name not in diagrams.names(ROOT):
                    missing.append(f"cell {i}: no diagram {name!r} in images/diagrams/")
    return missing


@pytest.mark.parametrize("path", ALL, ids=_rel)
def test_referenced_files_exist(path):
    assert missing_references(_read(path), path.parent) == []


def test_reference_check_finds_broken_links(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(
        "![ok](../images/diagrams/rendered/dp_step.svg) ![gone](img/nope.png) [web](https://example.org/x.png)\n"
        '[next](02_missing.ipynb#part) [top](#top) <img src="../images/none.svg"/> ![abs](/etc/hosts)'),
        nbformat.v4.new_code_cell('diagrams.show("dp_step")\ndiagrams.show("no_such_diagram")')]
    found = "\n".join(missing_references(nb, NOTEBOOKS_DIR))
    for bad in ("img/nope.png", "02_missing.ipynb#part", "../images/none.svg", "/etc/hosts", "'no_such_diagram'"):
        assert bad in found
    assert "dp_step.svg" not in found and "example.org" not in found and "'dp_step'" not in found


# ------------------------------------------------------------------ (c) no copied library functions

MIN_BODY_NODES = 12  # bodies smaller than this (one-line wrappers) are too common to call copies


def _body_key(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """A function body with docstring, formatting and local names abstracted away, or None if tiny.

    Parameters and names assigned in the body become v0, v1, ... in order of first appearance,
    so a copy with renamed variables still matches; attribute and global names stay, so two
    functions calling different APIs do not.
    """
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    module = ast.Module(body=body, type_ignores=[])
    if sum(1 for _ in ast.walk(module)) < MIN_BODY_NODES:
        return None
    local = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg) if a]
    local += [n.id for n in ast.walk(module) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    rename = {name: f"v{i}" for i, name in enumerate(dict.fromkeys(local))}
    for node in ast.walk(module):
        if isinstance(node, ast.Name) and node.id in rename:
            node.id = rename[node.id]
        elif isinstance(node, ast.arg) and node.arg in rename:
            node.arg = rename[node.arg]
    return ast.dump(module, annotate_fields=False, include_attributes=False)


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def library_bodies() -> dict[str, str]:
    """Normalised body -> 'module.function' for every function and method in course_lib."""
    bodies = {}
    for path in sorted((ROOT / "course_lib").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for fn in _functions(ast.parse(path.read_text(encoding="utf-8"))):
            key = _body_key(fn)
            if key is not None:
                bodies.setdefault(key, f"{module}.{fn.name}")
    return bodies


def cell_python(source: str) -> str:
    """A cell's code as plain Python (IPython's %magics and !shell lines translated)."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def copied_functions(nb, bodies: dict[str, str]) -> list[str]:
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or cell.source.lstrip().startswith("%%"):  # cell magics: not Python
            continue
        for fn in _functions(ast.parse(cell_python(cell.source))):
            key = _body_key(fn)
            if key in bodies:
                found.append(f"cell {i} defines {fn.name}(), a copy of {bodies[key]}: call it, and show it "
                              "with inspect.getsource, instead of copying it")
    return found


@pytest.fixture(scope="module")
def bodies():
    return library_bodies()


@pytest.mark.parametrize("path", LESSONS, ids=_rel)
def test_no_copied_library_functions(path, bodies):
    assert copied_functions(_read(path), bodies) == []


def test_copy_detector_catches_a_renamed_copy(bodies):
    from course_lib import utils

    src = textwrap.dedent(inspect.getsource(utils.free_port))
    copy = (src.replace("def free_port(host", "def my_port(address").replace("host", "address")
               .replace(" s:", " sock:").replace("s.", "sock.").replace('"""Return a TCP', '"""My own TCP'))
    assert "free_port" not in copy and "sock.bind" in copy
    different = copy.replace("return sock.getsockname()[1]", "return sock.getsockname()[0]")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import socket\n%matplotlib inline\n" + copy),
                nbformat.v4.new_code_cell(different),
                nbformat.v4.new_code_cell("def tiny(x):\n    return x")]
    found = copied_functions(nb, bodies)
    assert len(found) == 1 and "cell 0 defines my_port(), a copy of course_lib.utils.free_port" in found[0]


# ------------------------------------------------------------------ (e) lesson structure

def _section(cell, title: str) -> str | None:
    """The text from a '## Title' heading or a bold '**Title**' lead-in on, if the cell has one."""
    if cell.cell_type != "markdown":
        return None
    m = re.search(rf"^(?:#+\s*|\*\*){title}\b", cell.source, re.MULTILINE | re.IGNORECASE)
    return cell.source[m.start():] if m else None


@pytest.mark.parametrize("path", LESSONS, ids=_rel)
def test_lesson_structure(path):
    nb = _read(path)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith(utils.colab_badge(_rel(path))), \
        "the first cell starts with the Colab badge: python tools/notebooks.py sync"
    assert re.search(r"^# \S", first.source, re.MULTILINE), "the first cell has the notebook's title (# ...)"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and code[0].source == smoke.colab_setup_cell(), \
        "the first code cell is the Colab setup cell: python tools/notebooks.py sync"
    goals = [g for g in (_section(c, "Learning goals") for c in nb.cells[:4]) if g]
    assert goals and len(re.findall(r"^\s*(?:[-*]|\d+\.)\s+\S", goals[0], re.MULTILINE)) >= 2, \
        "'## Learning goals' (or '**Learning goals**') with a list, in the first four cells"
    summary = [s for s in (_section(c, "Summary") for c in nb.cells[-2:]) if s]
    assert summary and len(summary[0].split()) >= 20, "a '## Summary' (or '**Summary**') in the last two cells"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


def _run_setup_cell(source: str) -> list[tuple[str, str]]:
    """Run a setup cell with a shell that records its line magics, expanding {variables} as IPython does."""
    from IPython.utils.text import DollarFormatter

    calls, namespace = [], {}

    class FakeShell:
        def run_line_magic(self, name, line):
            calls.append((name, DollarFormatter().vformat(line, args=[], kwargs=namespace)))

    namespace["get_ipython"] = FakeShell
    exec(compile(cell_python(source), "<setup cell>", "exec"), namespace)  # noqa: S102 - our own generated cell
    return calls


def test_setup_cell_installs_on_colab_only(monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    monkeypatch.delenv("COURSE_INSTALL_SPEC", raising=False)
    assert _run_setup_cell(smoke.colab_setup_cell()) == []
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab-test")
    assert _run_setup_cell(smoke.colab_setup_cell()) == [("pip", f'install --quiet "{utils.install_spec()}"')]
    # the colab extra: MPICH (Colab has no MPI, and %%mpirun needs the wheel's mpiexec) and otter-grader
    assert utils.install_spec(repo="o/r", branch="b") == "course-lib[colab] @ git+https://github.com/o/r@b"
    # a fork or a mirror: the environment variable, or an edit of the one line that names the spec
    mirror = "course-lib[colab] @ git+https://git.example.org/me/course.git@v2"
    monkeypatch.setenv("COURSE_INSTALL_SPEC", mirror)
    assert _run_setup_cell(smoke.colab_setup_cell()) == [("pip", f'install --quiet "{mirror}"')]
    monkeypatch.delenv("COURSE_INSTALL_SPEC")
    edited = smoke.colab_setup_cell().replace(utils.install_spec(), "course-lib==0.1.0")
    assert sum(utils.install_spec() in line for line in smoke.colab_setup_cell().splitlines()) == 1
    assert _run_setup_cell(edited) == [("pip", 'install --quiet "course-lib==0.1.0"')]


def test_exercise_setup_cells_share_the_install_spec():
    from course_lib import exercises

    lines = utils.colab_install_lines(then=("from course_lib.exercises import fetch_student_tests",
                                            'fetch_student_tests("01_collectives")'))
    assert lines in exercises.exercise_setup_cell("01_collectives")
    assert utils.colab_install_lines() in smoke.colab_setup_cell()


def test_sync_rewrites_badge_and_setup_cell():
    nb = nbtools.skeleton("01_x", "X")
    nb.cells[0].source = nb.cells[0].source.replace(utils.colab_badge("notebooks/01_x.ipynb"),
                                                    utils.colab_badge("notebooks/01_x.ipynb", repo="old/name"))
    nb.cells[2].source = "print('old setup')"
    assert nbtools.sync(nb, "notebooks/01_x.ipynb") is True
    assert nb.cells[0].source.startswith(utils.colab_badge("notebooks/01_x.ipynb")) and "old/name" not in nb.cells[0].source
    assert nb.cells[2].source == smoke.colab_setup_cell()
    assert nbtools.sync(nb, "notebooks/01_x.ipynb") is False


def test_smoke_switch(monkeypatch):
    monkeypatch.delenv("COURSE_SMOKE", raising=False)
    assert smoke.smoke_or(1000, 10) == 1000 and not smoke.is_smoke()
    for on in ("1", "true", "YES", " on "):
        assert smoke.smoke_or(1000, 10, {"COURSE_SMOKE": on}) == 10
    for off in ("", "0", "false", "no", "off"):
        assert smoke.smoke_or(1000, 10, {"COURSE_SMOKE": off}) == 1000
    monkeypatch.setenv("COURSE_SMOKE", "1")
    assert smoke.is_smoke() and smoke.smoke_or("full", "small") == "small"
    monkeypatch.setenv("COURSE_SMOKE", "2")
    with pytest.raises(ValueError, match="COURSE_SMOKE='2'.*set it to 1"):
        smoke.smoke_or(1, 2)
    assert utils.colab_url("notebooks/01_a.ipynb").endswith("/blob/main/notebooks/01_a.ipynb")
    for bad in ("../x.ipynb", "/abs/x.ipynb", "notebooks/x.py"):
        with pytest.raises(ValueError, match="path inside the repository"):
            utils.colab_url(bad)
