"""ZeRO and FSDP: data parallelism that shards what every rank would repeat (imports nothing).

    sharding       ShardLayout: how ZeRO cuts and packs parameters; full <-> sharded states
    zero12         ShardedOptimizer (ZeRO-1/2, like ZeroRedundancyOptimizer); "zero1", "zero2"
    zero3          FullyShardedDataParallel (ZeRO-3, like FSDP: mixed precision, prefetch,
                   replicated small parameters); "zero3"
    units          which modules ZeRO-3 / FSDP gather and free together
    torch_sharded  PyTorch's: "torch_zero1" (ZeroRedundancyOptimizer), "fsdp_grad_op",
                   "fsdp_full" (FSDP2 fully_shard)

Their collectives (reduce-scatter, all-gather) go through ``parallel.comms`` directly.
"""
