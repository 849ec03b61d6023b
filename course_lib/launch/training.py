"""launch_training(config) and ``course train``: one way to run the course trainer on N ranks.

    from course_lib.gpt.config import make_config
    from course_lib.launch import launch_training
    cfg = make_config("shakespeare_char_cpu", {"max_iters": 200, "out_dir": "runs/ddp2"})
    result = launch_training(cfg, nproc=2)
    result.metrics.plot(x="iter", y="train_loss")

Both front ends are :func:`run_training`, and differ only in how the run is shown:

* ``display="notebook"`` (:func:`launch_training`): rank-prefixed live output and a tqdm bar in
  the launcher that follows ``RUN_DIR/metrics.csv``; the workers draw no bar.
* ``display="terminal"`` (``course train``, :mod:`course_lib.launch.train_cli`): rank 0's own
  output byte for byte, its own progress bar included, as if it ran in this terminal.

Either way: :func:`check_request` refuses a bad request before anything is spawned, with one line
that says what to change; :func:`prepare_run_dir` writes ``RUN_DIR/config.json`` (RUN_DIR =
``config.out_dir``); then ``python -m course_lib.trainer.loop --config-file RUN_DIR/config.json``
runs on every rank under torchrun through :func:`course_lib.launch.api.launch` (its process
handling, logs in ``RUN_DIR/logs``, failure diagnosis). One process can also train right here,
after the same checks: :func:`train_in_process`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from course_lib.analysis.memory import ModelShape, breakdown
from course_lib.gpt import checkpoint as ckpt_io
from course_lib.gpt import data
from course_lib.gpt.config import TrainConfig
from course_lib.hardware import detect, pick_dtype
from course_lib.launch import allocation, checks, placement
from course_lib.launch.api import LaunchResult, launch
from course_lib.launch.monitor import MetricsProgress
from course_lib.launch.placement import LaunchConfigError, RankPlan
from course_lib.trainer.loop import train

TRAIN_MODULE = "course_lib.trainer.loop"
RUN_FILES = ("last.pt", "best.pt", "metrics.csv", "summary.json", "run.json", "config.json")
DISPLAYS = ("notebook", "terminal")


@dataclass(frozen=True)
class TrainRequest:
    """A training run as asked for: the config (``nproc`` resolved), nodes, device and overwrite."""
    config: TrainConfig
    nnodes: int
    device: str  # 'cpu' or 'cuda'
    overwrite: bool = False
    plan: RankPlan | None = None  # each rank's device and the backend (launch.placement)

    @property
    def world_size(self) -> int:
        return self.config.nproc * self.nnodes

    @property
    def strategy(self) -> str:
        return self.config.resolved_strategy(self.world_size)


# --- the checks, in order; each raises a one-line error (LaunchConfigError is a ConfigError). A new
# kind of parallelism adds its own function to CHECKS.

def check_strategy_world(req: TrainRequest) -> None:
    checks.check_strategy(req.strategy)
    if req.strategy == "single" and req.world_size > 1:
        raise LaunchConfigError(f"strategy 'single' runs one process but {req.world_size} ranks were asked for; "
                                "use strategy 'auto' or 'ddp', or nproc=1")


def check_dtype(req: TrainRequest) -> None:
    try:
        pick_dtype(detect(req.device), req.config.dtype)
    except ValueError as e:
        raise LaunchConfigError(f"dtype: {e}") from None


def check_data(req: TrainRequest) -> None:
    """The dataset is prepared (else DataError: how to prepare it) and longer than one block."""
    cfg = req.config
    data.load_meta(cfg.data_dir or None, cfg.dataset)
    if data.load_tokens(cfg.data_dir or None, cfg.dataset, "val").numel() <= cfg.block_size + 1:
        raise LaunchConfigError(f"block_size {cfg.block_size} is longer than the {cfg.dataset} val split")


def check_memory(req: TrainRequest) -> None:
    """The model fits: estimated bytes per rank vs the GPU's memory, or this host's RAM / ranks."""
    profile = detect(req.device)
    dtype = pick_dtype(profile, req.config.dtype)
    need = estimate_bytes(req.config, req.world_size, dtype)
    if req.device == "cuda":
        share = req.plan.ranks_per_device if req.plan else 1  # ranks sharing one GPU share its memory
        have, where = profile.memory_bytes / share, f"the GPU ({profile.name})" + (f" / {share} ranks" if share > 1 else "")
    else:
        have = psutil.virtual_memory().total / req.config.nproc
        where = f"this machine's RAM / {req.config.nproc} ranks"
    if need > have:
        raise LaunchConfigError(
            f"this config needs about {need / 1e9:.2f} GB per rank (course_lib.analysis.memory estimate, "
            f"{dtype}) but {where} has {have / 1e9:.2f} GB; lower batch_size or block_size, "
            "use a ZeRO strategy or more ranks, or a smaller model")


def check_out_dir(req: TrainRequest) -> None:
    """A resume matches its checkpoint (fields, ranks); a new run does not overwrite one unasked."""
    cfg, last = req.config, Path(req.config.out_dir) / ckpt_io.LAST
    if cfg.init_from == "resume":
        ckpt_io.check_resume(ckpt_io.load_checkpoint(last, mmap=True), cfg, last, req.world_size)
    elif last.exists() and not req.overwrite:
        raise LaunchConfigError(f"{cfg.out_dir} already holds a run (last.pt); pass --resume to continue it, "
                                "--overwrite to start it again, or choose another --out_dir")


def check_layout(req: TrainRequest) -> None:
    """tp/pp/cp: the grid fills the ranks, and the precision is one the pipeline runs."""
    cfg = req.config
    if cfg.model_parallel_size == 1:
        return
    try:
        cfg.check_layout(req.world_size)
    except ValueError as e:
        raise LaunchConfigError(str(e)) from None
    if pick_dtype(detect(req.device), cfg.dtype) == "float16":
        raise LaunchConfigError("float16 needs loss scaling, which the tp/pp/cp pipeline does not do; "
                                "use --dtype=bfloat16 or --dtype=float32")
    if (cfg.pp > 1 or cfg.cp > 1) and req.device == "cuda" and req.plan and req.plan.backend == "gloo":
        # torch.distributed docs, "Backends": gloo has no send/recv of CUDA tensors
        raise LaunchConfigError(f"pp/cp send activations point to point, which gloo cannot do with CUDA tensors "
                                f"({req.plan.line()}); use one rank per GPU (NCCL) or --device=cpu")


def check_job(req: TrainRequest) -> None:
    """Inside a SLURM/PBS job: the nodes and GPUs it was given."""
    allocation.check_scheduler(req.nnodes, (req.plan and req.plan.gpus_per_node) or req.config.nproc, req.device)


CHECKS: list[Callable[[TrainRequest], None]] = [check_job, check_strategy_world, check_dtype, check_layout,
                                                 check_memory, check_data, check_out_dir]


def check_request(config: TrainConfig, *, nproc=None, nnodes: int = 1, overwrite: bool = False,
                  recipe: str = "") -> TrainRequest:
    """Every check of a training request, before anything is spawned or written.

    The config validated its own fields; here: the ranks' devices and backend
    (:mod:`course_lib.launch.placement`: ranks beyond the GPUs share them over gloo), then CHECKS.
    Errors: LaunchConfigError (a ConfigError), DataError, CheckpointError, each one line.
    ``nproc``: None = ``config.nproc``; an int, or "auto" (one rank per GPU, else 2 CPU ranks).
    """
    if not isinstance(config, TrainConfig):
        raise LaunchConfigError(f"expected a TrainConfig (course_lib.gpt.config.make_config), got {type(config).__name__}")
    nproc = config.nproc if nproc is None else nproc
    plan = placement.plan(nproc, config.device, recipe=recipe or config.name, nnodes=checks.check_nnodes(nnodes),
                       same_host=True)
    req = TrainRequest(config.replace(nproc=plan.nproc), plan.nnodes, plan.device_type, overwrite, plan)
    for check in CHECKS:
        check(req)
    return req


def prepare_run_dir(req: TrainRequest) -> Path:
    """Clear an overwritten run, write RUN_DIR/config.json; returns its path."""
    cfg, out = req.config, Path(req.config.out_dir)
    if cfg.init_from == "scratch" and req.overwrite:
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
    return cfg.save().resolve()


def prepare_run(config: TrainConfig, *, nproc=None, nnodes: int = 1, overwrite: bool = False,
                recipe: str = "") -> TrainRequest:
    """check_request, then prepare_run_dir: what comes before the workers (or an in-process train)."""
    req = check_request(config, nproc=nproc, nnodes=nnodes, overwrite=overwrite, recipe=recipe)
    prepare_run_dir(req)
    return req


def train_in_process(config: TrainConfig, *, overwrite: bool = False, progress: bool = True) -> dict:
    """The same checks and run directory, then one process training right here (a notebook's
    kernel, a test): :func:`course_lib.trainer.loop.train`. Returns its summary."""
    req = prepare_run(config, overwrite=overwrite)
    if req.world_size > 1 or req.strategy != "single":
        raise LaunchConfigError(f"{req.world_size} rank(s) with strategy {req.strategy} need workers: "
                                "use launch_training (or course train)")
    return train(req.config, progress=progress)


def run_training(config: TrainConfig, *, display: str = "notebook", nproc=None, nnodes: int = 1,
                 overwrite: bool = False, progress: bool = True, timeout: float | None = None,
                 show_ranks=(0,), env=None, check: bool = False, recipe: str = "", **launch_kwargs) -> LaunchResult:
    """Check, prepare the run directory, and train on ``nproc`` ranks per node under torchrun.

    display: "notebook" (rank-prefixed output, a bar following metrics.csv) or "terminal" (rank
    0's raw output with the trainer's own bar). ``timeout`` is a wall-clock limit; the collective
    timeout is ``config.timeout_s``. ``recipe`` names the run in the plan line (default: the
    config's name). Other keyword arguments go to :func:`launch`.
    """
    if display not in DISPLAYS:
        raise LaunchConfigError(f"display must be one of {', '.join(DISPLAYS)}, got {display!r}")
    checks.check_timeout("timeout", timeout)  # the rest of launch()'s own checks need no run directory
    req = prepare_run(config, nproc=nproc, nnodes=nnodes, overwrite=overwrite, recipe=recipe)
    cfg, config_file = req.config, Path(req.config.out_dir).resolve() / "config.json"
    env = dict(env or {})
    if cfg.threads:
        env.setdefault("OMP_NUM_THREADS", str(cfg.threads))
    args = ["--config-file", str(config_file)]
    bar = None
    if display == "terminal":
        args += [] if progress else ["--no-progress"]
    else:  # the workers draw no bar: the launcher's follows metrics.csv (iterations 0..max_iters)
        args.append("--no-progress")
        if progress:
            err = launch_kwargs.get("err")
            bar = lambda rd: MetricsProgress(str(rd / "metrics.csv"), cfg.max_iters + 1, desc=cfg.name, file=err)
    return launch(TRAIN_MODULE, args, module=True, nproc=cfg.nproc, nnodes=req.nnodes, device=req.device,
                  backend=req.plan.backend, recipe=req.plan.recipe,
                  timeout=timeout, collective_timeout=cfg.timeout_s, env=env, run_dir=config_file.parent,
                  show_ranks=show_ranks, progress=bar, output="raw" if display == "terminal" else "ranks",
                  check=check, **launch_kwargs)


def launch_training(config: TrainConfig, *, nproc=None, nnodes: int = 1, timeout: float | None = None,
                    progress: bool = True, show_ranks=(0,), env=None, check: bool = False,
                    overwrite: bool = True, **launch_kwargs) -> LaunchResult:
    """Train ``config`` on ``nproc`` ranks per node from Python or a notebook (None = ``config.nproc``).

    :func:`run_training` with the notebook display; ``overwrite`` (default, so a re-run cell
    starts afresh) clears a finished run in ``out_dir``, False refuses it. Returns a LaunchResult
    whose ``metrics`` is RUN_DIR/metrics.csv as a DataFrame.
    """
    return run_training(config, display="notebook", nproc=nproc, nnodes=nnodes, overwrite=overwrite,
                        progress=progress, timeout=timeout, show_ranks=show_ranks, env=env, check=check,
                        **launch_kwargs)


def _zero_stage(strategy: str) -> int:
    """ZeRO stage whose model-state memory a strategy has (Rajbhandari et al. 2020)."""
    return {"zero1": 1, "torch_zero1": 1, "zero2": 2, "fsdp_grad_op": 2, "zero3": 3,
            "fsdp_full": 3}.get(strategy, 0)


def _vocab_size(config: TrainConfig) -> int:
    """The model's vocabulary: from the prepared dataset, else 65 characters / 50304 GPT-2 tokens."""
    try:
        return data.model_vocab_size(data.load_meta(config.data_dir or None, config.dataset))
    except data.DataError:  # not prepared: check_data says so
        return 65 if config.dataset.endswith("_char") else 50304


def estimate_bytes(config: TrainConfig, world_size: int, dtype: str) -> float:
    """Per-device training memory of ``config``: ZeRO model states + Korthikanti activations."""
    shape = ModelShape("config", config.n_layer, config.n_head, config.n_embd, config.block_size,
                       _vocab_size(config), config.batch_size, bias=config.bias, dropout=config.dropout)
    return breakdown(preset=shape, dp=world_size, stage=_zero_stage(config.resolved_strategy(world_size)),
                     dtype="fp32" if dtype == "float32" else "mixed").total
