"""python -m course_lib.experiments.strategy_comparison --repeats 5 --ranks 1,2

(``python benchmarks/strategies.py`` runs the same; notebook 8 calls it from an installed package.)

Every training strategy (ours and PyTorch's) on the Shakespeare CPU recipe (the
``shakespeare_char_cpu`` preset of ``course train``), with 1 and 2 ranks on this machine: the
experiment of the course's labs. For each strategy x ranks, ``--repeats`` independent runs (fresh
processes and model), each timing ``--iters`` training steps after ``--warmup``; the table gives
the median over runs of

* time per iteration (the slowest rank's median step, ms) and tokens per second;
* speedup = tokens/s over the 1-process ``single`` baseline's, efficiency = speedup / ranks;
* exposed communication per step (``Strategy.comm_s``; PyTorch's wrappers hide what overlaps);
* per-rank memory: model states (parameters + gradients + optimizer states, measured on the live
  tensors by course_lib.parallel.footprint, the ZeRO paper's accounting) and peak RSS.

Scaling is weak by default, as ``course train`` does it: each rank keeps the recipe's micro-batch
(12 x 64 tokens), so 2 ranks process twice the tokens per step; ``--scaling strong`` splits the
recipe's batch across the ranks instead. A step is the trainer's: micro-batches with no_sync,
finish_grads, global-norm clipping, AdamW step. CPU workers get cores / ranks threads each.

The repeats are interleaved (all cells once, then again, ...) so that a slow spell of a shared
machine hits every cell alike. Writes ``OUT_DIR/strategies_runs.csv`` (every run, appended as it
finishes), ``OUT_DIR/strategies.csv`` (one row per strategy x ranks) and
``OUT_DIR/strategies.md`` (the Markdown table), and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from course_lib.gpt.data import TrainBatches, load_meta, load_tokens, model_vocab_size, prepare
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.hardware import MB
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.footprint import measure_model_states, peak
from course_lib.parallel.step import train_step
from course_lib.parallel.strategy import build_strategy
from course_lib.registry import STRATEGIES
from course_lib.trainer.config import make_config
from course_lib.trainer.loop import optimizer_factory
from course_lib.utils import progress_bar

COMPARISON_FIELDS = ["strategy", "nodes", "ranks", "ms_per_iter", "ms_min", "ms_max", "tokens_per_s", "speedup",
          "efficiency", "comm_ms", "model_states_mb", "rss_mb", "runs", "threads_per_rank", "scaling"]


def bench_worker(rank: int, world_size: int, spec: dict) -> dict:
    """One run on one rank: time spec['iters'] steps, then measure the model states once."""
    cfg = make_config("shakespeare_char_cpu", spec["overrides"])
    torch.set_num_threads(spec["threads"])
    meta = load_meta(None, cfg.dataset)
    tokens = load_tokens(None, cfg.dataset, "train")
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(block_size=cfg.block_size, vocab_size=model_vocab_size(meta),
                          n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                          dropout=cfg.dropout, bias=cfg.bias))
    strategy = build_strategy(spec["strategy"], model, optimizer_factory(cfg))
    accum = cfg.gradient_accumulation_steps
    batches = TrainBatches(tokens, cfg.batch_size, cfg.block_size, accum, rank, world_size, cfg.seed)

    def step(snapshots: list | None = None) -> None:
        def phase(name: str, micro: int | None):
            # model states after backward, after the gradient communication, after the step
            if snapshots is not None and name in ("finish_grads", "update", "zero_grad"):
                snapshots.append(measure_model_states(strategy))
            return contextlib.nullcontext()
        train_step(strategy, *batches.next(), grad_clip=cfg.grad_clip, phase=phase)

    times, comms = [], []
    for it in range(spec["warmup"] + spec["iters"]):
        t0, c0 = time.perf_counter(), strategy.comm_s
        step()
        if it >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
            comms.append(strategy.comm_s - c0)
    snapshots: list = []
    step(snapshots)
    return {"s_per_iter": statistics.median(times), "comm_s": statistics.median(comms),
            "model_states": peak(*snapshots).total,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "tokens_per_iter": cfg.batch_size * accum * world_size * cfg.block_size}


def one_run(strategy: str, ranks: int, iters: int, warmup: int, scaling: str, threads: int) -> dict:
    """One run of a cell: fresh processes, model and strategy; the slowest rank's figures."""
    recipe = make_config("shakespeare_char_cpu")
    overrides = {"device": "cpu", "dtype": "float32"}
    if scaling == "strong":
        overrides["batch_size"] = recipe.batch_size // ranks
    spec = {"strategy": strategy, "overrides": overrides, "iters": iters, "warmup": warmup, "threads": threads}
    per_rank = run_ranks(bench_worker, ranks, spec, threads=threads)
    return {"strategy": strategy, "ranks": ranks,
            "s": max(r["s_per_iter"] for r in per_rank),  # the slowest rank sets the pace
            "comm": max(r["comm_s"] for r in per_rank),
            "states": max(r["model_states"] for r in per_rank),
            "rss": max(r["rss"] for r in per_rank), "tokens": per_rank[0]["tokens_per_iter"]}


