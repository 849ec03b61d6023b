"""One home per fact: the process group is made in one function, config.json written in one method.
A copy elsewhere in course_lib fails this test (read with ast: calls, not text)."""

from __future__ import annotations

import ast
from pathlib import Path

import course_lib

PACKAGE = Path(course_lib.__file__).parent


def _calls(attr: str) -> dict[str, int]:
    """module path -> how many calls of ``*.attr(...)`` or ``attr(...)`` it makes."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name == attr:
                    rel = path.relative_to(PACKAGE).as_posix()
                    found[rel] = found.get(rel, 0) + 1
    return found


def test_one_init_process_group():
    calls = _calls("init_process_group")
    direct = {p for p in calls if "dist.init_process_group(" in (PACKAGE / p).read_text()}
    assert direct == {"utils.py"}, f"torch's init_process_group called outside course_lib.utils: {direct - {'utils.py'}}"
    assert len(calls) >= 6  # its callers: the trainer, torchrun's bootstrap, the local ranks, the pool, ...


def test_one_writer_of_config_json():
    writers = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if '"config.json"' in p.read_text() and ("atomic_write" in p.read_text() or "write_text" in p.read_text())]
    assert writers == ["trainer/config.py"], f"config.json written outside TrainConfig.save: {writers}"
    assert set(_calls("save")) >= {"trainer/metrics.py", "launch/training.py"}  # the two moments it is written


# ------------------------------------------------------------------ each public name defined once

# The public names defined in more than one module on purpose (at most 5): name -> its modules. Each
# definition outside the first module says "convention" in a comment on its line or just above it.
CONVENTIONS = {
    # grader's copy: exercises.grading gives the exercises' tests the names the lessons taught, from
    # fresh copies of their modules (a cell that patched the original cannot change a grade)
    "run_ranks": ("launch/spawn.py", "exercises/grading.py"),
    "p2p_only": ("exercises/p2p.py", "exercises/grading.py"),
}
ENTRY_NAMES = {"main", "cli", "register", "__all__"}  # each command's module has its own


def public_definitions(package: Path = PACKAGE) -> dict[str, list[tuple[str, int]]]:
    """name -> [(module path, line)] for every public top-level def, class or assignment (an import,
    re-export included, is no definition). The generated copies under ``_course`` are skipped."""
    found: dict[str, list[tuple[str, int]]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith("_"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                continue
            lineno = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            for name in names:
                if not name.startswith("_") and name not in ENTRY_NAMES:
                    found.setdefault(name, []).append((rel, lineno))
    return found


def second_definitions(package: Path = PACKAGE, conventions: dict = CONVENTIONS) -> list[str]:
    problems = []
    for name, where in sorted(public_definitions(package).items()):
        modules = tuple(rel for rel, _ in where)
        if len(modules) < 2:
            continue
        if set(modules) != set(conventions.get(name, ())):
            problems.append(f"{name} is defined in {', '.join(modules)}: keep one home and import it, "
                            "or give each thing its own name")
            continue
        for rel, lineno in where:
            if rel == conventions[name][0]:  # the home
                continue
            lines = (package / rel).read_text().splitlines()
            above = lines[max(0, lineno - 3):lineno]
            if not any("convention" in line for line in above):
                problems.append(f"{rel}:{lineno} defines {name} again without a comment naming its convention")
    return problems


def test_each_public_name_is_defined_once():
    assert len(CONVENTIONS) <= 5
    problems = second_definitions()
    assert not problems, "\n".join(problems)


def test_one_way_to_run_a_function_on_n_local_ranks_has_one_signature():
    """Issue 30 item 2: run_ranks(fn, nproc, *args), fn(rank, world_size, *args), in the library and
    in the grader's copy alike (its keywords a subset: the grader fixes the backend and threads)."""
    import inspect

    from course_lib.exercises import grading
    from course_lib.launch import spawn

    ours, graders = inspect.signature(spawn.run_ranks), inspect.signature(grading.run_ranks)
    positional = [(p.name, p.kind) for p in ours.parameters.values() if p.kind != p.KEYWORD_ONLY]
    assert positional == [(p.name, p.kind) for p in graders.parameters.values() if p.kind != p.KEYWORD_ONLY]
    assert [name for name, _ in positional] == ["fn", "nproc", "args"]
    assert {n for n, p in graders.parameters.items() if p.kind == p.KEYWORD_ONLY} <= set(ours.parameters)


def test_the_check_sees_a_second_definition(tmp_path):
    pkg = tmp_path / "course_lib"
    (pkg / "gpt").mkdir(parents=True)
    (pkg / "analysis").mkdir()
    (pkg / "_course").mkdir()
    (pkg / "analysis" / "memory.py").write_text("GB = 1e9\ndef main(): pass\n_x = 1\n")
    (pkg / "gpt" / "model.py").write_text("from course_lib.analysis.memory import GB\ndef main(): pass\n_x = 2\n")
    (pkg / "_course" / "copy.py").write_text("GB = 1e9\n")  # a generated copy: not counted
    assert second_definitions(pkg) == []  # an import is no second definition, nor main, nor _x
    (pkg / "gpt" / "model.py").write_text("GB: float = 1e9\n")
    (problem,) = second_definitions(pkg)
    assert problem.startswith("GB is defined in analysis/memory.py, gpt/model.py: keep one home")
    conventions = {"GB": ("analysis/memory.py", "gpt/model.py")}
    (problem,) = second_definitions(pkg, conventions)
    assert problem == "gpt/model.py:1 defines GB again without a comment naming its convention"
    (pkg / "gpt" / "model.py").write_text("# convention: the paper's unit, here too\nGB: float = 1e9\n")
    assert second_definitions(pkg, conventions) == []


# ------------------------------------------------------------------ the count rule in one place

# Where the rule "a whole number, not a bool" is still written out, and why: an upper bound too
# (a range, not a count), a message that names the other choice ('auto'), or the PRAM simulator's
# messages, which the exercises' tests quote.
OWN_COUNT_RULE = {"utils.py": "check_count itself", "exercises/grading.py": "1 to MAX_RANKS",
                  "launch/rank_pool.py": "1 to 64 ranks", "launch/placement.py": "a number or 'auto'",
                  "pram/algorithms.py": "PRAM wording", "pram/allreduce.py": "PRAM wording"}


def _spells_out_the_count_rule(node) -> bool:
    """``isinstance(x, bool) or not isinstance(x, int) ...``: check_count's rule, written again."""
    if not (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or)):
        return False
    calls = [v.operand if isinstance(v, ast.UnaryOp) else v for v in node.values]
    kinds = {c.args[1].id for c in calls if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "isinstance"
             and len(c.args) == 2 and isinstance(c.args[1], ast.Name)}
    return {"bool", "int"} <= kinds


def test_counts_are_checked_by_check_count():
    spelled = sorted({path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                      for node in ast.walk(ast.parse(path.read_text())) if _spells_out_the_count_rule(node)})
    extra = sorted(set(spelled) - set(OWN_COUNT_RULE))
    assert set(spelled) == set(OWN_COUNT_RULE), f"use course_lib.utils.check_count in {extra}"
