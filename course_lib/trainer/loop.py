"""python -m course_lib.trainer.loop --config-file RUN_DIR/config.json   (what every worker runs)

Train the nanoGPT-style model in this process: alone, or as one of the ranks torchrun started.

    python -m course_lib.trainer.loop --config=shakespeare_char_cpu --max_iters=200   # one process, here
    course train --config=shakespeare_char_cpu --nproc=2     # checks the request, then launches workers
    course train --resume --out_dir=out-shakespeare-char-cpu # continue a run exactly

The loop is nanoGPT's (Karpathy, github.com/karpathy/nanoGPT, train.py): linear warmup then
cosine learning-rate decay, AdamW, gradient clipping, gradient accumulation, periodic evaluation
with checkpoints. Every way of distributing it goes through a Strategy
(:mod:`course_lib.parallel.strategy`); this file never wraps the model itself, and its step is the
one every experiment runs too, :func:`course_lib.parallel.step.train_step`. Setting up and
checkpointing a run is :mod:`course_lib.trainer.run`, its timing and metrics
:class:`course_lib.trainer.metrics.RunMeter`. Checking a request and launching workers is the host's
job (:mod:`course_lib.launch.training`); nothing here imports it.

Data parallel semantics: all ranks build the model from the same seed (and the strategy
broadcasts rank 0's weights), each rank trains on its own slice of one global batch (see
:class:`course_lib.gpt.data.TrainBatches`), gradients are averaged on the last micro-step only.
"""

from __future__ import annotations

import gc
import math
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist

from course_lib import registry
from course_lib.gpt.activation_meter import SavedTensorMeter
from course_lib.gpt.checkpoint import CheckpointError
from course_lib.gpt.data import DataError
from course_lib.parallel.replicas import ReplicaMismatchError, check_replicas
from course_lib.parallel.step import Precision
from course_lib.parallel.step import train_step as one_step
from course_lib.parallel.strategy import Strategy
from course_lib.registry import ConfigError
from course_lib.trainer.config import TrainConfig, arg_parser, config_from_args
from course_lib.trainer.metrics import RunMeter
from course_lib.trainer.process import setup_runtime
from course_lib.trainer.run import Run, evaluate, save_run_checkpoint, setup_run


def get_lr(it: int, cfg: TrainConfig) -> float:
    """Linear warmup for warmup_iters, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)  # 0 -> 1
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    """Run (or resume) the training described by ``cfg`` in this process; returns a summary.

    Under torchrun every worker calls this (``python -m course_lib.trainer.loop``); the host side
    that checks the request and launches them is :func:`course_lib.launch.training.run_training`.
    """
    threads_before = torch.get_num_threads()
    rt = setup_runtime(cfg)
    run = meter = None
    try:
        run = setup_run(cfg, rt)
        meter = RunMeter(cfg, rt, run.strategy, run.strategy_name, run.num_params, run.flops_per_token,
                         run.start_iter, progress)
        return train_loop(run, meter)
    finally:
        if rt.distributed and dist.is_initialized():
            # Free the strategy (PyTorch's DDP and FSDP keep the group inside their C++ objects)
            # while the group is alive; freed after destroy_process_group, a gloo group's
            # destructor could block one rank for good while the other had moved on.
            run = meter = None
            gc.collect()
            dist.destroy_process_group()
        torch.set_num_threads(threads_before)  # a notebook or test process keeps its own setting


def train_loop(run: Run, meter: RunMeter) -> dict:
    """nanoGPT's loop: evaluate and checkpoint every eval_interval, one step per iteration."""
    cfg, strategy = run.cfg, run.strategy
    x, y = run.batches.next()  # (accum, B, T) each
    for it in range(run.start_iter, cfg.max_iters + 1):
        if it % cfg.eval_interval == 0 or it == cfg.max_iters:
            losses = evaluate(run, cfg.eval_iters)
            is_best = losses["val"] < run.best_val
            run.best_val = min(run.best_val, losses["val"])
            if not (it == run.start_iter and cfg.init_from == "resume"):  # that checkpoint is the one we loaded
                save_run_checkpoint(run, it, losses["val"], is_best)
            meter.evaluated(it, losses, is_best)
        if it == cfg.max_iters:
            break
        lr = get_lr(it, cfg)
        for group in strategy.optimizer.param_groups:
            group["lr"] = lr
        measure = meter.wants_row(it)  # activations are counted on the steps that get a row
        loss, grad_norm, act_bytes = timed_train_step(strategy, x, y, cfg, run.precision, meter, measure)
        if cfg.check_replicas_every and (it + 1) % cfg.check_replicas_every == 0 and dist.is_initialized():
            check_step_replicas(strategy, x, it)
        x, y = run.batches.next()  # the next batch (asynchronous copy on a GPU)
        meter.log(it, loss, lr, grad_norm, precision_columns(run, act_bytes) if measure else None)
    return meter.finish(cfg.max_iters, run.best_val)


