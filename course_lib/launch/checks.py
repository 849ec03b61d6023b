"""Refuse bad launches before anything is spawned, with a message that says what to change.

The one home of the launcher's checks, all run before anything is spawned or written:

* :func:`check_launch`: a :class:`course_lib.launch.api.LaunchSpec` (nodes, the script or module
  to run, timeouts, the stop's grace, environment, rendezvous, output, NCCL debugging; the ranks'
  devices and backend through :func:`course_lib.launch.placement.plan`, where they are decided; the
  SLURM/PBS job through
  :func:`course_lib.launch.placement.check_scheduler`).
* :func:`check_request`: a whole training request, one function per kind of check in
  :data:`CHECKS` (the job, strategy vs ranks, dtype, the tp/pp/cp layout, memory, data, out_dir
  and resume). The configuration's own fields are checked by the configuration itself
  (:class:`course_lib.trainer.config.TrainConfig`), once, where it is built.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import psutil

import course_lib.launch.placement as placement  # noqa: PLR0402 - the module itself: launch/__init__'s lazy names stay unread
import course_lib.launch.torchrun as torchrun  # noqa: PLR0402 - as above
from course_lib.analysis.memory import ModelShape, micro_batches_in_flight, stage_states, step_peak
from course_lib.gpt import data
from course_lib.hardware import detect, pick_dtype
from course_lib.launch.placement import LaunchConfigError, RankPlan
from course_lib.registry import FP16_ON_GRID, STRATEGIES
from course_lib.trainer.config import TrainConfig, check_resume
from course_lib.utils import check_count, check_port, check_seconds


def check_nnodes(nnodes) -> int:
    return check_count("nnodes", nnodes, error=LaunchConfigError)


def resolve_target(target, module: bool | None = None) -> tuple[str, bool]:
    """(target, is_module): a .py path that exists, or an importable module name."""
    target = os.fspath(target)
    looks_like_path = target.endswith(".py") or os.sep in target
    if module is None:
        module = not looks_like_path and not Path(target).is_file()
    if not module:
        if not Path(target).is_file():
            raise LaunchConfigError(f"script {target!r} does not exist (working directory "
                                    f"{os.getcwd()}); give the path of a .py file")
        return str(Path(target).resolve()), False
    try:
        found = importlib.util.find_spec(target) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise LaunchConfigError(f"{target!r} is neither a file nor an importable module; give a "
                                "script path (ending in .py) or a module name like course_lib.trainer.loop")
    return target, True


def check_strategy(name: str) -> None:
    if name not in STRATEGIES:
        raise LaunchConfigError(f"unknown strategy {name!r}; choose one of {sorted(STRATEGIES)}")


def check_show_ranks_and_env(show_ranks, env) -> None:
    """A LaunchSpec's ``show_ranks`` ("all", or rank numbers) and ``env`` (a dict of names to values)."""
    ranks = None if isinstance(show_ranks, (str, bytes)) else show_ranks
    if show_ranks != "all" and not (isinstance(ranks, Iterable) and all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)):
        raise LaunchConfigError(f"show_ranks must be 'all' or rank numbers such as (0,) or [0, 1], got {show_ranks!r}")
    # a name that is empty or holds "=" (or NUL) cannot be in an environment: execve refuses it as the ranks start
    if env is not None and not (isinstance(env, Mapping) and all(
            isinstance(k, str) and k and "=" not in k and "\0" not in k for k in env)):
        raise LaunchConfigError(f"env must be a dict of variable names to values, such as {{'OMP_NUM_THREADS': '1'}}, "
                                f"got {env!r}")


def check_endpoint(endpoint) -> None:
    """``rdzv_endpoint``: "HOST:PORT", the port a number from 1 to 65535."""
    host, _, port = endpoint.rpartition(":") if isinstance(endpoint, str) else ("", "", "")
    try:
        check_port("port", port)
    except ValueError:
        host = ""
    if not host:
        raise LaunchConfigError(f"rdzv_endpoint must be HOST:PORT with a port from 1 to 65535, such as "
                                f"'node01:29400', got {endpoint!r}")


