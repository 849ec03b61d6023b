"""The facts about the training strategies, without torch: the one place that the configuration's
validation (``course train``), the trainer's registry, model parallelism and the notebooks' tables
read.

    from course_lib.registry import STRATEGIES, STRATEGY_NAMES, strategy_rows
    STRATEGIES["zero2"].zero_stage        # 2
    strategy_rows()                       # one dict per strategy, for a table

For each strategy: the class that implements it (``"module:Class"``, imported only when the
strategy is built), what it does in one line, the ZeRO stage of its memory (Rajbhandari et al.
2020, "ZeRO", Sec. 5: 0 for plain data parallelism), whose implementation it is, whether it
takes a 16-bit gradient all-reduce (``grad_comm_dtype``: only the strategies that all-reduce whole
gradients), and whether it can be the data-parallel flavour beside tensor, pipeline or context
parallelism (:class:`course_lib.parallel.model_parallel.ModelParallel`), and whether its collectives
on CUDA tensors need NCCL (``needs_nccl_on_cuda``: refused on ranks that share a GPU over gloo).

And the configuration's torch-free pieces, which every layer may read without torch or the model:
:class:`ConfigError`, the field machinery (:func:`check_types`, :func:`field_docs`: a docstring per
field, what ``--help`` prints), the device a run may ask for (:func:`device_error`: the
configuration's rule and the rank placement's), and the parallel layout of a run,
:class:`ParallelConfig`, with its rules. After torchtitan's ``job_config`` (each component owns a
typed configuration): the run's :class:`course_lib.trainer.config.TrainConfig` is made of five,
flat, so that ``--n_layer=4`` and config.json stay as they are: the model, the data, the optimizer
and the run (:mod:`course_lib.trainer.config`) and the parallel layout here. The layout's rules are in two parts:
:meth:`ParallelConfig.check` (the layout alone: degrees, the strategy beside tp/pp/cp, the
schedule) and :func:`layout_error` (what the layout asks of the model and the data: heads over tp,
blocks over pp, every sequence in 2 cp chunks, sequence shards over tp). Those four are
:func:`divisibility_error`, on plain numbers: the layout planner and the communication model in
``analysis`` refuse with it too. The process-group grid itself is
:class:`course_lib.parallel.process_groups.ProcessGroupGrid`.

    from course_lib.registry import ParallelConfig
    ParallelConfig(nproc=4, tp=2, pp=2)          # checked now: one line per refusal (ConfigError)

:class:`MoEConfig`, the experts' fields of the model configuration (:mod:`course_lib.gpt.moe`), is
here too, torch-free, because both the run's configuration and ``gpt.model.GPTConfig`` carry it.
"""

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import typing
from dataclasses import dataclass


@dataclass(frozen=True)
class StrategyInfo:
    cls: str  # "module:Class"
    does: str
    zero_stage: int | None  # None: one process, nothing to shard
    whose: str  # "ours" or "PyTorch"
    grad_comm_dtype: bool = False  # takes grad_comm_dtype=bfloat16 (all-reduces whole gradients)
    beside_model_parallel: bool = False  # a data-parallel flavour of ModelParallel (tp/pp/cp)
    # its collectives on CUDA tensors need NCCL: on ranks sharing a GPU over gloo, PyTorch's FSDP2
    # crashed a rank (SIGSEGV, an H200, issue 28); launch.checks refuses it there
    needs_nccl_on_cuda: bool = False
    # between steps the module's parameters are this rank's shards (ZeRO-3; FSDP2's DTensors, in both
    # of its flavours): replicas are not comparable there (check_replicas_every is refused)
    shards_parameters: bool = False


