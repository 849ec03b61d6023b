"""Mixed precision measured on the course model: gradient underflow, loss scaling, bytes by dtype.

    from course_lib.experiments.precision import gradient_underflow, autocast_bytes

* :func:`gradient_underflow`: one batch, the fp32 gradients as reference, then the same step
  under fp16 (or bf16) autocast with the loss multiplied by a scale S and the gradients divided
  by S again: how many gradient values that are nonzero in fp32 come out exactly zero (they
  underflowed fp16's smallest subnormal, 2^-24), the relative error of the whole gradient, and
  whether anything overflowed (inf/NaN: the step a GradScaler skips). Micikevicius et al. 2018,
  "Mixed Precision Training" (arXiv:1710.03740), Sec. 3.2 and Fig. 3.
* :func:`autocast_bytes`: a forward and backward under autocast, then the bytes of parameters,
  gradients, Adam's moments and the tensors autograd saved, split by dtype: where the bytes of
  ``torch.autocast`` really go, next to the ZeRO paper's 2 + 2 + 12 per parameter.
* :func:`grad_comm_worker`: data parallelism with fp32 and with bf16 gradient all-reduce (ours
  and PyTorch DDP's), bytes and losses; :func:`recompute_runs`: the trainer once per
  ``--recompute`` mode, activation bytes measured and modelled, compute time.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from course_lib.gpt.model import GPT, GPTConfig
from course_lib.launch.training import train_in_process
from course_lib.parallel.step import Precision, train_step
from course_lib.parallel.strategy import build_strategy
from course_lib.trainer.metrics import SavedTensorMeter, read_metrics


def _flat_grads(model: nn.Module, scale: float) -> torch.Tensor:
    return torch.cat([(p.grad.float() / scale).flatten() if p.grad is not None
                      else torch.zeros(p.numel()) for p in model.parameters()])


def _grads(model: nn.Module, x, y, dtype: str, scale: float, loss_divisor: float) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=getattr(torch, dtype if dtype != "float32" else "bfloat16"),
                        enabled=dtype != "float32"):
        _, loss = model(x, y)
    (loss.float() / loss_divisor * scale).backward()  # what GradScaler.scale(loss) does
    return _flat_grads(model, scale)  # unscaled: the gradient of loss / loss_divisor


def gradient_underflow(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                       scales=(1.0, 2.0**8, 2.0**16, 2.0**24), dtypes=("float16", "bfloat16"),
                       loss_divisor: float = 1.0, pure_fp16: bool = False) -> dict:
    """The gradients of one batch in fp32 and under 16-bit autocast with loss scale S.

    ``loss_divisor``: the loss is divided by it first, as gradient accumulation divides by the
    number of micro-batches (smaller gradients, more underflow). ``pure_fp16``: run fp16 with
    the model itself cast to fp16 (fp16 weights and gradients, Micikevicius et al.'s setting)
    instead of autocast. Returns ``reference`` (the fp32 gradient magnitudes, for a histogram)
    and ``rows``: one per (dtype, scale) with ``flushed`` (fraction of the fp32-nonzero gradient
    values that came out zero), ``rel_err`` (|g - g32| / |g32|) and ``overflow`` (any inf/NaN).
    """
    model = copy.deepcopy(model).train()
    ref = _grads(model, x, y, "float32", 1.0, loss_divisor)
    nonzero = ref != 0
    rows = []
    for dtype in dtypes:
        pure = pure_fp16 and dtype == "float16"
        m = copy.deepcopy(model).half() if pure else model  # pure: fp16 weights, no autocast
        for scale in scales:
            g = _grads(m, x, y, "float32" if pure else dtype, scale, loss_divisor)
            finite = bool(torch.isfinite(g).all())
            rows.append({"dtype": dtype + (" (pure)" if pure else ""), "scale": scale,
                         "flushed": ((g == 0) & nonzero).sum().item() / max(1, nonzero.sum().item()),
                         "rel_err": ((g - ref).norm() / ref.norm()).item() if finite else math.nan,
                         "overflow": not finite})
    return {"reference": ref.abs(), "rows": rows, "n_values": ref.numel()}


def below(values: torch.Tensor, threshold: float) -> float:
    """Fraction of the nonzero ``values`` whose magnitude is below ``threshold``."""
    v = values[values != 0].abs()
    return (v < threshold).float().mean().item() if v.numel() else 0.0


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def autocast_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: str = "bfloat16",
                   recompute: str = "none") -> dict:
    """Bytes a training step of ``model`` holds under autocast ``dtype``, by role and dtype.

    Returns {"params": {dtype: bytes}, "grads": ..., "optimizer": ..., "saved": ...}: parameters,
    gradients and AdamW's exp_avg / exp_avg_sq after one step, and what autograd saved for
    backward during the forward (each storage once; parameters excluded, so a 16-bit weight copy
    that autocast made counts as saved). Also ``num_params``.
    """
    model = copy.deepcopy(model).train()
    if hasattr(model, "set_recompute"):
        model.set_recompute(recompute)
    device_type = next(model.parameters()).device.type
    single = build_strategy("single", model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4))
    meter, held = SavedTensorMeter(model), {}

    def by_dtype(tensors) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        seen = set()
        for t in tensors:
            if t is not None and _storage_key(t) not in seen:
                seen.add(_storage_key(t))
                out[str(t.dtype).removeprefix("torch.")] += t.untyped_storage().nbytes()
        return dict(out)

    def phase(name: str, micro: int | None):
        if name == "zero_grad":  # after the optimizer step, before the gradients are freed
            ps = list(model.parameters())
            opt = single.optimizer
            held.update(params=by_dtype(ps), grads=by_dtype(p.grad for p in ps),
                        optimizer=by_dtype(v for p in ps for k, v in opt.state[p].items() if k != "step"))
        return meter if name == "forward" else nullcontext()

    autocast = torch.autocast(device_type, dtype=getattr(torch, dtype), enabled=dtype != "float32")
    train_step(single, x[None], y[None], precision=Precision(autocast), phase=phase)  # one micro-batch
    return {**held, "saved": meter.by_dtype(), "num_params": sum(p.numel() for p in model.parameters())}


def _after_grads(seen: dict):
    """A phase hook for train_step: once the gradients are communicated, note in ``seen`` the
    bytes the strategy's Comms counted so far and whether every gradient is a number of
    ``seen["comm"]`` (bf16/fp16: the 16-bit path ran)."""
    def phase(name: str, micro: int | None):
        if name == "update":
            strategy, comm = seen["strategy"], seen["comm"]
            if hasattr(strategy, "comms"):
                seen["volume"] = strategy.comms.volume_bytes
            seen["on_grid"] = comm is None or all(torch.equal(p.grad, p.grad.to(comm).float())
                                                  for p in strategy.module.parameters() if p.grad is not None)
        return nullcontext()
    return phase


def grad_comm_worker(rank: int, world_size: int, strategies=("ddp", "torch_ddp"),
                     dtypes=("float32", "bfloat16"), gpt_kwargs: dict | None = None, steps: int = 10,
                     batch_size: int = 4, lr: float = 3e-3, seed: int = 0) -> dict:
    """One rank of a data-parallel run per (strategy, gradient communication dtype), from the same
    weights on the same data: ``run_ranks(grad_comm_worker, 2, ...)``.

    Per run: ``losses`` (mean over ranks, per step), ``volume`` (bytes the strategy's Comms
    counted for one step's gradients, ZeRO accounting; None for PyTorch DDP, whose C++ reducer
    our counter does not see) and ``on_grid`` (every averaged gradient value is a number of the
    communication dtype: the proof that the 16-bit path really ran, for either implementation).
    """
    cfg = GPTConfig(**(gpt_kwargs or {"block_size": 16, "vocab_size": 65, "n_layer": 2, "n_head": 2,
                                      "n_embd": 32, "bias": False}))
    out = {}
    for name in strategies:
        for dtype in dtypes:
            torch.manual_seed(seed)
            model = GPT(cfg)
            num_params = model.num_params()  # before wrapping: a ZeRO-3 module shows this rank's shards
            comm = None if dtype == "float32" else getattr(torch, dtype)
            strategy = build_strategy(name, model, lambda m: torch.optim.AdamW(m.parameters(), lr=lr),
                                      grad_comm_dtype=comm)
            gen = torch.Generator().manual_seed(seed + 1)
            losses, volume, on_grid = [], None, True
            for _ in range(steps):
                idx = torch.randint(0, cfg.vocab_size, (batch_size * world_size, cfg.block_size + 1),
                                    generator=gen)
                x, y = idx[rank::world_size, :-1].contiguous(), idx[rank::world_size, 1:].contiguous()
                before = strategy.comms.volume_bytes if hasattr(strategy, "comms") else None
                seen = {"strategy": strategy, "comm": comm}
                loss = train_step(strategy, x[None], y[None], phase=_after_grads(seen)).loss
                if before is not None:
                    volume = seen["volume"] - before
                if comm is not None:
                    on_grid &= seen["on_grid"]
                mean = loss.clone()
                dist.all_reduce(mean)
                losses.append(mean.item() / world_size)
            out[(name, dtype)] = {"losses": losses, "volume": volume, "on_grid": on_grid,
                                  "num_params": num_params}
    return out


def recompute_runs(base, modes=("none", "selective", "full")) -> list[dict]:
    """Train ``base`` (a TrainConfig) once per recompute mode in this process, each in its own
    ``out_dir/<mode>``; one row per run from its metrics.csv: the activation bytes measured and
    modelled (MB per rank), the median compute ms per step (the first logged row, with its
    warm-up, left out) and the final training loss."""
    out = []
    for mode in modes:
        cfg = base.replace(recompute=mode, out_dir=str(Path(base.out_dir) / mode))
        train_in_process(cfg, overwrite=True, progress=False)
        rows = [r for r in read_metrics(Path(cfg.out_dir) / "metrics.csv") if r["act_mb"] == r["act_mb"]]
        timed = rows[1:] or rows
        out.append({"recompute": mode, "act_mb": rows[-1]["act_mb"], "act_model_mb": rows[-1]["act_model_mb"],
                    "compute_ms": statistics.median(r["compute_ms"] for r in timed),
                    "train_loss": rows[-1]["train_loss"], "losses": [r["train_loss"] for r in rows]})
    return out
