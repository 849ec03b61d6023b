"""course train --config=shakespeare_char_cpu   (or: python -m course_lib.gpt.train ...)

Train the nanoGPT-style model, in one process or as one of N data-parallel workers.

    course train --config=shakespeare_char_cpu                 # one process
    course train --config=shakespeare_char_cpu --nproc=2       # 2 workers through torchrun
    course train --resume --out_dir=out-shakespeare-char-cpu   # continue a run exactly
    python -m course_lib.gpt.train --config-file RUN_DIR/config.json   # what each worker runs

The loop is nanoGPT's (Karpathy, github.com/karpathy/nanoGPT, train.py): linear warmup then
cosine learning-rate decay, AdamW, gradient clipping, gradient accumulation, periodic evaluation
with checkpoints. Every way of distributing it goes through a Strategy
(:mod:`course_lib.parallel.strategy`); this file never wraps the model itself. The host side
(config.json, launching torchrun) is :mod:`course_lib.launch.train_cli`.

Data parallel semantics: all ranks build the model from the same seed (and the strategy
broadcasts rank 0's weights), each rank trains on its own slice of one global batch (see
:class:`course_lib.gpt.data.TrainBatches`), gradients are averaged on the last micro-step only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.gpt import checkpoint as ckpt_io
from course_lib.gpt.config import TrainConfig
from course_lib.gpt.data import TrainBatches, eval_batches, load_meta, load_tokens, model_vocab_size
from course_lib.gpt.metrics import MetricsWriter, SpanTimer, announce_run, throughput
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.gpt.runtime import Runtime, launcher_info, setup_runtime


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


def optimizer_factory(cfg: TrainConfig):
    """AdamW with weight decay on matrices only (dim >= 2), fused into one kernel (CPU and CUDA)."""
    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=True)
    return make


@torch.no_grad()
def evaluate(strategy, eval_sets: dict, autocast, rt: Runtime, n_batches: int) -> dict:
    """Mean loss of the fixed eval batches per split; each rank does its share, then all-reduce."""
    strategy.model.eval()
    out = {}
    for split, (x, y, weights) in eval_sets.items():
        total = torch.zeros((), device=rt.device)
        for k, w in enumerate(weights.tolist()):
            with autocast:
                _, loss = strategy.model(x[k], y[k])
            total += w * loss.float()
        if rt.world_size > 1:
            dist.all_reduce(total)  # sum over ranks
        out[split] = total.item() / n_batches
    strategy.model.train()
    return out


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    """Run (or resume) the training described by ``cfg`` in this process; returns a summary.

    Under torchrun every worker calls this; launch through :func:`course_lib.launch.train_cli.run`.
    """
    threads_before = torch.get_num_threads()
    rt = setup_runtime(cfg)
    try:
        return _train(cfg, rt, progress)
    finally:
        if rt.distributed and dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads_before)  # a notebook or test process keeps its own setting


def _train(cfg: TrainConfig, rt: Runtime, progress: bool) -> dict:
    from tqdm.auto import tqdm

    from course_lib.hardware import detect
    from course_lib.parallel.strategy import build_strategy

    master = rt.rank == 0
    out_dir = Path(cfg.out_dir)
    data_dir = cfg.data_dir or None
    meta = load_meta(data_dir, cfg.dataset)
    train_tokens, val_tokens = (load_tokens(data_dir, cfg.dataset, s) for s in ("train", "val"))

    # The model: the same seed on every rank gives the same initial weights.
    torch.manual_seed(cfg.seed)
    gptconf = GPTConfig(block_size=cfg.block_size, vocab_size=model_vocab_size(meta), n_layer=cfg.n_layer,
                        n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias)
    model = GPT(gptconf).to(rt.device)
    if cfg.compile:
        model.compile()  # in place: parameter names (and checkpoints) stay those of the plain model
    strategy_name = cfg.resolved_strategy(rt.world_size)
    strategy = build_strategy(strategy_name, model, optimizer_factory(cfg))
    optimizer = strategy.optimizer
    scaler = torch.amp.GradScaler(rt.device_type, enabled=rt.dtype == "float16")
    scale_good_steps = 0  # consecutive finite fp16 steps (for the scale's growth)
    autocast = (nullcontext() if rt.dtype == "float32"
                else torch.autocast(rt.device_type, dtype=getattr(torch, rt.dtype)))

    # Data: one global batch per step, this rank's slice; a fixed eval set per split.
    batches = TrainBatches(train_tokens, cfg.batch_size, cfg.block_size, cfg.gradient_accumulation_steps,
                           rt.rank, rt.world_size, cfg.seed, rt.device)
    eval_sets = {split: eval_batches(tokens, cfg.batch_size, cfg.block_size, cfg.eval_iters, cfg.seed + 1 + i,
                                     rt.rank, rt.world_size, rt.device)
                 for i, (split, tokens) in enumerate((("train", train_tokens), ("val", val_tokens)))}
    # Per-rank randomness from here on (dropout differs between ranks, as in nanoGPT).
    torch.manual_seed(cfg.seed + rt.rank)
    random.seed(cfg.seed + rt.rank)

    start_iter, best_val = 0, math.inf
    if cfg.init_from == "resume":
        ck = ckpt_io.load_checkpoint(out_dir / ckpt_io.LAST, map_location=rt.device)
        ckpt_io.check_resumable(ck["config"], cfg, out_dir / ckpt_io.LAST, ck["iter_num"])
        if ck["world_size"] != rt.world_size:
            raise ckpt_io.CheckpointError(f"{out_dir / ckpt_io.LAST} was written by {ck['world_size']} ranks, "
                                          f"this run has {rt.world_size}; resume with --nproc={ck['world_size']}")
        strategy.load_state_dict(ck)
        if ck["scaler"] is not None and scaler.is_enabled():
            scaler.load_state_dict(ck["scaler"]["state"])
            scale_good_steps = ck["scaler"]["good_steps"]
        ckpt_io.set_rng_state(ck["rng"][rt.rank], batches.generator)
        start_iter, best_val = ck["iter_num"], ck["best_val_loss"]
        del ck

    tokens_per_iter = cfg.batch_size * cfg.gradient_accumulation_steps * rt.world_size * cfg.block_size
    profile = detect(rt.device)
    peak_key = rt.dtype if rt.dtype != "float32" else ("tf32" if rt.device_type == "cuda" else "float32")
    peak = profile.peak(peak_key)
    peak_total = peak * rt.world_size if peak else None
    flops_per_token = model.flops_per_token()
    metrics = None
    if master:
        info = {"strategy": strategy_name, "world_size": rt.world_size, "device": rt.device, "dtype": rt.dtype,
                "threads_per_worker": rt.threads, "n_params": model.num_params(), "tokens_per_iter": tokens_per_iter,
                "global_batch": cfg.batch_size * cfg.gradient_accumulation_steps * rt.world_size,
                "hardware": profile.name, "peak_flops_per_device": peak, "peak_is_estimate": profile.estimated,
                "torch": torch.__version__, "start_iter": start_iter, "launcher": launcher_info(),
                "backend": dist.get_backend() if dist.is_initialized() else None}
        announce_run(cfg, info)  # run.json, config.json and the header lines
        metrics = MetricsWriter(out_dir / "metrics.csv", start_iter)

    def save_checkpoint(it: int, val_loss: float, is_best: bool) -> None:
        state = strategy.state_dict()  # full state; a collective for sharded strategies
        rngs = [ckpt_io.rng_state(batches.resume_state)]
        if rt.world_size > 1:
            rngs = [None] * rt.world_size
            dist.all_gather_object(rngs, ckpt_io.rng_state(batches.resume_state))
        if master:
            ckpt_io.save_checkpoint(out_dir / ckpt_io.LAST, {
                "format": ckpt_io.FORMAT_VERSION, **state, "iter_num": it, "val_loss": val_loss,
                "best_val_loss": best_val, "config": cfg.to_dict(), "model_args": dataclasses.asdict(gptconf),
                "meta": {k: meta[k] for k in ("dataset", "tokenizer", "vocab_size", "chars") if k in meta},
                "world_size": rt.world_size, "rng": rngs,
                "scaler": {"state": scaler.state_dict(), "good_steps": scale_good_steps} if scaler.is_enabled() else None,
            })
            if is_best:
                ckpt_io.copy_checkpoint(out_dir / ckpt_io.LAST, out_dir / ckpt_io.BEST)

    bar = tqdm(total=cfg.max_iters, initial=start_iter, desc=cfg.name, unit="it", dynamic_ncols=True,
               disable=not (master and progress))
    compute, comm_start, compute_comm = SpanTimer(rt.device_type), strategy.comm_s, 0.0
    t_last, steps, run_steps, run_s = time.perf_counter(), 0, 0, 0.0
    evals, last_eval, loss_sum, grad_norm = None, {}, None, None
    x, y = batches.next()  # (accum, B, T) each
    for it in range(start_iter, cfg.max_iters + 1):
        if it % cfg.eval_interval == 0 or it == cfg.max_iters:
            evals = last_eval = evaluate(strategy, eval_sets, autocast, rt, cfg.eval_iters)
            is_best = evals["val"] < best_val
            best_val = min(best_val, evals["val"])
            if not (it == start_iter and cfg.init_from == "resume"):  # that checkpoint is the one we loaded
                save_checkpoint(it, evals["val"], is_best)
            if master:
                bar.write(f"step {it}: train loss {evals['train']:.4f}, val loss {evals['val']:.4f}"
                          + (" (best)" if is_best else ""))
            t_last, steps, comm_start, compute_comm = time.perf_counter(), 0, strategy.comm_s, 0.0  # not step time
            compute.reset()
        if it == cfg.max_iters:
            if master:
                metrics.write({"iter": it, "val_loss": evals["val"], "eval_train_loss": evals["train"]})
            break

        lr = get_lr(it, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # forward/backward over the micro-batches; gradients are synchronised on the last one only
        compute.start()
        for micro in range(cfg.gradient_accumulation_steps):
            last = micro == cfg.gradient_accumulation_steps - 1
            with nullcontext() if last else strategy.no_sync():
                with autocast:
                    _, loss = strategy.model(x[micro], y[micro])
                loss = loss / cfg.gradient_accumulation_steps  # the mean over the micro-batches
                scaler.scale(loss).backward()
            loss_sum = loss.detach() if micro == 0 else loss_sum + loss.detach()  # no host sync
        compute.stop()
        strategy.finish_grads()  # wait for (or do) the gradient all-reduce
        compute.start()
        comm_before_step = strategy.comm_s
        if scaler.is_enabled():
            scaler.unscale_(optimizer)
        if cfg.grad_clip > 0 or scaler.is_enabled():  # the norm over all ranks' gradients
            grad_norm = strategy.clip_grad_norm_(cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        if scaler.is_enabled():
            scale_good_steps = _fp16_step(strategy, scaler, grad_norm, scale_good_steps)
        else:
            strategy.step()
        strategy.zero_grad()
        compute.stop()
        compute_comm += strategy.comm_s - comm_before_step  # e.g. ZeRO's all-gather: not compute
        x, y = batches.next()  # the next batch (asynchronous copy on a GPU)
        steps += 1

        if it % cfg.log_interval == 0 or evals is not None:
            if rt.world_size > 1:  # the loss of the global batch (a collective at log steps only)
                dist.all_reduce(loss_sum)
                loss_sum /= rt.world_size
            train_loss = loss_sum.item()  # the one host sync per logged step
            elapsed = time.perf_counter() - t_last
            comm_s = strategy.comm_s - comm_start
            row = {"iter": it, "train_loss": train_loss, "lr": lr,
                   "grad_norm": grad_norm.item() if grad_norm is not None else None,
                   **throughput(steps, elapsed, compute.total_s() - compute_comm, comm_s, tokens_per_iter,
                                flops_per_token, peak_total)}
            if evals is not None:
                row.update(val_loss=evals["val"], eval_train_loss=evals["train"])
            if master:
                metrics.write(row)
            bar.update(it + 1 - bar.n)
            bar.set_postfix(loss=f"{train_loss:.4f}", val=f"{last_eval.get('val', math.nan):.4f}",
                            ms=f"{row['step_ms']:.0f}", refresh=False)  # no eval yet after a mid-interval resume
            run_steps, run_s = run_steps + steps, run_s + elapsed
            t_last, steps, comm_start, compute_comm, evals = time.perf_counter(), 0, strategy.comm_s, 0.0, None
            compute.reset()
    bar.update(cfg.max_iters - bar.n)
    bar.close()
    summary = {"out_dir": str(out_dir), "iters": cfg.max_iters, "val_loss": last_eval["val"],
               "train_loss": last_eval["train"], "best_val_loss": best_val, "world_size": rt.world_size,
               "strategy": strategy_name, "ms_per_iter": 1e3 * run_s / run_steps if run_steps else math.nan}
    if master:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"[{cfg.name}] done: iter {cfg.max_iters}, train loss {summary['train_loss']:.4f}, "
              f"val loss {summary['val_loss']:.4f} (best {best_val:.4f}), {summary['ms_per_iter']:.1f} ms/iter",
              flush=True)
    return summary


def _fp16_step(strategy, scaler, grad_norm: torch.Tensor, good_steps: int) -> int:
    """fp16 + loss scaling: skip the step on inf/NaN gradients and halve the scale; double it
    after ``growth_interval`` good steps (GradScaler's rule). The decision uses the *global* norm
    so every rank agrees, also when gradients are sharded."""
    finite = bool(torch.isfinite(grad_norm))  # a host sync per step, as GradScaler.step makes too
    scale = scaler.get_scale()
    if finite:
        strategy.step()
        good_steps += 1
        if good_steps == scaler.get_growth_interval():
            scale, good_steps = scale * scaler.get_growth_factor(), 0
    else:
        scale, good_steps = scale * scaler.get_backoff_factor(), 0
    scaler.update(scale)  # also clears the per-step "already unscaled" record
    return good_steps


def cli(argv: list[str]) -> int:
    """``course train`` and ``python -m course_lib.gpt.train``: a torchrun worker (``--config-file``
    under torchrun) or the host side (see :mod:`course_lib.launch.train_cli`)."""
    from course_lib.launch.train_cli import cli as launch_cli
    return launch_cli(argv)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
