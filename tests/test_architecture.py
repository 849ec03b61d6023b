"""The architecture in the folders (issue 10): no import cycle, a small top level, package docstrings
that name their modules, and entry points that start without torch. (A file's size follows its
idea: the hard 300-line cap of issue 10 was dropped in issue 30.)

The import graph is read with ``ast`` from the source, so it sees every import, also those inside
functions and under ``if TYPE_CHECKING``: ``import course_lib.a.b`` and ``from course_lib.a import b``
(b a module) are edges to ``course_lib.a.b``; ``from course_lib.a import name`` is an edge to the
package ``course_lib.a``. Importing ``a.b`` also runs ``a/__init__``, but that is not counted: a
package whose ``__init__`` re-exports its modules would otherwise be a cycle with each of them.
Modules named in strings and imported on demand (the strategy registry, the ``course`` command
table, ``course_lib.launch``'s lazy names) are not import statements and are not edges.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "course_lib"
MAX_TOP_LEVEL_MODULES = 5


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / "course_lib").rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The course_lib modules that ``name`` (source file ``path``) imports, anywhere in the file."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y, from .. import z
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in modules else source)
    return {t for t in targets if t in modules and t != name}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = all_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (Tarjan 1972); returns the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component (breadth first)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def test_graph_reader_sees_every_kind_of_import(tmp_path):
    # A check that could miss imports would pass on anything: run it on a made-up package first.
    pkg = tmp_path / "course_lib"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from course_lib.sub import b  # a module, inside a function\n",
        "sub/__init__.py": "from .c import name\n",
        "sub/b.py": "import course_lib.sub.c\n",
        "sub/c.py": "from .. import a\nname = 1\n",
        "d.py": "from course_lib.sub import name\nimport os\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert graph == {
        "course_lib": set(),
        "course_lib.a": {"course_lib.sub.b"},
        "course_lib.sub": {"course_lib.sub.c"},
        "course_lib.sub.b": {"course_lib.sub.c"},
        "course_lib.sub.c": {"course_lib.a"},
        "course_lib.d": {"course_lib.sub"},
    }
    (component,) = strongly_connected(graph)
    assert component == ["course_lib.a", "course_lib.sub.b", "course_lib.sub.c"]
    assert one_cycle(graph, component) == [
        "course_lib.a", "course_lib.sub.b", "course_lib.sub.c", "course_lib.a"]


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # it read the real package
    cycles = [" -> ".join(one_cycle(graph, c)) for c in strongly_connected(graph)]
    print("\n".join(["import cycles:"] + cycles) if cycles else "no import cycle")
    assert not cycles, "import cycles (function-level imports included):\n  " + "\n  ".join(cycles)


# What the entry points a student meets first must not load (seconds of import each): the package,
# the launcher every rank imports, ``course --help`` and the torch-free commands.
LIGHT_ENTRY_POINTS = {
    "import course_lib": "import course_lib",
    "import course_lib.launch": "import course_lib.launch",
    "course --help": "from course_lib.cli import main; main(['--help'])",
    "course memory": "import course_lib.analysis.memory_cli",
    "course images": "import course_lib.notebook.diagrams_build",
    "course pram": "import course_lib.pram.cli",
    "course submit": "import course_lib.launch.cluster",
    "course info": "import course_lib.hardware",
    "course bench": "import course_lib.experiments.comm_bench",
    "course check-gpu": "import course_lib.experiments.gpu_check",  # torch once a step runs
}
HEAVY = ("torch", "matplotlib", "pandas", "ipywidgets")


@pytest.mark.parametrize("entry", LIGHT_ENTRY_POINTS)
def test_entry_point_imports_no_heavy_library(entry):
    check = f"{LIGHT_ENTRY_POINTS[entry]}; import sys; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.splitlines()[-1] == "[]", f"{entry} loads {out.stdout.splitlines()[-1]}"


def test_top_level_is_small():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    print("top-level modules:", modules)
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, f"course_lib/ holds {len(modules)} modules: {modules}"


def packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


@pytest.mark.parametrize("package", packages(), ids=lambda p: module_name(p / "__init__.py"))
def test_package_docstring_names_its_modules(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    assert doc, f"{package / '__init__.py'} has no docstring"
    words = set(doc.replace(".", " ").replace(",", " ").replace("(", " ").replace(")", " ")
                .replace(":", " ").replace("`", " ").split())
    members = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
    members += [p.parent.name for p in package.glob("*/__init__.py")]
    missing = sorted(m for m in members if m not in words)
    assert not missing, f"the docstring of {module_name(package / '__init__.py')} does not name {missing}"


def test_runnable_modules_start_with_their_command():
    """A file with a ``__main__`` block says first how to run it, as nanoGPT's scripts do: a module of
    course_lib ``python -m`` (or torchrun, mpiexec) naming it, or the ``course`` command behind it; a
    script of benchmarks/ or tools/ ``python`` and its path."""
    scripts = {str(p.relative_to(ROOT)): p for folder in ("benchmarks", "tools")
               for p in sorted((ROOT / folder).glob("*.py"))}
    runnable = {name: path for name, path in {**all_modules(), **scripts}.items()
                if '__name__ == "__main__"' in path.read_text()}
    assert len(runnable) >= 15
    wrong = {}
    for name, path in runnable.items():
        first = [line.lstrip("`") for line in (ast.get_docstring(ast.parse(path.read_text())) or "").splitlines()[:1]]
        if not first or not (name in first[0] or first[0].startswith("course ")):
            wrong[name] = first
    assert not wrong, f"runnable files whose docstring does not start with their command: {wrong}"


def readme_tree(text: str) -> set[str]:
    """Paths in the README's module tree: lines such as ``│   ├── model.py  what it holds``, four
    characters of indentation per level below ``course_lib/``."""
    section = text.split("## Module map", 1)[1]
    block = section.split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines():
        m = re.match(r"^((?:│   |    )*)(?:├── |└── )(\S+)", line)
        if not m:
            continue
        depth, name = len(m.group(1)) // 4, m.group(2)
        stack[depth:] = [name.rstrip("/")]
        paths.add("/".join(stack) + ("/" if name.endswith("/") else ""))
    return paths


def test_readme_tree_matches_the_folders():
    listed = readme_tree((ROOT / "README.md").read_text())
    actual = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
              if not (p.name == "__init__.py" and p.parent != PACKAGE)}
    actual |= {f"{p.parent.relative_to(PACKAGE)}/" for p in PACKAGE.rglob("*/__init__.py")}
    assert len(listed) > 50
    assert listed == actual, (f"README module tree: missing {sorted(actual - listed)}, "
                              f"not in course_lib {sorted(listed - actual)}")

