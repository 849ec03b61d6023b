"""course check-gpu [--dry-run] [--full] [--only STEP,...] [--out runs/gpu-check] [--results benchmarks/RESULTS.md]
python -m course_lib.experiments.gpu_check --probe cuda|cpu   (the probe the ``ranks`` step runs)

One command that checks the course on one CUDA GPU in under 12 minutes, with a verdict per check:

1. the hardware profile and dtype :mod:`course_lib.hardware` detects (bf16 on A100/H100/L4);
2. nanoGPT's ``shakespeare_char`` recipe trained in bf16: the best validation loss against the
   1.4697 nanoGPT's README publishes for it ("On one A100 GPU this training run takes about 3
   minutes and the best validation loss is 1.4697"), within :data:`LOSS_MARGIN`;
3. the T4 path forced on the same GPU (fp16 autocast with loss scaling), trained side by side
   with (2): the same loss within :data:`FP16_MATCH`;
4. a 1-rank NCCL process group through torchrun (the trainer with ``--nproc=1 --strategy=ddp``)
   and the collectives benchmark (``course bench comm --backend nccl --nproc 1``);
5. the memory of a GPT-2-small training step against the memory model
   (:func:`course_lib.analysis.memory.step_peak`): weights + Adam moments within :data:`STATES_TOLERANCE`,
   ``torch.cuda.max_memory_allocated`` within :data:`MEMORY_BAND` of the modelled peak;
6. the MFU of a GPT-2-small-shaped bf16 step, eager and with ``torch.compile``;
7. the in-kernel rank helpers (``run_ranks``, ``notebook_launcher``, ``grading.isolated``) called
   from a process that has already run a CUDA backward and started a thread, as a notebook kernel
   has. Forked ranks died there ("Unable to handle autograd's threading in combination with
   fork-based multiprocessing", "CUDA error: initialization error"). The probe runs in a fresh
   interpreter (``--probe``, the second command above), so the state it builds is its own, and
   prints one JSON line;
8. ``course train --nproc=2`` on one GPU, which must use the GPU (both ranks on it) or refuse
   before it starts; it once ran the GPU recipe on two CPU ranks without a word;
9. with ``--full`` (``make test-gpu``) also the tests marked ``gpu`` (pytest in the clone) and
   every lesson in full mode, each in its own process, with its wall time.

It writes ``gpu_check.json`` (after every step, so a crash loses nothing) and ``gpu_check.md`` in
``--out`` and appends the Markdown to ``benchmarks/RESULTS.md`` (in a clone). ``--dry-run`` prints
the plan; ``--only`` runs some of its steps.

The module reads top to bottom: the thresholds and the plan; one function per step, which takes
the output folder and returns plain, JSON-ready figures (devices, shapes and trainer arguments are
parameters, so the tests run the same code on a CPU at toy sizes; the command uses the defaults:
one CUDA GPU, the course's recipes, GPT-2 small); :func:`judge`, which turns the figures into
verdicts; the reports; the command line; the probe's entry point. It imports no torch: ``--help``
and ``--dry-run`` start at once, and a step imports torch and the trainer when it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING


from course_lib.analysis.memory import ModelShape, get_preset
from course_lib.exercises import grading
from course_lib.experiments.comm_bench import run_benchmark
from course_lib.gpt.data import prepare
from course_lib.hardware import PROFILES, GiB, detect, pick_dtype
from course_lib.launch.forked import notebook_launcher
from course_lib.launch.spawn import run_ranks
from course_lib.utils import atomic_write_bytes, progress_bar, repo_root

if TYPE_CHECKING:  # for the annotations only: torch is imported when a step runs
    import torch

    from course_lib.parallel.step import Precision

NANOGPT_VAL_LOSS = 1.4697  # nanoGPT README, shakespeare_char, best val loss on one A100
# One published run, not a mean: our trainer draws its batches and its fixed eval batches from its
# own generators and runs in eager mode, so the curve differs from nanoGPT's by seed-level noise
# (dropout 0.2 on a 10M-parameter model). 0.05 (3.4%) covers that; a real fault shows up larger
# (the loss is ~1.6 after half the iterations, ~2.5 at the character-frequency level).
LOSS_MARGIN = 0.05
FP16_MATCH = 0.03  # |fp16 - bf16| best val loss: both round to 16 bits; loss scaling keeps the small grads
# Weights + Adam moments after a step: exact up to the allocator's 512-byte rounding.
STATES_TOLERANCE = 0.02
# Peak / modelled peak of the whole step (course_lib.analysis.memory.step_peak: states, activations and
# the cross-entropy's two fp32 gradients at the start of backward), within 10 % as issue 21 asks.
# On a CPU the model meets the live tensors of a real step within 1 % (tests/test_step_peak.py);
# on a GPU the allocator's rounding adds a little. On an H200 (issue 28): x0.91 with the CPU's loss
# term, x1.00 with the GPU's (analysis.memory.step_peak).
MEMORY_BAND = (0.9, 1.1)
TIME_LIMIT_S = 720.0  # the plan below sums to 680 s
STATUSES = ("pass", "fail", "error")

# nanoGPT's recipe (config/train_shakespeare_char.py) in bf16, and the T4 path forced on the same
# GPU: fp16 autocast, for which the trainer turns on loss scaling (GradScaler).
RECIPES = {"bf16": ("--config=shakespeare_char", "--dtype=bfloat16"),
           "fp16": ("--config=shakespeare_char", "--dtype=float16")}
NCCL_RUN = ("--config=shakespeare_char", "--max_iters=20", "--eval_interval=10", "--eval_iters=2",
            "--log_interval=5", "--nproc=1", "--strategy=ddp")
SHARE_RUN = ("--config=shakespeare_char", "--max_iters=20", "--eval_interval=10", "--eval_iters=2",
             "--log_interval=5", "--nproc=2")
PROBE_TIMEOUT_S = 300.0


# -- the plan -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    name: str
    title: str
    budget_s: int  # the time this step should take on an A100/H100 (the plan's arithmetic)
    does: str


PLAN = (
    Step("profile", "profile and dtype", 10, "course_lib.hardware.detect('cuda') and pick_dtype"),
    Step("data", "data", 10, "course data prepare shakespeare_char (nothing if prepared)"),
    Step("recipes", "shakespeare_char bf16 + fp16", 330,
         "course train --config=shakespeare_char --dtype=bfloat16 | --dtype=float16 (loss scaling), side by side"),
    Step("nccl", "NCCL through torchrun", 60,
         "course train --nproc=1 --strategy=ddp (torchrun, NCCL), 20 iters; course bench comm --backend nccl --nproc 1"),
    Step("memory", "GPT-2 small memory", 30, "max_memory_allocated of a bf16 step (batch 12 x 1024) vs step_peak()"),
    Step("mfu", "GPT-2 small MFU", 150, "bf16 steps (batch 12 x 1024), eager then torch.compile; MFU vs peak"),
    Step("ranks", "in-kernel ranks after CUDA", 30,
         "run_ranks, notebook_launcher, grading.isolated from a process that ran a CUDA backward"),
    Step("share", "--nproc=2 on one GPU", 60, "course train --nproc=2, 20 iters: both ranks on the GPU, or refused"),
)
# make test-gpu: the check plus the suite's GPU tests and every lesson in full mode
FULL_PLAN = PLAN + (
    Step("gpu_tests", "tests marked gpu", 120, "python -m pytest -m gpu (in a clone)"),
    Step("lessons", "lessons in full mode", 1500, "notebooks/01..10 executed in full mode, each timed"),
)


def time_limit(plan=PLAN) -> float:
    """The base check's limit, plus the planned time of each step beyond it (``--full``)."""
    return TIME_LIMIT_S + sum(s.budget_s for s in plan if s not in PLAN)


