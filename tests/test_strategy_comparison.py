"""The strategy comparison of notebook 8 (course_lib.experiments.strategy_comparison) and its script.

    python -m pytest tests/test_strategy_comparison.py -q
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.experiments import strategy_comparison as sc

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_one_repeat_of_ddp_against_the_baseline(tmp_path):
    rows = sc.compare(["ddp", "zero1"], [2], repeats=1, iters=1, warmup=0, threads=1, out_dir=tmp_path, progress=False)
    by_name = {r["strategy"]: r for r in rows}
    assert [(r["strategy"], r["ranks"]) for r in rows] == [("single", 1), ("ddp", 2), ("zero1", 2)]
    assert by_name["single"]["speedup"] == 1.0
    for r in rows:
        assert r["ms_per_iter"] > 0 and r["efficiency"] == pytest.approx(r["speedup"] / r["ranks"])
    # weak scaling: 2 ranks process twice the tokens of one step
    assert by_name["ddp"]["tokens_per_s"] * by_name["ddp"]["ms_per_iter"] == pytest.approx(
        2 * by_name["single"]["tokens_per_s"] * by_name["single"]["ms_per_iter"])
    # DP replicates the model states; ZeRO-1 shards the optimizer's (Rajbhandari et al. 2020)
    single, ddp, zero1 = (by_name[n]["model_states_mb"] for n in ("single", "ddp", "zero1"))
    assert ddp == pytest.approx(single, rel=0.01) and zero1 < 0.8 * ddp
    with open(tmp_path / "strategies.csv") as f:
        assert [r["strategy"] for r in csv.DictReader(f)] == ["single", "ddp", "zero1"]
    with open(tmp_path / "strategies_runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 3
    assert (tmp_path / "strategies.md").read_text().startswith("| strategy | nodes | ranks |")


def test_an_interrupted_comparison_leaves_no_older_summary(tmp_path, monkeypatch):
    """The raw rows are written as each run ends; the summary only at the end. A stopped re-run
    once left the previous summary beside its own partial rows, possibly for other strategies."""
    for name in ("strategies.csv", "strategies.md"):
        (tmp_path / name).write_text("from an earlier comparison\n")
    done = []

    def one_run(name, ranks, *args):
        if done:
            raise KeyboardInterrupt
        done.append(name)
        return {"strategy": name, "ranks": ranks, "s": 1.0, "comm": 0.0, "states": 1, "rss": 1, "tokens": 1}

    monkeypatch.setattr(sc, "one_run", one_run)
    with pytest.raises(KeyboardInterrupt):
        sc.compare(["ddp"], [2], repeats=1, iters=1, warmup=0, threads=1, out_dir=tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["strategies_runs.csv"]
    with open(tmp_path / "strategies_runs.csv") as f:
        assert [r["strategy"] for r in csv.DictReader(f)] == ["single"]  # the run that finished


def test_bad_input_is_refused_before_any_run(tmp_path):
    with pytest.raises(ValueError, match="unknown strategies.*'nope'"):
        sc.compare(["ddp", "nope"], [2], out_dir=tmp_path)
    with pytest.raises(ValueError, match="must be >= 1"):
        sc.compare(["ddp"], [0], out_dir=tmp_path)
    with pytest.raises(ValueError, match="divisible"):
        sc.compare(["ddp"], [5], scaling="strong", out_dir=tmp_path)
    assert not (tmp_path / "strategies_runs.csv").exists()


def test_benchmark_script_is_the_module_command_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "strategies.py"), "--strategies", "ddp,nope",
                          "--out-dir", str(tmp_path)], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown strategies ['nope']" in out.stderr
    assert not any(tmp_path.iterdir())


def test_the_mb_columns_hold_megabytes():
    """model_states_mb and rss_mb are MB (1e6 bytes, hardware.MB) as their names and the table's
    header say; they held MiB."""
    run = {"strategy": "ddp", "ranks": 2, "s": 0.1, "comm": 0.01, "states": 3e6, "rss": 5e8, "tokens": 100}
    row = sc.summarize([run], "strong", 1)
    assert (row["model_states_mb"], row["rss_mb"]) == (3.0, 500.0)
    assert "model states / rank (MB) | peak RSS / rank (MB)" in sc.comparison_markdown(
        [{**row, "speedup": 1.0, "efficiency": 1.0}])
