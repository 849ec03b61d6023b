"""The experts lesson's measurements (notebook 13): the router over training, a real routing's
all-to-all, and expert against data parallelism on CPU ranks, set beside the models.

    history = router_history(read_metrics(run_dir / "metrics.csv"), n_expert)   # tokens per expert
    counts = routing_counts(model, x, ep=4)           # rows each rank would send each rank
    results = run_ranks(compare_layouts, 4, model_kwargs, LAYOUTS, steps)       # every rank's figures
    rows = measured_rows(results, model_kwargs)         # measured beside analysis.moe_memory

:func:`compare_layouts` builds the same MoE GPT on every rank, cuts it for each layout with
:func:`course_lib.parallel.parallelize.parallelize` (ep carved out of dp: the experts over the ep
group, tokens by all-to-all) and trains it with the one step (:func:`course_lib.parallel.step.train_step`)
on the same global batches, each rank its share; one process trains the whole batch beside them.
Per layout and rank it keeps the losses of the global batch, the most model states held
(:func:`course_lib.parallel.footprint.measure_model_states`, through the strategy's ``figures``),
the bytes sent in each group (:mod:`course_lib.parallel.comms`: ``ep`` the all-to-alls, ``router``
the routers' counts, ``dp`` the non-expert gradients, ``edp`` the experts' gradients) and the
step time. :func:`measured_rows` sets those beside :func:`course_lib.analysis.moe_memory.rank_states`
(fp32 Adam: 4 + 4 + 8 bytes per parameter) and :func:`course_lib.analysis.comm_cost.moe_all_to_all_bytes`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.analysis.comm_cost import moe_all_to_all_bytes
from course_lib.analysis.moe_memory import MoEShape, rank_states
from course_lib.gpt.model import GPT, GPTConfig, make_adamw
from course_lib.gpt.moe import moe_layers
from course_lib.parallel.parallelize import parallelize
from course_lib.parallel.step import train_step
from course_lib.parallel.strategy import build_strategy

# the layouts of 4 ranks the lesson compares: plain data parallelism (every rank all experts), and
# the experts over 2 and 4 ranks; ZeRO-1 on the non-expert parameters beside ep 2
LAYOUTS: dict[str, dict] = {
    "dp4 (ep1)": {"ep": 1, "strategy": "ddp"},
    "dp4 ep2": {"ep": 2, "strategy": "ddp"},
    "dp4 ep4": {"ep": 4, "strategy": "ddp"},
    "dp4 ep2 zero1": {"ep": 2, "strategy": "zero1"},
}
DP_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}  # the ZeRO stage of the non-expert states


def router_history(rows: Sequence[Mapping], n_expert: int) -> dict:
    """From metrics.csv's rows (:func:`course_lib.trainer.metrics.read_metrics`): per logged step,
    the assignments routed to each expert (summed over the blocks, since the previous row), the
    load-balancing loss and the training loss, in the shape ``notebook.moe_plots`` draws
    (``tokens_per_expert``: steps x 1 x E)."""
    rows = [r for r in rows if _number(r.get("train_loss")) is not None and _number(r.get("moe_tokens_e0")) is not None]
    return {"steps": [int(float(r["iter"])) for r in rows],
            "tokens_per_expert": [[float(r[f"moe_tokens_e{e}"]) for e in range(n_expert)] for r in rows],
            "aux_loss": [float(r["moe_aux_loss"]) for r in rows],
            "train_loss": [float(r["train_loss"]) for r in rows]}


def _number(value) -> float | None:
    """A metrics.csv cell as a float; None when empty (an evaluation row has no training columns)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


@torch.no_grad()
def routing_counts(model: GPT, x: torch.Tensor, ep: int, block: int = 0) -> list[list[int]]:
    """counts[r][s]: the assignments rank r's tokens x[r] (ep, B, T) send to the experts of rank s
    (rank s holds experts [s E/ep, (s+1) E/ep)) in MoE block ``block``, routed by the model's own
    router: the send counts of that block's dispatch, one row per rank."""
    layer = moe_layers(model)[block]
    seen = []
    hook = layer.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        counts = []
        for r in range(ep):
            seen.clear()
            model(x[r])
            h = seen[0].reshape(-1, seen[0].shape[-1])  # (B*T, C): the block's MLP input
            choice = F.softmax(layer.router(h), dim=-1).topk(layer.top_k, dim=-1).indices  # (B*T, k)
            owner = choice.reshape(-1) // (layer.n_expert // ep)
            counts.append(torch.bincount(owner, minlength=ep).tolist())
    finally:
        hook.remove()
    return counts


