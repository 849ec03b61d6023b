"""Parallel training you can read and check, one concept per module (imports nothing on import).

    step                the one training step of every strategy: train_step, its two halves
    strategy            the Strategy interface the trainer uses; build_strategy
    comms               collectives that count bytes (ZeRO-paper volume, ring bytes) and time
    ring                the ring all-reduce from point-to-point messages, one step at a time
    buckets             the one bucket-closing rule (DDP's bucket_cap_mb), for DP and ZeRO
    data_parallel       DataParallelNaive / DataParallelBucket (nn.Module wrappers, like torch's
                        DistributedDataParallel); strategies "ddp_naive", "ddp"
    sharding            ShardLayout: how ZeRO cuts and packs parameters; full <-> sharded states
    zero                ShardedOptimizer (ZeRO-1/2, like ZeroRedundancyOptimizer); "zero1", "zero2"
    zero3               FullyShardedDataParallel (ZeRO-3, like FSDP: mixed precision, prefetch,
                        replicated small parameters); "zero3"
    units               which modules ZeRO-3 / FSDP gather and free together
    torch_sharded       PyTorch's: "torch_zero1" (ZeroRedundancyOptimizer), "fsdp_grad_op",
                        "fsdp_full" (FSDP2 fully_shard); "torch_ddp" is in strategy
    tensor_parallel     Megatron's f/g, column/row-parallel linears, TP MLP, attention, GPT
    sequence_parallel   all-gather / reduce-scatter along the sequence (Korthikanti et al. 2022)
    vocab_parallel      the vocabulary split: embedding, cross-entropy on split logits
    context_parallel    ring attention over cp ranks with zigzag chunks
    pipeline_parallel   stages, micro-batches, AFAB (GPipe) and 1F1B schedules, bubble
    process_groups      the dp x pp x cp x tp grid
    gpt_parallel        the course GPT cut for one place of the grid
    model_parallel      ModelParallel: the trainer's strategy for tp/pp/cp layouts
    footprint           bytes of parameters, gradients, optimizer states one rank holds
    toy                 a small MLP with the GPT interface
    collective_check    teaching mode: each collective compared across ranks before it runs; the
                        flight recorder
    replicas            check_replicas: are the data-parallel replicas still replicas?

Every strategy's ``state_dict()`` is the FULL model and optimizer state (the unsharded
optimizer's format), identical on every rank, so checkpoints move between strategies and
numbers of ranks.
"""
