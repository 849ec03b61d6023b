"""Tensor and sequence parallelism: one layer's matrices split over the tp group (imports nothing).

    comms    the conjugate operators: Megatron's f / g (all-reduce) and sequence parallelism's
             all-gather / reduce-scatter along T (Korthikanti et al. 2022)
    layers   column/row-parallel linears, the TP MLP and attention, a tensor-parallel GPT
    vocab    the vocabulary split: embedding, cross-entropy on split logits
"""
