"""The trainer's configuration: one frozen, typed dataclass, named presets and ``--field=value``.

    course train --config=shakespeare_char_cpu --max_iters=500 --nproc=2

Field names follow nanoGPT's ``train.py`` where it has one; the presets are nanoGPT's
``config/train_shakespeare_char.py`` (the GPU recipe) and the CPU variant from nanoGPT's README
(``--device=cpu --compile=False --eval_iters=20 --block_size=64 --batch_size=12 --n_layer=4
--n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0``). A run writes
its config into the run directory as ``config.json``; every worker loads it from there.

The command line of a training run is generated from the fields here too (:func:`arg_parser`,
:func:`config_from_args`: a preset or a config.json, ``--resume``, then any field as
``--field=value``; an unknown field is an error with a suggestion). ``course train`` (the host,
launch/training.py) and ``python -m course_lib.trainer.loop --config-file RUN_DIR/config.json``
(each worker, trainer/loop.py) both parse with them, so a field means the same everywhere.
"""

import argparse
import ast
import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from course_lib import registry
from course_lib.analysis.activations import RECOMPUTE  # none, selective, full
from course_lib.gpt.data import DATASETS
from course_lib.gpt.layout import layout_error, world_error
from course_lib.hardware import default_nproc
from course_lib.utils import atomic_write_bytes

# Every strategy name the trainer knows, ours and PyTorch's, and the ones that take a 16-bit
# gradient all-reduce: from the torch-free registry (course_lib.registry)
STRATEGY_NAMES, GRAD_COMM_STRATEGIES = registry.STRATEGY_NAMES, registry.GRAD_COMM_STRATEGIES
CONFIG_FILE = "config.json"  # in each run directory: the frozen TrainConfig every rank reads
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
GRAD_COMM_DTYPES = ("float32", "bfloat16")
INIT_FROM = ("scratch", "resume")


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and says what is allowed."""


@dataclass(frozen=True)
class TrainConfig:
    # I/O
    out_dir: str = "out"
    """The run directory: config.json, metrics.csv, checkpoints."""
    eval_interval: int = 250
    """Evaluate (and checkpoint) every this many iterations."""
    log_interval: int = 10
    """One metrics.csv row every this many iterations."""
    eval_iters: int = 20
    """Batches per split in each evaluation."""
    init_from: str = "scratch"
    """'scratch' or 'resume' (continue the run in out_dir)."""
    # data
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
    # model
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
    # AdamW
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
    # learning-rate schedule: linear warmup, then cosine decay to min_lr
    decay_lr: bool = True
    """Cosine decay after warmup (False: constant learning_rate)."""
    warmup_iters: int = 100
    """Linear warmup steps."""
    lr_decay_iters: int = 2000
    """Step at which the decay reaches min_lr."""
    min_lr: float = 1e-4
    """The learning rate at the end of the decay."""
    # system
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:N'."""
    dtype: str = "auto"
    """'auto' = from the hardware profile (bf16 / fp16 + scaler / fp32)."""
    compile: bool = False
    """torch.compile the model."""
    recompute: str = "none"
    """Activations: 'none', 'selective' (attention core) or 'full' (per block)."""
    grad_comm_dtype: str = "float32"
    """Data-parallel gradient all-reduce in 'float32' or 'bfloat16'."""
    seed: int = 1337
    """Seed of the model's initialisation, the batches and the evaluation sets (per rank: seed + rank after setup)."""
    # distributed (ours)
    nproc: int = 1
    """Worker processes on this host; > 1 launches them through torchrun."""
    strategy: str = "auto"
    """'auto' = 'single' for one process, else data parallel."""
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
    run_name: str = ""
    """A label for progress bars and plots; '' = the out_dir's name."""
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

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type is float and type(value) is int:
                object.__setattr__(self, f.name, float(value))  # JSON writes 1.0 as 1
            elif type(value) is not f.type:
                raise ConfigError(f"{f.name}: expected {f.type.__name__}, got {type(value).__name__} {value!r}")
        positive = ("eval_interval", "log_interval", "eval_iters", "gradient_accumulation_steps", "batch_size",
                    "block_size", "n_layer", "n_head", "n_embd", "nproc", "tp", "pp", "cp")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_iters", "warmup_iters", "lr_decay_iters", "threads", "seed", "check_replicas_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("learning_rate", "min_lr", "weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not self.out_dir:
            raise ConfigError("out_dir must not be empty")
        _choice("dtype", self.dtype, DTYPE_NAMES)
        _choice("recompute", self.recompute, RECOMPUTE)
        _choice("grad_comm_dtype", self.grad_comm_dtype, GRAD_COMM_DTYPES)
        if self.grad_comm_dtype != "float32" and self.strategy not in ("auto",) + GRAD_COMM_STRATEGIES:
            raise ConfigError(f"grad_comm_dtype={self.grad_comm_dtype} is for data-parallel gradient all-reduce "
                              f"({', '.join(GRAD_COMM_STRATEGIES)}); strategy {self.strategy} shards gradients")
        _choice("init_from", self.init_from, INIT_FROM)
        _choice("strategy", self.strategy, ("auto",) + STRATEGY_NAMES)
        _choice("dataset", self.dataset, DATASETS)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if error := layout_error(self):  # tp, pp, cp, sequence_parallel (course_lib.gpt.layout)
            raise ConfigError(error)
        if self.strategy == "single" and self.nproc > 1 and self.model_parallel_size == 1:
            raise ConfigError(f"strategy 'single' runs one process but nproc={self.nproc}; "
                              "use --strategy=ddp (or auto) or --nproc=1")

        zero = registry.STRATEGIES[self.strategy].zero_stage if self.strategy in registry.STRATEGIES else None
        if self.check_replicas_every and (self.model_parallel_size > 1 or (zero or 0) >= 3):
            raise ConfigError(f"check_replicas_every compares data-parallel replicas; strategy {self.strategy} with "
                              f"tp={self.tp}, pp={self.pp}, cp={self.cp} shards the parameters (they are meant to differ)")

    def check_layout(self, world_size: int) -> None:  # ranks = dp*tp*pp*cp: launchers check, workers again
        if error := world_error(self, world_size):
            raise ConfigError(error)

    # --- derived values -------------------------------------------------------------------------
    @property
    def model_parallel_size(self) -> int:  # ranks of one model replica (1: plain data parallelism)
        return self.tp * self.pp * self.cp

    def resolved_strategy(self, world_size: int) -> str:
        """'auto' -> 'single' for one process, else our DDP."""
        if self.strategy != "auto":
            return self.strategy
        return "single" if world_size == 1 else "ddp"

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


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}

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


