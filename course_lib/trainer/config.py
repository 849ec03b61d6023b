"""A training run's configuration: five components, one flat whole, presets, ``--field=value``, resume rules.

After torchtitan's ``job_config`` (one module, a typed configuration per component, a docstring
per field): :class:`TrainConfig` is made of five frozen components, each owning, documenting and
checking its fields: :class:`ModelConfig` (the GPT's size), :class:`DataConfig` (the dataset and
the batches), :class:`OptimizerConfig` (AdamW and its schedule), :class:`RunConfig` (where and how
the run goes) and the parallel layout, :class:`course_lib.registry.ParallelConfig` (torch-free,
beside the strategies it names). Its fields are flat (``TrainConfig(n_layer=4, tp=2)``,
config.json, ``--n_layer=4``); ``cfg.model``, ``cfg.data``, ``cfg.optimizer``, ``cfg.parallel``
and ``cfg.run`` are the components alone. It lives with the trainer, which runs it; ``gpt/``
knows no configuration of a run and no strategy. Torch-free: the launcher reads it before
anything starts.

    course train --config=shakespeare_char_cpu --max_iters=500 --nproc=2
    ModelConfig(n_layer=4, n_embd=30, n_head=4)   # ConfigError: n_embd (30) must be divisible by n_head (4)

Field names follow nanoGPT's ``train.py`` where it has one; the presets are nanoGPT's
``config/train_shakespeare_char.py`` (the GPU recipe) and the CPU variant from nanoGPT's README
(``--device=cpu --compile=False --eval_iters=20 --block_size=64 --batch_size=12 --n_layer=4
--n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0``). A run writes its
config into the run directory as ``config.json`` (:meth:`TrainConfig.save`); every worker loads
it from there.

The command line of a training run is generated from the fields (:func:`arg_parser`,
:func:`config_from_args`: a preset or a config.json, ``--resume``, then any field as
``--field=value``; an unknown field is an error with a suggestion). ``course train`` (the host,
launch/training.py) and ``python -m course_lib.trainer.loop --config-file RUN_DIR/config.json``
(each worker, trainer/loop.py) both parse with them, so a field means the same everywhere.

Which fields a resumed run may change (:data:`RESUME_MAY_CHANGE`, :func:`check_resume`) is a rule
of the configuration too: the launcher checks it before spawning, each worker again.
"""

import argparse
import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from course_lib.analysis.activations import RECOMPUTE  # none, selective, full
from course_lib.analysis.dp_recipes import global_batch_size
from course_lib.gpt.data import DATASETS, load_meta
from course_lib.hardware import default_nproc
from course_lib.registry import (ConfigError, MoEConfig, ParallelConfig, at_least, check_types, choice, device_error,
                                 field_docs, layout_error)
from course_lib.utils import atomic_write_bytes

CONFIG_FILE = "config.json"  # in each run directory: the frozen TrainConfig every rank reads
# Every file a run writes in its directory (checkpoints, trainer/metrics.py's records, the config):
# what a new run in the same directory clears
RUN_FILES = ("last.pt", "best.pt", "metrics.csv", "summary.json", "run.json", "ranks.json", CONFIG_FILE)


def clear_run(out_dir: str | os.PathLike, files: bool = True) -> None:
    """Remove a run's RUN_FILES from ``out_dir`` (with ``files``) and, always, the temporary files of
    a write that a stopped worker left half done (``.last.pt.XXXX.tmp``: SIGTERM or SIGKILL skips
    the writer's own cleanup, and a checkpoint's is as large as the checkpoint)."""
    out = Path(out_dir)
    for name in RUN_FILES:
        if files:
            (out / name).unlink(missing_ok=True)
        for tmp in out.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)


DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
INIT_FROM = ("scratch", "resume")
# Fields a resumed run may change: where and how it runs, how often it reports, and how long.
RESUME_MAY_CHANGE = frozenset({"out_dir", "init_from", "max_iters", "eval_interval", "log_interval", "eval_iters",
                               "device", "compile", "strategy", "threads", "timeout_s", "run_name", "data_dir",
                               "recompute", "grad_comm_dtype",  # memory and wire format, not the model
                               # the precision: dtype=auto changes it with the device anyway (T4 fp16 ->
                               # CPU fp32), and the trainer loads the loss scaler only where both scale
                               "dtype",
                               "check_collectives", "check_replicas_every",  # checks, not the arithmetic
                               # the layout: any, if the global batch stays the same (check_layout_change)
                               "nproc", "tp", "pp", "cp", "ep", "ep_dispatch", "sequence_parallel", "pp_schedule",
                               "batch_size", "gradient_accumulation_steps"})



