"""``course check-gpu`` without a GPU: the plan, the clear error on a CPU machine, the pass/fail
judgement from given figures, the reports (JSON, Markdown, RESULTS.md), a failed or crashing step,
and the measurement steps themselves on a CPU at toy sizes (gloo instead of NCCL, fp32 instead of
bf16). The GPU run itself is ``make check-gpu`` on a machine with one CUDA GPU.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import nbformat
import pytest
import torch

from course_lib.analysis.memory import ModelShape
from course_lib.experiments import gpu_check
from course_lib.experiments.gpu_check import FP16_MATCH, LOSS_MARGIN, NANOGPT_VAL_LOSS, PLAN, judge, run_check
from course_lib.gpt.data import prepare

GOOD = {
    "profile": {"device": "NVIDIA H100 80GB HBM3", "profile": "h100", "known_profile": True, "dtype": "bfloat16",
                "expected_dtype": "bfloat16", "grad_scaler": False, "torch": "2.x", "cuda": "12.x"},
    "data": {"data_dir": "data/shakespeare_char", "seconds": 0.1},
    "recipes": {"bf16": {"best_val_loss": 1.4702, "dtype": "bfloat16", "iters": 5000, "ms_per_iter": 20.0},
                "fp16": {"best_val_loss": 1.4755, "dtype": "float16", "iters": 5000, "ms_per_iter": 24.0,
                         "loss_scale": 32768.0}},
    "nccl": {"run": {"backend": "nccl", "world_size": 1, "torchrun": True}, "bench_backend": "nccl",
             "bench_all_correct": True, "bench": [{"op": "all_reduce"}]},
    "memory": {"states_measured_bytes": 1.391 * 2**30, "states_model_bytes": 1.390 * 2**30, "states_ratio": 1.001,
               "measured_bytes": 12.6 * 2**30, "model_bytes": 12.38 * 2**30, "ratio": 12.6 / 12.38,
               "parts": {"weights": 0.46 * 2**30, "optimizer": 0.93 * 2**30, "activations": 6.38 * 2**30,
                         "loss gradients": 4.61 * 2**30}},
    "mfu": {"eager": {"mfu": 0.31, "ms_per_step": 90.0}, "compiled": {"mfu": 0.45, "ms_per_step": 62.0},
            "compile_speedup": 90 / 62},
    "ranks": {k: {"ok": True, "seconds": 1.5} for k in ("run_ranks", "notebook_launcher", "isolated")},
    "share": {"ran": True, "world_size": 2, "device": "cuda", "backend": "gloo"},
}
FULL = {**GOOD, "gpu_tests": {"passed": 5, "failed": 0, "skipped": 0},
        "lessons": {"01_setup": {"ok": True, "seconds": 20.0}, "08_distributed": {"ok": True, "seconds": 90.0}}}


def _status(verdicts, check):
    (v,) = [v for v in verdicts if v.check == check]
    return v.status


def _with(path: str, value):
    """GOOD with one figure changed, e.g. _with('recipes.bf16.best_val_loss', 1.6)."""
    figures = copy.deepcopy(GOOD)
    *keys, last = path.split(".")
    node = figures
    for k in keys:
        node = node[k]
    node[last] = value
    return figures


def test_plan_fits_the_time_limit_and_dry_run_prints_it():
    assert [s.name for s in PLAN] == ["profile", "data", "recipes", "nccl", "memory", "mfu", "ranks", "share"]
    assert sum(s.budget_s for s in PLAN) <= gpu_check.TIME_LIMIT_S
    assert sum(s.budget_s for s in gpu_check.FULL_PLAN) <= gpu_check.time_limit(gpu_check.FULL_PLAN)
    assert list(gpu_check.STEP_FUNCTIONS) == [s.name for s in gpu_check.FULL_PLAN]  # a function per step
    done = subprocess.run([sys.executable, "-m", "course_lib.cli", "check-gpu", "--dry-run"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    for step in PLAN:
        assert f" {step.name} " in done.stdout
    assert f"within {LOSS_MARGIN} of nanoGPT's {NANOGPT_VAL_LOSS}" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_cuda_a_one_line_error(tmp_path, capsys):
    assert gpu_check.cli(["--out", str(tmp_path / "out"), "--no-results"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA GPU here" in err and "--dry-run" in err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_judge_passes_good_figures_and_fails_each_fault():
    verdicts = judge(GOOD, {}, wall_s=480)
    assert [v.status for v in verdicts] == ["pass"] * 9, verdicts
    bf16 = "bf16 recipe vs nanoGPT"
    assert _status(judge(_with("recipes.bf16.best_val_loss", NANOGPT_VAL_LOSS + LOSS_MARGIN - 1e-4), {}, 1), bf16) \
        == "pass"
    assert _status(judge(_with("recipes.bf16.best_val_loss", NANOGPT_VAL_LOSS + LOSS_MARGIN + 1e-4), {}, 1), bf16) \
        == "fail"
    # a loss far *below* the published one is a fault too (validation data leaking into training)
    assert _status(judge(_with("recipes.bf16.best_val_loss", 1.30), {}, 1), bf16) == "fail"
    assert _status(judge(_with("recipes.bf16.dtype", "float32"), {}, 1), bf16) == "fail"
    fp16 = "fp16 + loss scaling (T4 path)"
    assert _status(judge(_with("recipes.fp16.best_val_loss", 1.4702 + FP16_MATCH + 1e-3), {}, 1), fp16) == "fail"
    assert _status(judge(_with("recipes.fp16.dtype", "bfloat16"), {}, 1), fp16) == "fail"
    assert _status(judge(_with("recipes.fp16.loss_scale", None), {}, 1), fp16) == "fail"  # no GradScaler ran
    nccl = "NCCL through torchrun"
    assert _status(judge(_with("nccl.run.backend", "gloo"), {}, 1), nccl) == "fail"
    assert _status(judge(_with("nccl.run.torchrun", False), {}, 1), nccl) == "fail"
    assert _status(judge(_with("nccl.bench_all_correct", False), {}, 1), nccl) == "fail"
    assert _status(judge(_with("memory.ratio", 1.12), {}, 1), "GPT-2 small memory vs model") == "fail"
    assert _status(judge(_with("memory.ratio", 0.88), {}, 1), "GPT-2 small memory vs model") == "fail"
    assert _status(judge(_with("memory.states_ratio", 1.03), {}, 1), "GPT-2 small memory vs model") == "fail"
    assert _status(judge(_with("mfu.compiled.mfu", math.nan), {}, 1), "GPT-2 small MFU") == "fail"  # no peak known
    assert _status(judge(_with("mfu.eager.mfu", 1.2), {}, 1), "GPT-2 small MFU") == "fail"  # a wrong peak
    assert _status(judge(_with("profile.known_profile", False), {}, 1), "profile and dtype") == "fail"
    assert _status(judge(_with("profile.dtype", "float32"), {}, 1), "profile and dtype") == "fail"
    assert _status(judge(GOOD, {}, gpu_check.TIME_LIMIT_S + 1), "within the time limit") == "fail"
    ranks = "in-kernel ranks after a CUDA backward"
    assert _status(judge(_with("ranks.isolated", {"ok": False, "error": "RuntimeError: fork", "seconds": 1}), {}, 1),
                   ranks) == "fail"
    share = "--nproc=2 on one GPU"
    assert _status(judge(_with("share.device", "cpu"), {}, 1), share) == "fail"  # the GPU recipe on CPU ranks
    refused = {"ran": False, "refused_before_start": True, "message": "use --nproc=1\n"}
    assert _status(judge(_with("share", refused), {}, 1), share) == "pass"
    assert _status(judge(_with("share", {**refused, "refused_before_start": False}), {}, 1), share) == "fail"
    missing = {k: v for k, v in GOOD.items() if k != "memory"}
    (v,) = [v for v in judge(missing, {"memory": "OutOfMemoryError: CUDA out of memory\ntraceback"}, 1)
            if v.check.startswith("GPT-2 small memory")]
    assert (v.status, v.detail) == ("error", "OutOfMemoryError: CUDA out of memory")


def _fake_steps(fail: str | None = None, crash: str | None = None):
    def make(name):
        def step(out):
            if name == fail:
                raise RuntimeError(f"{name} broke")
            if name == crash:
                raise KeyboardInterrupt
            return GOOD[name]
        return step
    return {s.name: make(s.name) for s in PLAN}


def test_reports_are_written_and_appended(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Earlier section\n\nkept\n")
    report = run_check(tmp_path / "out", _fake_steps(fail="memory"), results_md=results, log=lambda *_: None)
    saved = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert saved["figures"]["recipes"] == GOOD["recipes"] and "memory" not in saved["figures"]
    assert saved["errors"]["memory"].startswith("RuntimeError: memory broke")
    assert {v["check"]: v["status"] for v in saved["verdicts"]}["GPT-2 small memory vs model"] == "error"
    assert [s["status"] for s in saved["steps"]] == ["ok", "ok", "ok", "ok", "error", "ok", "ok", "ok"]
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert md.startswith("## GPU check (`course check-gpu`)") and "NVIDIA H100 80GB HBM3" in md
    assert "| bf16 recipe vs nanoGPT | pass | best val 1.4702 vs 1.4697 (+0.0005, margin 0.05)" in md
    assert "| GPT-2 small memory vs model | ERROR | RuntimeError: memory broke |" in md
    assert "8 of 9 checks pass" in md
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\n## Earlier section\n\nkept\n\n## GPU check") and text.endswith(md)
    assert report["verdicts"] == saved["verdicts"]
    run_check(tmp_path / "out2", _fake_steps(), results_md=results, log=lambda *_: None)
    assert results.read_text().count("## GPU check") == 2  # appended, never overwritten


def test_a_crash_keeps_the_steps_already_measured(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run_check(tmp_path, _fake_steps(crash="nccl"), log=lambda *_: None)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(saved["figures"]) == ["profile", "data", "recipes"]


TINY = ["--config=shakespeare_char_cpu", "--device=cpu", "--n_layer=1", "--n_head=2", "--n_embd=16",
        "--block_size=16", "--batch_size=4", "--max_iters=3", "--lr_decay_iters=3", "--warmup_iters=1",
        "--eval_interval=3", "--eval_iters=1", "--log_interval=1", "--threads=1"]


@pytest.mark.slow  # four trainer processes and a benchmark: ~20 s idle, a minute on a loaded machine
@pytest.mark.timeout(240)
def test_measurement_steps_run_on_a_cpu_at_toy_sizes(tmp_path):
    """The real step functions, with CPU stand-ins for what needs a GPU (fp32, gloo)."""
    prepare("shakespeare_char", tmp_path / "data", quiet=True)
    data = f"--data_dir={tmp_path / 'data'}"
    profile = gpu_check.profile_step(tmp_path, device="cpu")
    assert (profile["profile"], profile["dtype"], profile["device"]) == ("cpu", "float32", "cpu")

    runs = gpu_check.recipes_step(tmp_path, {"a": [*TINY, data], "b": [*TINY, data, "--seed=7"]})
    for name in ("a", "b"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert runs[name]["best_val_loss"] == summary["best_val_loss"] and runs[name]["iters"] == 3
        # course train always runs its workers under torchrun, one of them here
        assert (runs[name]["dtype"], runs[name]["world_size"], runs[name]["torchrun"]) == ("float32", 1, True)
    assert runs["a"]["best_val_loss"] != runs["b"]["best_val_loss"]  # two runs, not one read twice

    nccl = gpu_check.nccl_step(tmp_path, [*TINY, data, "--nproc=1", "--strategy=ddp"], backend="gloo",
                               sizes=("1K",))
    assert (nccl["run"]["backend"], nccl["run"]["world_size"], nccl["run"]["torchrun"]) == ("gloo", 1, True)
    assert nccl["bench_all_correct"] and {r["op"] for r in nccl["bench"]} >= {"all_reduce", "broadcast"}

    shape = ModelShape("toy", n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=65, batch_size=2)
    mfu = gpu_check.mfu_step(tmp_path, shape, batch_size=2, steps=2, warmup=1, compile_modes=(False,),
                             device="cpu", dtype="float32")
    assert mfu["eager"]["tokens_per_s"] > 0 and 0 < mfu["eager"]["mfu"] < 1 and "compiled" not in mfu
    verdicts = judge({"mfu": mfu}, {}, 1)
    assert _status(verdicts, "GPT-2 small MFU") == "fail"  # the compiled half is missing

    share = gpu_check.share_step(tmp_path, [*TINY, data, "--nproc=2"])
    assert (share["ran"], share["world_size"], share["device"]) == (True, 2, "cpu")
    refused = gpu_check.share_step(tmp_path, [*TINY, data, "--nproc=0"])  # bad input: nothing starts
    assert not refused["ran"] and refused["refused_before_start"] and "nproc" in refused["message"]


def test_full_plan_judges_the_gpu_tests_and_every_lesson():
    full = gpu_check.FULL_PLAN
    assert [v.status for v in judge(FULL, {}, 1, full)] == ["pass"] * 11
    assert _status(judge({**FULL, "gpu_tests": {"passed": 4, "failed": 0, "skipped": 1}}, {}, 1, full),
                   "tests marked gpu") == "fail"  # a GPU test that skips on a GPU machine is a fault
    bad = {**FULL["lessons"], "09_mixed": {"ok": False, "seconds": 3.0, "error": "CellExecutionError"}}
    (v,) = [v for v in judge({**FULL, "lessons": bad}, {}, 1, full) if v.check == "lessons in full mode"]
    assert v.status == "fail" and "09 3 s FAILED" in v.detail
    assert "lessons in full mode" not in {v.check for v in judge(GOOD, {}, 1)}  # not planned without --full


@pytest.mark.timeout(240)
def test_rank_probe_runs_the_in_kernel_helpers_after_a_backward(tmp_path):
    """The probe check-gpu runs after a CUDA backward, here after a CPU one: every helper answers
    with the right value, in a process of its own."""
    figures = gpu_check.ranks_step(tmp_path, device="cpu")
    for name in ("run_ranks", "notebook_launcher", "isolated"):
        assert figures[name]["ok"], figures[name]
    assert (tmp_path / "ranks_probe.log").exists()


def test_gpu_tests_and_lessons_steps_count_what_ran(tmp_path):
    root = tmp_path / "clone"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    (root / "tests" / "test_x.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_a():\n    pass\n\n@pytest.mark.gpu\n"
        "def test_b():\n    assert 1 == 2\n\ndef test_not_gpu():\n    pass\n")
    t = gpu_check.gpu_tests_step(tmp_path, root=root)
    assert (t["passed"], t["failed"], t["skipped"]) == (1, 1, 0) and t["exit_code"] == 1

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1 + 1")])
    bad = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise ValueError('boom')")])
    for name, book in (("01_ok.ipynb", nb), ("02_bad.ipynb", bad)):
        nbformat.write(book, tmp_path / name)
    lessons = gpu_check.lessons_step(tmp_path, [tmp_path / "01_ok.ipynb", tmp_path / "02_bad.ipynb"],
                                     smoke=True)
    assert lessons["01_ok"]["ok"] and lessons["01_ok"]["seconds"] >= 0
    assert not lessons["02_bad"]["ok"] and "boom" in lessons["02_bad"]["error"]