def summarize(runs: list[dict], scaling: str, threads: int) -> dict:
    s = statistics.median(r["s"] for r in runs)
    return {"strategy": runs[0]["strategy"], "nodes": 1, "ranks": runs[0]["ranks"],
            "ms_per_iter": 1e3 * s, "ms_min": 1e3 * min(r["s"] for r in runs),
            "ms_max": 1e3 * max(r["s"] for r in runs), "tokens_per_s": runs[0]["tokens"] / s,
            "comm_ms": 1e3 * statistics.median(r["comm"] for r in runs),
            "model_states_mb": statistics.median(r["states"] for r in runs) / MB,
            "rss_mb": statistics.median(r["rss"] for r in runs) / MB, "runs": len(runs),
            "threads_per_rank": threads, "scaling": scaling}


def comparison_markdown(rows: list[dict]) -> str:
    head = ("| strategy | nodes | ranks | time/iter (ms) | min-max (ms) | tokens/s | speedup | "
            "efficiency | exposed comm (ms) | model states / rank (MB) | peak RSS / rank (MB) |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['nodes']} | {r['ranks']} | {r['ms_per_iter']:.1f} | "
                     f"{r['ms_min']:.1f}-{r['ms_max']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['speedup']:.2f} | {r['efficiency']:.0%} | {r['comm_ms']:.1f} | "
                     f"{r['model_states_mb']:.2f} | {r['rss_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def compare(strategies: list[str], ranks: list[int], repeats: int = 5, iters: int = 10, warmup: int = 3,
            scaling: str = "weak", threads: int = 0, out_dir: str | os.PathLike = "runs/strategies",
            progress: bool = True) -> list[dict]:
    """Run every strategy x ranks ``repeats`` times; return one summary row per cell (``COMPARISON_FIELDS``).

    The 1-rank ``single`` baseline always runs first. Prepares ``shakespeare_char`` if needed
    and writes the three files of the module docstring into ``out_dir``.
    """

    unknown = [n for n in strategies if n not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    if not ranks or min(ranks) < 1 or repeats < 1 or iters < 1 or warmup < 0:
        raise ValueError("ranks, repeats and iters must be >= 1 (warmup >= 0)")
    batch = make_config("shakespeare_char_cpu").batch_size
    if scaling == "strong" and any(batch % r for r in ranks):
        raise ValueError(f"strong scaling needs the recipe's batch_size ({batch}) divisible by every rank count")
    cores = len(os.sched_getaffinity(0))
    if max(ranks) > cores:
        print(f"note: {max(ranks)} ranks on {cores} cores: ranks share cores", file=sys.stderr)
    prepare("shakespeare_char", quiet=True)
    cells = [("single", 1)] + [(n, r) for n in strategies if n != "single" for r in ranks]
    per_rank_threads = {r: threads or max(1, cores // r) for r in [*ranks, 1]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in ("strategies.csv", "strategies.md"):  # an interrupted run must not leave an older summary
        (out / old).unlink(missing_ok=True)          # beside its own raw rows
    # Repeats are the outer loop: a slow spell of a shared machine then hits every cell alike.
    runs: dict[tuple, list] = {cell: [] for cell in cells}
    with open(out / "strategies_runs.csv", "w", newline="") as f:  # every run, as it finishes
        writer = csv.DictWriter(f, fieldnames=["repeat", "strategy", "ranks", "s", "comm", "states", "rss", "tokens"])
        writer.writeheader()
        with progress_bar(total=len(cells) * repeats, desc="runs (strategy x ranks x repeat)",
                          disable=not progress) as bar:
            for repeat in range(repeats):
                for name, r in cells:
                    run = one_run(name, r, iters, warmup, scaling, per_rank_threads[r])
                    runs[name, r].append(run)
                    writer.writerow({"repeat": repeat, **run})
                    f.flush()
                    bar.update()
    rows = [summarize(runs[cell], scaling, per_rank_threads[cell[1]]) for cell in cells]
    baseline = rows[0]["tokens_per_s"]  # 'single' on 1 rank
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / baseline
        row["efficiency"] = row["speedup"] / row["ranks"]
    with open(out / "strategies.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COMPARISON_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    (out / "strategies.md").write_text(comparison_markdown(rows) + (
        f"\n{cores} cores; load average at the end {load} (1, 5, 15 min); {repeats} runs x "
        f"{iters} steps per cell; threads per rank {per_rank_threads}; {scaling} scaling; "
        f"torch {torch.__version__}.\n"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Every strategy x ranks on the Shakespeare CPU recipe.")
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts (default 1,2)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma-separated (default: all); 'single' runs at 1 rank only")
    p.add_argument("--repeats", type=int, default=5, help="independent runs per cell (median; default 5)")
    p.add_argument("--iters", type=int, default=10, help="timed steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--scaling", choices=("weak", "strong"), default="weak")
    p.add_argument("--threads", type=int, default=0,
                   help="threads per rank (default 0: cores // ranks, as course train)")
    p.add_argument("--out-dir", default="runs/strategies", help="CSV and Markdown go here")
    args = p.parse_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
        compare(args.strategies.split(","), ranks, args.repeats, args.iters, args.warmup, args.scaling,
                args.threads, args.out_dir)
    except ValueError as e:
        p.error(str(e))
    out = Path(args.out_dir)
    print((out / "strategies.md").read_text())
    print(f"wrote {out / 'strategies.csv'} and {out / 'strategies.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
