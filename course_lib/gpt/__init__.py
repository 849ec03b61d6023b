"""The course GPT and its trainer, one process's view (imports nothing on import).

    model       GPTConfig, GPT: GPT-2 architecture, optimizer groups, FLOPs, generation
    data        dataset preparation (characters, GPT-2 BPE from the shipped ranks), batches
    config      TrainConfig: the one frozen config of a run; presets; --field=value parsing
    runtime     where a training process runs: rank, device, dtype, threads, process group
    train       the training loop and its step (what each torchrun worker runs)
    run         what one training process holds: setup, resume, evaluation, checkpoint saving
    checkpoint  atomic checkpoints and exact resume
    metrics     RunMeter (timing, metrics.csv, progress bar, summary), timers, throughput and MFU
    activation_meter  the activations a forward keeps for backward, measured (metrics.csv act_mb)
    sample      text from a run's checkpoint (course sample)
    finetune    the second stage of an LLM's life: fine-tuning a run on new text
"""
