"""The trainer in one process on a tiny model: run directory and metrics, learning-rate
schedule, gradient-accumulation equivalence, exact resume after an interruption, incompatible
resumes, dtype choice per hardware, the fp16 loss-scale rule, and sampling; then best.pt after a
crash between a new best's two files and in a fine-tuning run whose start is best, the peak MFU
divides by for fp32 on GPUs with and without TF32, and train() alone refusing a multi-rank config."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from course_lib.gpt import checkpoint as ckpt_io
from course_lib.gpt.data import TrainBatches, prepare
from course_lib.gpt.sample import cli as sample_cli
from course_lib.gpt.sample import sample
from course_lib.hardware import PROFILES, cpu_autocast_dtypes, pick_dtype
from course_lib.launch.training import train_in_process as run
from course_lib.parallel.step import _fp16_step
from course_lib.registry import ConfigError
from course_lib.trainer.config import TrainConfig, make_config
from course_lib.trainer.loop import get_lr, setup_runtime, train
from course_lib.trainer.metrics import COLUMNS, read_metrics

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, max_iters=8, lr_decay_iters=8,
            warmup_iters=2, learning_rate=3e-3, eval_interval=4, eval_iters=2, log_interval=1, dropout=0.0,
            device="cpu", threads=1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    prepare("shakespeare_char", root, quiet=True)
    return str(root)


def tiny(data_dir, out_dir, **kw) -> TrainConfig:
    return make_config("shakespeare_char_cpu", {**TINY, "data_dir": data_dir, "out_dir": str(out_dir), **kw})


def params(out_dir) -> dict:
    return ckpt_io.load_checkpoint(f"{out_dir}/last.pt")["model"]


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(learning_rate=1e-3, min_lr=1e-4, warmup_iters=100, lr_decay_iters=2000)
    assert get_lr(0, cfg) == pytest.approx(1e-3 / 101)  # linear warmup from (it + 1) / (warmup + 1)
    assert get_lr(99, cfg) == pytest.approx(1e-3 * 100 / 101)
    assert get_lr(100, cfg) == pytest.approx(1e-3)  # the top of the cosine
    assert get_lr(1050, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half way: the mean of lr and min_lr
    assert get_lr(2000, cfg) == get_lr(5000, cfg) == 1e-4
    lrs = [get_lr(i, cfg) for i in range(100, 2001)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert get_lr(7, cfg.replace(decay_lr=False)) == 1e-3


def test_train_names_what_it_takes():
    threads = torch.get_num_threads()
    with pytest.raises(TypeError, match=r"train\(\) takes a TrainConfig, got dict: .*make_config"):
        train({"max_iters": 1})
    assert torch.get_num_threads() == threads  # refused before the runtime was touched


def test_the_bar_ends_on_the_final_evaluation(data_dir, tmp_path, capsys):
    """The bar's val= was the evaluation before the last (no step row follows the final one)."""
    summary = run(tiny(data_dir, tmp_path / "run", eval_interval=3, max_iters=6, lr_decay_iters=6))
    out = capsys.readouterr().out
    assert "1 x cpu (1 thread each) | strategy single" in out  # the header, in English for one thread
    last_bar_line = out.split("\r")[-1].split("\n")[0]  # tqdm's last redraw
    assert last_bar_line.startswith("run: 100%") and f"val={summary['val_loss']:.4f}" in last_bar_line, last_bar_line


def test_run_directory_metrics_and_checkpoints(data_dir, tmp_path):
    cfg = tiny(data_dir, tmp_path / "run")
    summary = train(cfg, progress=False)
    out = tmp_path / "run"
    assert {p.name for p in out.iterdir()} >= {"config.json", "run.json", "metrics.csv", "last.pt", "best.pt",
                                              "summary.json"}
    assert TrainConfig.load(out / "config.json") == cfg
    assert (out / "metrics.csv").read_text().splitlines()[0] == ",".join(COLUMNS)
    rows = read_metrics(out / "metrics.csv")
    assert [r["iter"] for r in rows] == list(range(9))  # one row per logged step, then the final eval
    assert [r["iter"] for r in rows if not math.isnan(r["val_loss"])] == [0, 4, 8]
    for r in rows[:-1]:
        assert r["lr"] == pytest.approx(get_lr(r["iter"], cfg))
        assert r["comm_ms"] == 0.0 and 0 < r["compute_ms"] <= r["step_ms"]
        assert r["tokens_per_s"] == pytest.approx(4 * 32 * 1000 / r["step_ms"])
        assert r["tflops"] > 0 and 0 < r["mfu"] < 1
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 0.3  # it learns
    assert summary["val_loss"] == rows[-1]["val_loss"] and summary["world_size"] == 1
    info = json.loads((out / "run.json").read_text())
    assert info["peak_is_estimate"] is True and info["global_batch"] == 4 and info["dtype"] == "float32"
    last, best = (ckpt_io.load_checkpoint(out / f"{n}.pt") for n in ("last", "best"))
    assert last["iter_num"] == 8 and last["config"] == cfg.to_dict() and len(last["rng"]) == 1
    assert best["val_loss"] == min(r["val_loss"] for r in rows if not math.isnan(r["val_loss"]))
    assert last["meta"]["vocab_size"] == 65 and set(last["optimizer"]["state"])