def _batch(step: int, n: int, vocab: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, vocab, (n, T + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _adamw(lr: float):
    """The trainer's AdamW (gpt.model.make_adamw), no weight decay: these runs compare layouts."""
    return lambda m: make_adamw(m, lr, weight_decay=0.0)


def compare_layouts(rank: int, world_size: int, model_kwargs: dict, layouts: Mapping[str, dict] | None = None,
                    steps: int = 3, batch_size: int = 2, lr: float = 1e-3, seed: int = 0) -> dict:
    """Run on every rank (``run_ranks(compare_layouts, 4, model_kwargs, LAYOUTS, steps)``): each
    layout trains ``steps`` steps from the same weights on the same global batches (``batch_size``
    sequences per rank, random tokens); rank 0 also trains one process on the whole batch. Per
    layout: ``losses`` (the global batch's), ``states`` (bytes of model states, the most held),
    ``sent`` (bytes per group, the last step), ``step_ms`` (median), ``tokens`` (this rank's)."""
    layouts = LAYOUTS if layouts is None else layouts
    cfg = GPTConfig(**model_kwargs)
    n = batch_size * world_size
    out: dict = {}
    for name, lay in layouts.items():
        torch.manual_seed(seed)
        strategy = parallelize(GPT(cfg), _adamw(lr), lay.get("strategy", "ddp"), ep=lay.get("ep", 1),
                               model_parallel=True)
        g = strategy.grid
        mine = slice(batch_size * g.dp_rank, batch_size * (g.dp_rank + 1))
        losses, times, figures = [], [], {}
        for s in range(steps):
            x, y = _batch(s, n, cfg.vocab_size, cfg.block_size)
            dist.barrier()  # every rank starts the step together: its time is the slowest rank's
            t0 = time.perf_counter()
            loss = train_step(strategy, x[None, mine], y[None, mine]).loss.detach().reshape(1)
            times.append(time.perf_counter() - t0)
            dist.all_reduce(loss)
            losses.append(loss.item() / world_size)
            figures = strategy.figures()  # bytes since the last call: this step's
        out[name] = {"losses": losses, "states": figures["model_state_bytes"],
                     "sent": {k.removeprefix("sent_bytes_"): v for k, v in figures.items() if k.startswith("sent_bytes_")},
                     "step_ms": 1e3 * statistics.median(times[1:] or times), "tokens": batch_size * cfg.block_size}
    if rank == 0:
        torch.manual_seed(seed)
        single = build_strategy("single", GPT(cfg), _adamw(lr))  # the same step, one process, the whole batch
        ref = []
        for s in range(steps):
            x, y = _batch(s, n, cfg.vocab_size, cfg.block_size)
            ref.append(train_step(single, x[None], y[None]).loss.item())
        out["one process"] = {"losses": ref}
    dist.barrier()
    return out


def measured_rows(results: Sequence[Mapping], model_kwargs: dict, layouts: Mapping[str, dict] | None = None) -> list[dict]:
    """One row per layout and rank: model states measured and by :func:`rank_states` (fp32 Adam),
    how far apart they are (percent of the model), the step time, the bytes each group sent in the
    last step, the all-to-all's bytes for an even router (:func:`moe_all_to_all_bytes`), and how
    far the losses are from one process."""
    layouts = LAYOUTS if layouts is None else layouts
    cfg = GPTConfig(**model_kwargs)
    shape = MoEShape.of_gpt(cfg)
    ref = results[0]["one process"]["losses"]
    world = len(results)
    rows = []
    for name, lay in layouts.items():
        ep, stage = lay.get("ep", 1), DP_STAGE[lay.get("strategy", "ddp")]
        model = rank_states(shape, dp=world, ep=ep, stage=stage, expert_stage=0, dtype="fp32").total.total
        for rank, res in enumerate(results):
            r = res[name]
            even = sum(moe_all_to_all_bytes(r["tokens"], cfg.top_k, cfg.n_embd, ep, 4).values()) * cfg.n_layer
            rows.append({"layout": name, "rank": rank, "states MB": r["states"] / 1e6, "model MB": model / 1e6,
                         "states vs model %": 100 * (r["states"] / model - 1), "step ms": r["step_ms"],
                         "all_to_all MB": r["sent"].get("ep", 0.0) / 1e6, "even router MB": even / 1e6,
                         "all_reduce MB": (r["sent"].get("dp", 0.0) + r["sent"].get("edp", 0.0)) / 1e6,
                         "router counts MB": r["sent"].get("router", 0.0) / 1e6,
                         "max |loss - one process|": max(abs(a - b) for a, b in zip(r["losses"], ref))})
    return rows