def plan_text(plan=PLAN) -> str:
    lines = [(f"course check-gpu: {len(plan)} steps, about {sum(s.budget_s for s in plan)} s "
              f"(limit {time_limit(plan):.0f} s) on one A100/H100-class GPU")]
    lines += [f"  {i}. {s.name:<9} ~{s.budget_s:>4} s  {s.does}" for i, s in enumerate(plan, 1)]
    lines += ["pass if:", f"  bf16 best val loss within {LOSS_MARGIN} of nanoGPT's {NANOGPT_VAL_LOSS}",
              f"  fp16 (loss scaling) best val loss within {FP16_MATCH} of bf16's",
              (f"  weights + Adam moments within {STATES_TOLERANCE:.0%} of the memory model; "
               f"peak / modelled total in [{MEMORY_BAND[0]}, {MEMORY_BAND[1]}]"),
              "  NCCL: 1 rank under torchrun, every benchmarked collective correct; 0 < MFU <= 1",
              "  run_ranks, notebook_launcher and isolated give the right values after a CUDA backward",
              "  --nproc=2 on one GPU: both ranks on cuda, or refused before any rank starts",
              f"  the whole check within {time_limit(plan):.0f} s"]
    return "\n".join(lines)


# -- the steps: one function each, the output folder in, JSON-ready figures out -----------------