def _choice(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def make_config(preset: str | None = None, overrides: dict | None = None, base: TrainConfig | None = None) -> TrainConfig:
    """Defaults (or ``base``), then the preset, then the overrides; validated once at the end."""
    d = (base or TrainConfig()).to_dict()
    if preset is not None:
        if preset not in TRAIN_PRESETS:
            raise ConfigError(f"unknown --config {preset!r}; choose one of {', '.join(TRAIN_PRESETS)}")
        d.update(TRAIN_PRESETS[preset])
    d.update(overrides or {})
    return TrainConfig.from_dict(d)


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
    if args.config and args.config_file:
        raise ConfigError("give either --config or --config-file, not both")
    base = None
    if args.config_file:
        base = TrainConfig.load(args.config_file)
    elif args.resume and not args.config:
        out_dir = overrides.get("out_dir")
        if not out_dir:
            raise ConfigError("--resume needs --out_dir=DIR (the run to continue)")
        base = TrainConfig.load(Path(out_dir) / "config.json")
    return make_config(args.config, overrides, base=base), args


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal under it in :class:`TrainConfig`), read from this
    file's source: what ``--help`` prints for it."""
    tree = ast.parse(Path(__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
    docs = {}
    for field, doc in zip(cls.body, cls.body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


def _help_epilog() -> str:
    d, docs = TrainConfig(), field_docs()
    fields = "\n".join(f"  {f'--{name}={getattr(d, name)!r}':<42} {f.type.__name__:<6} {docs.get(name, '')}"
                       for name, f in FIELDS.items())
    return (f"presets (--config=NAME): {', '.join(TRAIN_PRESETS)}\n\nfields (default values; any one as --field=value):\n"
            f"{fields}\n\nbool fields also accept a bare --field (true); --nproc=auto uses every GPU, or 2 CPU workers.")