def timed_train_step(strategy: Strategy, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig, precision: Precision,
               meter: RunMeter, measure: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, int | None]:
    """One optimizer step (:func:`course_lib.parallel.step.train_step`) timed by ``meter``; x, y
    (accum, B, T) are this rank's micro-batches. Returns this rank's mean loss (a device tensor),
    the global gradient norm (None unclipped) and, with ``measure``, the bytes the first
    micro-batch's forward kept for backward (else None)."""
    saved = SavedTensorMeter(strategy.module) if measure else None

    def phase(name: str, micro: int | None):
        if name in ("forward_backward", "update"):  # compute; finish_grads is communication
            return meter.compute()
        return saved if (saved and name == "forward" and micro == 0) else nullcontext()

    result = one_step(strategy, x, y, cfg.grad_clip, precision, phase)
    return result.loss, result.grad_norm, saved.bytes if saved else None


def check_step_replicas(strategy: Strategy, x: torch.Tensor, it: int) -> None:
    """The data-parallel replicas after step ``it``: parameters, the optimizer state where it is
    not sharded (ZeRO-1/2 shard it), this rank's batch (must differ); raises ReplicaMismatchError."""
    sharded = registry.STRATEGIES[strategy.name].zero_stage if strategy.name in registry.STRATEGIES else 0
    report = check_replicas(strategy.module, None if sharded else strategy.optimizer, batch=x, grads=False,
                            group=strategy.group)
    if not report.ok:
        raise ReplicaMismatchError(f"after step {it}: {report}")


def precision_columns(run: Run, act_bytes: int | None) -> dict:
    """metrics.csv's activation and loss-scale columns for a logged step."""
    row = {"act_mb": act_bytes / 1e6 if act_bytes is not None else None,
           "act_model_mb": run.act_model_bytes / 1e6 if math.isfinite(run.act_model_bytes) else None}
    if run.precision.scaler.is_enabled():
        row.update(loss_scale=run.precision.scaler.get_scale(), skipped_steps=run.precision.skipped)
    return row


def main(argv: list[str]) -> int:
    """The worker: ``--config-file`` (what the launcher writes), or a preset and ``--field=value``
    overrides (as ``course submit`` jobs and nanoGPT's ``python train.py`` pass them)."""
    parser = arg_parser("python -m course_lib.trainer.loop", "Train in this process (a torchrun worker, or alone).")
    try:
        cfg, args = config_from_args(parser, argv)
        if "WORLD_SIZE" not in os.environ and (cfg.nproc > 1 or cfg.resolved_strategy(1) != "single"):
            raise ConfigError(f"nproc={cfg.nproc}, strategy {cfg.resolved_strategy(cfg.nproc)} needs torchrun's "
                              f"workers; launch them with: course train --nproc={cfg.nproc} ...")
        train(cfg, progress=not args.no_progress)
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"python -m course_lib.trainer.loop: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