@dataclass(frozen=True)
class ModelConfig(MoEConfig):
    """The GPT: its size (the vocabulary comes from the data; the context is ``block_size``)."""

    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability (0: none)."""
    bias: bool = False
    """Biases in the Linear and LayerNorm layers (GPT-2 has them; nanoGPT's default leaves them out)."""

    def __post_init__(self):
        check_types(self)
        ModelConfig.check(self)

    def check(self) -> None:
        MoEConfig.check(self)
        at_least(self, 1, ("n_layer", "n_head", "n_embd"))
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True)
class DataConfig:
    """What feeds the model: the dataset and the batches each rank draws from it."""

    data_dir: str = ""
    """'' = the default data folder (course_lib.utils.default_data_dir)."""
    dataset: str = "shakespeare_char"
    """The prepared dataset: 'shakespeare_char' (characters) or 'shakespeare' (GPT-2 BPE)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (and per rank)."""
    batch_size: int = 12
    """Micro-batch per rank; global batch = batch_size * accum * world size."""
    block_size: int = 64
    """Tokens per sequence (the context length)."""

    def __post_init__(self):
        check_types(self)
        DataConfig.check(self)

    def check(self) -> None:
        at_least(self, 1, ("gradient_accumulation_steps", "batch_size", "block_size"))
        choice("dataset", self.dataset, DATASETS)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule: linear warmup, then cosine decay to min_lr."""

    learning_rate: float = 1e-3
    """Peak learning rate (after warmup)."""
    max_iters: int = 2000
    """Optimizer steps of the run."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay (matrices only)."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.99
    """AdamW's second-moment decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables."""
    decay_lr: bool = True
    """Cosine decay after warmup (False: constant learning_rate)."""
    warmup_iters: int = 100
    """Linear warmup steps."""
    lr_decay_iters: int = 2000
    """Step at which the decay reaches min_lr."""
    min_lr: float = 1e-4
    """The learning rate at the end of the decay."""

    def __post_init__(self):
        check_types(self)
        OptimizerConfig.check(self)

    def check(self) -> None:
        at_least(self, 0, ("max_iters", "warmup_iters", "lr_decay_iters", "learning_rate", "min_lr", "weight_decay",
                           "grad_clip"))
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        # once the warmup is over, get_lr answers min_lr from lr_decay_iters on: a decay that ends
        # inside the warmup drops the rate in one step at iteration warmup_iters. Refused only where that step is
        # taken (iterations 0..max_iters-1) and changes the rate: the short runs whose max_iters and
        # lr_decay_iters both stay under the default warmup_iters (tests, benchmarks) never get there
        w = self.warmup_iters
        if self.decay_lr and self.lr_decay_iters < w < self.max_iters and self.min_lr != self.learning_rate:
            raise ConfigError(
                f"lr_decay_iters ({self.lr_decay_iters}) < warmup_iters ({w}) with decay_lr: the cosine decay "
                f"would end before the warmup does, so at iteration {w} the learning rate jumps from "
                f"{self.learning_rate * w / (w + 1):g} to min_lr {self.min_lr:g} and stays there; set "
                f"lr_decay_iters >= warmup_iters (usually lr_decay_iters = max_iters = {self.max_iters}), "
                f"or a smaller warmup_iters, or decay_lr=false (or max_iters <= {w}: the run ends in its warmup)")


@dataclass(frozen=True)
class RunConfig:
    """The run itself: where it writes, how often it evaluates and logs, its device, precision and seed."""

    out_dir: str = "out"
    """The run directory: config.json, metrics.csv, checkpoints."""
    eval_interval: int = 250
    """Evaluate (and checkpoint) every this many iterations."""
    log_interval: int = 10
    """One metrics.csv row every this many iterations."""
    eval_iters: int = 20
    """Global batches per split in each evaluation: fixed rows, the same for every layout of one
    global batch (each rank: eval_iters x gradient_accumulation_steps forwards)."""
    init_from: str = "scratch"
    """'scratch' or 'resume' (continue the run in out_dir)."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:N'."""
    dtype: str = "auto"
    """'auto' = from the hardware profile (bf16 / fp16 + scaler / fp32)."""
    compile: bool = False
    """torch.compile the model."""
    recompute: str = "none"
    """Activations: 'none', 'selective' (attention core) or 'full' (per block)."""
    seed: int = 1337
    """Seed of the model's initialisation, the batches and the evaluation sets (per rank: seed + rank after setup)."""
    run_name: str = ""
    """A label for progress bars and plots; '' = the out_dir's name."""

    def __post_init__(self):
        check_types(self)
        RunConfig.check(self)

    def check(self) -> None:
        at_least(self, 1, ("eval_interval", "log_interval", "eval_iters"))
        at_least(self, 0, ("seed",))
        if not self.out_dir:
            raise ConfigError("out_dir must not be empty")
        choice("dtype", self.dtype, DTYPE_NAMES)
        choice("recompute", self.recompute, RECOMPUTE)
        choice("init_from", self.init_from, INIT_FROM)
        if error := device_error(self.device):  # the rank placement's rule too (launch.placement)
            raise ConfigError(error)