def profile_step(out: Path, device: str = "cuda") -> dict:
    """What :mod:`course_lib.hardware` detects and the dtype the trainer would pick."""
    # torch here, not at the top: `course check-gpu --help` and `--dry-run` start without it
    import torch

    profile = detect(device)
    cuda = device.startswith("cuda")
    return {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "capability": ".".join(map(str, torch.cuda.get_device_capability(device))) if cuda else None,
            "profile": profile.name, "known_profile": profile.name in PROFILES,
            "dtype": pick_dtype(profile), "expected_dtype": profile.train_dtype,
            "grad_scaler": profile.needs_grad_scaler, "bf16_supported": cuda and torch.cuda.is_bf16_supported(),
            "memory_gib": round(profile.memory_bytes / GiB, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda}


def data_step(out: Path, data_dir: str | None = None) -> dict:
    """Prepare shakespeare_char (nothing to do when it is already there)."""
    t0 = time.perf_counter()
    folder = prepare("shakespeare_char", data_dir, quiet=True)
    return {"data_dir": str(folder), "seconds": round(time.perf_counter() - t0, 2)}


def _last_iter(metrics: Path) -> int:
    try:
        lines = metrics.read_text().strip().splitlines()
        return int(lines[-1].split(",")[0]) if len(lines) > 1 else 0
    except (OSError, ValueError):
        return 0


def train_runs(out: Path, runs: dict[str, Sequence[str]], timeout_s: float = 900.0) -> dict:
    """``course train`` for each of ``runs`` (name -> arguments) side by side, each in its own
    process and run folder (``out/NAME``, log in ``out/NAME.log``); one progress bar follows
    their metrics.csv. Returns each run's summary.json and run.json figures and its wall time."""
    # the trainer's modules import torch: only when a step runs (`--dry-run` starts without it)
    from course_lib.gpt.checkpoint import load_checkpoint
    from course_lib.launch.training import build_config

    procs, totals, t0 = {}, {}, time.perf_counter()
    for name, args in runs.items():
        argv = [*args, f"--out_dir={out / name}", "--overwrite", "--no-progress"]
        totals[name] = build_config(argv)[0].max_iters
        with open(out / f"{name}.log", "w") as log:  # the child keeps its own descriptor
            procs[name] = (subprocess.Popen([sys.executable, "-m", "course_lib.cli", "train", *argv],
                                            stdout=log, stderr=subprocess.STDOUT), time.perf_counter())
    walls = {}
    with progress_bar(total=sum(totals.values()), desc=" + ".join(runs), unit="it") as bar:
        while len(walls) < len(procs):
            for name, (proc, start) in procs.items():
                if name not in walls and proc.poll() is not None:
                    walls[name] = time.perf_counter() - start
            bar.update(sum(_last_iter(out / n / "metrics.csv") for n in runs) - bar.n)
            if time.perf_counter() - t0 > timeout_s:
                for proc, _ in procs.values():
                    proc.kill()
                raise TimeoutError(f"training did not finish in {timeout_s:.0f} s (logs in {out})")
            time.sleep(1.0)
    result = {}
    for name, (proc, _) in procs.items():
        if proc.returncode != 0:
            tail = (out / f"{name}.log").read_text()[-1500:]
            raise RuntimeError(f"course train ({name}) exited with {proc.returncode}:\n{tail}")
        summary = json.loads((out / name / "summary.json").read_text())
        info = json.loads((out / name / "run.json").read_text())
        result[name] = {"best_val_loss": summary["best_val_loss"], "val_loss": summary["val_loss"],
                        "iters": summary["iters"], "ms_per_iter": summary["ms_per_iter"],
                        "dtype": info["dtype"], "device": info["device"], "world_size": info["world_size"],
                        "backend": info.get("backend"), "torchrun": "torchrun_run_id" in info.get("launcher", {}),
                        "wall_s": round(walls[name], 1)}
        if info["dtype"] == "float16":  # evidence of loss scaling: the GradScaler's scale at the end
            scaler = load_checkpoint(out / name / "last.pt", mmap=True)["scaler"]
            result[name]["loss_scale"] = scaler["state"]["scale"] if scaler else None
    return result


def recipes_step(out: Path, runs: dict[str, Sequence[str]] = RECIPES) -> dict:
    return train_runs(out, runs)


def nccl_step(out: Path, train_args: Sequence[str] = NCCL_RUN, backend: str = "nccl",
              sizes: Sequence[str] = ("1M", "256M")) -> dict:
    """The trainer as one torchrun rank in a process group (NCCL on a GPU), then ``course bench comm``."""
    run = train_runs(out, {"nccl_run": train_args})["nccl_run"]
    rows = run_benchmark(backend, 1, sizes, iters=20, warmup=5, timeout_s=300)
    return {"run": run, "bench_backend": backend, "bench_all_correct": all(r["correct"] for r in rows),
            "bench": [{k: r[k] for k in ("op", "size_bytes", "time_us", "algbw_GBps", "correct")} for r in rows]}


def _library_workspaces(device: str) -> tuple[int, int]:
    """Allocate what the math libraries keep for the life of the process, before measuring.

    The first matmul on a stream makes cuBLAS (and cuBLASLt) take a workspace from PyTorch's
    caching allocator, which ``memory_allocated`` counts from then on: on Hopper PyTorch sizes it
    at 32 MiB each (``aten/src/ATen/cuda/CublasHandlePool.cpp``: ":4096:2:16:8 default, 32MiB for
    Hopper"; "cuBLAS workspaces" in PyTorch's CUDA semantics notes gives the general default,
    ``CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8``, about 8 MiB). Counting it as model state is the
    likely source of the ~64 MiB check-gpu once measured above weights + Adam (x1.046): an
    unverified hypothesis until ``library_workspace_bytes`` is read on a GPU. Returns (what the
    warm-up allocated and kept, the allocated bytes after it: the baseline of the measurement)."""
    # torch here, not at the top: `course check-gpu --help` and `--dry-run` start without it
    import torch

    before = torch.cuda.memory_allocated(device)
    a = torch.randn(256, 256, device=device, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (a @ a).float().sum().backward()  # a bf16 GEMM forward and backward, as the step does
    del a
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_allocated(device)
    return after - before, after


def memory_step(out: Path, preset: str = "gpt2", batch_size: int = 12, device: str = "cuda") -> dict:
    """A bf16-autocast training step of the trainer against :func:`course_lib.analysis.memory.step_peak`:

    * after a step (gradients freed), ``memory_allocated`` holds the weights and Adam's two
      moments: 4 + 8 bytes per parameter, since the trainer keeps them in fp32;
    * ``max_memory_allocated`` of the next step against the modelled peak: those states, every
      activation and the cross-entropy's two fp32 (b s, v) gradients at the start of backward
      (:func:`course_lib.experiments.step_memory.measure_step_peak`)."""
    # the trainer's modules import torch: only when a step runs (`--dry-run` starts without it)
    import torch

    from course_lib.experiments.step_memory import measure_step_peak
    from course_lib.gpt.model import GPTConfig

    shape = get_preset(preset)
    workspace, base = _library_workspaces(device)
    cfg = GPTConfig.from_shape(shape)
    r = measure_step_peak(cfg, batch_size, "bfloat16", device)
    torch.cuda.empty_cache()
    return {"preset": shape.name, "batch_size": batch_size, "seq_len": shape.block_size,
            "num_params": r["num_params"], "states_measured_bytes": r["states_bytes"] - base,
            "states_model_bytes": r["model_states_bytes"],
            "states_ratio": (r["states_bytes"] - base) / r["model_states_bytes"],
            "measured_bytes": r["measured_bytes"] - base, "model_bytes": r["model_bytes"],
            "ratio": (r["measured_bytes"] - base) / r["model_bytes"], "parts": r["parts"],
            "library_workspace_bytes": workspace}


def _setup(shape: ModelShape, device: str, dtype: str):
    """The GPT on ``device`` in the single-process strategy (fused AdamW on a GPU), and its autocast."""
    # the trainer's modules import torch: only when a step runs (`--dry-run` starts without it)
    import torch

    from course_lib.gpt.model import GPT, GPTConfig
    from course_lib.parallel.step import Precision
    from course_lib.parallel.strategy import build_strategy

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_shape(shape)).to(device)
    fused = {"fused": True} if device.startswith("cuda") else {}
    single = build_strategy("single", model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, **fused))
    autocast = (nullcontext() if dtype == "float32"
                else torch.autocast(device.split(":")[0], dtype=getattr(torch, dtype)))
    return single, Precision(autocast)


