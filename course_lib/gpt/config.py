"""Four components of a training run's configuration, each owning, documenting and checking its fields.

After torchtitan's ``job_config`` (a typed configuration per component, a docstring per field):
:class:`ModelConfig` (the GPT's size), :class:`DataConfig` (the dataset and the batches),
:class:`OptimizerConfig` (AdamW and its schedule) and :class:`RunConfig` (where and how the run
goes). They know no strategy: the parallel layout is :class:`course_lib.registry.ParallelConfig`,
and the run's whole configuration, the five flat in one, with its presets and command line, is
:class:`course_lib.trainer.config.TrainConfig`.

    from course_lib.gpt.config import ModelConfig
    ModelConfig(n_layer=4, n_embd=30, n_head=4)      # ConfigError: n_embd (30) must be divisible by n_head (4)

Field names follow nanoGPT's ``train.py`` where it has one.
"""

from dataclasses import dataclass

from course_lib.analysis.activations import RECOMPUTE  # none, selective, full
from course_lib.gpt.data import DATASETS
from course_lib.registry import ConfigError, at_least, check_types, choice

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
INIT_FROM = ("scratch", "resume")


@dataclass(frozen=True)
class ModelConfig:
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
    """Batches per split in each evaluation."""
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
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
