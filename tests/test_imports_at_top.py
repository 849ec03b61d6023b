"""Imports stay at the top of a file unless a comment says why they cannot (issue 30, item 5).

An import inside a function (read with ``ast``; a nested function's imports count for it) must
have a comment on its own line, on another import of its block, or on the line just above the
block. A block is a run of import statements inside one function, blank lines between them
allowed: one comment may explain the torch imports and the course_lib modules that need torch
together. The generated copies under ``course_lib/_course`` are skipped.
"""

from __future__ import annotations

import ast
from pathlib import Path

import course_lib

PACKAGE = Path(course_lib.__file__).parent


def _function_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return list({id(n): n for n in found}.values())  # a nested function's imports are walked twice


def unexplained_imports(package: Path = PACKAGE) -> list[str]:
    """``path:line: statement`` of each in-function import that no comment explains."""
    problems = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith("_"):
            continue
        text = path.read_text()
        lines = text.splitlines()
        imports = _function_imports(ast.parse(text))
        import_lines = {i for n in imports for i in range(n.lineno - 1, n.end_lineno)}
        is_import = import_lines.__contains__

        for node in imports:
            first, last = node.lineno - 1, node.end_lineno - 1
            while first > 0 and (is_import(first - 1) or (not lines[first - 1].strip() and is_import(first - 2))):
                first -= 1
            while last + 1 < len(lines) and (is_import(last + 1)
                                             or (not lines[last + 1].strip() and is_import(last + 2))):
                last += 1
            block = [lines[i] for i in range(first, last + 1) if is_import(i)]
            if not any("#" in line for line in block) and not lines[first - 1].lstrip().startswith("#"):
                problems.append(f"{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return problems


def test_every_import_inside_a_function_says_why():
    problems = unexplained_imports()
    assert not problems, ("imports inside functions without a comment saying why they are not at the top "
                          "of the file (move them up, or say why they cannot be):\n  " + "\n  ".join(problems))


def test_the_check_sees_an_unexplained_import(tmp_path):
    pkg = tmp_path / "course_lib"
    pkg.mkdir()
    (pkg / "_course").mkdir()
    (pkg / "_course" / "copy.py").write_text("def f():\n    import json\n")  # generated: skipped
    (pkg / "ok.py").write_text(
        "import os\n\n\n"
        "def f():\n"
        "    # torch here: `course --help` must not import it\n"
        "    import torch\n\n"
        "    from course_lib.parallel.data import ring\n"  # the same block: explained by the comment above
        "    return torch, ring\n\n\n"
        "def g():\n"
        "    import pandas as pd  # optional here\n"
        "    return pd\n")
    assert unexplained_imports(pkg) == []
    (pkg / "bad.py").write_text(
        "def f():\n"
        "    x = 1  # a comment that is not about the import\n"
        "    import json\n"
        "    return json, x\n\n\n"
        "def g():\n"
        "    def inner():\n"
        "        from pathlib import Path\n"
        "        return Path\n"
        "    return inner\n")
    assert unexplained_imports(pkg) == ["bad.py:3: import json", "bad.py:9: from pathlib import Path"]