def seconds_per_call(fn: Callable[[], object], steps: int, warmup: int, device: str) -> float:
    """Seconds per call of ``fn`` after ``warmup`` calls (with torch.compile the first ones compile);
    on a GPU synchronised before and after the clock."""
    import torch  # here: `course check-gpu --dry-run` starts without torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) / steps


def time_steps(strategy, x: torch.Tensor, y: torch.Tensor, precision: Precision, steps: int, warmup: int,
               device: str, grad_clip: float = 0.0) -> float:
    """Seconds per step of the trainer's step on x, y (accum, B, T): :func:`seconds_per_call`."""
    # the trainer's modules import torch: only when a step runs (`--dry-run` starts without it)
    from course_lib.parallel.step import train_step

    return seconds_per_call(lambda: train_step(strategy, x, y, grad_clip=grad_clip, precision=precision),
                            steps, warmup, device)


def mfu_step(out: Path, preset: str | ModelShape = "gpt2", batch_size: int = 12, steps: int = 20,
             warmup: int = 3, compile_modes: Sequence[bool] = (False, True), device: str = "cuda",
             dtype: str = "bfloat16") -> dict:
    """MFU (PaLM's definition, :meth:`GPT.estimate_mfu`) of a GPT-2-small-shaped training step,
    eager and with ``torch.compile``, against the data-sheet peak of ``dtype``."""
    # torch here, not at the top: `course check-gpu --help` and `--dry-run` start without it
    import torch

    shape = get_preset(preset)
    peak = detect(device).peak(dtype)
    result = {"preset": shape.name, "batch_size": batch_size, "seq_len": shape.block_size, "dtype": dtype,
              "peak_tflops": peak / 1e12 if peak else None}
    for compiled in compile_modes:
        single, precision = _setup(shape, device, dtype)
        model = single.module
        if compiled:
            single.model = torch.compile(model)  # what forward is called on; the optimizer keeps model's
        x = torch.randint(shape.vocab_size, (batch_size, shape.block_size), device=device)
        y = torch.roll(x, -1, dims=1)
        t0 = time.perf_counter()
        s = time_steps(single, x[None], y[None], precision, steps, warmup, device)  # one micro-batch
        tokens_per_s = batch_size * shape.block_size / s
        result["compiled" if compiled else "eager"] = {
            "ms_per_step": s * 1e3, "tokens_per_s": tokens_per_s, "mfu": model.estimate_mfu(tokens_per_s, peak),
            "setup_s": round(time.perf_counter() - t0 - s * steps, 1)}
        del model, single
    if "eager" in result and "compiled" in result:
        result["compile_speedup"] = result["eager"]["ms_per_step"] / result["compiled"]["ms_per_step"]
    return result


