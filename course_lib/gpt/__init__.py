"""The course GPT: the model, its data, their configurations and checkpoints (imports nothing on import).

The loop that trains it is :mod:`course_lib.trainer`; this package sits below ``parallel/`` and
imports nothing above it.

    model       GPTConfig, GPT: GPT-2 architecture, optimizer groups, FLOPs, generation
    data        dataset preparation (characters, GPT-2 BPE from the shipped ranks), batches
    config      ModelConfig, DataConfig, OptimizerConfig, RunConfig: four components of a run's configuration,
                each field documented and checked (the whole is course_lib.trainer.config.TrainConfig)
    checkpoint  atomic checkpoints and exact resume
    activation_meter  the activations a forward keeps for backward, measured (metrics.csv act_mb)
    sample      text from a run's checkpoint (course sample)
"""