def check_launch(target, spec) -> tuple[placement.RankPlan, str, bool, float | None, float]:
    """Every check of a :class:`~course_lib.launch.api.LaunchSpec` and its target, before anything
    is spawned: (the rank plan, the resolved target, is it a module, timeout, collective timeout)."""
    if callable(target):
        raise LaunchConfigError(f"launch runs a script or a module, not {target!r}: for a function on N ranks use "
                                "run_ranks(fn, nproc, *args) or notebook_launcher(fn, args, nproc=N)")
    check_show_ranks_and_env(spec.show_ranks, spec.env)
    nnodes = check_nnodes(spec.nnodes)
    plan = placement.plan(spec.nproc, spec.device, spec.backend, spec.recipe or Path(os.fspath(target)).name,
                          nnodes, same_host=spec.rdzv_endpoint is None)
    timeout = check_seconds("timeout", spec.timeout, error=LaunchConfigError)
    collective_timeout = check_seconds("collective_timeout", spec.collective_timeout, False, LaunchConfigError)
    target, is_module = resolve_target(target, spec.module)
    if spec.rdzv not in torchrun.RDZV_BACKENDS:
        raise LaunchConfigError(f"rdzv must be one of {torchrun.RDZV_BACKENDS}, got {spec.rdzv!r}")
    if nnodes > 1 and spec.rdzv != "c10d":
        raise LaunchConfigError("several nodes need the c10d rendezvous (rdzv='c10d')")
    if spec.rdzv_endpoint is not None:
        check_endpoint(spec.rdzv_endpoint)
    if spec.rdzv_endpoint and not spec.rdzv_id:
        raise LaunchConfigError("rdzv_endpoint needs rdzv_id: the same id on every node")
    check_seconds("grace", spec.grace, False, LaunchConfigError, allow_zero=True)  # SIGTERM to SIGKILL
    if spec.output not in ("ranks", "raw"):
        raise LaunchConfigError(f"output must be 'ranks' or 'raw', got {spec.output!r}")
    for name, hook in (("progress", spec.progress), ("before_start", spec.before_start)):
        if hook is not None and not callable(hook):
            raise LaunchConfigError(f"{name} must be a function or None, got {hook!r}")
    placement.check_scheduler(nnodes, plan.gpus_per_node or plan.nproc, plan.device_type)  # in a SLURM/PBS job
    torchrun.nccl_debug_env(spec.nccl_debug, spec.nccl_debug_subsys, spec.nccl_debug_file)  # validates
    return plan, target, is_module, timeout, collective_timeout


# --- a training request: the checks, in order; each raises a one-line error (LaunchConfigError is a
# ConfigError). A new kind of parallelism adds its own function to CHECKS.

@dataclass(frozen=True)
class TrainRequest:
    """A training run as asked for: the config (``nproc`` resolved), nodes, device and overwrite."""
    config: TrainConfig
    nnodes: int
    device: str  # 'cpu', 'cuda', or 'cuda:N' when the config names a GPU (the launcher plans with it again)
    overwrite: bool = False
    plan: RankPlan | None = None  # each rank's device and the backend (launch.placement)

    @property
    def device_type(self) -> str:  # 'cpu' or 'cuda'
        return self.device.split(":")[0]

    @property
    def world_size(self) -> int:
        return self.config.nproc * self.nnodes

    @property
    def strategy(self) -> str:
        return self.config.resolved_strategy(self.world_size)


# --- the checks, in order; each raises a one-line error (LaunchConfigError is a ConfigError). A new
# kind of parallelism adds its own function to CHECKS.

def check_strategy_world(req: TrainRequest) -> None:
    check_strategy(req.strategy)
    cfg = req.config  # 'single' beside tp/pp: one model replica, no data parallelism (dp = cp = 1)
    if req.strategy == "single" and req.world_size > 1 and not (cfg.cp == 1 and req.world_size == cfg.tp * cfg.pp):
        raise LaunchConfigError(f"strategy 'single' runs one process but {req.world_size} ranks were asked for; "
                                "use strategy 'auto' or 'ddp', or nproc=1")
    if (STRATEGIES[req.strategy].needs_nccl_on_cuda and req.device_type == "cuda" and req.plan
            and req.plan.backend == "gloo"):
        # Seen on an H200 with torch 2.11 (issue 28): fsdp_grad_op on 2 ranks sharing the GPU over gloo
        # killed rank 0 with SIGSEGV, no Python error. FSDP2 all-gathers and reduce-scatters CUDA tensors,
        # the newest of gloo's CUDA paths (reduce-scatter since torch 2.8, placement.py): the refusal
        # rests on that crash, not on the documentation, whose "Backends" table now lists both.
        raise LaunchConfigError(f"{req.strategy} (PyTorch's FSDP2) needs NCCL for CUDA tensors, and these ranks "
                                f"share a GPU over gloo ({req.plan.line()}); use one rank per GPU, --device=cpu, "
                                "or the course's zero2/zero3, which run over gloo")


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
    need = estimate_bytes(req.config, req.world_size, dtype, req.device_type)
    if req.device_type == "cuda":
        share = req.plan.ranks_per_device if req.plan else 1  # ranks sharing one GPU share its memory
        have, where = profile.memory_bytes / share, f"the GPU ({profile.name})" + (f" / {share} ranks" if share > 1 else "")
    else:
        have = psutil.virtual_memory().total / req.config.nproc
        where = f"this machine's RAM / {req.config.nproc} ranks"
    if need > have:
        raise LaunchConfigError(
            f"this config needs about {need / 1e9:.2f} GB per rank (launch.checks.estimate_bytes, "
            f"{dtype}) but {where} has {have / 1e9:.2f} GB; lower batch_size or block_size, "
            "recompute activations (--recompute=full), use a ZeRO strategy, more ranks or tp/pp, or a smaller model")