def test_gradient_accumulation_equals_a_larger_batch(data_dir, tmp_path):
    train(tiny(data_dir, tmp_path / "accum", batch_size=2, gradient_accumulation_steps=4), progress=False)
    train(tiny(data_dir, tmp_path / "big", batch_size=8), progress=False)
    a, b = params(tmp_path / "accum"), params(tmp_path / "big")
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)
    la, lb = (read_metrics(tmp_path / n / "metrics.csv") for n in ("accum", "big"))
    assert [r["train_loss"] for r in la[:-1]] == pytest.approx([r["train_loss"] for r in lb[:-1]], rel=1e-6)


def test_interrupted_and_resumed_run_matches_an_uninterrupted_one(data_dir, tmp_path, monkeypatch):
    kw = dict(max_iters=12, lr_decay_iters=12, dropout=0.1)  # dropout: the torch RNG state matters too
    train(tiny(data_dir, tmp_path / "straight", **kw), progress=False)

    # interrupt the same run during iteration 9: the last checkpoint is from iteration 8, and
    # metrics.csv already holds rows the resumed run will write again
    calls, real_next = [0], TrainBatches.next

    def next_then_crash(self):
        calls[0] += 1
        if calls[0] == 11:  # the batch after the step of iteration 9
            raise KeyboardInterrupt
        return real_next(self)

    cfg = tiny(data_dir, tmp_path / "resumed", **kw)
    monkeypatch.setattr(TrainBatches, "next", next_then_crash)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False)
    monkeypatch.undo()
    assert ckpt_io.load_checkpoint(tmp_path / "resumed" / "last.pt")["iter_num"] == 8
    assert read_metrics(tmp_path / "resumed" / "metrics.csv")[-1]["iter"] == 8
    run(cfg.replace(init_from="resume"), progress=False)

    straight, resumed = (read_metrics(tmp_path / n / "metrics.csv") for n in ("straight", "resumed"))
    keys = ("iter", "train_loss", "val_loss", "eval_train_loss", "lr", "grad_norm")
    as_str = lambda rows: [[repr(r[k]) for k in keys] for r in rows]  # noqa: E731 (NaN == NaN as text)
    assert as_str(resumed) == as_str(straight)  # exactly, not approximately
    a, b = params(tmp_path / "straight"), params(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_resumes_and_reused_out_dir_are_errors(data_dir, tmp_path):
    cfg = tiny(data_dir, tmp_path / "run", max_iters=2)
    with pytest.raises(ckpt_io.CheckpointError, match="no checkpoint at"):
        run(cfg.replace(init_from="resume"), progress=False)
    run(cfg, progress=False)
    with pytest.raises(ConfigError, match="already holds a run.*--resume.*--overwrite"):
        run(cfg, progress=False)
    run(cfg, overwrite=True, progress=False)
    bigger = cfg.replace(init_from="resume", n_layer=3, max_iters=4)
    with pytest.raises(ConfigError, match="n_layer: checkpoint has 2, now 3"):
        run(bigger, progress=False)  # caught before any training starts
    with pytest.raises(ConfigError, match="n_layer"):
        train(bigger, progress=False)  # and by a worker started some other way


def test_dtype_follows_the_hardware_profile(data_dir, tmp_path):
    assert pick_dtype(PROFILES["a100-80gb"]) == pick_dtype(PROFILES["h100"]) == "bfloat16"
    assert pick_dtype(PROFILES["t4"]) == "float16" and PROFILES["t4"].needs_grad_scaler
    assert pick_dtype(PROFILES["cpu"]) == "float32"
    assert setup_runtime(tiny(data_dir, tmp_path)).dtype == "float32"  # this CPU host
    assert setup_runtime(tiny(data_dir, tmp_path, dtype="bfloat16")).dtype == "bfloat16"  # --dtype wins
    if "float16" not in cpu_autocast_dtypes():  # older torch: refused before any training
        with pytest.raises(ConfigError, match="dtype: float16 autocast is not supported on CPU"):
            run(tiny(data_dir, tmp_path / "fp16", dtype="float16"), progress=False)
    summary = train(tiny(data_dir, tmp_path / "bf16", dtype="bfloat16", max_iters=2), progress=False)
    assert math.isfinite(summary["val_loss"])  # the autocast path runs


def test_fp16_steps_skip_overflow_and_adapt_the_scale():
    from course_lib.parallel.strategy import build_strategy
    from course_lib.trainer.loop import optimizer_factory

    model = torch.nn.Linear(4, 1)
    strategy = build_strategy("single", model, optimizer_factory(TrainConfig()))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)

    def step(x) -> int:
        scaler.scale(model(x).sum()).backward()
        scaler.unscale_(strategy.optimizer)
        norm = strategy.clip_grad_norm_(math.inf)
        before = model.weight.detach().clone()
        good = _fp16_step(strategy, scaler, norm, step.good)
        strategy.zero_grad()
        step.good = good
        return not torch.equal(before, model.weight)

    step.good = 0
    assert step(torch.ones(1, 4)) and scaler.get_scale() == 1024.0
    assert step(torch.ones(1, 4)) and scaler.get_scale() == 2048.0  # 2 good steps: grow x2
    assert not step(torch.full((1, 4), math.inf)) and scaler.get_scale() == 1024.0  # overflow: skip, halve
    assert step.good == 0


