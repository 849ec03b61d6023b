"""The measured experiments behind the notebooks: real processes, compared with one process or a model.

    data_parallel_check    DP variants vs one process, bucket counts (notebook 3)
    dp_speedup             the trainer on 1 and N ranks: measured data-parallel speedup (notebook 3)
    model_parallel_check   tensor and pipeline parallel vs one process, bubble (notebook 5)
    memory_measure         saved activations and model states of real processes (notebook 4)
    step_memory            the peak of one real training step (live tensors; a GPU's allocator) (notebook 4)
    zero_walkthrough       one ZeRO-1/2/3 step taken apart across cells on %ranks (notebook 4)
    tp_walkthrough         one tensor-parallel MLP's shards and partial products on %ranks (notebook 10)
    precision              fp16 underflow, loss scaling, bytes by dtype, bf16 gradient all-reduce, recompute runs (notebook 9)
    scaling_measure        strong and weak scaling of a job with a known serial part (notebook 2)
    profiling              one training step per rank under torch.profiler, its Chrome trace (notebook 8)
    step_intervals         a profiled step as compute, communication, overlap and exposed time
    layout_profile         one profiled step of a tp/pp/cp layout per rank (notebook 10)
    strategy_comparison    every strategy x ranks, repeated runs and medians (notebook 8, benchmarks/strategies.py)
    comm_bench             the collectives benchmark, ``course bench comm`` (notebook 2)
    comm_bench_workers     what each rank of that benchmark runs (torch.distributed or MPI)
    hang                   a deliberate hang turned into an error (notebook 2)
    debugging              a hand-written data-parallel step with seeded bugs (notebook 12, exercise 8)
    gpu_check              ``course check-gpu``: the course on one CUDA GPU, its measurements, a verdict per check
    frameworks_fabric      Lightning Fabric on the course's ranks: its strategies, its step, bytes, refusals (notebook 11)
    frameworks_gpt         the course GPT the course's way and Fabric's way, against one process (notebook 11)
    frameworks_inside      DDP's hooks and buckets, FSDP2's shards and gathers, read from the framework (notebook 11)
    frameworks_qa          a Hugging Face BERT for question answering on Shakespeare, the labs' strategy table (notebook 11)
    frameworks_job         a Fabric training run under srun, Fabric's SLURM environment (``course submit --launcher srun``)
    moe_runs               the router over training, a routing's all-to-all, ep against dp on CPU ranks (notebook 13)
"""