def check_out_dir(req: TrainRequest) -> None:
    """A resume matches its checkpoint (fields, ranks); a new run does not overwrite one unasked."""
    from course_lib.gpt import checkpoint as ckpt_io  # torch: launch() (this module's other user) loads none

    cfg, last = req.config, Path(req.config.out_dir) / ckpt_io.LAST
    if cfg.init_from == "resume":
        check_resume(ckpt_io.load_checkpoint(last, mmap=True), cfg, last, req.world_size)
    elif last.exists() and not req.overwrite:
        raise LaunchConfigError(f"{cfg.out_dir} already holds a run (last.pt); pass --resume to continue it, "
                                "--overwrite to start it again, or choose another --out_dir")


def check_layout(req: TrainRequest) -> None:
    """tp/pp/cp (and ep): the grid fills the ranks, and the precision is one the pipeline runs."""
    cfg = req.config
    if not cfg.on_grid(cfg.n_expert):
        return
    try:
        cfg.check_layout(req.world_size)
    except ValueError as e:
        raise LaunchConfigError(str(e)) from None
    if pick_dtype(detect(req.device), cfg.dtype) == "float16":
        raise LaunchConfigError(FP16_ON_GRID)
    if (cfg.pp > 1 or cfg.cp > 1) and req.device_type == "cuda" and req.plan and req.plan.backend == "gloo":
        # torch.distributed docs, "Backends": gloo has no send/recv of CUDA tensors
        raise LaunchConfigError(f"pp/cp send activations point to point, which gloo cannot do with CUDA tensors "
                                f"({req.plan.line()}); use one rank per GPU (NCCL) or --device=cpu")


def check_job(req: TrainRequest) -> None:
    """Inside a SLURM/PBS job: the nodes and GPUs it was given."""
    placement.check_scheduler(req.nnodes, (req.plan and req.plan.gpus_per_node) or req.config.nproc, req.device_type)


CHECKS: list[Callable[[TrainRequest], None]] = [check_job, check_strategy_world, check_dtype, check_layout,
                                                 check_memory, check_data, check_out_dir]


def check_request(config: TrainConfig, *, nproc=None, nnodes: int = 1, overwrite: bool = False,
                  recipe: str = "", backend: str = "auto") -> TrainRequest:
    """Every check of a training request, before anything is spawned or written.

    The config validated its own fields; here: the ranks' devices and backend
    (:mod:`course_lib.launch.placement`: ranks beyond the GPUs share them over gloo), then CHECKS.
    Errors: LaunchConfigError (a ConfigError), DataError, CheckpointError, each one line.
    ``nproc``: None = ``config.nproc``; an int, or "auto" (one rank per GPU, else 2 CPU ranks).
    ``backend``: "auto" (NCCL for one rank per GPU, else gloo), "gloo" or "nccl".
    """
    if not isinstance(config, TrainConfig):
        raise LaunchConfigError(f"expected a TrainConfig (course_lib.trainer.config.make_config), got {type(config).__name__}")
    nproc = config.nproc if nproc is None else nproc
    plan = placement.plan(nproc, config.device, backend, recipe=recipe or config.name, nnodes=check_nnodes(nnodes),
                          same_host=True)
    # 'cuda:N' stays: run_training hands req.device to the launcher, whose own plan would start at cuda:0
    device = config.device if config.device.startswith("cuda:") else plan.device_type
    req = TrainRequest(config.replace(nproc=plan.nproc), plan.nnodes, device, overwrite, plan)
    for check in CHECKS:
        check(req)
    return req



