"""python benchmarks/precision.py [--iters 60] [--repeats 2]

Figures of the mixed-precision lesson (notebook 9) on the CPU recipe ``shakespeare_char_cpu``
(4 layers, 128 dims, block 64, batch 12), one process, one thread:

* ``--recompute=none|selective|full`` in fp32 and bf16 autocast with the real trainer: activation
  MB per rank measured (metrics.csv ``act_mb``) against Korthikanti et al.'s model
  (``act_model_mb``), median compute ms per step and its ratio to ``none`` (model: 4/3 for full);
* fp16 underflow on the same model: the share of gradient values flushed to zero and the
  gradient's relative error, without and with a loss scale (loss / 64, as 64-step accumulation);
* fp32 vs bf16 gradient all-reduce on 2 gloo ranks (our DDP and PyTorch DDP) of a small GPT
  (:func:`course_lib.experiments.precision.grad_comm_worker`'s: 2 layers, 32 wide, block 16, 27k
  parameters, 4 random sequences per rank): bytes per step as our Comms count them (the ZeRO
  paper's 2 x the buffer; PyTorch's C++ reducer is not counted), the largest loss difference over
  the steps.

Timings on a shared machine are noisy: the script repeats each run and reports the median of
the per-row medians. Record results in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from course_lib.experiments.precision import below, grad_comm_worker, gradient_underflow, recompute_runs
from course_lib.gpt import data
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.step import Precision, forward_backward
from course_lib.parallel.strategy import build_strategy
from course_lib.trainer.config import make_config

OVERHEAD_REPS = 30  # forward + backward per mode and dtype in recompute_overhead: its fastest is reported


def recompute_table(iters: int, repeats: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            runs: dict[str, list[dict]] = {}
            for rep in range(repeats):
                base = make_config("shakespeare_char_cpu", {
                    "max_iters": iters, "lr_decay_iters": iters, "eval_interval": 10 * iters, "eval_iters": 1,
                    "log_interval": 5, "threads": 1, "device": "cpu", "dtype": dtype,
                    "out_dir": str(Path(tmp) / f"{dtype}-{rep}")})
                for r in recompute_runs(base):
                    runs.setdefault(r["recompute"], []).append(r)
            base_ms = statistics.median(r["compute_ms"] for r in runs["none"])
            for mode, rs in runs.items():
                ms = statistics.median(r["compute_ms"] for r in rs)
                rows.append({"dtype": dtype, "recompute": mode, "act_mb": rs[0]["act_mb"],
                             "act_model_mb": rs[0]["act_model_mb"], "compute_ms": ms, "vs_none": ms / base_ms,
                             "final_loss": rs[0]["train_loss"]})
    return rows


def recompute_overhead(reps: int) -> list[dict]:
    """Forward + backward of the CPU recipe's model (batch 12 x 64 tokens), the three modes
    interleaved rep by rep, fastest of ``reps`` each: the least noisy figure on a shared machine."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, bias=False))
    single = build_strategy("single", model, lambda m: torch.optim.AdamW(m.parameters()))
    x = torch.randint(0, 65, (1, 12, 64))  # one micro-batch
    rows = []
    for dtype in ("float32", "bfloat16"):
        best = {m: float("inf") for m in ("none", "selective", "full")}
        precision = Precision(torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != "float32"))
        for _ in range(reps):
            for mode in best:
                model.set_recompute(mode)
                t0 = time.perf_counter()
                forward_backward(single, x, x, precision)  # the trainer's first half-step
                best[mode] = min(best[mode], time.perf_counter() - t0)
                single.zero_grad()
        rows += [{"dtype": dtype, "recompute": m, "fwd+bwd ms (min)": 1e3 * t, "vs_none": t / best["none"]}
                 for m, t in best.items()]
    return rows


def underflow_table() -> list[dict]:
    data.prepare("shakespeare_char", quiet=True)
    tokens = data.load_tokens(None, "shakespeare_char", "train")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, bias=False))
    starts = torch.randint(len(tokens) - 65, (12,))
    x = torch.stack([tokens[s:s + 64] for s in starts])
    y = torch.stack([tokens[s + 1:s + 65] for s in starts])
    r = gradient_underflow(model, x, y, scales=(1.0, 2.0**8, 2.0**16, 2.0**40), loss_divisor=64.0)
    print(f"fp32 gradient values below 2^-25: {below(r['reference'], 2.0**-25):.3%} of {r['n_values']:,}")
    return r["rows"]


def grad_comm_table(steps: int) -> list[dict]:
    res = run_ranks(grad_comm_worker, 2, ("ddp", "torch_ddp"), ("float32", "bfloat16"), None, steps)[0]
    rows = []
    for name in ("ddp", "torch_ddp"):
        fp32, bf16 = res[(name, "float32")], res[(name, "bfloat16")]
        # None: PyTorch's DDP communicates in its C++ reducer, which our byte counter does not see
        volume = {k: "not counted" if r["volume"] is None else r["volume"] for k, r in (("fp32", fp32), ("bf16", bf16))}
        rows.append({"strategy": name, "fp32 bytes/step": volume["fp32"], "bf16 bytes/step": volume["bf16"],
                     "max |loss diff|": max(abs(a - b) for a, b in zip(fp32["losses"], bf16["losses"])),
                     "final loss fp32": fp32["losses"][-1], "final loss bf16": bf16["losses"][-1]})
    return rows


def show(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2, help="trainer runs per mode (0: skip them)")
    p.add_argument("--comm-steps", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)  # the one thread the docstring promises, as the trainer runs get (threads=1)
    show("fp16 underflow (loss / 64)", underflow_table())
    show("16-bit gradient all-reduce, 2 gloo ranks", grad_comm_table(args.comm_steps))
    show(f"recomputation overhead, forward + backward (fastest of {OVERHEAD_REPS}, modes interleaved)",
         recompute_overhead(OVERHEAD_REPS))
    if args.repeats:
        show("activation recomputation (trainer, 1 thread)", recompute_table(args.iters, args.repeats))


if __name__ == "__main__":
    main()
