"""``course pram ALGORITHM --n N --model MODEL [--json]``: counts, violations, bad input."""

import json
import subprocess
import sys

import pytest

from course_lib import cli as course_cli
from course_lib.pram.cli import cli


def _json(capsys, argv):
    assert cli(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_json_counts_of_textbook_algorithms(capsys):
    out = _json(capsys, ["tree-sum", "--n", "1024", "--model", "EREW", "--json"])
    assert (out["steps"], out["work"], out["processors"]) == (10, 1023, 512)
    assert out["correct"] and out["model"] == "EREW" and out["ops"] == {"add": 1023}
    out = _json(capsys, ["prefix-hillis-steele", "--n", "8", "--model", "CREW", "--json"])
    assert (out["steps"], out["work"]) == (3, 17)
    out = _json(capsys, ["max-crcw", "--n", "8", "--model", "CRCW-common", "--json"])
    assert (out["steps"], out["processors"]) == (3, 64)
    out = _json(capsys, ["matmul", "--n", "4", "--json"])   # default model: CREW
    assert (out["model"], out["steps"], out["processors"]) == ("CREW", 3, 64)


def test_text_output_table_and_classification(capsys):
    assert cli(["broadcast-erew", "--n", "8", "--table", "--classify"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("broadcast-erew, n=8, EREW: 3 steps, work 7 (copy: 7), 8 processors")
    assert "weakest model: EREW." in out and "total" in out
    out = _json(capsys, ["or-crcw", "--n", "8", "--model", "CRCW-max", "--classify", "--json"])
    assert out["weakest_model"] == "CRCW-common" and "Weaker models fail: EREW" in out["reason"]


def test_a_model_that_runs_but_computes_something_else_exits_1(capsys):
    # the sum rule counts the ones instead of OR-ing them
    assert cli(["or-crcw", "--n", "8", "--model", "CRCW-sum"]) == 1
    assert "or-crcw gives a wrong result on CRCW-sum: R[0] is 4, expected 1" in (
        capsys.readouterr().err)


def test_violation_exits_1_with_the_message(capsys):
    assert cli(["max-crcw", "--n", "8", "--model", "CREW"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("course pram: CREW: processors 1, 2, 5, 6 and 7 wrote address 8 at "
                          "step 1 (M[0])")
    assert cli(["prefix-hillis-steele", "--n", "8", "--model", "erew", "--json"]) == 1
    assert "EREW: processors 1 and 2 read address 1 at step 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["tree-sum", "--n", "12"], "tree-sum needs n to be a power of two, got n=12; try n=8 or "
                                "n=16"),
    (["matmul", "--n", "0"], "matmul: n must be a positive integer, got 0"),
    (["quick-sort"], "unknown PRAM algorithm 'quick-sort'; choose one of: tree-sum,"),
    (["tree-sum", "--model", "QRQW"], "unknown PRAM model 'QRQW'; choose one of: EREW, CREW, "
                                      "CRCW-common, CRCW-arbitrary, CRCW-priority, CRCW-sum"),
    (["matmul", "--n", "128"], "matmul with n=128 needs 2,097,152 processors, more than the "
                               "1,048,576 allowed"),
    (["max-crcw", "--n", "8", "--max-processors", "32"], "needs 64 processors, more than the 32"),
])
def test_bad_input_exits_2_before_running(capsys, argv, message):
    assert cli(argv) == 2
    assert message in capsys.readouterr().err


def test_help_lists_algorithms_and_models(capsys):
    assert course_cli.main(["pram", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: course pram")
    for name in ("tree-sum", "prefix-hillis-steele", "prefix-blelloch", "max-crcw", "or-crcw",
                 "matmul", "broadcast-crew", "broadcast-erew", "step-table", "EREW", "CREW",
                 "CRCW-common", "CRCW-arbitrary", "CRCW-priority", "CRCW-sum", "CRCW-max"):
        assert f"  {name} " in out
    assert cli(["tree-sum", "--n", "eight"]) == 2          # argparse's own error
    assert "invalid int value: 'eight'" in capsys.readouterr().err


def test_step_table_json(capsys):
    out = _json(capsys, ["step-table", "--json", "--shape", "2,2,4,2,8"])
    rows = {r["kernel"]: r for r in out["rows"]}
    assert out["shape"] == {"B": 2, "T": 2, "C": 4, "NH": 2, "V": 8}
    assert rows["matmul_forward (qkv)"]["model"] == "CREW"
    assert rows["matmul_backward (qkv)"]["model"] == "CRCW-sum"
    assert rows["adamw_update"]["model"] == "EREW"
    assert cli(["step-table", "--shape", "2,4,8"]) == 2
    assert "--shape must be B,T,C,NH,V" in capsys.readouterr().err
    assert cli(["step-table", "--shape", "2,4,10,4,16"]) == 2
    assert "C=10 must be divisible by NH=4" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_course_command_in_a_real_process():
    ok = subprocess.run([sys.executable, "-m", "course_lib.cli", "pram", "tree-sum", "--n", "8",
                         "--json"], capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["steps"] == 3
    bad = subprocess.run([sys.executable, "-m", "course_lib.cli", "pram", "max-crcw", "--n", "4",
                          "--model", "EREW"], capture_output=True, text=True)
    assert bad.returncode == 1 and "EREW: processors" in bad.stderr