def _vocab_size(config: TrainConfig) -> int:
    """The model's vocabulary: from the prepared dataset, else 65 characters / 50304 GPT-2 tokens."""
    try:
        return data.model_vocab_size(data.load_meta(config.data_dir or None, config.dataset))
    except data.DataError:  # not prepared: check_data says so
        return 65 if config.dataset.endswith("_char") else 50304


def estimate_bytes(config: TrainConfig, world_size: int, dtype: str, device: str = "cpu") -> float:
    """Per-device training memory of ``config`` on ``world_size`` ranks: model states + activations.

    Model states of the rank that holds the most: :func:`course_lib.analysis.memory.stage_states`
    (the layouts' parameter count that tests/test_parallel_4d.py checks against measured states),
    with experts :func:`course_lib.analysis.moe_memory.rank_states` (ep divides them). The
    strategy's ZeRO stage shards over the dp x cp ranks, the course's shard group, and leaves the
    experts whole, as the course's ZeRO does. Activations of one micro-batch, with the config's
    ``recompute``: those of the trainer's own step on one rank of the tp group on ``device``,
    :func:`course_lib.analysis.memory.step_peak` (Korthikanti et al. 2022 over tp, with sequence
    parallelism as asked; autocast's fp32 residual stream, the fused attention of a GPU, and the
    loss's fp32 gradients and copies, 6 to 10 bytes per logit; within 0.2 % of
    ``max_memory_allocated`` for GPT-2 small on an H200, benchmarks/RESULTS.md; tp = 2 within 4 %
    of a CPU step's live tensors, tests/test_step_peak.py), over cp (each rank holds 1/cp of
    every sequence). With pp, a
    stage holds n_layer / pp layers' activations of
    :func:`~course_lib.analysis.memory.micro_batches_in_flight` micro-batches (AFAB: all, 1F1B: at
    most pp). A mixture of experts adds what its top_k (and shared) experts keep beyond one dense
    MLP (:meth:`~course_lib.analysis.moe_memory.MoEShape.extra_activation_bytes`; whole on every tp
    rank, as the experts are: :mod:`course_lib.parallel.expert.layer`).
    Not modelled: the pipeline's sent activations, small beside the rest.
    """
    tp, pp, cp = config.tp, config.pp, config.cp
    dp_cp = max(1, world_size // (tp * pp))  # the ranks one ZeRO shard group spans
    stage = STRATEGIES[config.resolved_strategy(world_size)].zero_stage or 0
    precision = "fp32" if dtype == "float32" else "mixed"
    vocab_size = _vocab_size(config)
    shape = ModelShape("config", config.n_layer, config.n_head, config.n_embd, config.block_size,
                       vocab_size, config.batch_size, bias=config.bias, dropout=config.dropout)
    if config.n_expert:
        # here: moe_memory builds its table of published models on import, which a dense run never reads
        from course_lib.analysis.moe_memory import MoEShape, rank_states

        moe = MoEShape.of_gpt(SimpleNamespace(**config.to_dict(), vocab_size=vocab_size))
        states = rank_states(moe, dp=dp_cp, ep=config.ep, tp=tp, pp=pp, stage=stage, expert_stage=0,
                             dtype=precision).total.total
        experts = 0.0 if config.recompute == "full" else moe.extra_activation_bytes(  # full: recomputed too
            config.block_size // cp, config.batch_size, 4 if dtype == "float32" else 2)
    else:
        states, experts = stage_states(shape, dp=dp_cp, tp=tp, pp=pp, stage=stage, dtype=precision).total, 0.0
    # the trainer's step on one rank of the tp group, as measured; cp: 1/cp of every sequence
    peak = step_peak(config.n_layer, config.n_head, config.n_embd, config.block_size, vocab_size,
                     config.batch_size, dtype, device_type=device, dropout=config.dropout, bias=config.bias,
                     recompute=config.recompute, tp=tp, sequence_parallel=config.sequence_parallel)
    micro = (peak.activations + peak.loss_grads) / cp
    in_flight = micro_batches_in_flight(pp, config.gradient_accumulation_steps, config.pp_schedule)
    return states + (micro + experts) * in_flight / pp