# -- in-kernel ranks after a backward: the probe runs in a process of its own -------------------

def _all_reduce_rank(rank: int, world_size: int, device: str) -> list[float]:
    # torch in the rank only: planning and judging a check need no torch
    import torch
    import torch.distributed as dist

    t = torch.full((2,), float(rank + 1), device=device)
    dist.all_reduce(t)  # gloo reduces CUDA tensors too (through host copies)
    return t.cpu().tolist()


def _launcher_rank() -> float:
    # torch in the rank only: planning and judging a check need no torch
    import torch
    import torch.distributed as dist

    w = torch.ones(3, requires_grad=True)
    (w * (dist.get_rank() + 1)).sum().backward()  # autograd in the rank, after the kernel's own
    g = w.grad.clone()
    dist.all_reduce(g)
    return float(g[0])


def _isolated_check() -> float:
    # torch in the checked process only: planning and judging a check need no torch
    import torch

    w = torch.ones(2, requires_grad=True)
    (3 * w).sum().backward()
    return float(w.grad.sum())


def probe(device: str = "cuda") -> dict:
    """Put this process in a notebook kernel's state (a backward on ``device``, a live thread), then
    call each in-kernel helper; return what each gave and how long it took."""
    # torch in the probe's own process only: `course check-gpu --dry-run` starts without it
    import torch

    x = torch.randn(64, 64, device=device, requires_grad=True)
    (x @ x).sum().backward()  # CUDA initialised and autograd's device threads started
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()  # a kernel has threads of its own
    out = {"device": device, "cuda_initialized": torch.cuda.is_initialized()}
    calls = {
        "run_ranks": (lambda: run_ranks(_all_reduce_rank, 2, device, timeout=60), [[3.0, 3.0]] * 2),
        "notebook_launcher": (lambda: notebook_launcher(_launcher_rank, nproc=2, timeout=60), [3.0, 3.0]),
        "isolated": (lambda: grading.isolated(_isolated_check, timeout=60), 6.0),
    }
    for name, (call, expected) in calls.items():
        t0 = time.perf_counter()
        try:
            got = call()
            out[name] = {"ok": got == expected, "result": got, "expected": expected}
        except Exception as e:  # noqa: BLE001 - the failure is the figure
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500]}
        out[name]["seconds"] = round(time.perf_counter() - t0, 2)
    stop.set()
    return out


def ranks_step(out: Path, device: str = "cuda", timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """The probe in a fresh interpreter; its last stdout line is the JSON figures."""
    proc = subprocess.run([sys.executable, "-m", "course_lib.experiments.gpu_check", "--probe", device],
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    (out / "ranks_probe.log").write_text(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the probe exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-1500:]}")
    return json.loads(lines[-1])


# -- several ranks on one GPU -------------------------------------------------------------------

def share_step(out: Path, args: Sequence[str] = SHARE_RUN) -> dict:
    """``course train --nproc=2`` where there is one GPU: what each rank ran on, or the refusal."""
    shutil.rmtree(out / "share", ignore_errors=True)  # a metrics.csv left here would read as "started"
    try:
        run = train_runs(out, {"share": args}, timeout_s=600.0)["share"]
        return {"ran": True, **run}
    except (RuntimeError, ValueError) as e:  # ValueError: the arguments were refused here, in-process
        log = str(e) if isinstance(e, ValueError) or not (out / "share.log").exists() \
            else (out / "share.log").read_text()
        spawned = not isinstance(e, ValueError) and (out / "share" / "metrics.csv").exists()
        return {"ran": False, "refused_before_start": not spawned, "message": log[-1500:]}


# -- the suite's GPU tests and the lessons (--full) ---------------------------------------------

def gpu_tests_step(out: Path, root: Path | None = None, marker: str = "gpu") -> dict:
    """``pytest -m gpu`` in the clone: counts of passed, failed and skipped tests."""
    root = root or repo_root()
    if root is None:
        raise RuntimeError("the tests are in a clone of the course, not in the wheel")
    xml = out / "gpu_tests.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider",
                           f"--junitxml={xml}"], cwd=root, capture_output=True, text=True, check=False)
    (out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"exit_code": proc.returncode, "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
            "failed": n["failures"] + n["errors"], "skipped": n["skipped"], "tail": proc.stdout[-800:]}


