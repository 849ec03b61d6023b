"""The training loop one process runs, alone or as one of torchrun's ranks (imports nothing on import).

    python -m course_lib.trainer.loop --config-file RUN_DIR/config.json   (what every worker runs)

    config      TrainConfig: the one frozen config of a run, its five components flat (model, data, optimizer,
                run here; the parallel layout in course_lib.registry); presets; its command line, generated
                from the fields (host and workers); what a resumed run may change
    loop        training in this process, as nanoGPT's train.py: where it runs (rank, device, dtype, threads,
                the process group), what it holds (data, model, Strategy, resume), evaluation, checkpoint
                saving, and the loop (warmup and cosine learning rate, the step)
    metrics     RunMeter (timing, metrics.csv, run.json, progress bar, summary), timers, throughput and MFU;
                the activations a forward keeps for backward, measured (SavedTensorMeter: act_mb)
    finetune    the second stage of an LLM's life: fine-tuning a run on new text

It stands on ``gpt/`` (the model and data) and ``parallel/`` (the Strategy and the one step,
:func:`course_lib.parallel.step.train_step`); ``launch/`` starts it and reads what it writes.
"""
