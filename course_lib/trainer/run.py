"""What one training process holds, and how it starts, evaluates and checkpoints.

:func:`setup_run` builds it from the config: the data (one global batch per step, this rank's
slice; fixed eval batches per split), the model from the config's seed behind its Strategy, the
precision (autocast, and the fp16 loss scaler), and, for ``init_from='resume'``, the state of
``last.pt`` (weights, optimizer, scaler, RNGs: an exact resume). The loop that uses it is
:func:`course_lib.trainer.loop.train_loop`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.gpt import checkpoint as ckpt_io
from course_lib.gpt.activation_meter import modelled_bytes
from course_lib.gpt.config import GRAD_COMM_STRATEGIES, MoEConfig, TrainConfig
from course_lib.gpt.data import TrainBatches, eval_batches, load_meta, load_tokens, model_vocab_size
from course_lib.gpt.model import GPT, GPTConfig, make_adamw
from course_lib.parallel.parallelize import parallelize
from course_lib.parallel.step import Precision
from course_lib.parallel.strategy import Strategy
from course_lib.trainer.process import Runtime


def optimizer_factory(cfg: TrainConfig):
    """What a Strategy calls on the model (or its shard): the course's one AdamW (model.make_adamw)."""
    return lambda model: make_adamw(model, cfg.learning_rate, cfg.weight_decay, (cfg.beta1, cfg.beta2))


def strategy_options(cfg: TrainConfig, strategy_name: str) -> dict:
    """Keyword arguments for the strategy from the config: 16-bit gradient all-reduce for the
    data-parallel ones (``--grad_comm_dtype``; one process has nothing to communicate)."""
    if cfg.grad_comm_dtype == "float32" or strategy_name not in GRAD_COMM_STRATEGIES:
        return {}
    return {"grad_comm_dtype": getattr(torch, cfg.grad_comm_dtype)}


@dataclass
class Run:
    cfg: TrainConfig
    rt: Runtime
    model: GPT  # the plain model (parameter names); the strategy wraps it
    strategy: Strategy
    strategy_name: str
    batches: TrainBatches
    eval_sets: dict  # split -> (x, y, weights): this rank's share of the fixed eval batches
    precision: Precision
    meta: dict
    start_iter: int = 0
    best_val: float = math.inf
    act_model_bytes: float = 0.0  # activations of one micro-batch, modelled (metrics.csv act_model_mb)
    num_params: int = 0  # the whole model's, counted before a strategy wraps it (ZeRO-3 shows shards)
    flops_per_token: float = 0.0  # training FLOPs per token of the whole model (for MFU)


def setup_run(cfg: TrainConfig, rt: Runtime) -> Run:
    data_dir = cfg.data_dir or None
    meta = load_meta(data_dir, cfg.dataset)
    train_tokens, val_tokens = (load_tokens(data_dir, cfg.dataset, s) for s in ("train", "val"))
    torch.manual_seed(cfg.seed)  # the same seed on every rank gives the same initial weights
    gptconf = GPTConfig(block_size=cfg.block_size, vocab_size=model_vocab_size(meta), n_layer=cfg.n_layer,
                        n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias,
                        **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(MoEConfig)})
    model = GPT(gptconf).to(rt.device).set_recompute(cfg.recompute)
    if cfg.compile:
        model.compile()  # in place: parameter names (and checkpoints) stay those of the plain model
    strategy_name = cfg.resolved_strategy(rt.world_size)
    num_params, flops_per_token = model.num_params(), model.flops_per_token()  # before any wrapper
    if cfg.on_grid(cfg.n_expert):
        cfg.check_layout(rt.world_size)  # ranks = dp x tp x pp x cp, ep | dp (the launcher checked it too)
    strategy = parallelize(model, optimizer_factory(cfg), strategy_name, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep,
                           ep_padded=cfg.ep_dispatch == "padded",
                           sequence_parallel=cfg.sequence_parallel, pp_schedule=cfg.pp_schedule,
                           **strategy_options(cfg, strategy_name))
    dp_rank, dp_world_size = strategy.dp_rank, strategy.dp_world_size
    # every rank of a tp/pp/cp group reads its dp rank's samples (cp ranks cut out their chunks)
    batches = TrainBatches(train_tokens, cfg.batch_size, cfg.block_size, cfg.gradient_accumulation_steps,
                           dp_rank, dp_world_size, cfg.seed, rt.device)
    eval_sets = {split: eval_batches(tokens, cfg.batch_size, cfg.block_size, cfg.eval_iters, cfg.seed + 1 + i,
                                     dp_rank, dp_world_size, rt.device)
                 for i, (split, tokens) in enumerate((("train", train_tokens), ("val", val_tokens)))}
    torch.manual_seed(cfg.seed + rt.rank)  # per-rank randomness from here on (dropout, as in nanoGPT)
    random.seed(cfg.seed + rt.rank)
    run = Run(cfg, rt, model, strategy, strategy_name, batches, eval_sets, Precision.for_dtype(rt.device_type, rt.dtype), meta,
              act_model_bytes=math.nan if cfg.on_grid(cfg.n_expert)  # per stage: peak_activation_bytes
              else modelled_bytes(cfg, gptconf.vocab_size, rt.dtype, rt.device_type),
              num_params=num_params, flops_per_token=flops_per_token)
    if cfg.init_from == "resume":
        _resume(run)
    return run


