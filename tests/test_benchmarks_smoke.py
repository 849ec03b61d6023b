"""The benchmarks' fixed crashes stay fixed, without running a benchmark (each test well under a
second): what they refuse before anything starts, and which trainer rows train_throughput.py reads."""

from __future__ import annotations

import importlib.util
import statistics
import sys

import pytest
import torch
from test_architecture import ROOT


def load(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is no package), registered under its name, where
    dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_step_memory_refuses_cuda_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, on any machine
    step_memory = load("step_memory_gpu")
    monkeypatch.setattr(sys, "argv", ["step_memory_gpu.py"])  # main() reads its arguments there
    with pytest.raises(SystemExit) as e:
        step_memory.main()
    assert e.value.code == 2
    assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err  # a line, not a traceback


@pytest.mark.parametrize("argv, says", [
    (["--ranks", "2"], "layouts are listed for 4, 8 ranks"),  # was a KeyError
    (["--ranks", "4", "--only", "dp8"], "no layout dp8 at 4 ranks"),  # was an empty table
    (["--ranks", "8", "--batch", "4"], "does not split over the 8 dp ranks of dp8"),  # was a rank's crash
])
def test_parallel_layouts_refuses_before_any_rank_starts(argv, says, capsys):
    with pytest.raises(SystemExit):
        load("parallel_layouts").main(argv)
    assert says in capsys.readouterr().err


def test_train_throughput_reads_only_rows_after_the_warmup(monkeypatch, tmp_path):
    tt = load("train_throughput")
    logged = []

    def fake_training(cfg, **kwargs):  # the trainer's metrics.csv rows for cfg's log_interval
        every = cfg.log_interval
        logged[:] = [{"iter": i, "step_ms": float(i + 1), "compute_ms": 1.0, "comm_ms": 0.0,
                      "tokens_per_s": 1.0, "mfu": 0.1} for i in range(0, cfg.max_iters, every)]
        logged.append({"iter": cfg.max_iters, "step_ms": float("nan")})  # the final evaluation's row

    monkeypatch.setattr(tt, "run_training", fake_training)
    monkeypatch.setattr(tt, "read_metrics", lambda path: logged)
    # 2 iterations after 1 of warmup (a StatisticsError before): rows every iteration, iters 1 and 2 kept
    short = tt.measure("short", "shakespeare_char_cpu", {}, 1, 2, str(tmp_path), tmp_path)
    assert short["ms_per_iter"] == 2.5
    # 200 after 20: the row at 20 averages iterations 11-20, all warmup; the first kept is 30's
    long = tt.measure("long", "shakespeare_char_cpu", {}, 20, 200, str(tmp_path), tmp_path)
    assert long["ms_per_iter"] == statistics.median([i + 1.0 for i in range(30, 220, 10)])

