"""python benchmarks/parallel_layouts.py --ranks 4,8 --iters 4

Every way of cutting the Shakespeare CPU model (the ``shakespeare_char_cpu`` preset: 4 layers,
n_embd 128, 4 heads, block 64, vocabulary 65) over 4 and 8 gloo ranks on this machine: data,
tensor (+ sequence), pipeline and context parallelism and their combinations, trained by
:func:`course_lib.parallel.parallelize.parallelize`. Strong scaling: every layout trains the
same global batch per step (``--micro`` micro-batches of ``--batch`` sequences, split over dp),
so the rows compare directly. Per layout (medians over ``--iters`` steps after one warm-up step):

* ms/iter (the slowest rank) and tokens/s;
* per-rank memory, the most over ranks: model states (parameters + gradients + AdamW states,
  measured on the live tensors) and peak activation bytes (what autograd saved, in flight);
* bytes each rank sends per step in each group (tp, sp, cp, pp, dp), the most over ranks; "dp"
  is the gradient all-reduce, over the dp x cp ranks (a cp layout with dp = 1 has dp bytes);
* the pipeline bubble on the schedule's logical clock, next to (p - 1) / (m + p - 1).

Tokens are random (timing does not depend on them). Workers get one thread each. Prints a
Markdown table; ``--out FILE`` also writes it there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext

import torch

from course_lib.gpt.model import GPT, GPTConfig
from course_lib.hardware import MiB
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.parallelize import parallelize
from course_lib.parallel.step import train_step
from course_lib.trainer.config import TrainConfig
from course_lib.trainer.loop import optimizer_factory

LAYOUTS = {  # name -> (dp, tp, pp, cp, sequence_parallel)
    4: {"dp4": (4, 1, 1, 1, False), "tp4": (1, 4, 1, 1, False), "tp2+sp-dp2": (2, 2, 1, 1, True),
        "pp4": (1, 1, 4, 1, False), "pp2-dp2": (2, 1, 2, 1, False), "cp2-dp2": (2, 1, 1, 2, False),
        "tp2-pp2": (1, 2, 2, 1, False), "tp2+sp-cp2": (1, 2, 1, 2, True)},
    8: {"dp8": (8, 1, 1, 1, False), "tp2-pp2-dp2": (2, 2, 2, 1, False), "tp2+sp-dp4": (4, 2, 1, 1, True),
        "pp2-cp2-dp2": (2, 1, 2, 2, False), "tp2-pp2-cp2": (1, 2, 2, 2, False),
        "tp2+sp-pp2-cp2": (1, 2, 2, 2, True), "pp4-dp2": (2, 1, 4, 1, False)},
}


def worker(rank: int, world_size: int, lay: tuple, args) -> dict:
    dp, tp, pp, cp, sp = lay
    cfg = GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False)
    torch.manual_seed(0)
    strategy = parallelize(GPT(cfg), optimizer_factory(TrainConfig()), args.strategy, tp=tp, pp=pp, cp=cp,
                           sequence_parallel=sp, pp_schedule=args.schedule, model_parallel=True)  # dp-only measured alike
    g = torch.Generator().manual_seed(1)
    b = args.batch // dp
    times, figures, fig = [], [], {}

    def phase(name, micro):
        if name == "zero_grad":  # the step's figures, taken while the gradients are still held
            fig.update(strategy.figures())
        return nullcontext()
    for it in range(args.iters + 1):
        x = torch.randint(0, cfg.vocab_size, (args.micro, b, cfg.block_size), generator=g)
        t0 = time.perf_counter()
        train_step(strategy, x, x.roll(-1, dims=-1), grad_clip=1.0, phase=phase)
        if it:  # the first step is warm-up (allocations, optimizer state)
            times.append(time.perf_counter() - t0)
            figures.append(dict(fig))
    return {"ms": 1e3 * statistics.median(times), "figures": figures[-1]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="4,8", help="comma-separated world sizes (4, 8)")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--batch", type=int, default=16, help="sequences per micro-batch, all dp ranks together")
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--strategy", default="ddp", choices=("ddp", "zero1", "zero2"))
    p.add_argument("--schedule", default="1f1b", choices=("afab", "1f1b"))
    p.add_argument("--only", default="", help="comma-separated layout names")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error("--iters must be at least 1 (timed steps after the warm-up step)")
    # Refused here, before any rank starts (a rank would fail deep in its step, or a layout run on
    # fewer sequences than the tokens/s column counts).
    try:
        counts = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks takes comma-separated world sizes, got {args.ranks!r}")
    if set(counts) - set(LAYOUTS):
        p.error(f"--ranks: layouts are listed for {', '.join(map(str, LAYOUTS))} ranks, not {args.ranks}")
    only = set(args.only.split(",")) - {""}
    known = {name for n in counts for name in LAYOUTS[n]}
    if only - known:
        p.error(f"--only: no layout {', '.join(sorted(only - known))} at {args.ranks} ranks "
                f"(known: {', '.join(sorted(known))})")
    for n in counts:
        for name, lay in LAYOUTS[n].items():
            if (not only or name in only) and (args.batch < lay[0] or args.batch % lay[0]):
                p.error(f"--batch {args.batch} does not split over the {lay[0]} dp ranks of {name}")
    header = ("| ranks | layout | ms/iter | tokens/s | model states MiB | peak act. MiB | tp MiB | sp MiB | cp MiB | "
              "pp MiB | dp MiB | bubble (theory) |")
    rows = [header, "|" + "---|" * 12]
    print("\n".join(rows), flush=True)
    for n in counts:
        for name, lay in LAYOUTS[n].items():
            if only and name not in only:
                continue
            res = run_ranks(worker, n, lay, args)
            ms = max(r["ms"] for r in res)
            f = [r["figures"] for r in res]
            top = {k: max(x.get(k, 0) for x in f) / MiB for k in f[0] if k.startswith(("sent", "model", "peak"))}
            tokens = args.micro * args.batch * 64
            bubble = f"{f[0]['bubble']:.2f} ({f[0]['bubble_theory']:.2f})"
            row = (f"| {n} | {name} | {ms:.0f} | {tokens / ms * 1e3:,.0f} | {top['model_state_bytes']:.2f} | "
                   f"{top['peak_activation_bytes']:.2f} | "
                   + " | ".join(f"{top[f'sent_bytes_{k}']:.2f}" for k in ("tp", "sp", "cp", "pp", "dp"))
                   + f" | {bubble} |")
            rows.append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