STRATEGIES: dict[str, StrategyInfo] = {
    "single": StrategyInfo("course_lib.parallel.strategy:SingleProcess",
                           "one process, no communication (the baseline)", None, "ours",
                           beside_model_parallel=True),
    "ddp": StrategyInfo("course_lib.parallel.data.ddp:DDP",
                        "data parallel: gradients all-reduced in buckets during backward", 0, "ours",
                        grad_comm_dtype=True, beside_model_parallel=True),
    "ddp_naive": StrategyInfo("course_lib.parallel.data.ddp:DDPNaive",
                              "data parallel: each gradient all-reduced after backward", 0, "ours",
                              grad_comm_dtype=True),
    "zero1": StrategyInfo("course_lib.parallel.zero.zero12:Zero1",
                          "optimizer states sharded: reduce-scatter gradients, all-gather parameters", 1, "ours",
                          beside_model_parallel=True),
    "zero2": StrategyInfo("course_lib.parallel.zero.zero12:Zero2",
                          "gradients sharded too, reduce-scattered bucket by bucket in backward", 2, "ours",
                          beside_model_parallel=True),
    "zero3": StrategyInfo("course_lib.parallel.zero.zero3:Zero3",
                          "parameters sharded too: all-gathered per layer for forward and for backward", 3, "ours",
                          beside_model_parallel=True, shards_parameters=True),
    "torch_ddp": StrategyInfo("course_lib.parallel.strategy:TorchDDP",
                              "DistributedDataParallel (buckets, overlap)", 0, "PyTorch", grad_comm_dtype=True),
    "torch_zero1": StrategyInfo("course_lib.parallel.zero.torch_sharded:TorchZero1",
                                "ZeroRedundancyOptimizer: optimizer states sharded", 1, "PyTorch"),
    "fsdp_grad_op": StrategyInfo("course_lib.parallel.zero.torch_sharded:FSDPGradOp",
                                 "FSDP2 fully_shard, parameters stay gathered from forward to backward", 2,
                                 "PyTorch", needs_nccl_on_cuda=True, shards_parameters=True),
    "fsdp_full": StrategyInfo("course_lib.parallel.zero.torch_sharded:FSDPFull",
                              "FSDP2 fully_shard, parameters resharded after forward", 3, "PyTorch",
                              needs_nccl_on_cuda=True, shards_parameters=True),
}

STRATEGY_NAMES = tuple(STRATEGIES)
GRAD_COMM_STRATEGIES = tuple(n for n, s in STRATEGIES.items() if s.grad_comm_dtype)
DP_FLAVOURS = tuple(n for n, s in STRATEGIES.items() if s.beside_model_parallel)


def strategy_rows() -> list[dict]:
    """One row per strategy: name, what it does, its ZeRO stage, whose, its class."""
    return [{"strategy": name, "what it does": s.does, "ZeRO stage": "-" if s.zero_stage is None else s.zero_stage,
             "whose": s.whose, "with tp/pp/cp": "yes" if s.beside_model_parallel else "no", "class": s.cls}
            for name, s in STRATEGIES.items()]


# --- the configuration's torch-free pieces: its error, its fields, the parallel layout -------------

PP_SCHEDULES = ("1f1b", "afab")
EP_DISPATCH = ("exact", "padded")
# the dp flavour under tp/pp/cp: one fact, in the registry ("auto" resolves to one of them)
MODEL_PARALLEL_STRATEGIES = ("auto", *DP_FLAVOURS)
GRAD_COMM_DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and says what is allowed."""


def choice(name: str, value: str, allowed) -> None:
    """ConfigError unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def at_least(cfg, low: float, names) -> None:
    """ConfigError naming the first of ``names`` whose value is below ``low`` (or not a number >= it)."""
    for name in names:
        if not getattr(cfg, name) >= low:
            raise ConfigError(f"{name} must be >= {low:g}, got {getattr(cfg, name)}")


# torch.device's own syntax for these: ASCII digits, no leading zero ('cuda:01', 'cuda:²' refused)
_DEVICE = re.compile(r"auto|cpu|cuda(?::(?:0|[1-9][0-9]*))?")


def device_error(device) -> str | None:
    """Why ``device`` is not a device a run may ask for, or None: 'auto' (the GPUs if there are
    any, else the CPU), 'cpu', 'cuda' or 'cuda:N'. The rule of the run's configuration
    (``RunConfig.device``) and of the rank placement (:func:`course_lib.launch.placement.plan_ranks`)."""
    if isinstance(device, str) and _DEVICE.fullmatch(device):
        return None
    return f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}"


def check_types(cfg) -> None:
    """Every field of the dataclass ``cfg`` holds its declared type (an int is taken for a float).
    The types are read with ``typing.get_type_hints``: a module with ``from __future__ import
    annotations`` (gpt/model.py) declares them as strings."""
    types = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, want = getattr(cfg, f.name), types[f.name]
        if want is float and type(value) is int:
            object.__setattr__(cfg, f.name, float(value))  # JSON writes 1.0 as 1
        elif type(value) is not want:
            raise ConfigError(f"{f.name}: expected {want.__name__}, got {type(value).__name__} {value!r}")


