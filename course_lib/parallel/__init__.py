"""Parallel training you can read and check, one concept per module (imports nothing on import).

    step                the one training step of every strategy: train_step, its two halves
    strategy            the Strategy interface the trainer uses; build_strategy
    comms               collectives that count bytes (ZeRO-paper volume, ring bytes) and time
    process_groups      the dp x pp x cp x tp grid
    footprint           bytes of parameters, gradients, optimizer states one rank holds
    toy                 a small MLP with the GPT interface
    collective_check    teaching mode: each collective compared across ranks before it runs; the
                        flight recorder
    replicas            check_replicas: are the data-parallel replicas still replicas?

One folder per parallelism, each with its own communication code, naive and optimised side by side:

    data                DDP naive and bucketed, the bucket rule, the ring all-reduce
    zero                ZeRO-1/2, ZeRO-3 / FSDP, their sharding and units; PyTorch's ZeRO and FSDP2
    tensor              tensor and sequence parallelism: f/g and the sequence collectives, the
                        parallel layers, the vocabulary split
    pipeline            p2p between stages; stages, AFAB and 1F1B schedules
    context             the ring shift; ring attention with zigzag chunks
    expert              expert parallelism: all-to-all dispatch / combine (exact, padded), the
                        experts of one ep rank, their own data-parallel group

Then the pieces put together:

    gpt_parallel        the course GPT cut for one place of the grid
    model_parallel      ModelParallel: the trainer's strategy for tp/pp/cp layouts
    parallelize         parallelize(): tp/sp, pp, cp, then dp/ZeRO applied in one documented
                        order; what the trainer calls

Every strategy's ``state_dict()`` is the FULL model and optimizer state (the unsharded
optimizer's format), identical on every rank, so checkpoints move between strategies and
numbers of ranks.
"""
