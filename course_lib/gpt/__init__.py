"""The course GPT: the model, its data and checkpoints (imports nothing on import).

The loop that trains it, and the configuration of a run, are :mod:`course_lib.trainer`; this
package sits below ``parallel/``, imports nothing above it and knows no strategy.

    model       GPTConfig, GPT: GPT-2 architecture, optimizer groups, FLOPs, generation
    moe         mixture of experts: top-k router, experts, load-balancing loss, capacity, router stats
    chunked_loss  the LM head and cross-entropy fused over row chunks, never holding the logits
    data        dataset preparation (characters, GPT-2 BPE from the shipped ranks), batches
    checkpoint  atomic checkpoints and exact resume
    sample      text from a run's checkpoint (course sample)
"""
