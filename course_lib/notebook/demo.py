"""python -m course_lib.notebook.demo --nproc=auto --out_dir=runs/demo

The instructor demo (``make demo``): Shakespeare, data parallel on every local device.

Prepares the character-level data, trains with DDP on all local devices -- the
``shakespeare_char_cpu`` recipe on a CPU host (2 workers x cores // 2 threads), nanoGPT's
``shakespeare_char`` GPU recipe on a GPU node (one worker per GPU; ``--nproc=2`` on one GPU: both
share it over gloo, as :mod:`course_lib.launch.placement` decides and prints) -- then writes
``OUT_DIR/loss.png`` and ``OUT_DIR/sample.txt`` next to the run's metrics.csv and checkpoints,
and prints the final val loss and a sample. Upstream nanoGPT's README says its CPU recipe "gets us a
loss of only 1.88" (2000 iterations, one process with batch 12); here each of the 2 ranks takes
a batch of 12, so the global batch is 24 and the same 2000 iterations see twice the data.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from course_lib.gpt.data import DataError, prepare
from course_lib.gpt.sample import sample
from course_lib.launch import placement
from course_lib.launch.api import LaunchError
from course_lib.launch.training import run_training
from course_lib.notebook.plots import plot_loss_curve
from course_lib.registry import ConfigError
from course_lib.trainer.config import make_config, parse_overrides

NANOGPT_CPU_VAL_LOSS = 1.88  # nanoGPT README, shakespeare_char on a CPU after 2000 iterations: "a loss of only 1.88"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.notebook.demo", description=__doc__.split("\n\n")[1])
    p.add_argument("--nproc", default="auto", help="workers: 'auto' = every GPU, or 2 on a CPU host")
    p.add_argument("--out_dir", "--out-dir", default="runs/demo")
    p.add_argument("--config", default="auto", help="preset; 'auto' = shakespeare_char_cpu on CPU, shakespeare_char on GPU")
    args, rest = p.parse_known_args(argv)  # the rest: any trainer field as --field=value

    t0 = time.perf_counter()
    try:
        overrides = {"out_dir": args.out_dir, "run_name": "demo", **parse_overrides(rest)}
        # where the ranks run decides the recipe: the GPU one whenever they run on GPUs (shared or not)
        plan = placement.plan(args.nproc, overrides.get("device", "auto"))
        preset = args.config if args.config != "auto" else ("shakespeare_char" if plan.device_type == "cuda"
                                                            else "shakespeare_char_cpu")
        cfg = make_config(preset, {**overrides, "nproc": plan.nproc})
        prepare(cfg.dataset, cfg.data_dir or None)
        run_training(cfg, display="terminal", overwrite=True, check=True, recipe=preset)  # what course train runs
    except (ConfigError, DataError, LaunchError) as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 1
    summary = json.loads((Path(cfg.out_dir) / "summary.json").read_text())
    out = Path(cfg.out_dir)
    plot_loss_curve(str(out / "metrics.csv"), title=f"{preset}, {summary['world_size']} x {summary['strategy']}"
                    ).savefig(out / "loss.png", dpi=120)
    text = sample(out, max_new_tokens=500, which="best")[0]
    (out / "sample.txt").write_text(text)
    wall = time.perf_counter() - t0

    print("\n" + "=" * 72)
    print(f"final val loss {summary['val_loss']:.4f} (best {summary['best_val_loss']:.4f}) after {summary['iters']} "
          f"iterations on {summary['world_size']} ranks ({summary['strategy']}), {summary['ms_per_iter']:.1f} ms/iter")
    if preset == "shakespeare_char_cpu":
        verdict = "reached" if summary["val_loss"] <= NANOGPT_CPU_VAL_LOSS else "NOT reached"
        print(f"nanoGPT's CPU recipe reaches {NANOGPT_CPU_VAL_LOSS}: {verdict}")
    print(f"wall time {wall:.0f} s; run directory {out}/ (metrics.csv, loss.png, sample.txt, best.pt, last.pt)")
    print("=" * 72 + "\nsample (best.pt, temperature 0.8, top_k 200):\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
