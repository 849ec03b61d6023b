"""The course GPT: the model, its data, its configuration and checkpoints (imports nothing on import).

The loop that trains it is :mod:`course_lib.trainer`; this package sits below ``parallel/`` and
imports nothing above it.

    model       GPTConfig, GPT: GPT-2 architecture, optimizer groups, FLOPs, generation
    moe         mixture of experts: top-k router, experts, load-balancing loss, capacity, router stats
    data        dataset preparation (characters, GPT-2 BPE from the shipped ranks), batches
    config      TrainConfig: the one frozen config of a run, made of its components (model, data,
                optimizer, run here; the parallel layout in course_lib.registry); presets; its command line, generated
                from the fields (--config, --config-file, --resume, --field=value; host and workers)
    checkpoint  atomic checkpoints and exact resume
    activation_meter  the activations a forward keeps for backward, measured (metrics.csv act_mb)
    sample      text from a run's checkpoint (course sample)
    finetune    the second stage of an LLM's life: fine-tuning a run on new text
"""
