"""What a dp x pp x cp x tp layout asks of the model and of the ranks: TrainConfig's checks for
``tp``, ``pp``, ``cp``, ``sequence_parallel`` and ``pp_schedule``, one line per refusal.

The layout itself is :class:`course_lib.parallel.process_groups.ProcessGroupGrid`; these rules are
what its pieces need: heads split over tp, blocks over pp, every sequence in 2 cp chunks (zigzag
ring attention), the sequence shards of sequence parallelism over tp.
"""

from __future__ import annotations

from course_lib.registry import DP_FLAVOURS

PP_SCHEDULES = ("1f1b", "afab")
# the dp flavour under tp/pp/cp: one fact, in the registry ("auto" resolves to one of them)
MODEL_PARALLEL_STRATEGIES = ("auto", *DP_FLAVOURS)


def layout_error(cfg) -> str | None:
    """The first rule ``cfg`` (a TrainConfig) breaks, or None."""
    tp, pp, cp = cfg.tp, cfg.pp, cfg.cp
    if cfg.pp_schedule not in PP_SCHEDULES:
        return f"pp_schedule must be one of {', '.join(PP_SCHEDULES)}; got {cfg.pp_schedule!r}"
    if cfg.n_head % tp:
        return f"n_head ({cfg.n_head}) must be divisible by tp ({tp}): each rank holds n_head/tp heads"
    if cfg.n_layer % pp:
        return f"n_layer ({cfg.n_layer}) must be divisible by pp ({pp}): each stage holds n_layer/pp blocks"
    if cp > 1 and cfg.block_size % (2 * cp):
        return (f"block_size ({cfg.block_size}) must be divisible by 2*cp ({2 * cp}): "
                "each cp rank holds 2 chunks of every sequence")
    if cfg.sequence_parallel and tp == 1:
        return "sequence_parallel splits the sequence over the tp ranks: it needs tp > 1"
    if cfg.sequence_parallel and (cfg.block_size // cp) % tp:
        return (f"sequence_parallel: the {cfg.block_size // cp} tokens per cp rank (block_size / cp) "
                f"must be divisible by tp ({tp})")
    if tp * pp * cp == 1:
        return None
    if cfg.strategy not in MODEL_PARALLEL_STRATEGIES:
        return (f"strategy {cfg.strategy!r} does not combine with tp/pp/cp; choose one of "
                f"{', '.join(MODEL_PARALLEL_STRATEGIES)} (the data-parallel flavour across dp)")
    if cfg.dropout:
        return (f"dropout={cfg.dropout} with tp/pp/cp is not supported (the tp ranks would need one "
                "shared random stream); use --dropout=0")
    if cfg.compile:
        return "compile with tp/pp/cp is not supported (collectives inside autograd functions); use --compile=false"
    if getattr(cfg, "recompute", "none") != "none":
        return f"recompute={cfg.recompute} with tp/pp/cp is not supported yet (the stages keep their activations)"
    if getattr(cfg, "grad_comm_dtype", "float32") not in ("float32", "auto"):
        return (f"grad_comm_dtype={cfg.grad_comm_dtype} with tp/pp/cp is not supported: the dp gradients of a "
                "model-parallel run are reduced in their own dtype")
    return None


def world_error(cfg, world_size: int) -> str | None:
    """The grid must fill the world: world_size = dp * tp * pp * cp."""
    n = cfg.tp * cfg.pp * cfg.cp
    if world_size % n:
        return (f"nproc ({world_size} ranks) must be divisible by tp*pp*cp = {cfg.tp}*{cfg.pp}*{cfg.cp} = {n} "
                "(dp = ranks / (tp*pp*cp))")
    return None
