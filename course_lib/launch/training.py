"""launch_training(config): the course trainer on N ranks, with a progress bar and the metrics.

    from course_lib.gpt.config import make_config
    from course_lib.launch import launch_training
    cfg = make_config("shakespeare_char_cpu", {"max_iters": 200, "out_dir": "runs/ddp2"})
    result = launch_training(cfg, nproc=2)
    result.metrics.plot(x="iter", y="loss")

Before anything starts: the strategy must exist and the model must fit (estimated memory per
device from :mod:`course_lib.analysis.memory`, checked against the GPU, or the host's RAM for CPU
ranks). Then ``RUN_DIR/config.json`` is written (RUN_DIR = ``config.out_dir``) and
``python -m course_lib.gpt.train --config-file RUN_DIR/config.json`` runs on every rank under
torchrun; a tqdm bar follows ``RUN_DIR/metrics.csv``, which is returned as a DataFrame.
"""

from __future__ import annotations

import dataclasses

from course_lib.launch import checks
from course_lib.launch.api import LaunchResult, launch
from course_lib.launch.monitor import MetricsProgress

TRAIN_MODULE = "course_lib.gpt.train"


def _zero_stage(strategy: str) -> int:
    """ZeRO stage whose model-state memory a strategy has (Rajbhandari et al. 2020)."""
    return {"zero1": 1, "torch_zero1": 1, "zero2": 2, "fsdp_grad_op": 2, "zero3": 3,
            "fsdp_full": 3}.get(strategy, 0)


def _vocab_size(config) -> int:
    """The model's vocabulary: from the prepared dataset, else 65 characters / 50304 GPT-2 tokens."""
    from course_lib.gpt import data

    try:
        return data.model_vocab_size(data.load_meta(config.data_dir or None, config.dataset))
    except Exception:  # noqa: BLE001 - not prepared yet: the trainer will say so
        return 65 if config.dataset.endswith("_char") else 50304


def estimate_bytes(config, world_size: int, dtype: str) -> float:
    """Per-device training memory of ``config``: ZeRO model states + Korthikanti activations."""
    from course_lib.analysis.memory import ModelShape, breakdown

    shape = ModelShape("config", config.n_layer, config.n_head, config.n_embd, config.block_size,
                       _vocab_size(config), config.batch_size, bias=config.bias, dropout=config.dropout)
    mem_dtype = "fp32" if dtype == "float32" else "mixed"
    return breakdown(preset=shape, dp=world_size, stage=_zero_stage(config.resolved_strategy(world_size)),
                     dtype=mem_dtype).total


def check_training(config, nproc_per_node: int, nnodes: int, device: str) -> float:
    """Strategy known and memory sufficient, else LaunchConfigError; returns the estimate."""
    import psutil

    from course_lib.hardware import detect, pick_dtype

    world = nproc_per_node * nnodes
    try:
        strategy = config.resolved_strategy(world)
    except Exception as e:  # noqa: BLE001 - the config's own check, reported as a launch error
        raise checks.LaunchConfigError(str(e)) from None
    checks.check_strategy(strategy)
    if strategy == "single" and world > 1:
        raise checks.LaunchConfigError(f"strategy 'single' runs one process but {world} ranks were "
                                       "asked for; use strategy='auto' or 'ddp', or nproc=1")
    profile = detect("cuda" if device == "cuda" else "cpu")
    dtype = pick_dtype(profile, config.dtype)
    need = estimate_bytes(config, world, dtype)
    if device == "cuda":
        have, where = profile.memory_bytes, f"the GPU ({profile.name})"
    else:
        have, where = psutil.virtual_memory().total / nproc_per_node, f"this machine's RAM / {nproc_per_node} ranks"
    if need > have:
        raise checks.LaunchConfigError(
            f"this config needs about {need / 1e9:.2f} GB per rank (course_lib.analysis.memory estimate, "
            f"{dtype}) but {where} has {have / 1e9:.2f} GB; lower batch_size or block_size, "
            "use a ZeRO strategy or more ranks, or a smaller model")
    return need


def launch_training(config, *, nproc=None, nnodes: int = 1, timeout: float | None = None,
                    progress: bool = True, show_ranks=(0,), env=None, check: bool = False,
                    overwrite: bool = True, **launch_kwargs) -> LaunchResult:
    """Train ``config`` (a course_lib.gpt.config.TrainConfig) on ``nproc`` ranks per node.

    nproc: None = ``config.nproc``; an int, or "auto" (one rank per GPU, else 2 CPU ranks).
    The collective timeout is ``config.timeout_s``; ``timeout`` is a wall-clock limit.
    The trainer's own checks run first (``course_lib.launch.train_cli.prepare_run_dir``: data
    prepared, dtype, resume compatible); ``overwrite`` (default, so a re-run notebook cell starts
    afresh) clears a finished run in ``out_dir``, False refuses it. Returns a LaunchResult whose ``metrics`` is RUN_DIR/metrics.csv as a DataFrame.
    """
    nproc = config.nproc if nproc is None else nproc
    device = checks.resolve_device(config.device.split(":")[0], nproc)
    nproc = checks.resolve_nproc(nproc, device)
    nnodes = checks.check_nnodes(nnodes)
    check_training(config, nproc, nnodes, device)
    if dataclasses.is_dataclass(config) and hasattr(config, "replace"):
        # the workers train where the launch decided ('auto' with more ranks than GPUs: CPU)
        config = config.replace(nproc=nproc, **({"device": "cpu"} if device == "cpu" else {}))
    from course_lib.gpt.config import ConfigError
    from course_lib.launch.train_cli import prepare_run_dir

    try:
        config_file = prepare_run_dir(config, overwrite=overwrite).resolve()
    except ConfigError as e:
        raise checks.LaunchConfigError(str(e)) from None
    run_dir = config_file.parent
    env = dict(env or {})
    if getattr(config, "threads", 0):
        env.setdefault("OMP_NUM_THREADS", str(config.threads))
    total = config.max_iters + 1  # iterations 0..max_iters, as nanoGPT counts them
    err = launch_kwargs.get("err")
    bar = (lambda rd: MetricsProgress(str(rd / "metrics.csv"), total, desc=config.name, file=err)) \
        if progress else None
    # the workers draw no bar of their own: the launcher's follows metrics.csv
    return launch(TRAIN_MODULE, ["--config-file", str(config_file), "--no-progress"], module=True, nproc=nproc,
                  nnodes=nnodes, device=device, timeout=timeout, collective_timeout=config.timeout_s,
                  env=env, run_dir=run_dir, show_ranks=show_ranks, progress=bar, check=check,
                  **launch_kwargs)