def field_docs(cls) -> dict[str, str]:
    """Each field's docstring (the string literal under it) of the dataclass ``cls`` and of the
    dataclasses it is made of, read from their source: what ``--help`` prints for the field."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for field, doc in itertools.pairwise(body):
            if (isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: the MLP of every block replaced by routed experts (``n_expert > 0``;
    :mod:`course_lib.gpt.moe`). Part of the model's configuration (:class:`ModelConfig` and
    :class:`course_lib.gpt.model.GPTConfig` carry these fields); torch-free, so the launcher checks it."""

    n_expert: int = 0
    """Routed experts per block (each a GPT-2 MLP); 0 = the dense model."""
    top_k: int = 1
    """Experts each token is sent to (Switch Transformer: 1; GShard, Mixtral: 2)."""
    n_shared_expert: int = 0
    """0 or 1: one MLP every token also goes through (DeepSeekMoE's shared expert)."""
    capacity_factor: float = 0.0
    """0 = dropless; else each expert takes at most ceil(capacity_factor * top_k * N / n_expert)
    assignments of a micro-batch of N tokens (all data-parallel ranks' tokens); the rest are dropped."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch Transformer, eq. 4), summed over the MoE blocks."""

    def check(self) -> None:
        at_least(self, 0, ("n_expert", "n_shared_expert", "capacity_factor", "aux_loss_coef"))
        if self.n_shared_expert > 1:
            raise ConfigError(f"n_shared_expert must be 0 or 1, got {self.n_shared_expert}")
        if self.n_expert and not 1 <= self.top_k <= self.n_expert:
            raise ConfigError(f"top_k must be in [1, n_expert={self.n_expert}], got {self.top_k}")