def lessons_step(out: Path, notebooks: Sequence[Path] | None = None, smoke: bool = False) -> dict:
    """Execute every lesson (full mode unless ``smoke``), each in its own ``python -m
    course_lib.notebook.book --lesson`` process (nbclient; a crash ends only that lesson); its wall
    time or its error."""
    root = repo_root()
    if notebooks is None:
        if root is None:
            raise RuntimeError("the lessons are run from a clone of the course")
        notebooks = sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    result = {}
    for path in notebooks:
        cmd = [sys.executable, "-m", "course_lib.notebook.book", "--lesson", str(path), "--out", str(out / "lessons")]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd + (["--smoke"] if smoke else []), capture_output=True, text=True, check=False)
        entry = {"ok": proc.returncode == 0, "seconds": round(time.perf_counter() - t0, 1)}
        if proc.returncode != 0:
            entry["error"] = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
        result[Path(path).stem] = entry
    return result


# each step of the plan -> the function that measures it
STEP_FUNCTIONS: dict[str, Callable[[Path], dict]] = {
    "profile": profile_step, "data": data_step, "recipes": recipes_step, "nccl": nccl_step,
    "memory": memory_step, "mfu": mfu_step, "ranks": ranks_step, "share": share_step,
    "gpu_tests": gpu_tests_step, "lessons": lessons_step,
}


# -- verdicts -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckVerdict:
    check: str
    status: str  # pass | fail | error (the step it needs did not run)
    detail: str


def _verdict(check: str, ok: bool, detail: str) -> CheckVerdict:
    return CheckVerdict(check, "pass" if ok else "fail", detail)


