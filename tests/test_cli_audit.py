"""``course`` as a user meets it: ``--version``, and bad input refused in one line before any work.

    python -m pytest tests/test_cli_audit.py

Each test runs the command as a user would (a subprocess) or calls its main with argv.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.analysis import memory_cli
from course_lib.gpt.sample import cli as sample_cli
from course_lib.notebook import book

ROOT = Path(__file__).resolve().parents[1]


def _course(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "course_lib.cli", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_is_the_one_in_pyproject(flag):
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)[1]
    proc = _course(flag)
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, f"course {version}", "")


@pytest.mark.timeout(60)
def test_usage_names_the_version_flag():
    assert "--version" in _course("--help").stdout


@pytest.mark.timeout(60)
def test_book_lesson_into_a_file_is_refused_before_a_kernel_starts(tmp_path):
    lesson = tmp_path / "tiny.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")]), lesson)
    out = tmp_path / "not_a_folder"
    out.write_text("keep me\n")
    proc = subprocess.run([sys.executable, "-m", "course_lib.notebook.book", "--lesson", str(lesson),
                           "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Kernel" not in proc.stderr  # no kernel was started
    assert f"--out {out} is a file" in proc.stderr.splitlines()[-1]
    assert out.read_text() == "keep me\n"


@pytest.mark.timeout(30)
def test_book_build_into_a_file_is_refused_before_any_lesson_runs(tmp_path, monkeypatch, capsys):
    out = tmp_path / "not_a_folder"
    out.write_text("")

    def build_book(*args, **kwargs):  # would execute every lesson (minutes) before failing
        raise AssertionError("build_book started although --out is a file")

    monkeypatch.setattr(book, "build_book", build_book)
    with pytest.raises(SystemExit) as e:
        book.main(["--smoke", "--out", str(out)])
    assert e.value.code == 2
    assert f"--out {out} is a file" in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv", [["--params", "inf"], ["--params", "1e400"], ["--params", "1e9", "--k", "inf"]])
def test_memory_refuses_an_infinite_number(argv, capsys):
    with pytest.raises(SystemExit) as e:
        memory_cli.cli(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "must be a finite number" in captured.err


@pytest.mark.timeout(30)
def test_memory_still_names_a_number_it_cannot_read(capsys):
    with pytest.raises(SystemExit) as e:
        memory_cli.cli(["--params", "abc"])
    assert e.value.code == 2
    assert "argument --params: invalid float value: 'abc'" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [["--num_samples", "0"], ["--max_new_tokens", "-3"], ["--temperature", "-1"],
                                 ["--top_k", "-2"], ["--seed", "-1"]])
def test_sample_names_a_bad_number_as_a_usage_error(tmp_path, capsys, bad):
    """They exited 1 (a failure) after looking for the checkpoint; a wrong argument is a usage error, 2."""
    with pytest.raises(SystemExit) as e:
        sample_cli(["--out_dir", str(tmp_path / "no-run"), *bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert bad[0].lstrip("-") in err and "no-run" not in err  # the argument, not the missing run


def test_sample_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        sample_cli(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, says in (("--ckpt", "lowest validation loss"), ("--num_samples", "how many texts"),
                         ("--max_new_tokens", "tokens generated"), ("--temperature", "sharpens"),
                         ("--seed", "the same texts"), ("--device", "auto, cpu, cuda or cuda:N")):
        assert option in text and says in text, option


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [["data", "prepare", "--help"], ["exercises", "publish", "--help"],
                                  ["exercises", "new", "--help"], ["exercises", "check", "--help"]])
def test_every_argument_of_these_commands_is_explained(argv):
    """Their positional arguments and --root came with no help text at all."""
    out = _course(*argv).stdout
    listed = re.findall(r"^  (\S+)(?:  +|\n)", out, flags=re.M)  # argparse's argument column
    assert listed, out
    blank = [a for a in listed if re.search(rf"^  {re.escape(a)}\s*$", out, flags=re.M)
             and not re.search(rf"^  {re.escape(a)}\n {{10,}}\S", out, flags=re.M)]
    assert not blank, (blank, out)
