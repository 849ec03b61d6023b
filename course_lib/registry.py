"""The facts about the training strategies, without torch: the one place that the configuration's
validation (``course train``), the trainer's registry, model parallelism and the notebooks' tables
read.

    from course_lib.registry import STRATEGIES, STRATEGY_NAMES, strategy_rows
    STRATEGIES["zero2"].zero_stage        # 2
    strategy_rows()                       # one dict per strategy, for a table

For each strategy: the class that implements it (``"module:Class"``, imported only when the
strategy is built), what it does in one line, the ZeRO stage of its memory (Rajbhandari et al.
2020, "ZeRO", Sec. 5: 0 for plain data parallelism), whose implementation it is, whether it
takes a 16-bit gradient all-reduce (``grad_comm_dtype``: only the strategies that all-reduce whole
gradients), and whether it can be the data-parallel flavour beside tensor, pipeline or context
parallelism (:class:`course_lib.parallel.model_parallel.ModelParallel`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StrategyInfo:
    cls: str  # "module:Class"
    does: str
    zero_stage: int | None  # None: one process, nothing to shard
    whose: str  # "ours" or "PyTorch"
    grad_comm_dtype: bool = False  # takes grad_comm_dtype=bfloat16 (all-reduces whole gradients)
    beside_model_parallel: bool = False  # a data-parallel flavour of ModelParallel (tp/pp/cp)


STRATEGIES: dict[str, StrategyInfo] = {
    "single": StrategyInfo("course_lib.parallel.strategy:SingleProcess",
                           "one process, no communication (the baseline)", None, "ours",
                           beside_model_parallel=True),
    "ddp": StrategyInfo("course_lib.parallel.data.ddp:DDP",
                        "data parallel: gradients all-reduced in buckets during backward", 0, "ours",
                        grad_comm_dtype=True, beside_model_parallel=True),
    "ddp_naive": StrategyInfo("course_lib.parallel.data.ddp:DDPNaive",
                              "data parallel: each gradient all-reduced after backward", 0, "ours",
                              grad_comm_dtype=True),
    "zero1": StrategyInfo("course_lib.parallel.zero.zero12:Zero1",
                          "optimizer states sharded: reduce-scatter gradients, all-gather parameters", 1, "ours",
                          beside_model_parallel=True),
    "zero2": StrategyInfo("course_lib.parallel.zero.zero12:Zero2",
                          "gradients sharded too, reduce-scattered bucket by bucket in backward", 2, "ours",
                          beside_model_parallel=True),
    "zero3": StrategyInfo("course_lib.parallel.zero.zero3:Zero3",
                          "parameters sharded too: all-gathered per layer for forward and for backward", 3, "ours"),
    "torch_ddp": StrategyInfo("course_lib.parallel.strategy:TorchDDP",
                              "DistributedDataParallel (buckets, overlap)", 0, "PyTorch", grad_comm_dtype=True),
    "torch_zero1": StrategyInfo("course_lib.parallel.zero.torch_sharded:TorchZero1",
                                "ZeroRedundancyOptimizer: optimizer states sharded", 1, "PyTorch"),
    "fsdp_grad_op": StrategyInfo("course_lib.parallel.zero.torch_sharded:FSDPGradOp",
                                 "FSDP2 fully_shard, parameters stay gathered from forward to backward", 2,
                                 "PyTorch"),
    "fsdp_full": StrategyInfo("course_lib.parallel.zero.torch_sharded:FSDPFull",
                              "FSDP2 fully_shard, parameters resharded after forward", 3, "PyTorch"),
}

STRATEGY_NAMES = tuple(STRATEGIES)
GRAD_COMM_STRATEGIES = tuple(n for n, s in STRATEGIES.items() if s.grad_comm_dtype)
DP_FLAVOURS = tuple(n for n, s in STRATEGIES.items() if s.beside_model_parallel)


def strategy_rows() -> list[dict]:
    """One row per strategy: name, what it does, its ZeRO stage, whose, its class."""
    return [{"strategy": name, "what it does": s.does, "ZeRO stage": "-" if s.zero_stage is None else s.zero_stage,
             "whose": s.whose, "with tp/pp/cp": "yes" if s.beside_model_parallel else "no", "class": s.cls}
            for name, s in STRATEGIES.items()]