def _resume(run: Run) -> None:
    path = Path(run.cfg.out_dir) / ckpt_io.LAST
    ck = ckpt_io.load_checkpoint(path, map_location=run.rt.device)
    ckpt_io.check_resume(ck, run.cfg, path, run.rt.world_size)
    run.strategy.load_state_dict(ck)
    if ck["scaler"] is not None and run.precision.scaler.is_enabled():
        run.precision.scaler.load_state_dict(ck["scaler"]["state"])
        run.precision.good_steps = ck["scaler"]["good_steps"]
        run.precision.skipped = ck["scaler"].get("skipped", 0)
    same_ranks = ck["world_size"] == run.rt.world_size
    ckpt_io.set_rng_state(ck["rng"][run.rt.rank if same_ranks else 0], run.batches.generator)
    run.start_iter, run.best_val = ck["iter_num"], ck["best_val_loss"]


@torch.no_grad()
def evaluate(run: Run, n_batches: int) -> dict:
    """Mean loss of the fixed eval batches per split; each dp rank does its share, then all-reduce
    (the tp and pp ranks of a model replica hold its loss, its cp ranks their chunks' means)."""
    model = run.strategy.model
    model.eval()
    out = {}
    for split, (x, y, weights) in run.eval_sets.items():
        total = torch.zeros((), device=run.rt.device)
        for k, w in enumerate(weights.tolist()):
            with run.precision.autocast:
                loss = run.strategy.eval_loss(x[k], y[k])
            total += w * loss.float()
        if run.rt.world_size > 1:
            dist.all_reduce(total)  # sum over ranks
        out[split] = total.item() / n_batches / run.cfg.model_parallel_size
    model.train()
    return out


def save_run_checkpoint(run: Run, it: int, val_loss: float, is_best: bool) -> None:
    """last.pt (and best.pt if ``is_best``): the full state, written by rank 0. Every rank must
    call it: gathering sharded state and the ranks' RNG states are collectives."""
    state = run.strategy.state_dict()
    rngs = [ckpt_io.rng_state(run.batches.resume_state)]
    if run.rt.world_size > 1:
        rngs = [None] * run.rt.world_size
        dist.all_gather_object(rngs, ckpt_io.rng_state(run.batches.resume_state))
    if run.rt.rank != 0:
        return
    out, scaler, cfg = Path(run.cfg.out_dir), run.precision.scaler, run.cfg
    ckpt_io.save_checkpoint(out / ckpt_io.LAST, {
        "format": ckpt_io.FORMAT_VERSION, **state, "iter_num": it, "val_loss": val_loss,
        "best_val_loss": run.best_val, "config": cfg.to_dict(), "model_args": dataclasses.asdict(run.model.config),
        "meta": {k: run.meta[k] for k in ("dataset", "tokenizer", "vocab_size", "chars") if k in run.meta},
        "world_size": run.rt.world_size, "rng": rngs,
        "scaler": {"state": scaler.state_dict(), "good_steps": run.precision.good_steps,
                   "skipped": run.precision.skipped} if scaler.is_enabled() else None,
    })
    if is_best:
        ckpt_io.copy_checkpoint(out / ckpt_io.LAST, out / ckpt_io.BEST)
