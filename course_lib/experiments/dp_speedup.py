"""The measured speedup of data parallelism with the real trainer (notebook 3, section 8).

    from course_lib.experiments.dp_speedup import measure_speedup
    runs = measure_speedup("cpu", ["ddp"], iters=60)          # 1 rank, then 2 ranks per strategy
    pd.DataFrame(speedup_table(runs))                          # course_lib.analysis.scaling_laws

Each run is ``launch_training`` of nanoGPT's CPU recipe (``shakespeare_char_cpu``) for ``iters``
iterations: one rank with the ``single`` strategy, then every data-parallel strategy on 2 ranks
(CPU) or on 2, 4, 8 ranks up to the GPUs there are. The micro-batch per rank stays the recipe's,
so N ranks process N times the tokens per iteration (weak scaling). The figures are the
trainer's own: the median ``step_ms`` of the logged iterations after the first two (warm-up).
"""

from __future__ import annotations

import time

from course_lib.analysis import dp_recipes
from course_lib.launch import launch_training
from course_lib.trainer.config import make_config

WARMUP_ITERS = 2  # left out of the median: allocation and first-touch costs


def rank_counts(device: str, gpus: int) -> list[int]:
    """1 and 2 ranks on the CPU; 1, 2, 4, 8 up to the GPU count on GPUs."""
    return [1, 2] if device == "cpu" else [n for n in (1, 2, 4, 8) if n <= gpus]


def measure_speedup(device: str, strategies: list[str], iters: int, gpus: int = 0, eval_iters: int = 2,
                    run_root: str | None = None, preset: str = "shakespeare_char_cpu") -> list[dict]:
    """One run per (ranks, strategy); a dict each: ranks, strategy, ms_per_iter, tokens_per_iter,
    final train loss (the rows :func:`course_lib.analysis.scaling_laws.speedup_table` reads)."""
    run_root = run_root or f"runs/dp_speedup/{time.strftime('%Y%m%d-%H%M%S')}"
    runs = []
    for n in rank_counts(device, gpus):
        for name in (["single"] if n == 1 else strategies):
            cfg = make_config(preset, {
                "device": device, "strategy": name, "max_iters": iters, "lr_decay_iters": iters,
                "warmup_iters": 2, "eval_interval": 10 * iters, "eval_iters": eval_iters,
                "log_interval": 1, "out_dir": f"{run_root}/{name}-{n}"})
            result = launch_training(cfg, nproc=n, timeout=600, check=True)
            steps = result.metrics.dropna(subset=["step_ms"]).query(f"iter >= {WARMUP_ITERS}")
            tokens = dp_recipes.global_batch_size(cfg.batch_size, cfg.gradient_accumulation_steps, n) * cfg.block_size
            runs.append({"ranks": n, "strategy": name, "ms_per_iter": steps["step_ms"].median(),
                         "tokens_per_iter": tokens, "final train loss": steps["train_loss"].iloc[-1]})
    return runs
