"""The trainer's precision and memory options on a tiny model in one process: --recompute gives
bit-identical fp32 losses with the activation memory Korthikanti et al. 2022 predict (metrics.csv
``act_mb`` against ``act_model_mb``, within 10 %), --dtype=float16 on a CPU logs its loss scale and
skipped steps (GradScaler's rule: the scale halves once per skipped step) and resumes with its
scale, and --grad_comm_dtype is refused where it does not apply."""

from __future__ import annotations

import math

import pytest
import torch

from course_lib.gpt.data import prepare
from course_lib.hardware import cpu_autocast_dtypes
from course_lib.launch.training import train_in_process
from course_lib.parallel.step import Precision
from course_lib.registry import ConfigError
from course_lib.trainer.config import make_config
from course_lib.trainer.metrics import read_metrics

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 4, "max_iters": 4,
        "lr_decay_iters": 4, "warmup_iters": 1, "learning_rate": 3e-3, "eval_interval": 4, "eval_iters": 1,
        "log_interval": 1, "dropout": 0.0, "device": "cpu", "threads": 1}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    prepare("shakespeare_char", root, quiet=True)
    return str(root)


# Feature-detected, not a version check: the fp16 tests need torch's CPU autocast to accept
# float16, which older releases disable (hardware.cpu_autocast_dtypes asks the context itself).
# The torch the Makefile installs (2.13) accepts it, so in CI these tests run.
needs_fp16_autocast = pytest.mark.skipif("float16" not in cpu_autocast_dtypes(),
                                         reason="this torch has no fp16 CPU autocast")


def run(data_dir, out_dir, **kw) -> list[dict]:
    cfg = make_config("shakespeare_char_cpu", {**TINY, "data_dir": data_dir, "out_dir": str(out_dir), **kw})
    train_in_process(cfg, progress=False)
    return [r for r in read_metrics(out_dir / "metrics.csv") if not math.isnan(r["train_loss"])]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_recompute_same_losses_less_memory_as_modelled(data_dir, tmp_path, dtype):
    rows = {mode: run(data_dir, tmp_path / mode, recompute=mode, dtype=dtype)
            for mode in ("none", "selective", "full")}
    for mode, rs in rows.items():
        for r in rs:
            assert r["act_mb"] == pytest.approx(r["act_model_mb"], rel=0.10), (mode, r["iter"])
        if dtype == "float32":  # the same operations again: bit-identical losses
            assert [r["train_loss"] for r in rs] == [r["train_loss"] for r in rows["none"]], mode
    assert rows["full"][-1]["act_mb"] < rows["none"][-1]["act_mb"] / 3
    assert rows["selective"][-1]["act_mb"] <= rows["none"][-1]["act_mb"]
    assert all(math.isnan(r["loss_scale"]) for r in rows["none"])  # no scaler outside fp16


@needs_fp16_autocast
def test_fp16_on_cpu_logs_loss_scale_and_skipped_steps(data_dir, tmp_path):
    rows = run(data_dir, tmp_path / "fp16", dtype="float16", max_iters=6, lr_decay_iters=6)
    assert rows and all(r["loss_scale"] > 0 for r in rows)
    for r in rows:  # GradScaler's rule: 2^16 halved once per skipped step (no growth in 2000 steps)
        assert r["loss_scale"] == 2.0**16 * 0.5 ** r["skipped_steps"]
    assert math.isfinite(rows[-1]["train_loss"])


@needs_fp16_autocast
def test_fp16_run_resumes_with_its_loss_scale(data_dir, tmp_path, monkeypatch):
    """Stopped and resumed: the loss scale, its count of good steps, the skipped
    steps and the losses go on as in the run that was never stopped (the scaler's state is in
    last.pt). The scale starts at 2^20 and grows after 2 good steps, so it moves both ways."""
    for_dtype = Precision.for_dtype.__func__

    def moving_scale(cls, device_type, dtype):
        precision = for_dtype(cls, device_type, dtype)
        precision.scaler = torch.amp.GradScaler(device_type, init_scale=2.0**20, growth_interval=2)
        return precision

    monkeypatch.setattr(Precision, "for_dtype", classmethod(moving_scale))
    ten = {"dtype": "float16", "max_iters": 10, "lr_decay_iters": 10, "eval_interval": 10}
    whole = run(data_dir, tmp_path / "whole", **ten)
    scales = [r["loss_scale"] for r in whole]
    # stop before a step that grows the scale: its previous step was good, so the run resumes
    # halfway through a growth interval and grows at once only if the count of good steps was saved
    stop = next(k for k in range(2, 10) if scales[k] > scales[k - 1] and whole[k - 1]["skipped_steps"] > 0)
    run(data_dir, tmp_path / "half", **{**ten, "max_iters": stop, "eval_interval": stop})
    resumed = run(data_dir, tmp_path / "half", **{**ten, "eval_interval": stop}, init_from="resume")
    keys = ("iter", "train_loss", "loss_scale", "skipped_steps")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole]


def test_grad_comm_dtype_only_for_data_parallel():
    with pytest.raises(ConfigError, match="grad_comm_dtype=bfloat16 is for data-parallel"):
        make_config("shakespeare_char_cpu", {"strategy": "zero2", "grad_comm_dtype": "bfloat16", "nproc": 2})
    with pytest.raises(ConfigError, match="grad_comm_dtype must be one of"):
        make_config("shakespeare_char_cpu", {"grad_comm_dtype": "float8"})
    with pytest.raises(ConfigError, match="recompute must be one of"):
        make_config("shakespeare_char_cpu", {"recompute": "some"})
    assert make_config("shakespeare_char_cpu", {"strategy": "torch_ddp", "nproc": 2,
                                                "grad_comm_dtype": "bfloat16"}).grad_comm_dtype == "bfloat16"


def test_bf16_gradient_all_reduce_in_the_trainer_halves_its_bytes(data_dir, tmp_path):
    """course train --nproc=2 --grad_comm_dtype=bfloat16 on 2 gloo workers: metrics.csv's comm_mb
    (bytes our DDP hands to collectives per step) is half the fp32 run's, the losses stay within
    2e-3 (tests/test_grad_comm.py states the tolerance)."""
    import io

    from course_lib.launch import launch_training

    rows = {}
    for dtype in ("float32", "bfloat16"):
        cfg = make_config("shakespeare_char_cpu", {**TINY, "data_dir": data_dir, "out_dir": str(tmp_path / dtype),
                                                   "nproc": 2, "strategy": "ddp", "grad_comm_dtype": dtype})
        launch_training(cfg, out=io.StringIO(), err=io.StringIO(), check=True)
        rows[dtype] = [r for r in read_metrics(tmp_path / dtype / "metrics.csv") if not math.isnan(r["train_loss"])]
    for a, b in zip(rows["float32"], rows["bfloat16"]):
        assert b["comm_mb"] * 2 == pytest.approx(a["comm_mb"], rel=1e-6) and a["comm_mb"] > 0
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=2e-3)


def test_a_run_shorter_than_its_warmup_says_so(data_dir, tmp_path, capsys):
    """The recipes warm up for 100 iterations: a short run of one ends below its learning rate."""
    run(data_dir, tmp_path / "short", max_iters=2, lr_decay_iters=2, warmup_iters=2, eval_interval=2)
    assert "note: warmup_iters (2) >= max_iters (2): the run ends inside its warmup" in capsys.readouterr().out
    run(data_dir, tmp_path / "long", max_iters=2, lr_decay_iters=2, warmup_iters=1, eval_interval=2)
    assert "warmup_iters" not in capsys.readouterr().out
