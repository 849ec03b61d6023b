"""The measured experiments behind the notebooks: real processes, compared with one process or a model.

    data_parallel_check    DP variants vs one process, bucket counts (notebook 3)
    model_parallel_check   tensor and pipeline parallel vs one process, bubble (notebook 5)
    memory_measure         saved activations and model states of real processes (notebook 4)
    profiling              compute vs communication per rank of a profiled step (notebook 8)
    strategy_comparison    every strategy x ranks, repeated runs and medians (notebook 8, benchmarks/strategies.py)
    comm_bench(_workers)   the collectives benchmark, ``course bench comm`` (notebook 2)
    hang                   a deliberate hang turned into an error (notebook 2)
"""