@dataclass(frozen=True)
class ParallelConfig:
    """How a run is spread over processes: ranks, the data-parallel strategy, the dp x pp x cp x tp grid."""

    nproc: int = 1
    """Worker processes on this host; > 1 launches them through torchrun."""
    strategy: str = "auto"
    """'auto' = 'single' for one process, else data parallel (course_lib.STRATEGIES)."""
    threads: int = 0
    """Intra-op threads per CPU worker; 0 = cores // workers on this host."""
    timeout_s: float = 600.0
    """How long a collective may wait before the run fails."""
    check_collectives: bool = False
    """Teaching mode: each collective compared across ranks before it runs (op, dtype, shape, root;
    parallel.collective_check): a mismatch is named instead of hanging or aborting."""
    check_replicas_every: int = 0
    """Every this many steps, the data-parallel replicas compared (parameters, optimizer state, each
    rank's batch; parallel.replicas); the run stops, naming the first tensor that differs."""
    grad_comm_dtype: str = "float32"
    """Data-parallel gradient all-reduce in 'float32' or 'bfloat16'."""
    tp: int = 1
    """Tensor-parallel degree (Megatron-LM); dp = nproc / (tp * pp * cp) (parallel.model_parallel)."""
    pp: int = 1
    """Pipeline stages; the micro-batches are the gradient_accumulation_steps."""
    cp: int = 1
    """Context-parallel degree: the sequence split, attention by ring."""
    sequence_parallel: bool = False
    """tp also splits the LayerNorm regions along the sequence."""
    pp_schedule: str = "1f1b"
    """'afab' (GPipe: all forward, all backward) or '1f1b'."""
    ep: int = 1
    """Expert-parallel degree (mixture of experts): each rank holds n_expert/ep experts, tokens go to
    them by all-to-all. Carved out of dp (as in Megatron-LM and DeepSeek-V3): ep divides dp; the
    other parameters stay data-parallel over all dp ranks, the experts over dp/ep (parallel.expert)."""
    ep_dispatch: str = "exact"
    """The all-to-all of expert parallelism: 'exact' (each rank sends its real rows) or 'padded' (the
    naive one: every block padded to top_k x the rank's tokens, equal splits; parallel.expert.comms)."""

    def __post_init__(self):
        check_types(self)
        ParallelConfig.check(self)

    def check(self) -> None:
        """The layout's own rules (what it asks of the model: :func:`layout_error`)."""
        at_least(self, 1, ("nproc", "tp", "pp", "cp", "ep"))
        at_least(self, 0, ("threads", "check_replicas_every"))
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        choice("strategy", self.strategy, ("auto",) + STRATEGY_NAMES)
        choice("grad_comm_dtype", self.grad_comm_dtype, GRAD_COMM_DTYPES)
        if self.grad_comm_dtype != "float32" and self.strategy not in ("auto",) + GRAD_COMM_STRATEGIES:
            raise ConfigError(f"grad_comm_dtype={self.grad_comm_dtype} is for data-parallel gradient all-reduce "
                              f"({', '.join(GRAD_COMM_STRATEGIES)}); strategy {self.strategy} shards gradients")
        choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        choice("ep_dispatch", self.ep_dispatch, EP_DISPATCH)
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel splits the sequence over the tp ranks: it needs tp > 1")
        if self.model_parallel_size > 1 and self.strategy not in MODEL_PARALLEL_STRATEGIES:
            raise ConfigError(f"strategy {self.strategy!r} does not combine with tp/pp/cp; choose one of "
                              f"{', '.join(MODEL_PARALLEL_STRATEGIES)} (the data-parallel flavour across dp)")
        if self.strategy == "single" and self.nproc > 1 and self.model_parallel_size == 1:
            raise ConfigError(f"strategy 'single' runs one process but nproc={self.nproc}; "
                              "use --strategy=ddp (or auto) or --nproc=1")
        info = STRATEGIES.get(self.strategy)
        if self.check_replicas_every and (self.model_parallel_size > 1 or (info and info.shards_parameters)):
            raise ConfigError(f"check_replicas_every compares data-parallel replicas; strategy {self.strategy} with "
                              f"tp={self.tp}, pp={self.pp}, cp={self.cp} shards the parameters (they are meant to differ)")

    @property
    def model_parallel_size(self) -> int:  # ranks of one model replica (1: plain data parallelism)
        return self.tp * self.pp * self.cp

    def resolved_strategy(self, world_size: int) -> str:
        """'auto' -> 'single' for one process, else our DDP."""
        if self.strategy != "auto":
            return self.strategy
        return "single" if world_size == 1 else "ddp"

    def check_layout(self, world_size: int) -> None:  # ranks = dp*tp*pp*cp: launchers check, workers again
        """The grid must fill the world: world_size = dp * tp * pp * cp, and ep divides dp."""
        n = self.model_parallel_size
        if world_size % n:
            raise ConfigError(f"nproc ({world_size} ranks) must be divisible by tp*pp*cp = "
                              f"{self.tp}*{self.pp}*{self.cp} = {n} (dp = ranks / (tp*pp*cp))")
        if (world_size // n) % self.ep:
            raise ConfigError(f"ep ({self.ep}) must divide dp = ranks / (tp*pp*cp) = {world_size // n}: "
                              "the expert-parallel groups are carved out of the data-parallel ranks")

    def on_grid(self, n_expert: int) -> bool:
        """Does this layout train on the dp x pp x cp x tp grid (ModelParallel)? With tp, pp or cp,
        and for a mixture of experts on several ranks (its router counts and experts need the grid)."""
        return self.model_parallel_size > 1 or (n_expert > 0 and self.nproc > 1)


FP16_ON_GRID = ("float16 needs loss scaling, which the tp/pp/cp pipeline does not do; "
                "use --dtype=bfloat16 or --dtype=float32")


def divisibility_error(*, tp: int = 1, pp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                       n_head: int | None = None, n_layer: int | None = None,
                       block_size: int | None = None) -> str | None:
    """The first divisibility rule of the dp x pp x cp x tp layout that these sizes break, or None:
    the heads split over tp, the blocks over the pp stages, every sequence into 2 chunks per cp rank
    (the load-balanced ring), and with ``sequence_parallel`` each cp rank's block_size / cp tokens
    over tp. A size given as None is not checked (the communication model has no heads to split).

    Plain numbers, so that the trainer's configuration (:func:`layout_error`), the layout planner
    (:func:`course_lib.analysis.layout_plan.plan_layouts`) and the communication model
    (:func:`course_lib.analysis.parallel_comm.sent_bytes_per_step`) refuse the same layouts in the
    same words: a model that floored n_layer / pp or block_size / cp would count another model."""
    if n_head is not None and n_head % tp:
        return f"n_head ({n_head}) must be divisible by tp ({tp}): each rank holds n_head/tp heads"
    if n_layer is not None and n_layer % pp:
        return f"n_layer ({n_layer}) must be divisible by pp ({pp}): each stage holds n_layer/pp blocks"
    if block_size is None:
        return None
    if cp > 1 and block_size % (2 * cp):
        return (f"block_size ({block_size}) must be divisible by 2*cp ({2 * cp}): "
                "each cp rank holds 2 chunks of every sequence")
    if sequence_parallel and (block_size // cp) % tp:
        return (f"sequence_parallel: the {block_size // cp} tokens per cp rank (block_size / cp) "
                f"must be divisible by tp ({tp})")
    return None


def layout_error(cfg) -> str | None:
    """The first rule that the layout of ``cfg`` (a TrainConfig) sets the model, data and run and
    that they break, or None; the sizes' divisibility (:func:`divisibility_error`) first."""
    if (error := divisibility_error(n_head=cfg.n_head, n_layer=cfg.n_layer, block_size=cfg.block_size, tp=cfg.tp,
                                    pp=cfg.pp, cp=cfg.cp, sequence_parallel=cfg.sequence_parallel)) is not None:
        return error
    if (error := moe_layout_error(cfg)) is not None:
        return error
    if not cfg.on_grid(cfg.n_expert):
        return None
    if cfg.dtype == "float16":  # "auto" that resolves to it on a T4: launch.checks.check_layout
        return FP16_ON_GRID
    if cfg.dropout:
        return (f"dropout={cfg.dropout} with tp/pp/cp is not supported (the tp ranks would need one "
                "shared random stream); use --dropout=0")
    if cfg.compile:
        return "compile with tp/pp/cp is not supported (collectives inside autograd functions); use --compile=false"
    if cfg.recompute != "none":
        return f"recompute={cfg.recompute} with tp/pp/cp is not supported yet (the stages keep their activations)"
    if cfg.grad_comm_dtype not in ("float32", "auto"):
        return (f"grad_comm_dtype={cfg.grad_comm_dtype} with tp/pp/cp is not supported: the dp gradients of a "
                "model-parallel run are reduced in their own dtype")
    return None


def moe_grid_error(n_expert: int, capacity_factor: float, sequence_parallel: bool, cp: int) -> str | None:
    """The grid layouts a mixture of experts does not train like one process, or None: the rule of
    both the run's configuration (:func:`moe_layout_error`) and
    :func:`course_lib.parallel.parallelize.parallelize`."""
    if not n_expert:
        return None
    if sequence_parallel:
        return "n_expert with sequence_parallel is not supported yet (routing statistics over the tp group)"
    if capacity_factor and cp > 1:
        return "capacity_factor with cp > 1 is not supported: which tokens are dropped would depend on cp"
    return None


def moe_layout_error(cfg) -> str | None:
    """What a mixture of experts (``n_expert``, parallel.expert) asks of the layout, or None."""
    if cfg.ep > 1 and not cfg.n_expert:
        return f"ep={cfg.ep} shards experts, but the model has none; set --n_expert (a multiple of ep)"
    if cfg.ep_dispatch != "exact" and cfg.ep == 1:
        return f"ep_dispatch={cfg.ep_dispatch} chooses the all-to-all of expert parallelism: it needs ep > 1"
    if not cfg.n_expert:
        return None
    if cfg.n_expert % cfg.ep:
        return f"n_expert ({cfg.n_expert}) must be divisible by ep ({cfg.ep}): each rank holds n_expert/ep experts"
    if cfg.ep > cfg.nproc:
        return f"ep ({cfg.ep}) cannot exceed nproc ({cfg.nproc})"
    if (error := moe_grid_error(cfg.n_expert, cfg.capacity_factor, cfg.sequence_parallel, cfg.cp)) is not None:
        return error
    if cfg.nproc > 1 and cfg.strategy not in MODEL_PARALLEL_STRATEGIES:
        return (f"strategy {cfg.strategy!r} with n_expert on several ranks: use one of "
                f"{', '.join(MODEL_PARALLEL_STRATEGIES)} (ZeRO-1/2/3 shard the other parameters; the experts "
                "are averaged over their own data-parallel group, parallel.expert)")
    return None
