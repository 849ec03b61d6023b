"""The measurements of ``course check-gpu``, one function per step (the plan, the verdicts and the
report are in :mod:`course_lib.experiments.gpu_check`).

    from course_lib.experiments.gpu_check_steps import mfu_step   # mfu_step(out, device="cuda")

Each step takes the check's output folder and returns plain, JSON-ready figures. Devices, shapes
and trainer arguments are parameters, so the tests run the same code on a CPU at toy sizes; the
command itself uses the defaults (one CUDA GPU, the course's recipes, GPT-2 small).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm.auto import tqdm

from course_lib.analysis.memory import ModelShape, get_preset
from course_lib.experiments.comm_bench import run_benchmark
from course_lib.experiments.step_memory import measure_step_peak
from course_lib.gpt.checkpoint import load_checkpoint
from course_lib.gpt.data import prepare
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.hardware import PROFILES, GiB, detect, pick_dtype
from course_lib.launch.training import build_config
from course_lib.parallel.step import Precision, train_step
from course_lib.parallel.strategy import build_strategy

# nanoGPT's recipe (config/train_shakespeare_char.py) in bf16, and the T4 path forced on the same
# GPU: fp16 autocast, for which the trainer turns on loss scaling (GradScaler).
RECIPES = {"bf16": ("--config=shakespeare_char", "--dtype=bfloat16"),
           "fp16": ("--config=shakespeare_char", "--dtype=float16")}
NCCL_RUN = ("--config=shakespeare_char", "--max_iters=20", "--eval_interval=10", "--eval_iters=2",
            "--log_interval=5", "--nproc=1", "--strategy=ddp")


def profile_step(out: Path, device: str = "cuda") -> dict:
    """What :mod:`course_lib.hardware` detects and the dtype the trainer would pick."""
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
    procs, totals, t0 = {}, {}, time.perf_counter()
    for name, args in runs.items():
        argv = [*args, f"--out_dir={out / name}", "--overwrite", "--no-progress"]
        totals[name] = build_config(argv)[0].max_iters
        with open(out / f"{name}.log", "w") as log:  # the child keeps its own descriptor
            procs[name] = (subprocess.Popen([sys.executable, "-m", "course_lib.cli", "train", *argv],
                                            stdout=log, stderr=subprocess.STDOUT), time.perf_counter())
    walls = {}
    with tqdm(total=sum(totals.values()), desc=" + ".join(runs), unit="it") as bar:
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


def _batch(shape: ModelShape, batch_size: int, device: str):
    x = torch.randint(shape.vocab_size, (batch_size, shape.block_size), device=device)
    return x, torch.roll(x, -1, dims=1)


def _setup(shape: ModelShape, device: str, dtype: str):
    """The GPT on ``device`` in the single-process strategy (fused AdamW on a GPU), and its autocast."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_shape(shape)).to(device)
    fused = {"fused": True} if device.startswith("cuda") else {}
    single = build_strategy("single", model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, **fused))
    autocast = (nullcontext() if dtype == "float32"
                else torch.autocast(device.split(":")[0], dtype=getattr(torch, dtype)))
    return single, Precision(autocast)


def _library_workspaces(device: str) -> tuple[int, int]:
    """Allocate what the math libraries keep for the life of the process, before measuring.

    The first matmul on a stream makes cuBLAS (and cuBLASLt) take a workspace from PyTorch's
    caching allocator, which ``memory_allocated`` counts from then on: on Hopper PyTorch sizes it
    at 32 MiB each (``CUBLAS_WORKSPACE_CONFIG``'s default ``:4096:8``, "Reproducibility" and
    "cuBLAS workspaces" in PyTorch's CUDA semantics notes). Counting it as model state is the
    likely source of the ~64 MiB check-gpu once measured above weights + Adam (x1.046): an
    unverified hypothesis until ``library_workspace_bytes`` is read on a GPU. Returns (what the
    warm-up allocated and kept, the allocated bytes after it: the baseline of the measurement)."""
    before = torch.cuda.memory_allocated(device)
    a = torch.randn(256, 256, device=device, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (a @ a).float().sum().backward()  # a bf16 GEMM forward and backward, as the step does
    del a
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_allocated(device)
    return after - before, after


def memory_step(out: Path, preset: str = "gpt2", batch_size: int = 12, device: str = "cuda") -> dict:
    """A bf16-autocast training step of the trainer against :mod:`course_lib.analysis.step_peak`:

    * after a step (gradients freed), ``memory_allocated`` holds the weights and Adam's two
      moments: 4 + 8 bytes per parameter, since the trainer keeps them in fp32;
    * ``max_memory_allocated`` of the next step against the modelled peak: those states, every
      activation and the cross-entropy's two fp32 (b s, v) gradients at the start of backward
      (:func:`course_lib.experiments.step_memory.measure_step_peak`)."""
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


def time_steps(strategy, x: torch.Tensor, y: torch.Tensor, precision: Precision, steps: int, warmup: int,
               device: str) -> float:
    """Seconds per step of the trainer's step on x, y (accum, B, T) after ``warmup`` steps (with
    torch.compile the first ones compile); on a GPU synchronised before and after the clock."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        train_step(strategy, x, y, precision=precision)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(strategy, x, y, precision=precision)
    sync()
    return (time.perf_counter() - t0) / steps


def mfu_step(out: Path, preset: str | ModelShape = "gpt2", batch_size: int = 12, steps: int = 20,
             warmup: int = 3, compile_modes: Sequence[bool] = (False, True), device: str = "cuda",
             dtype: str = "bfloat16") -> dict:
    """MFU (PaLM's definition, :meth:`GPT.estimate_mfu`) of a GPT-2-small-shaped training step,
    eager and with ``torch.compile``, against the data-sheet peak of ``dtype``."""
    shape = get_preset(preset)
    peak = detect(device).peak(dtype)
    result = {"preset": shape.name, "batch_size": batch_size, "seq_len": shape.block_size, "dtype": dtype,
              "peak_tflops": peak / 1e12 if peak else None}
    for compiled in compile_modes:
        single, precision = _setup(shape, device, dtype)
        model = single.module
        if compiled:
            single.model = torch.compile(model)  # what forward is called on; the optimizer keeps model's
        x, y = _batch(shape, batch_size, device)
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