def judge(figures: dict, errors: dict[str, str], wall_s: float, plan=PLAN) -> list[CheckVerdict]:
    """The pass/fail of each check from the figures the steps returned (a pure function)."""
    out = []

    planned = {s.name for s in plan}

    def need(step: str, check: str) -> dict | None:
        if step in figures:
            return figures[step]
        if step not in planned:  # --only left it out: no verdict
            return None
        out.append(CheckVerdict(check, "error", errors.get(step, f"step {step!r} did not run").splitlines()[0]))
        return None

    if p := need("profile", "profile and dtype"):
        ok = p["known_profile"] and p["dtype"] == p["expected_dtype"] and (p["dtype"] != "float16" or p["grad_scaler"])
        out.append(_verdict("profile and dtype", ok, f"{p['device']}: profile {p['profile']}, dtype {p['dtype']}"
                            + ("" if p["known_profile"] else " (unknown GPU: add it to hardware.PROFILES)")))
    if r := need("recipes", "bf16 recipe vs nanoGPT"):
        bf, fp = r["bf16"], r["fp16"]
        gap = bf["best_val_loss"] - NANOGPT_VAL_LOSS
        out.append(_verdict("bf16 recipe vs nanoGPT", bf["dtype"] == "bfloat16" and abs(gap) <= LOSS_MARGIN,
                            f"best val {bf['best_val_loss']:.4f} vs {NANOGPT_VAL_LOSS} ({gap:+.4f}, margin "
                            f"{LOSS_MARGIN}), {bf['iters']} iters, {bf['ms_per_iter']:.1f} ms/iter"))
        diff = fp["best_val_loss"] - bf["best_val_loss"]
        scale = fp.get("loss_scale")
        ok = fp["dtype"] == "float16" and bool(scale) and math.isfinite(scale) and abs(diff) <= FP16_MATCH
        out.append(_verdict("fp16 + loss scaling (T4 path)", ok,
                            f"best val {fp['best_val_loss']:.4f}, {diff:+.4f} from bf16 (margin {FP16_MATCH}), "
                            f"final loss scale {scale}"))
    if n := need("nccl", "NCCL through torchrun"):
        run = n["run"]
        ok = (run["backend"] == "nccl" and run["world_size"] == 1 and run["torchrun"]
              and n["bench_backend"] == "nccl" and n["bench_all_correct"])
        out.append(_verdict("NCCL through torchrun", ok,
                            f"trainer: backend {run['backend']}, {run['world_size']} rank, torchrun "
                            f"{'yes' if run['torchrun'] else 'no'}; bench: {len(n['bench'])} rows, "
                            f"{'all correct' if n['bench_all_correct'] else 'WRONG RESULTS'}"))
    if m := need("memory", "GPT-2 small memory vs model"):
        lo, hi = MEMORY_BAND
        ok = abs(m["states_ratio"] - 1) <= STATES_TOLERANCE and lo <= m["ratio"] <= hi
        out.append(_verdict("GPT-2 small memory vs model", ok,
                            f"weights + Adam {m['states_measured_bytes'] / 2**30:.3f} GiB vs model "
                            f"{m['states_model_bytes'] / 2**30:.3f} (x{m['states_ratio']:.3f}"
                            + (f", cuBLAS workspaces {m['library_workspace_bytes'] / 2**20:.0f} MiB apart"
                               if "library_workspace_bytes" in m else "") + "); peak "
                            f"{m['measured_bytes'] / 2**30:.2f} GiB vs model {m['model_bytes'] / 2**30:.2f} "
                            f"({', '.join(f'{k} {v / 2**30:.2f}' for k, v in m['parts'].items())}), "
                            f"x{m['ratio']:.2f} in [{lo}, {hi}]"))
    if f := need("mfu", "GPT-2 small MFU"):
        modes = [k for k in ("eager", "compiled") if k in f]
        ok = len(modes) == 2 and all(0 < f[k]["mfu"] <= 1 for k in modes)  # NaN fails: no known peak
        parts = [f"{k} {f[k]['mfu']:.1%} ({f[k]['ms_per_step']:.1f} ms/step)" for k in modes]
        speed = f", torch.compile x{f['compile_speedup']:.2f} faster" if "compile_speedup" in f else ""
        out.append(_verdict("GPT-2 small MFU", ok, ", ".join(parts) + speed))
    if "ranks" in planned and (rk := need("ranks", "in-kernel ranks after a CUDA backward")):
        names = ("run_ranks", "notebook_launcher", "isolated")
        ok = all(rk.get(k, {}).get("ok") for k in names)
        detail = ", ".join(f"{k} {'ok' if rk[k]['ok'] else rk[k].get('error', rk[k].get('result'))} "
                           f"({rk[k]['seconds']} s)" for k in names if k in rk)
        out.append(_verdict("in-kernel ranks after a CUDA backward", ok, detail))
    if "share" in planned and (s := need("share", "--nproc=2 on one GPU")):
        if s["ran"]:
            ok = s["world_size"] == 2 and str(s["device"]).startswith("cuda")
            detail = f"{s['world_size']} ranks on {s['device']}, backend {s['backend']}"
        else:
            ok = s["refused_before_start"]
            detail = ("refused before starting: " if ok else "failed after starting: ") + \
                     s["message"].strip().splitlines()[-1][:300]
        out.append(_verdict("--nproc=2 on one GPU", ok, detail))
    if "gpu_tests" in planned and (t := need("gpu_tests", "tests marked gpu")):
        ok = t["failed"] == 0 and t["skipped"] == 0 and t["passed"] > 0
        out.append(_verdict("tests marked gpu", ok,
                            f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped"))
    if "lessons" in planned and (ls := need("lessons", "lessons in full mode")):
        ok = bool(ls) and all(v["ok"] for v in ls.values())
        out.append(_verdict("lessons in full mode", ok, ", ".join(
            f"{k[:2]} {v['seconds']:.0f} s{'' if v['ok'] else ' FAILED'}" for k, v in ls.items())))
    limit = time_limit(plan)
    if planned >= {s.name for s in PLAN}:  # the limit is the whole check's
        out.append(_verdict("within the time limit", wall_s <= limit, f"{wall_s:.0f} s of {limit:.0f} s"))
    return out


# -- reports and the command line ---------------------------------------------------------------

def report_markdown(report: dict) -> str:
    """The report as a RESULTS.md section."""
    p = report["figures"].get("profile", {})
    head = (f"## GPU check (`course check-gpu`), {report['date']}, {p.get('device', '?')}\n\n"
            f"Profile {p.get('profile', '?')}, dtype {p.get('dtype', '?')}, torch {p.get('torch', '?')}, "
            f"CUDA {p.get('cuda', '?')}. Total {report['wall_s']:.0f} s. "
            f"{sum(v['status'] == 'pass' for v in report['verdicts'])} of {len(report['verdicts'])} checks pass.\n")
    rows = "".join(f"| {v['check']} | {v['status'].upper() if v['status'] != 'pass' else 'pass'} | {v['detail']} |\n"
                   for v in report["verdicts"])
    steps = "".join(f"| {s['name']} | {s['wall_s']:.0f} | {s['budget_s']} | {s['status']} |\n" for s in report["steps"])
    return (f"{head}\n| check | result | figures |\n|---|---|---|\n{rows}\n"
            f"| step | seconds | planned | status |\n|---|---:|---:|---|\n{steps}")


def write_report(report: dict, out: Path, results_md: Path | None) -> None:
    """gpu_check.json and gpu_check.md in ``out``; the Markdown appended to ``results_md``."""
    atomic_write_bytes(out / "gpu_check.json", (json.dumps(report, indent=1, default=str) + "\n").encode())
    text = report_markdown(report)
    atomic_write_bytes(out / "gpu_check.md", text.encode())
    if results_md is not None:
        old = results_md.read_text() if results_md.exists() else "# Benchmark results\n"
        atomic_write_bytes(results_md, (old.rstrip("\n") + "\n\n" + text).encode())


def run_check(out: str | Path, steps: dict[str, Callable[[Path], dict]] | None = None,
              results_md: Path | None = None, plan=PLAN, log=print) -> dict:
    """Run each step of ``plan`` (``steps`` maps a name to its function; default the real ones),
    keep going past a failed step, save the JSON after each, then judge and write the report."""
    steps = STEP_FUNCTIONS if steps is None else steps
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "figures": {}, "errors": {},
              "steps": [], "verdicts": [], "wall_s": 0.0,
              "thresholds": {"nanogpt_val_loss": NANOGPT_VAL_LOSS, "loss_margin": LOSS_MARGIN,
                             "fp16_match": FP16_MATCH, "states_tolerance": STATES_TOLERANCE,
                             "memory_band": MEMORY_BAND, "time_limit_s": time_limit(plan)}}
    t_start = time.perf_counter()
    for i, step in enumerate(plan, 1):
        log(f"[{i}/{len(plan)}] {step.title}: {step.does}")
        t0 = time.perf_counter()
        try:
            report["figures"][step.name] = steps[step.name](out)
            status = "ok"
        except Exception as e:  # noqa: BLE001 - a failed step is reported, the others still run
            report["errors"][step.name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
            status = "error"
            log(f"    error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        report["steps"].append({"name": step.name, "wall_s": time.perf_counter() - t0, "budget_s": step.budget_s,
                                "status": status})
        report["wall_s"] = time.perf_counter() - t_start
        write_report(report, out, None)  # nothing lost if a later step crashes the process
    report["verdicts"] = [asdict(v) for v in judge(report["figures"], report["errors"], report["wall_s"], plan)]
    write_report(report, out, results_md)
    return report


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="course check-gpu", description=__doc__.split("\n\n")[1])
    p.add_argument("--out", default="runs/gpu-check", help="where the runs and the report go")
    root = repo_root()
    default_md = root / "benchmarks" / "RESULTS.md" if root else None
    p.add_argument("--results", default=default_md, type=Path,
                   help=f"append the Markdown report here (default: {default_md or 'none outside a clone'})")
    p.add_argument("--no-results", action="store_true", help="do not append to a RESULTS.md")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the pass criteria, run nothing")
    p.add_argument("--full", action="store_true",
                   help="also the tests marked gpu and every lesson in full mode (make test-gpu, ~30 min)")
    p.add_argument("--only", default=None, metavar="STEP,...",
                   help=f"run only these steps, in the plan's order (of: {', '.join(s.name for s in FULL_PLAN)}); "
                        "the verdicts of the others are left out")
    a = p.parse_args(argv)
    plan = FULL_PLAN if a.full else PLAN
    if a.only is not None:
        wanted = [w.strip() for w in a.only.split(",") if w.strip()]
        names = [s.name for s in FULL_PLAN]
        if unknown := [w for w in wanted if w not in names]:
            p.error(f"--only: unknown step(s) {', '.join(unknown)}; the steps are {', '.join(names)}")
        plan = tuple(s for s in FULL_PLAN if s.name in wanted)
    if a.dry_run:
        print(plan_text(plan))
        return 0
    import torch  # here: --help and --dry-run stay fast

    if not torch.cuda.is_available():
        print(f"course check-gpu: no CUDA GPU here (torch {torch.__version__}: torch.cuda.is_available() is "
              "False); run it on a machine with an NVIDIA GPU, or --dry-run to see the plan", file=sys.stderr)
        return 2
    report = run_check(a.out, results_md=None if a.no_results else a.results, plan=plan)
    print("\n" + report_markdown(report))
    print(f"report: {Path(a.out) / 'gpu_check.json'}, {Path(a.out) / 'gpu_check.md'}"
          + (f"; appended to {a.results}" if a.results and not a.no_results else ""))
    return 0 if all(v["status"] == "pass" for v in report["verdicts"]) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:  # the ranks step's probe, in a fresh interpreter: one JSON line
        print(json.dumps(probe(sys.argv[2] if len(sys.argv) > 2 else "cuda")))
    else:
        sys.exit(cli(sys.argv[1:]))
