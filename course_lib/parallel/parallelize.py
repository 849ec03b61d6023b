"""One function applies every parallelism to the course GPT, in one visible order (as torchtitan's
``parallelize.py`` does for Llama): :func:`parallelize`, what the trainer calls.

The order, and why it is that order::

    0. no tp, pp or cp: the data-parallel strategy wraps the whole model (single, ddp, zero1-3,
       torch's DDP / ZeRO / FSDP); done.
    1. the grid: dp x pp x cp x tp process groups, tp innermost (its all-reduces are the most
       frequent, so its ranks are neighbours: one node); ep groups carved out of dp (ep innermost
       in it), for a mixture of experts.
    2. tp (+ sp, vocabulary): this rank's shards of every split matrix; under sequence
       parallelism the residual stream between the parallel linears is cut along T too.
    3. pp: this rank's stage (its blocks; the embeddings on the first, ln_f and the head on the
       last) and its micro-batch schedule (AFAB or 1F1B).
    4. cp: every attention by ring over the cp ranks; each step cuts this rank's zigzag chunks out
       of its samples (ModelParallel.forward_backward).
    4b. ep (n_expert > 0): each block's MoE keeps this rank's n_expert/ep experts and exchanges
       tokens by all-to-all over the ep group; its router counts tokens over dp x cp. A mixture of
       experts on several ranks always takes this path (its global router counts need the grid).
       Refused before the grid is built (registry.moe_grid_error): experts with sequence
       parallelism, and a capacity factor with cp > 1 (either would not equal one process).
    5. dp / ZeRO last, over the dp x cp group: it wraps the model as it finally is (the stage of
       tp/sp/cp blocks), so what it buckets, shards and averages are this rank's own tensors;
       cp ranks saw different tokens of the same samples, so they average with the dp ranks.
       Any of ``registry.DP_FLAVOURS``: single, ddp, zero1, zero2 and zero3; ZeRO-3 (FSDP beside
       tp: torchtitan's 2D layout) shards the stage with each block a unit and the rest (embeddings,
       ln_f, head) the root, gathered again for each micro-batch's forward and backward of the
       pipeline's schedule (AFAB, 1F1B), which forwards through its wrapper.
       With ep > 1 it skips the experts (ZeRO-1/2/3 shard none of them): ModelParallel averages
       them over their edp x cp group (parallel.expert.layer.sync_expert_grads).

Steps 2 to 4 build one module, :class:`~course_lib.parallel.gpt_parallel.GPTStage` (pp chooses its
blocks, tp/sp its layers, cp its attention), and load this rank's shards of the full weights into
it (the GPT's frozen parameters stay frozen);
:class:`~course_lib.parallel.model_parallel.ModelParallel` then runs the step over all of it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from course_lib import registry
from course_lib.parallel.comms import Comms
from course_lib.parallel.gpt_parallel import GPTStage
from course_lib.parallel.model_parallel import ModelParallel
from course_lib.parallel.pipeline.schedules import Pipeline
from course_lib.parallel.process_groups import ProcessGroupGrid
from course_lib.parallel.strategy import OptimizerFactory, Strategy, build_strategy


def parallelize(model: nn.Module, make_optimizer: OptimizerFactory, dp_strategy: str = "ddp", *,
                tp: int = 1, pp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                pp_schedule: str = "1f1b", model_parallel: bool | None = None, ep: int = 1,
                ep_padded: bool = False, **dp_options) -> Strategy:
    """The Strategy that trains ``model`` (a GPT, identical on every rank) on this rank's place of
    the dp x pp x cp x tp layout (dp = world size / (tp pp cp)); its ``dp_rank`` and
    ``dp_world_size`` say which samples this rank reads. ``dp_strategy``: a name of
    :data:`course_lib.registry.STRATEGIES` (with tp/pp/cp one of ``registry.DP_FLAVOURS``);
    ``dp_options``: its keyword arguments (e.g. ``grad_comm_dtype``). ``model_parallel``: None
    builds the grid's ModelParallel when tp, pp or cp > 1; True also for data parallelism alone
    (to measure a dp-only layout like the others: its per-stage figures, activation peak); a
    mixture of experts on several ranks is always on the grid. ``ep``: the expert-parallel degree
    (divides dp); ``ep_padded``: the naive all-to-all with padded equal splits (parallel.expert.comms).
    A mixture of experts with ``sequence_parallel``, or with a ``capacity_factor`` and cp > 1, is
    refused (ValueError, the rule of ``registry.moe_grid_error``): it would not train like one process."""
    # 0. data parallelism alone: the whole model, one wrapper
    world = dist.get_world_size() if dist.is_initialized() else 1
    if model_parallel is None:
        model_parallel = tp * pp * cp > 1 or (getattr(model.config, "n_expert", 0) > 0 and world > 1)
    if not model_parallel:
        return build_strategy(dp_strategy, model, make_optimizer, **dp_options)
    if dp_strategy not in registry.DP_FLAVOURS:
        raise ValueError(f"with tp/pp/cp the data-parallel strategy must be one of {', '.join(registry.DP_FLAVOURS)}, "
                         f"got {dp_strategy!r}")
    cfg = model.config  # a mixture of experts: the layouts that would not train like one process
    if (error := registry.moe_grid_error(cfg.n_expert, cfg.capacity_factor, sequence_parallel, cp)) is not None:
        raise ValueError(f"parallelize: {error}")  # on every rank, before any collective
    # 1. the grid
    grid = ProcessGroupGrid(dp=world // (tp * pp * cp), tp=tp, pp=pp, cp=cp, ep=ep)
    comms = {"tp": grid.tp_comms, "sp": Comms(grid.tp_group), "cp": grid.cp_comms, "pp": grid.pp_comms}
    if model.config.n_expert:  # 4b. the all-to-all, the router's counts, the experts' gradients
        comms.update(ep=Comms(grid.ep_group), router=Comms(grid.dp_cp_group), edp=Comms(grid.edp_cp_group))
    # 2.-4. tp/sp (its layers), pp (its blocks), cp (its attention): this rank's stage; tp: its shards
    stage = GPTStage(model.config, grid.pp_rank, grid.pp_world_size, comms, sequence_parallel, ep_padded)
    p0 = next(model.parameters())
    stage.to(device=p0.device, dtype=p0.dtype)
    stage.load_full_state(model.state_dict())
    stage.freeze(n for n, p in model.named_parameters() if not p.requires_grad)  # frozen stays frozen
    # 3. pp, continued: the schedule (the tied weight's gradients are summed after the dp reduction: sum_tied=False)
    pipeline = Pipeline(stage, grid.pp_comms, pp_schedule, sum_tied=False)
    # 5. dp / ZeRO over dp x cp, wrapping the stage
    if dp_strategy == "single" and grid.dp_world_size * grid.cp_world_size > 1:
        dp_strategy = "ddp"
    group = {} if dp_strategy == "single" else {"group": grid.dp_cp_group, **dp_options}
    if registry.STRATEGIES[dp_strategy].zero_stage == 3:  # ZeRO-3 gathers block by block (the rest: the root)
        group["units"] = list(stage.transformer.h.values())
    inner = build_strategy(dp_strategy, stage, make_optimizer, **group)
    return ModelParallel(stage, pipeline, inner, grid, comms, make_optimizer)