COMPONENTS = {"model": ModelConfig, "data": DataConfig, "optimizer": OptimizerConfig,
              "parallel": ParallelConfig, "run": RunConfig}


@dataclass(frozen=True)
class TrainConfig(RunConfig, ParallelConfig, OptimizerConfig, DataConfig, ModelConfig):
    """One training run: the model, data, optimizer, parallel layout and run configurations, flat.

    Each field belongs to one component (:data:`COMPONENTS`), which documents and checks it;
    ``cfg.model`` (``.data``, ``.optimizer``, ``.parallel``, ``.run``) is that component on its own.
    Built flat (``TrainConfig(n_layer=4, tp=2)``), saved flat (config.json), set flat
    (``--n_layer=4``); then the rules that join two components (the layout's demands on the model).
    """

    def __post_init__(self):
        check_types(self)
        for component in COMPONENTS.values():
            component.check(self)
        if error := layout_error(self):  # what tp, pp, cp, sequence_parallel ask of the model and data
            raise ConfigError(error)

    def _component(self, name: str):
        cls = COMPONENTS[name]
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    model = property(lambda self: self._component("model"), doc="The model's configuration (ModelConfig).")
    data = property(lambda self: self._component("data"), doc="The data's configuration (DataConfig).")
    optimizer = property(lambda self: self._component("optimizer"), doc="The optimizer's (OptimizerConfig).")
    parallel = property(lambda self: self._component("parallel"), doc="The parallel layout (ParallelConfig).")
    run = property(lambda self: self._component("run"), doc="The run's configuration (RunConfig).")

    @property
    def name(self) -> str:
        return self.run_name or Path(self.out_dir).name

    # --- serialisation --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "TrainConfig":
        unknown = sorted(set(d) - FIELDS.keys())
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str, source: str = CONFIG_FILE) -> "TrainConfig":
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{source} is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{source} must hold a JSON object")
        return cls.from_dict(d, source)

    def save(self) -> Path:
        """Write OUT_DIR/config.json, atomically: the one place that writes it (the launcher before
        any rank starts, the trainer again when it runs without the launcher). Returns its path."""
        path = Path(self.out_dir) / CONFIG_FILE
        atomic_write_bytes(path, self.to_json().encode())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrainConfig":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
        return cls.from_json(text, str(path))

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}  # every field, flat: what config.json and --field hold

# nanoGPT's config/train_shakespeare_char.py (a baby GPT on one GPU).
_SHAKESPEARE_CHAR = dict(
    out_dir="out-shakespeare-char", eval_interval=250, eval_iters=200, log_interval=10,
    dataset="shakespeare_char", gradient_accumulation_steps=1, batch_size=64, block_size=256,
    n_layer=6, n_head=6, n_embd=384, dropout=0.2, learning_rate=1e-3, max_iters=5000,
    lr_decay_iters=5000, min_lr=1e-4, beta2=0.99, warmup_iters=100,
)
TRAIN_PRESETS: dict[str, dict] = {
    "shakespeare_char": _SHAKESPEARE_CHAR,
    # the same on a CPU, as nanoGPT's README runs it
    "shakespeare_char_cpu": {**_SHAKESPEARE_CHAR, "out_dir": "out-shakespeare-char-cpu", "eval_iters": 20,
                             "block_size": 64, "batch_size": 12, "n_layer": 4, "n_head": 4, "n_embd": 128,
                             "max_iters": 2000, "lr_decay_iters": 2000, "dropout": 0.0},
}
# the CPU recipe with a mixture of experts in every block: 4 experts, each token to 2 (Mixtral's
# top-2 routing, Jiang et al. 2024, Sec. 2.1), dropless; course train --config=... --nproc=2 --ep=2
TRAIN_PRESETS["shakespeare_char_moe_cpu"] = {**TRAIN_PRESETS["shakespeare_char_cpu"],
                                             "out_dir": "out-shakespeare-char-moe-cpu", "n_expert": 4, "top_k": 2}


