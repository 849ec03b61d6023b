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
    assert writers == ["gpt/config.py"], f"config.json written outside TrainConfig.save: {writers}"
    assert set(_calls("save")) >= {"trainer/metrics.py", "launch/training.py"}  # the two moments it is written
