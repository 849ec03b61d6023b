"""python -m course_lib.trainer.loop --config-file RUN_DIR/config.json   (what every worker runs)

Train the nanoGPT-style model in this process: alone, or as one of the ranks torchrun started.

    python -m course_lib.trainer.loop --config=shakespeare_char_cpu --max_iters=200   # one process, here
    course train --config=shakespeare_char_cpu --nproc=2     # checks the request, then launches workers
    course train --resume --out_dir=out-shakespeare-char-cpu # continue a run exactly

One file, as nanoGPT's ``train.py`` and torchtitan's ``train.py``, read top to bottom:

1. Where this process runs (:func:`setup_runtime`): its rank, device, dtype and threads, resolved
   from the config; under torchrun it joins the process group (gloo on CPUs, NCCL on GPUs) with the
   config's timeout, on the device and backend the launcher planned for it
   (``COURSE_RANK_DEVICES``/``COURSE_BACKEND``: two ranks may share one GPU over gloo).
2. What the run holds (:func:`setup_run`): the data (one global batch per step, this rank's
   slice; fixed eval batches per split), the model from the config's seed behind its Strategy
   (:func:`course_lib.parallel.parallelize.parallelize`), the precision (autocast, and the fp16 loss
   scaler), and, for ``init_from='resume'``, the state of ``last.pt`` (weights, optimizer, scaler,
   RNGs: an exact resume); how it evaluates (:func:`evaluate`) and checkpoints
   (:func:`save_run_checkpoint`).
3. The loop (:func:`train_loop`), nanoGPT's (Karpathy, github.com/karpathy/nanoGPT, train.py):
   linear warmup then cosine learning-rate decay, AdamW, gradient clipping, gradient
   accumulation, periodic evaluation with checkpoints.

Every way of distributing it goes through a Strategy (:mod:`course_lib.parallel.strategy`); this
file never wraps the model itself, and its step is the one every experiment runs too,
:func:`course_lib.parallel.step.train_step`. Its timing and metrics are
:class:`course_lib.trainer.metrics.RunMeter`. Checking a request and launching workers is the
host's job (:mod:`course_lib.launch.training`); nothing here imports it.

Data parallel semantics: all ranks build the model from the same seed (and the strategy
broadcasts rank 0's weights), each rank trains on its own slice of one global batch (see
:class:`course_lib.gpt.data.TrainBatches`), gradients are averaged on the last micro-step only.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import random
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib import registry
from course_lib.gpt import checkpoint as ckpt_io
from course_lib.gpt.checkpoint import CheckpointError
from course_lib.gpt.data import SPLITS, DataError, TrainBatches, eval_batches, load_meta, load_tokens, model_vocab_size
from course_lib.gpt.model import GPT, GPTConfig, make_adamw
from course_lib.hardware import detect, pick_dtype, planned_device, planned_gpu_share
from course_lib.parallel.collective_check import install_collective_check
from course_lib.parallel.parallelize import parallelize
from course_lib.parallel.replicas import ReplicaMismatchError, check_replicas
from course_lib.parallel.step import Precision
from course_lib.parallel.step import train_step as one_step
from course_lib.parallel.strategy import Strategy
from course_lib.registry import GRAD_COMM_STRATEGIES, ConfigError, MoEConfig
from course_lib.trainer.config import TrainConfig, arg_parser, check_resume, config_from_args
from course_lib.trainer.metrics import RunMeter, SavedTensorMeter, modelled_bytes
from course_lib.utils import init_process_group

# --- 1. where this process runs ------------------------------------------------------------------

@dataclass
class Runtime:
    """Where this process runs: rank, device, dtype, threads (resolved from the config)."""
    rank: int
    world_size: int
    local_world_size: int
    device: str
    dtype: str
    threads: int
    distributed: bool
    devices: float = 1.0  # devices the run has: world_size, or fewer GPUs when ranks share them

    @property
    def device_type(self) -> str:
        return "cuda" if self.device.startswith("cuda") else "cpu"


def setup_runtime(cfg: TrainConfig) -> Runtime:
    """Join the process group when launched by torchrun; pick device, threads and dtype."""
    env = os.environ
    distributed = "RANK" in env and "WORLD_SIZE" in env
    rank, world = (int(env["RANK"]), int(env["WORLD_SIZE"])) if distributed else (0, 1)
    local_rank, local_world = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))
    device, backend = cfg.device, None
    planned = planned_device() if distributed else None
    if planned:  # the launcher's plan (course_lib.launch.placement): ranks may share a GPU over gloo
        device, backend = planned
    elif device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("device cuda requested but torch.cuda.is_available() is False; use --device=cpu")
        if not planned:
            device = f"cuda:{local_rank}" if distributed else (device if ":" in device else "cuda:0")
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (as nanoGPT)
        torch.backends.cudnn.allow_tf32 = True
        threads = torch.get_num_threads()
    else:  # N workers share the cores: cores // N threads each, so they do not oversubscribe
        threads = cfg.threads or max(1, len(os.sched_getaffinity(0)) // local_world)
        torch.set_num_threads(threads)
    if distributed and not dist.is_initialized():
        backend = backend or ("nccl" if device.startswith("cuda") else "gloo")
        init_process_group(backend, timeout_s=cfg.timeout_s, device=device)
    if distributed and cfg.check_collectives:
        install_collective_check(True, cfg.timeout_s)  # every rank: it makes a side group
    dtype = pick_dtype(detect(device), cfg.dtype)
    share = planned_gpu_share() if planned and device.startswith("cuda") else 1.0
    return Runtime(rank, world, local_world, device, dtype, threads, distributed, world * share)


# --- 2. what the run holds: setup, resume, evaluation, checkpoints ----------------------------

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
    eval_sets: dict  # split -> (x, y): this dp rank's rows of the fixed eval batches (gpt/data.py)
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
    train_tokens, val_tokens = (load_tokens(data_dir, cfg.dataset, s) for s in SPLITS)
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
                                     dp_rank, dp_world_size, cfg.gradient_accumulation_steps)
                 for i, (split, tokens) in enumerate((("train", train_tokens), ("val", val_tokens)))}
    if rt.device_type == "cuda":  # page-locked: each eval batch's copy to the GPU can overlap
        eval_sets = {split: (x.pin_memory(), y.pin_memory()) for split, (x, y) in eval_sets.items()}
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
    check_resume(ck, run.cfg, path, run.rt.world_size)
    run.strategy.load_state_dict(ck)
    if ck["scaler"] is not None and run.precision.scaler.is_enabled():
        run.precision.scaler.load_state_dict(ck["scaler"]["state"])
        run.precision.good_steps = ck["scaler"]["good_steps"]
        run.precision.skipped = ck["scaler"].get("skipped", 0)
    same_ranks = ck["world_size"] == run.rt.world_size
    ckpt_io.set_rng_state(ck["rng"][run.rt.rank if same_ranks else 0], run.batches.generator)
    run.start_iter, run.best_val = ck["iter_num"], ck["best_val_loss"]


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """Mean loss of the fixed eval batches per split: each dp rank its rows, then all-reduce (the
    tp and pp ranks of a model replica hold its loss, its cp ranks their chunks' means, so the
    sum over all ranks counts each replica's mean ``model_parallel_size`` times)."""
    model = run.strategy.model
    model.eval()
    out = {}
    for split, (x, y) in run.eval_sets.items():
        total = torch.zeros((), device=run.rt.device)
        for k in range(len(x)):  # eval_iters x accumulation forwards, one batch on the device at a time
            xk, yk = (t[k].to(run.rt.device, non_blocking=True) for t in (x, y))
            with run.precision.autocast:
                total += run.strategy.eval_loss(xk, yk).float()
        if run.rt.world_size > 1:
            dist.all_reduce(total)  # sum over ranks
        out[split] = total.item() / (len(x) * run.rt.world_size)
    model.train()
    return out


def save_run_checkpoint(run: Run, it: int, val_loss: float, is_best: bool) -> None:
    """last.pt (and best.pt if ``is_best``): the full state, written by rank 0. Every rank must
    call it: gathering sharded state and the ranks' RNG states are collectives. A new best is
    written as best.pt first, then linked as last.pt: a crash between the two leaves last.pt at
    the previous evaluation, so the resumed run reaches this one again and writes both (the other
    order left best.pt behind while last.pt's best_val_loss already counted this one)."""
    state = run.strategy.state_dict()
    rngs = [ckpt_io.rng_state(run.batches.resume_state)]
    if run.rt.world_size > 1:
        rngs = [None] * run.rt.world_size
        dist.all_gather_object(rngs, ckpt_io.rng_state(run.batches.resume_state))
    if run.rt.rank != 0:
        return
    out, scaler, cfg = Path(run.cfg.out_dir), run.precision.scaler, run.cfg
    ckpt_io.save_checkpoint(out / (ckpt_io.BEST if is_best else ckpt_io.LAST), {
        "format": ckpt_io.FORMAT_VERSION, **state, "iter_num": it, "val_loss": val_loss,
        "best_val_loss": run.best_val, "config": cfg.to_dict(), "model_args": dataclasses.asdict(run.model.config),
        "meta": {k: run.meta[k] for k in ("dataset", "tokenizer", "vocab_size", "chars") if k in run.meta},
        "world_size": run.rt.world_size, "rng": rngs,
        "scaler": {"state": scaler.state_dict(), "good_steps": run.precision.good_steps,
                   "skipped": run.precision.skipped} if scaler.is_enabled() else None,
    })
    if is_best:
        ckpt_io.copy_checkpoint(out / ckpt_io.BEST, out / ckpt_io.LAST)


# --- 3. the loop -------------------------------------------------------------------------------

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
    Outside torchrun (no ``WORLD_SIZE``, no process group) a config for several ranks (``nproc`` >
    1, or a distributed strategy) is a ConfigError, not a run on one.
    """
    if not isinstance(cfg, TrainConfig):  # a dict of overrides is what make_config takes
        raise TypeError(f"train() takes a TrainConfig, got {type(cfg).__name__}: build one with "
                        "course_lib.trainer.config.make_config(preset, overrides)")
    if "WORLD_SIZE" not in os.environ and not dist.is_initialized() and \
            (cfg.nproc > 1 or cfg.resolved_strategy(1) != "single"):
        raise ConfigError(f"nproc={cfg.nproc}, strategy {cfg.resolved_strategy(cfg.nproc)} needs torchrun's "
                          f"workers; launch them with: course train --nproc={cfg.nproc} ...")
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
            losses = evaluate(run)
            is_best = losses["val"] < run.best_val
            run.best_val = min(run.best_val, losses["val"])
            # at a resume's first iteration last.pt is this state: written again only as a new best
            # (a fine-tuning run's best restarts on the new data: best.pt is then the loaded weights)
            if is_best or not (it == run.start_iter and cfg.init_from == "resume"):
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
        train(cfg, progress=not args.no_progress)  # alone, it refuses a config for several ranks
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"python -m course_lib.trainer.loop: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
