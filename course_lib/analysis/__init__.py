"""Closed-form models the course teaches, checked against measurements in tests (no torch.distributed).

    comm_cost       alpha-beta cost of collectives and the bytes each rank moves
    memory          per-device training memory: model states (DP, ZeRO 1-3, per rank of a layout) and activations;
                    the peak of one trainer step (step_peak)
    activations     activation memory of a transformer layer (Korthikanti et al. 2022), under autocast and in the
                    course trainer; what recomputation costs in FLOPs
    precision       number formats (fp32 ... FP8) and the bytes per parameter of each way of holding states (notebook 9)
    memory_cli      ``course memory``
    scaling_laws    Amdahl, Gustafson, Karp-Flatt; fitting a serial fraction; 6 N D training cost
    dp_recipes      global batch, learning-rate scaling, data per rank
    strategy_guide  choosing a parallelism strategy from the models above
    parallel_comm   bytes per group per step of a dp x pp x cp x tp layout
    layout_plan     every layout of a model on a cluster: memory, communication, step time
    moe_memory      mixture-of-experts parameters (total, active) and model states per rank under ep
"""
