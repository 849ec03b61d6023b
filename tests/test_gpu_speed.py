"""benchmarks/gpu_speed.py (issue 21 item 7) works before a GPU runs it: the smoke mode runs every
variant through the course's step on a CPU, and upstream's bench.py output is read right."""

from __future__ import annotations

import sys

import pytest
from test_benchmarks_smoke import load

gpu_speed = load("gpu_speed")


def test_smoke_runs_every_variant(capsys):
    assert gpu_speed.main(["--smoke", "--steps", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"| {v.name} |" in out for v in gpu_speed.VARIANTS)


def test_upstream_time_is_read_from_bench_py(tmp_path):
    (tmp_path / "bench.py").write_text(
        'print("0/20 loss: 10.9")\nprint("time per iteration: 30.0000ms, MFU: 41.20%")\n')
    r = gpu_speed.run_upstream(tmp_path)
    assert r["ms_per_step"] == 30.0 and r["tokens_per_s"] == pytest.approx(12 * 1024 / 0.030)
    (tmp_path / "bench.py").write_text("import sys\nsys.exit('CUDA error: no device')\n")
    with pytest.raises(RuntimeError, match="CUDA error: no device"):
        gpu_speed.run_upstream(tmp_path)


def test_refuses_without_a_gpu_or_upstream(capsys):
    if sys.modules["torch"].cuda.is_available():
        with pytest.raises(SystemExit):
            gpu_speed.main(["--nanogpt", "/nonexistent"])
    else:
        with pytest.raises(SystemExit):
            gpu_speed.main([])
        assert "needs a CUDA GPU" in capsys.readouterr().err
