"""Per-step training metrics: a CSV written row by row, and timers that do not stall the GPU.

``metrics.csv`` holds one row per logged step (and one per evaluation):

    iter, train_loss, val_loss, eval_train_loss, lr, grad_norm, step_ms, compute_ms, comm_ms,
    tokens_per_s, tflops, mfu

``step_ms`` is wall time per iteration averaged since the previous row; ``compute_ms`` the time
in forward/backward and the optimizer step (CUDA events on a GPU, so no host sync per step);
``comm_ms`` the exposed communication the Strategy measured (``comm_s``). ``tflops`` is the
achieved model FLOP/s of the whole job and ``mfu`` that over the peak of all its devices (PaLM,
Chowdhery et al. 2022, App. B); on a CPU the peak is an estimate (course_lib.hardware).
Each row is on disk (file closed) as soon as it is written: a crash loses nothing already logged.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from pathlib import Path

from course_lib.utils import atomic_write_bytes

COLUMNS = ("iter", "train_loss", "val_loss", "eval_train_loss", "lr", "grad_norm", "step_ms", "compute_ms",
           "comm_ms", "tokens_per_s", "tflops", "mfu")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a metrics.csv as dicts of floats (NaN where a cell is empty); ``iter`` as int."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = {k: (float(v) if v not in ("", None) else math.nan) for k, v in r.items()}
            row["iter"] = int(row["iter"])
            rows.append(row)
    return rows


class MetricsWriter:
    """Append rows to ``metrics.csv``. On resume at ``start_iter`` the rows from ``start_iter`` on
    (written after the checkpoint by the interrupted run) are dropped first, so every iteration
    appears once."""

    def __init__(self, path: str | os.PathLike, start_iter: int = 0):
        self.path = Path(path)
        keep = []
        if start_iter > 0 and self.path.is_file():
            with open(self.path, newline="") as f:
                keep = [r for r in csv.DictReader(f) if r.get("iter", "").isdigit() and int(r["iter"]) < start_iter]
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
            w.writeheader()
            w.writerows(keep)
        os.replace(tmp, self.path)

    def write(self, row: dict) -> None:
        """Append one row; the file is closed again at once (one row per log step: cheap)."""
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, COLUMNS, extrasaction="ignore").writerow(
                {k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v) for k, v in row.items()})


class SpanTimer:
    """Sums the duration of code spans: perf_counter on a CPU, CUDA events on a GPU.

    ``start()``/``stop()`` only record; ``total_s()`` (called at log steps) synchronises once.
    """

    def __init__(self, device_type: str):
        self.cuda = device_type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._spans, self._open, self._cpu_s = [], None, 0.0

    def start(self) -> None:
        if self.cuda:
            import torch
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            import torch
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((self._open, end))
        else:
            self._cpu_s += time.perf_counter() - self._open

    def total_s(self) -> float:
        if self.cuda and self._spans:
            self._spans[-1][1].synchronize()
            self._cpu_s += sum(a.elapsed_time(b) for a, b in self._spans) / 1e3
            self._spans = []
        return self._cpu_s


def throughput(steps: int, elapsed_s: float, compute_s: float, comm_s: float, tokens_per_iter: int,
               flops_per_token: float, peak_flops_total: float | None) -> dict:
    """The timing columns for ``steps`` iterations that took ``elapsed_s`` of wall time."""
    tokens_per_s = steps * tokens_per_iter / elapsed_s
    achieved = flops_per_token * tokens_per_s
    return {
        "step_ms": 1e3 * elapsed_s / steps,
        "compute_ms": 1e3 * compute_s / steps,
        "comm_ms": 1e3 * comm_s / steps,
        "tokens_per_s": tokens_per_s,
        "tflops": achieved / 1e12,
        "mfu": achieved / peak_flops_total if peak_flops_total else math.nan,
    }


def announce_run(cfg, info: dict) -> None:
    """Write ``run.json`` (what this run resolved to) and ``config.json``, print the header."""
    out = Path(cfg.out_dir)
    atomic_write_bytes(out / "config.json", cfg.to_json().encode())
    atomic_write_bytes(out / "run.json", (json.dumps(info, indent=1) + "\n").encode())
    cpu = info["device"] == "cpu"
    where = f"{info['world_size']} x {info['device']}" + (f" ({info['threads_per_worker']} threads each)" if cpu else "")
    lines = [f"{where} | strategy {info['strategy']} | {info['dtype']} | {info['n_params'] / 1e6:.2f}M parameters",
             f"global batch {info['global_batch']} sequences = batch_size {cfg.batch_size} x grad_accum "
             f"{cfg.gradient_accumulation_steps} x {info['world_size']} ranks; {info['tokens_per_iter']:,} tokens/iter"]
    if info["peak_flops_per_device"] and info["peak_is_estimate"]:
        lines.append(f"MFU is relative to an ESTIMATED CPU peak of {info['peak_flops_per_device'] / 1e9:.0f} "
                     "GFLOP/s per worker (cores x 2.5 GHz x FLOP/cycle)")
    if cfg.init_from == "resume":
        lines.append(f"resumed from {out / 'last.pt'} at iter {info['start_iter']}")
    for line in lines:
        print(f"[{cfg.name}] {line}", flush=True)