def test_sampling_from_a_run(data_dir, tmp_path, capsys):
    train(tiny(data_dir, tmp_path / "run", max_iters=2), progress=False)
    capsys.readouterr()
    a = sample(tmp_path / "run", start="ROMEO:", num_samples=2, max_new_tokens=40, seed=3)
    b = sample(tmp_path / "run", start="ROMEO:", num_samples=2, max_new_tokens=40, seed=3, which="last")
    assert a == b and len(a) == 2 and all(len(t) == 6 + 40 and t.startswith("ROMEO:") for t in a)
    assert sample_cli(["--out_dir", str(tmp_path / "run"), "--max_new_tokens=10", "--start=A"]) == 0
    assert capsys.readouterr().out.startswith("A")
    by_dir, by_file = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "run" / "metrics.csv")
    assert [r["iter"] for r in by_dir] == [r["iter"] for r in by_file] != []  # the run directory: its metrics.csv
    assert sample_cli(["--out_dir", str(tmp_path / "nothing")]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    run = tmp_path / "run"  # bad arguments: what to change, not a torch error (cuda here once said "corrupt")
    bad = [({"device": "cuda:0"}, "but this machine has no CUDA GPU; use device='cpu'"),
           ({"device": "gpu"}, "device must be"), ({"top_k": 0}, "top_k must be a whole number >= 1, got 0"),
           ({"temperature": "0.8"}, "temperature must be"),
           ({"num_samples": 2.5}, "num_samples must be a whole number"), ({"start": None}, "start must be text"),
           ({"start": f"FILE:{tmp_path / 'none.txt'}"}, "cannot read the prompt file")]
    for kw, words in bad[0 if not torch.cuda.is_available() else 1:]:
        with pytest.raises(ValueError, match=re.escape(words)):
            sample(run, **kw)


def test_worker_entry_alone_refuses_a_distributed_config(data_dir, tmp_path, capsys, monkeypatch):
    from course_lib.trainer.loop import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--config=shakespeare_char_cpu", "--nproc=2", f"--out_dir={tmp_path}"]) == 2
    assert "needs torchrun's workers; launch them with: course train --nproc=2" in capsys.readouterr().err
    assert main(["--config=shakespeare_char_cpu", *[f"--{k}={v}" for k, v in TINY.items()], "--max_iters=1",
                 f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'alone'}", "--no-progress"]) == 0
    assert json.loads((tmp_path / "alone" / "summary.json").read_text())["iters"] == 1  # nanoGPT's python train.py


def test_a_new_best_survives_a_crash_between_its_two_files(data_dir, tmp_path, monkeypatch):
    """Stopped between writing a new best's two files (last.pt and best.pt) and resumed, best.pt
    is the best evaluation's state, as in the run never stopped (val falls at every evaluation of
    this run: the best is the last one, iteration 8)."""
    straight = train(tiny(data_dir, tmp_path / "straight"), progress=False)
    assert ckpt_io.load_checkpoint(tmp_path / "straight" / "best.pt")["iter_num"] == 8
    writes, real = [0], {name: getattr(ckpt_io, name) for name in ("save_checkpoint", "copy_checkpoint")}

    def stop_at_the_sixth_write(name):  # evaluations 0, 4, 8 write two files each
        def write(*args):
            writes[0] += 1
            if writes[0] == 6:
                raise KeyboardInterrupt
            return real[name](*args)
        return write

    for name in real:
        monkeypatch.setattr(ckpt_io, name, stop_at_the_sixth_write(name))
    cfg = tiny(data_dir, tmp_path / "stopped")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False)
    monkeypatch.undo()
    summary = train(cfg.replace(init_from="resume"), progress=False)
    best = ckpt_io.load_checkpoint(tmp_path / "stopped" / "best.pt")
    assert best["iter_num"] == 8 and best["val_loss"] == summary["best_val_loss"] == straight["best_val_loss"]
    a, b = params(tmp_path / "straight"), best["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_finetuning_run_whose_start_is_best_writes_it_as_best_pt(data_dir, tmp_path, monkeypatch):
    """Fine-tuning restarts "best" on the new data, so its first evaluation (the pre-trained
    weights) is a new best: if no later one beats it, best.pt must be those weights."""
    from course_lib.trainer import loop
    from course_lib.trainer.finetune import finetune_config

    train(tiny(data_dir, tmp_path / "pre"), progress=False)
    cfg = finetune_config(tmp_path / "pre", tmp_path / "ft", data_dir, iters=4, which="last")
    real_evaluate, calls = loop.evaluate, [0]

    def worse_every_time(run):  # as on a new corpus the model overfits at once
        calls[0] += 1
        return {k: v + calls[0] for k, v in real_evaluate(run).items()}

    monkeypatch.setattr(loop, "evaluate", worse_every_time)
    summary = train(cfg, progress=False)
    first = read_metrics(tmp_path / "ft")[0]
    assert first["iter"] == 8 and summary["best_val_loss"] == first["val_loss"]
    best = ckpt_io.load_checkpoint(tmp_path / "ft" / "best.pt")
    assert best["iter_num"] == 8 and best["best_val_loss"] == first["val_loss"]
    a, b = params(tmp_path / "pre"), best["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_mfu_of_fp32_on_a_gpu_without_tf32_uses_its_fp32_peak(data_dir, tmp_path, monkeypatch):
    """fp32 on a GPU: matmuls in TF32 where the GPU has it (A100: 156 TFLOP/s), in fp32 where it
    has not (V100, T4: their fp32 peak), rather than no peak and an MFU of NaN."""
    from course_lib.parallel.strategy import SingleProcess
    from course_lib.trainer import metrics
    from course_lib.trainer.loop import Runtime

    strategy = SingleProcess(torch.nn.Linear(2, 2), lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    for gpu, dtype, peak in [("v100", "float32", 15.7e12), ("t4", "float32", 8.1e12),
                             ("a100-80gb", "float32", 156e12), ("t4", "float16", 65e12)]:
        monkeypatch.setattr(metrics, "detect", lambda device, gpu=gpu: PROFILES[gpu])
        rt = Runtime(0, 2, 2, "cuda:0", dtype, 1, False, devices=2.0)
        meter = metrics.RunMeter(tiny(data_dir, tmp_path / gpu), rt, strategy, "ddp", 1000, 6e3, 0, False)
        assert meter.info["peak_flops_per_device"] == pytest.approx(peak), (gpu, dtype)
        assert meter.peak_total == pytest.approx(2 * peak)


def test_train_alone_refuses_a_config_for_several_ranks(data_dir, tmp_path, monkeypatch):
    """train() outside torchrun with nproc=2 once trained one process and recorded nproc=2 in
    config.json: now refused before the runtime is touched, as the worker's command line is."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    threads = torch.get_num_threads()
    for kw in ({"nproc": 2}, {"strategy": "ddp"}):
        with pytest.raises(ConfigError, match="needs torchrun's workers; launch them with: course train"):
            train(tiny(data_dir, tmp_path / "run", **kw), progress=False)
    assert torch.get_num_threads() == threads and not (tmp_path / "run").exists()
