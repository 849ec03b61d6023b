"""python benchmarks/train_throughput.py [--iters 200] [--cases 1x1,1x2,2x1] [--strategy ddp] [--gpu]

Throughput of the real trainer (course_lib.trainer.loop) on the CPU recipe ``shakespeare_char_cpu``
(4 layers, 4 heads, 128 dims, block 64, batch 12 per rank, fp32): ms/iter and tokens/s for
1 process x 1 thread, 1 process x 2 threads and 2-rank DDP x 1 thread each, and the scaling
efficiency of each against 1 x 1 (tokens/s over cases x 1 x 1's tokens/s, where cases = the cores
used). Each case trains ``--warmup`` + ``--iters`` iterations; the figure is the median of the
per-10-iteration averages (per-iteration for fewer than 20 ``--iters``) of the iterations after
the warmup (robust to a busy machine). Upstream nanoGPT's train.py with the same hyper-parameters
on this machine kind: about 99 ms/iter with 1 thread and 62-72 ms/iter with 2 threads (figures
from the project's issue 2; shown for fp32 eager runs only).

``--gpu`` instead runs nanoGPT's ``shakespeare_char`` GPU recipe and a GPT-2-small-shaped model
(12 layers, 12 heads, 768 dims, block 1024, GPT-2 BPE) on every visible GPU and reports MFU.
Record results in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from course_lib.gpt.data import prepare
from course_lib.launch.training import run_training
from course_lib.trainer.config import make_config
from course_lib.trainer.metrics import read_metrics

NANOGPT_MS = {"1 process x 1 thread": 99.0, "1 process x 2 threads": 67.0}  # midpoint of 62-72


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return (f"{cpu}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}"
            + (f", {len(gpus)} x {gpus[0]}" if gpus else ""))


def measure(name: str, preset: str, overrides: dict, warmup: int, iters: int, data_dir: str, out_root: Path) -> dict:
    total = warmup + iters
    # A row averages the iterations since the row before: every 10 iterations, or every one for a short
    # run (10 would leave no row wholly after the warmup; from 20 on, one always is).
    log_interval = 10 if iters >= 20 else 1
    cfg = make_config(preset, {"max_iters": total, "lr_decay_iters": total, "eval_interval": total + 1,
                               "eval_iters": 1, "log_interval": log_interval, "data_dir": data_dir,
                               "out_dir": str(out_root / name.replace(" ", "_")), "run_name": name, **overrides})
    run_training(cfg, display="terminal", overwrite=True, progress=False, check=True)  # what course train runs
    steps = [r for r in read_metrics(Path(cfg.out_dir) / "metrics.csv") if r["step_ms"] > 0]  # not eval rows
    # the row at iteration i covers (previous row's i, i], the first from iteration 0: kept when none of
    # those is a warmup iteration
    rows = [r for before, r in zip([{"iter": -1}] + steps, steps) if before["iter"] + 1 >= warmup]
    if not rows:
        raise SystemExit(f"{name}: no logged step after the {warmup} warmup iterations; raise --iters")
    med = lambda key: statistics.median(r[key] for r in rows)
    return {"case": name, "nproc": cfg.nproc, "threads": cfg.threads, "ms_per_iter": med("step_ms"),
            "compute_ms": med("compute_ms"), "comm_ms": med("comm_ms"), "tokens_per_s": med("tokens_per_s"),
            "mfu": med("mfu"), "tokens_per_iter": cfg.batch_size * cfg.gradient_accumulation_steps * cfg.nproc
            * cfg.block_size}


CPU_CASES = {  # name -> overrides of shakespeare_char_cpu
    "1x1": ("1 process x 1 thread", {"nproc": 1, "threads": 1}),
    "1x2": ("1 process x 2 threads", {"nproc": 1, "threads": 2}),
    "2x1": ("2 ranks x 1 thread", {"nproc": 2, "threads": 1}),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--iters", type=int, default=200, help="measured iterations per case (after the warmup)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--cases", default="1x1,1x2,2x1", help=f"CPU cases among {', '.join(CPU_CASES)}")
    p.add_argument("--strategy", default="ddp", help="strategy of the 2-rank case")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (compile time not counted)")
    p.add_argument("--dtype", default="auto", help="override the dtype (e.g. bfloat16 autocast on a CPU)")
    p.add_argument("--gpu", action="store_true", help="the GPU recipes instead (needs CUDA)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be at least 1 and --warmup at least 0")
    unknown = set(args.cases.split(",")) - set(CPU_CASES)
    if unknown and not args.gpu:
        p.error(f"--cases: unknown {', '.join(sorted(unknown))} (of {', '.join(CPU_CASES)})")
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        tmp = Path(tmp)
        results = []
        if args.gpu:
            if not torch.cuda.is_available():
                print("--gpu needs CUDA", file=sys.stderr)
                return 2
            n = torch.cuda.device_count()
            for name in ("shakespeare_char", "shakespeare"):
                prepare(name, tmp / "data", quiet=True)
            cases = [("shakespeare_char (6x384, block 256, batch 64)", "shakespeare_char", {"dropout": 0.0}),
                     ("GPT-2 small shape (12x768, block 1024, batch 8)", "shakespeare_char",
                      {"dataset": "shakespeare", "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024,
                       "batch_size": 8, "dropout": 0.0, "bias": True})]
            for name, preset, over in cases:
                results.append(measure(name, preset, {**over, "nproc": n, "compile": args.compile, "dtype": args.dtype,
                                                      "strategy": "auto" if n == 1 else args.strategy},
                                       args.warmup, args.iters, str(tmp / "data"), tmp))
        else:
            prepare("shakespeare_char", tmp / "data", quiet=True)
            for key in args.cases.split(","):
                name, over = CPU_CASES[key]
                if over["nproc"] > 1:
                    over = {**over, "strategy": args.strategy}
                    name = f"{name} ({args.strategy})"
                results.append(measure(name, "shakespeare_char_cpu", {**over, "compile": args.compile, "dtype": args.dtype},
                                       args.warmup, args.iters, str(tmp / "data"), tmp))

    print(f"\nmachine: {machine()}")
    print(f"{'case':<48} {'ms/iter':>8} {'comm ms':>8} {'tokens/s':>9} {'MFU':>7} {'efficiency':>10} {'nanoGPT':>8}")
    base = next((r for r in results if r["nproc"] == 1 and r["threads"] == 1), None)
    for r in results:
        cores = r["nproc"] * max(1, r["threads"] or 1)
        eff = f"{r['tokens_per_s'] / (cores * base['tokens_per_s']):.0%}" if base and not args.gpu else ""
        # upstream's figures are fp32 and eager: beside a bf16 or compiled run they would mislead
        ref = NANOGPT_MS.get(r["case"]) if args.dtype in ("auto", "float32") and not args.compile else None
        print(f"{r['case']:<48} {r['ms_per_iter']:>8.1f} {r['comm_ms']:>8.1f} {r['tokens_per_s']:>9,.0f} "
              f"{r['mfu']:>7.1%} {eff:>10} {f'{ref:.0f}' if ref else '':>8}")
    if not args.gpu:
        print("efficiency: tokens/s over (cores used x 1 process x 1 thread); MFU against an ESTIMATED CPU peak; "
              "nanoGPT: upstream ms/iter on this machine kind (issue 2)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
