"""One training path: every bad request is refused by check_request in one line before anything
is spawned or written (through launch_training and through ``course train`` alike), and a new
kind of check plugs into CHECKS. The runs themselves (course train vs launch_training on real
gloo workers) are in tests/test_train_distributed.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kernel_cells import spawned_here

from course_lib.gpt import checkpoint as ckpt_io
from course_lib.gpt.data import DataError, prepare
from course_lib.hardware import cpu_autocast_dtypes, gpu_count
from course_lib.launch import checks, launch_training, training
from course_lib.launch.placement import plan_ranks
from course_lib.launch.training import cli
from course_lib.registry import STRATEGIES, ConfigError
from course_lib.trainer.config import RUN_FILES, make_config

TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 4, "max_iters": 4,
        "lr_decay_iters": 4, "warmup_iters": 1, "eval_interval": 2, "eval_iters": 1, "device": "cpu", "threads": 1}


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """A dataset of 3,000 characters: its val split holds 300 tokens."""
    root = tmp_path_factory.mktemp("small")
    text = root / "small.txt"
    text.write_text(("To be, or not to be, that is the question.\n" * 70)[:3000])
    prepare("shakespeare_char", root / "data", source=text, quiet=True)
    return root / "data"


def tiny(data_dir, out_dir, **kw):
    return make_config("shakespeare_char_cpu", {**TINY, "data_dir": str(data_dir), "out_dir": str(out_dir), **kw})


def fake_run(out_dir, cfg, world_size: int = 1) -> None:
    """A last.pt with what check_request reads (config, iteration, ranks): no training needed."""
    out_dir.mkdir(parents=True)
    ckpt_io.save_checkpoint(out_dir / ckpt_io.LAST, {"format": ckpt_io.FORMAT_VERSION, "config": cfg.to_dict(),
                                                     "iter_num": 2, "world_size": world_size})


def refused(cfg, error, match, **kw) -> str:
    """launch_training refuses ``cfg`` with one line, spawning nothing and writing nothing."""
    before = spawned_here()
    files = sorted(p.name for p in Path(cfg.out_dir).glob("*"))
    with pytest.raises(error, match=match) as e:
        launch_training(cfg, overwrite=False, **kw)
    assert spawned_here() <= before, "a refused run started processes"
    assert sorted(p.name for p in Path(cfg.out_dir).glob("*")) == files, "it wrote files"
    assert "\n" not in str(e.value), f"not one line: {e.value}"
    return str(e.value)


def test_data_and_block_size(small_data, tmp_path):
    refused(tiny(tmp_path / "nothing", tmp_path / "a"), DataError,
            f"not prepared .*run: course data prepare shakespeare_char --data-dir {tmp_path / 'nothing'}")
    refused(tiny(small_data, tmp_path / "b", block_size=512), ConfigError,
            "block_size 512 is longer than the shakespeare_char val split")


def test_device_ranks_dtype_strategy_memory(small_data, tmp_path):
    cfg = tiny(small_data, tmp_path / "run")
    if gpu_count() == 0:
        refused(cfg.replace(device="cuda"), ConfigError, r"device='cuda' but this machine has no GPU", nproc=2)
    else:  # more ranks than GPUs share them over gloo (tests/test_placement.py); NCCL allows one rank per GPU
        refused(cfg.replace(device="cuda"), ConfigError, r"ranks on \d+ GPU\(s\) here with NCCL",
                nproc=gpu_count() + 1, backend="nccl")
    # the backend asked for is checked with the ranks' devices (it once reached launch() twice: a TypeError)
    refused(cfg.replace(device="cpu"), ConfigError, "NCCL runs on GPUs only", nproc=2, backend="nccl")
    if "float16" in cpu_autocast_dtypes():  # torch 2.13: CPU fp16 autocast exists, the lesson uses it
        checks.check_request(cfg.replace(dtype="float16"))
    else:
        refused(cfg.replace(dtype="float16"), ConfigError, "dtype: float16 autocast is not supported on CPU")
    refused(cfg.replace(strategy="single"), ConfigError, "strategy 'single' runs one process but 2 ranks", nnodes=2)
    refused(cfg.replace(strategy="single"), ConfigError, "strategy 'single' runs one process but nproc=2", nproc=2)
    refused(cfg.replace(nproc=2), ConfigError, "nproc must be a whole number", nproc="two")
    refused(cfg.replace(n_layer=48, n_head=25, n_embd=1600, block_size=256, batch_size=512), ConfigError,
            r"GB per rank \(launch.checks.estimate_bytes.*lower batch_size")


def test_resume_and_a_run_already_there(small_data, tmp_path):
    cfg = tiny(small_data, tmp_path / "run")
    refused(cfg.replace(init_from="resume"), ckpt_io.CheckpointError, "no checkpoint at")
    fake_run(tmp_path / "run", cfg)
    refused(cfg, ConfigError, "already holds a run .*--resume.*--overwrite")
    resume = cfg.replace(init_from="resume")
    msg = refused(resume.replace(n_layer=2, learning_rate=1e-2), ConfigError, "cannot resume")
    assert "n_layer: checkpoint has 1, now 2" in msg and "--n_layer=1 --learning_rate=0.001" in msg
    # another layout resumes only with the same global batch (batch_size x accumulation x dp)
    refused(resume.replace(nproc=2), ConfigError, "global batch of 4 sequences per step, this layout has 8")
    refused(resume, ConfigError, "global batch of 4 sequences per step, this layout has 8", nnodes=2)
    checks.check_request(resume.replace(nproc=2, batch_size=2))  # 2 ranks x 2: the same 4 sequences
    refused(resume.replace(max_iters=1), ConfigError, "at iteration 2, past max_iters=1")
    req = checks.check_request(resume)  # and the same request, right, passes every check
    assert (req.world_size, req.strategy, req.device) == (1, "single", "cpu")


@pytest.mark.parametrize("kw,error,match", [
    ({"nprocs": 2}, TypeError, r"unknown field\(s\) nprocs"),
    ({"device": "cuda"}, TypeError, r"sets device itself; leave it out \(device, timeout_s and out_dir are fields"),
    ({"env": ["A=1"]}, ConfigError, "env must be a dict of variable names to values"),
    ({"show_ranks": 0}, ConfigError, "show_ranks must be 'all' or rank numbers"),
    ({"show_ranks": "0"}, ConfigError, "show_ranks must be 'all' or rank numbers"),
    ({"rdzv": "etcd"}, ConfigError, "rdzv must be one of"),
    ({"timeout": 0}, ConfigError, "timeout must be a number of seconds > 0"),
    ({"before_start": print}, TypeError, "sets before_start itself")], ids=lambda v: str(v)[:24])
def test_a_bad_keyword_leaves_the_run_it_would_overwrite(small_data, tmp_path, kw, error, match):
    """launch_training overwrites by default (a re-run cell starts afresh), so every keyword is checked
    before the old run's files go: a mistyped one once deleted last.pt and best.pt, then was refused."""
    cfg = tiny(small_data, tmp_path / "run")
    fake_run(tmp_path / "run", cfg)
    files = sorted(p.name for p in (tmp_path / "run").iterdir())
    before = spawned_here()
    with pytest.raises(error, match=match):
        launch_training(cfg, **kw)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == files
    assert spawned_here() <= before


