"""Expert parallelism: the experts of a mixture-of-experts layer shared out over the ep group (imports nothing).

    comms    the all-to-all dispatch and combine (exact splits, and padded equal splits side by side),
             counted by parallel.comms
    layer    ExpertParallelMoE: this rank's experts, the router's global counts; the expert
             gradients' own data-parallel group; the experts' slices of the one full state dict
"""
