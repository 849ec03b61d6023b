"""``python -m course_lib.notebook.book --lesson``: which notebook a name means, and a bad one refused.

    python -m pytest tests/test_book_cli.py

Without a browser (test_book.py, the website itself, needs Chromium and is marked slow).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from course_lib.notebook import book

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


def test_lesson_is_found_by_path_name_or_number_and_a_bad_one_is_refused(tmp_path, capsys):
    lesson = ROOT / "notebooks" / f"{LESSONS[3]}.ipynb"
    for name in (str(lesson), lesson.name, lesson.stem, lesson.stem[:2], str(int(lesson.stem[:2]))):
        assert book.find_lesson(name, ROOT) == lesson, name
    with pytest.raises(SystemExit) as e:  # an argparse error, before any kernel starts
        book.main(["--lesson", "99_nothing", "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--lesson 99_nothing: no such notebook; give a path, or one of: " in err and LESSONS[3] in err
    assert not any(tmp_path.iterdir())


def test_times_without_an_executed_book_says_what_to_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        book.main(["--times", "--smoke", "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"no lesson executed into {tmp_path / 'executed' / 'smoke'} yet" in err
    assert "(python -m course_lib.notebook.book --smoke)" in err
    cache = tmp_path / "executed" / "smoke"
    cache.mkdir(parents=True)
    (cache / "times.json").write_text('{"01_setup.ipynb": {"seconds": 90, "when": "2026-11-27 16:00"}}')
    assert book.main(["--times", "--smoke", "--out", str(tmp_path)]) == 0
    assert "| `01_setup.ipynb` | 1.5 | 2026-11-27 16:00 |" in capsys.readouterr().out