def make_config(preset: str | None = None, overrides: dict | None = None, base: TrainConfig | None = None) -> TrainConfig:
    """Defaults (or ``base``), then the preset, then the overrides; validated once at the end."""
    if preset is not None and not isinstance(preset, str):  # make_config({...}) without a preset name
        raise ConfigError(f"make_config(preset, overrides): the preset is a name such as 'shakespeare_char_cpu' "
                          f"(or None), got {preset!r}")
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(f"overrides must be a dict such as {{'max_iters': 100}}, got {overrides!r}")
    d = (base or TrainConfig()).to_dict()
    if preset is not None:
        if preset not in TRAIN_PRESETS:
            raise ConfigError(f"unknown --config {preset!r}; choose one of {', '.join(TRAIN_PRESETS)}")
        d.update(TRAIN_PRESETS[preset])
    d.update(overrides or {})
    return TrainConfig.from_dict(d)


# --- what a resumed run may change ----------------------------------------------------------------

def check_resumable(saved: dict, cfg: TrainConfig, path: str | os.PathLike = "checkpoint",
                    iter_num: int = 0) -> None:
    """Raise ConfigError naming every field that differs from the checkpoint's config and may not
    (and if the checkpoint, at ``iter_num``, is already past ``max_iters``)."""
    if cfg.max_iters < iter_num:
        raise ConfigError(f"{path} is at iteration {iter_num}, past max_iters={cfg.max_iters}; "
                          f"pass --max_iters={iter_num} or more to continue it")
    default = TrainConfig().to_dict()  # a field newer than the checkpoint had its default value then
    diffs = [(k, saved.get(k, default[k]), v) for k, v in cfg.to_dict().items()
             if k not in RESUME_MAY_CHANGE and saved.get(k, default[k]) != v]
    if diffs:
        changed = "; ".join(f"{k}: checkpoint has {a!r}, now {b!r}" for k, a, b in diffs)
        fix = " ".join(f"--{k}={a}" for k, a, _ in diffs)
        raise ConfigError(f"cannot resume {path} with this config ({changed}); "
                          f"pass {fix} to continue that run, or start a new one in another --out_dir")


def _global_batch(cfg: dict, world_size: int) -> int:
    """:func:`~course_lib.analysis.dp_recipes.global_batch_size` of a config dict (dp = ranks / (tp pp cp))."""
    mp = cfg.get("tp", 1) * cfg.get("pp", 1) * cfg.get("cp", 1)
    return global_batch_size(cfg["batch_size"], cfg["gradient_accumulation_steps"], world_size // mp)


def check_layout_change(saved: dict, saved_world: int, cfg: TrainConfig, world_size: int,
                        path: str | os.PathLike = "checkpoint") -> None:
    """A checkpoint resumes under another layout (ranks, tp, pp, cp, strategy, micro-batching)
    when the global batch per step is the same: the full state has one format, the data sampler
    draws the same samples, and the step's gradient is the mean over the same global batch. With
    dropout the ranks' random streams would differ, so the number of ranks must stay; with experts
    the micro-batches must stay (the balancing loss and the capacity are per micro-batch)."""
    before, now = _global_batch(saved, saved_world), _global_batch(cfg.to_dict(), world_size)
    if before != now:
        raise ConfigError(f"{path} trained with a global batch of {before} sequences per step, this layout has "
                          f"{now} (batch_size x gradient_accumulation_steps x dp); choose batch_size and "
                          f"gradient_accumulation_steps so that they give {before}")
    accum = saved.get("gradient_accumulation_steps", 1)
    if cfg.n_expert and accum != cfg.gradient_accumulation_steps:
        raise ConfigError(f"{path} trained a mixture of experts in {accum} micro-batch(es) per step, this layout has "
                          f"{cfg.gradient_accumulation_steps}: the router's balancing loss and the experts' capacity "
                          "are counted per micro-batch, so the same global batch split otherwise trains differently; "
                          f"keep --gradient_accumulation_steps={accum} (and batch_size x dp as it was)")
    if saved_world != world_size and cfg.dropout:
        raise ConfigError(f"{path} was written by {saved_world} ranks, this run has {world_size}; with "
                              f"dropout={cfg.dropout} the random streams differ: resume with --nproc={saved_world}")


def check_same_vocabulary(model_meta: dict, data_meta: dict, folder) -> None:
    """ConfigError unless the data's token ids mean what they meant when the checkpoint trained: a
    vocabulary of the same size but other characters loads into the weights without complaint,
    then trains on every id as another character (another --data_dir on resume, fine-tuning data)."""
    for key in ("tokenizer", "vocab_size", "chars"):
        if model_meta.get(key) != data_meta.get(key):
            raise ConfigError(f"the data in {folder} uses another vocabulary than the checkpoint's ({key} "
                              "differs); encode it with the checkpoint's tokenizer (fine-tuning: "
                              "prepare_finetune_data(text, data_dir, base_meta=<the checkpoint's meta>))")


def check_resume(ck: dict, cfg: TrainConfig, path: str | os.PathLike, world_size: int) -> None:
    """Can ``cfg`` on ``world_size`` ranks continue checkpoint ``ck``? (checked by the launcher
    before spawning, and again by each worker, which may have been started some other way).
    The fields must match (but for the layout's), and the global batch (check_layout_change), and
    the data (``data_dir`` may change) must be in the checkpoint's vocabulary."""
    check_resumable(ck["config"], cfg, path, ck["iter_num"])
    check_layout_change(ck["config"], ck["world_size"], cfg, world_size, path)
    if "meta" in ck:  # every trainer checkpoint has it (sampling reads it)
        check_same_vocabulary(ck["meta"], load_meta(cfg.data_dir or None, cfg.dataset),
                              Path(cfg.data_dir or "data") / cfg.dataset)


# --- the command line, generated from the fields --------------------------------------------------

def parse_value(name: str, text: str):
    """Convert ``--name=text`` to the field's type; a ConfigError names the field if it cannot."""
    if name not in FIELDS:
        close = difflib.get_close_matches(name, FIELDS, n=1)
        hint = f" (did you mean --{close[0]}?)" if close else ""
        raise ConfigError(f"unknown option --{name}{hint}")
    typ = FIELDS[name].type
    if typ is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{name}: expected true or false, got {text!r}")
    if typ is int and name == "nproc" and text == "auto":
        return default_nproc()  # one per GPU, else 2 CPU workers
    try:
        return typ(text)
    except ValueError:
        kind = {int: "an integer", float: "a number"}[typ]
        raise ConfigError(f"--{name}: expected {kind}, got {text!r}") from None


def parse_overrides(args: list[str]) -> dict:
    """``['--max_iters=100', '--compile', '--bias=false']`` -> typed dict (bare flag = True for bools).

    ``--name value`` is accepted too, except after a bool field (it would be ambiguous).
    """
    out, i = {}, 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"expected --field=value, got {arg!r}")
        name, eq, text = arg[2:].partition("=")
        name = name.replace("-", "_")
        if not eq:
            if name in FIELDS and FIELDS[name].type is bool:
                text = "true"
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                i, text = i + 1, args[i + 1]
            else:
                if name in FIELDS:
                    raise ConfigError(f"--{name} needs a value (--{name}=VALUE)")
                parse_value(name, "")  # raises: unknown option (with a suggestion)
        out[name] = parse_value(name, text)
        i += 1
    return out


def arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The command line shared by ``course train`` (host) and ``python -m course_lib.trainer.loop``
    (worker): a preset or a config.json, ``--resume``, then any field as ``--field=value``."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, epilog=_help_epilog(), description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="PRESET", help=f"start from a preset: {', '.join(TRAIN_PRESETS)}")
    p.add_argument("--config-file", metavar="PATH", help="start from a config.json (what workers use)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out_dir (= --init_from=resume)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[TrainConfig, argparse.Namespace]:
    """Parse ``argv`` with ``parser`` (from :func:`arg_parser`); the rest are field overrides.
    ``--resume`` without a preset or file continues with the run's own config.json."""
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)
    if args.resume:
        overrides["init_from"] = "resume"
    resume = overrides.get("init_from") == "resume"  # --resume or --init_from=resume: one meaning (--help)
    if args.config and args.config_file:
        raise ConfigError("give either --config or --config-file, not both")
    base = None
    if args.config_file:
        base = TrainConfig.load(args.config_file)
    elif resume and not args.config:
        out_dir = overrides.get("out_dir")
        if not out_dir:
            raise ConfigError("--resume needs --out_dir=DIR (the run to continue)")
        base = TrainConfig.load(Path(out_dir) / "config.json")
    return make_config(args.config, overrides, base=base), args


def _help_epilog() -> str:
    d, docs = TrainConfig(), field_docs(TrainConfig)
    fields = "\n".join(f"{part} ({cls.__name__}):\n" + "\n".join(
        f"  {f'--{f.name}={getattr(d, f.name)!r}':<42} {f.type.__name__:<6} {docs[f.name]}" for f in dataclasses.fields(cls))
        for part, cls in COMPONENTS.items())
    return (f"presets (--config=NAME): {', '.join(TRAIN_PRESETS)}\n\nfields by component (default values; any one as "
            f"--field=value):\n{fields}\n\nbool fields also accept a bare --field (true); --nproc=auto uses every GPU, or 2 CPU workers.")
