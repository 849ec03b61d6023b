"""A run's configuration as a student meets it: what the help promises, what a flag selects.

    python -m pytest tests/test_config_audit.py

Each test is a bug that was found (a help text or a docstring that the code did not keep) and
stays fixed; the GPU count is an input (course_lib.launch.placement.plan_ranks), so the GPU cases
run on CPU.
"""

from __future__ import annotations

import pytest

from course_lib.launch import checks
from course_lib.launch.placement import PlanError, plan_ranks
from course_lib.launch.training import build_config
from course_lib.registry import ConfigError
from course_lib.trainer.config import check_resumable, make_config


@pytest.mark.timeout(60)
def test_init_from_resume_is_the_same_as_resume(tmp_path):
    # --help: "--resume  continue the run in --out_dir (= --init_from=resume)"; the field alone used
    # to start from the defaults, so the resume was refused for every field the run had changed
    run = make_config("shakespeare_char", {"out_dir": str(tmp_path), "max_iters": 5})
    run.save()
    flag, _ = build_config(["--resume", f"--out_dir={tmp_path}", "--max_iters=9"])
    field, _ = build_config(["--init_from=resume", f"--out_dir={tmp_path}", "--max_iters=9"])
    assert field == flag == run.replace(init_from="resume", max_iters=9)


@pytest.mark.timeout(60)
def test_cuda_n_places_the_rank_on_gpu_n():
    # config.py: device 'cuda:N'; the plan put the rank on cuda:0 whatever N was
    plan = plan_ranks(2, 1, device="cuda:1")
    assert plan.devices == ("cuda:1",) and plan.backend == "nccl"
    assert plan.device_type == "cuda" and plan.gpus_per_node == 1
    assert plan_ranks(2, 1, device="cuda:0").devices == ("cuda:0",)


@pytest.mark.timeout(60)
def test_cuda_n_beyond_the_gpus_or_for_several_ranks_is_refused():
    # Colab has one T4: cuda:1 does not exist (it ran on cuda:0, or failed in the worker)
    with pytest.raises(PlanError, match=r"device='cuda:1' but this machine has 1 GPU \(cuda:0\); use --device=cuda"):
        plan_ranks(1, 1, device="cuda:1")
    # one GPU by number, several ranks: ambiguous, so the message says how to ask for either
    with pytest.raises(PlanError, match=r"device='cuda:1' names one GPU, for one rank; for 2 ranks use --device=cuda"):
        plan_ranks(4, 2, device="cuda:1")


@pytest.mark.timeout(60)
def test_a_training_request_keeps_the_gpu_it_names(monkeypatch):
    # run_training hands req.device to the launcher, which plans again: "cuda" became cuda:0 there
    monkeypatch.setattr(checks.placement, "gpu_count", lambda: 2)  # a 2-GPU node
    monkeypatch.setattr(checks, "CHECKS", [])  # the checks themselves read the GPU: only the plan here
    req = checks.check_request(make_config("shakespeare_char_cpu", {"device": "cuda:1"}))
    assert (req.device, req.device_type, req.plan.devices) == ("cuda:1", "cuda", ("cuda:1",))
    assert checks.placement.plan(1, req.device).devices == ("cuda:1",)
    cpu = checks.check_request(make_config("shakespeare_char_cpu", {"device": "cpu", "nproc": 2}))
    assert (cpu.device, cpu.device_type) == ("cpu", "cpu")


@pytest.mark.timeout(60)
def test_a_resume_may_change_the_precision_as_dtype_auto_already_does():
    # A T4 (fp16) run continued on a laptop: with dtype=auto the precision changes (fp16 -> fp32) and
    # the resume was accepted; spelled out (--dtype=float32) the same change was refused. The
    # trainer loads the loss scaler's state only where both runs scale (trainer/loop.py).
    t4 = make_config("shakespeare_char_cpu", {"device": "cuda", "dtype": "float16"}).to_dict()
    laptop = make_config("shakespeare_char_cpu", {"device": "cpu", "dtype": "float32", "init_from": "resume"})
    check_resumable({**t4, "dtype": "auto"}, laptop.replace(dtype="auto"), iter_num=10)
    check_resumable(t4, laptop, iter_num=10)
    a100 = {**t4, "dtype": "bfloat16"}  # and an A100's bf16 run continued on a T4, which has no bf16
    check_resumable(a100, laptop.replace(device="cuda", dtype="float16"), iter_num=10)
    with pytest.raises(ConfigError, match=r"n_layer: checkpoint has 4, now 6.*--n_layer=4"):  # the model still may not
        check_resumable(t4, laptop.replace(n_layer=6), iter_num=10)