def test_a_new_run_clears_every_file_of_the_old_one(small_data, tmp_path):
    """An overwritten run keeps nothing the trainer wrote (a model-parallel run's ranks.json once
    stayed beside the next run's files, and the layout tables mixed the two); a resumed run keeps
    its files. Either way the half-written temporary files of a stopped worker go: SIGTERM and
    SIGKILL skip atomic_write's own cleanup, and a checkpoint's is as large as the checkpoint."""
    cfg = tiny(small_data, tmp_path / "run")
    fake_run(tmp_path / "run", cfg)
    trainer_files = [n for n in RUN_FILES if n not in ("last.pt", "config.json")]
    debris = [".last.pt.k2j4x9.tmp", ".metrics.csv.a1b2c3.tmp"]
    for name in trainer_files + debris + ["notes.txt"]:
        (tmp_path / "run" / name).write_text("old")
    training.prepare_run(cfg.replace(init_from="resume"))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted(["last.pt", "config.json", "notes.txt"]
                                                                          + trainer_files)
    for name in debris:
        (tmp_path / "run" / name).write_text("old")
    training.prepare_run(cfg, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json", "notes.txt"]


def test_course_train_reports_the_same_errors_in_one_line(small_data, tmp_path, capsys):
    args = [f"--{k}={v}" for k, v in TINY.items()] + [f"--data_dir={small_data}", f"--out_dir={tmp_path / 'run'}"]
    assert cli([*args, "--block_size=512", "--nproc=2"]) == 2
    assert capsys.readouterr().err == ("course train: error: block_size 512 is longer than the shakespeare_char "
                                       "val split\n")
    assert cli(["--config=shakespeare_char_cpu", *args, "--resume"]) == 1  # CheckpointError: nothing to resume
    err = capsys.readouterr().err
    assert err.startswith("course train: error: no checkpoint at") and err.count("\n") == 1
    assert cli([*args, "--grad_comm_dtype=bfloat16", "--strategy=zero2", "--nproc=2"]) == 2
    err = capsys.readouterr().err
    assert "grad_comm_dtype=bfloat16 is for data-parallel" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
    (tmp_path / "a_file").write_text("")  # an out_dir that cannot be made (as root too): one line, no traceback
    assert cli([*args, f"--out_dir={tmp_path / 'a_file' / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"course train: error: cannot write the run directory {tmp_path / 'a_file' / 'run'} "
                   "(Not a directory); choose another --out_dir\n")


def test_a_new_check_plugs_in(small_data, tmp_path, monkeypatch):
    """What a tensor-parallel helper does: append a function of the request to CHECKS."""
    def check_even_ranks(req):
        if req.world_size % 2:
            raise checks.LaunchConfigError(f"{req.world_size} ranks: this layout needs an even number")

    monkeypatch.setattr(checks, "CHECKS", [*checks.CHECKS, check_even_ranks])
    refused(tiny(small_data, tmp_path / "run", nproc=3), ConfigError, "3 ranks: this layout needs an even number")
    assert checks.check_request(tiny(small_data, tmp_path / "run", nproc=2)).world_size == 2


def test_the_worker_imports_no_launch_code():
    """python -m course_lib.trainer.loop starts without the host side (and no import cycle through it)."""
    code = ("import sys, course_lib.trainer.loop; "
            "print(sorted(m for m in sys.modules if m.startswith('course_lib.launch')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "[]"


def test_terminal_display_relays_rank_0_byte_for_byte(tmp_path):
    """course train's display: rank 0's output as written (a redrawn bar, a character split
    between two reads), other ranks' stderr still prefixed; the notebook's prefixes every line."""
    import io

    from course_lib.launch.supervise import OutputStreamer

    bar = "\rrun:  50%|█    | 1/2\rrun: 100%|██| 2/2\n".encode()
    (tmp_path / "rank0.out").write_bytes(b"header\n" + bar[:12])  # cut inside a multi-byte character
    (tmp_path / "rank1.err").write_bytes(b"warning from rank 1\n")
    raw, ranks = (OutputStreamer(str(tmp_path), (0,), io.StringIO(), io.StringIO(), raw=r) for r in (True, False))
    raw.poll()
    with open(tmp_path / "rank0.out", "ab") as f:
        f.write(bar[12:])
    raw.poll()
    ranks.poll(final=True)
    assert raw.out.getvalue() == "header\n" + bar.decode()
    assert raw.err.getvalue() == ranks.err.getvalue() == "[rank1] warning from rank 1\n"
    assert ranks.out.getvalue() == "[rank0] header\n[rank0] run: 100%|██| 2/2\n"  # what a terminal kept


def test_torch_fsdp_on_a_gpu_shared_over_gloo_is_refused(small_data, tmp_path):
    """Issue 28's H200 run: fsdp_grad_op on 2 ranks sharing one GPU over gloo died with SIGSEGV.
    The check refuses PyTorch's FSDP2 there (a one-GPU plan, made without a GPU) and lets the
    course's zero3 and a one-rank-per-GPU NCCL plan through."""
    cfg = tiny(small_data, tmp_path / "run", nproc=2)
    shared, nccl = plan_ranks(1, 2), plan_ranks(2, 2)  # cuda:0 twice over gloo; cuda:0, cuda:1 over NCCL
    assert shared.backend == "gloo" and nccl.backend == "nccl"
    fsdp = [n for n, info in STRATEGIES.items() if info.needs_nccl_on_cuda]
    assert fsdp == ["fsdp_grad_op", "fsdp_full"]  # PyTorch's FSDP2, as the registry says
    for name in fsdp:
        with pytest.raises(ConfigError, match=rf"{name} \(PyTorch's FSDP2\) needs NCCL for CUDA tensors.*share a GPU"):
            checks.check_strategy_world(checks.TrainRequest(cfg.replace(strategy=name), 1, "cuda", plan=shared))
        checks.check_strategy_world(checks.TrainRequest(cfg.replace(strategy=name), 1, "cuda", plan=nccl))
        checks.check_strategy_world(checks.TrainRequest(cfg.replace(strategy=name), 1, "cpu", plan=plan_ranks(0, 2)))
    checks.check_strategy_world(checks.TrainRequest(cfg.replace(strategy="zero3"), 1, "cuda", plan=shared))


def test_train_in_process_refuses_ranks_before_touching_the_run(small_data, tmp_path):
    """train_in_process once prepared the run directory first: asked for 2 ranks, it cleared the
    old run's last.pt (or made the folder and its config.json) and only then said "need workers"."""
    cfg = tiny(small_data, tmp_path / "run", nproc=2)
    fake_run(tmp_path / "run", cfg)
    files = sorted(p.name for p in (tmp_path / "run").iterdir())
    with pytest.raises(ConfigError, match=r"2 rank\(s\) with strategy \w+ need workers"):
        training.train_in_process(cfg, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == files
    with pytest.raises(ConfigError, match="need workers"):
        training.train_in_process(cfg.replace(out_dir=str(tmp_path / "new")))
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("kw,match", [({"grace": None}, "grace must be a number of seconds"),
                                      ({"env": {"A=B": "1"}}, "env must be a dict of variable names"),
                                      ({"rdzv_endpoint": "node01", "rdzv_id": "x"}, "rdzv_endpoint must be HOST:PORT")])
def test_a_bad_launch_field_leaves_the_run_it_would_overwrite(small_data, tmp_path, kw, match):
    """Fields only the launcher read once got past every check: before_start cleared the old run
    (last.pt, metrics), then grace=None raised a TypeError, a bad name or endpoint a ValueError."""
    cfg = tiny(small_data, tmp_path / "run")
    fake_run(tmp_path / "run", cfg)
    files = sorted(p.name for p in (tmp_path / "run").iterdir())
    before = spawned_here()
    with pytest.raises(ConfigError, match=match):
        launch_training(cfg, nproc=2, **kw)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == files
    assert spawned_here() <= before
