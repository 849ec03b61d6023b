"""Per-device training memory: model states for DP and ZeRO stages 1-3, plus activations.

    course memory --params 7.5e9 --dp 64            # the ZeRO paper's Figure 1 example
    course memory --preset gpt2 --dp 4 --gpu t4     # does GPT-2 small fit on a T4?

Model states follow Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (arXiv:1910.02054), Sections 3.1 and 5. With mixed-precision Adam every
parameter costs 2 bytes of fp16/bf16 weights, 2 bytes of fp16/bf16 gradients and K = 12 bytes of
optimizer state (fp32 master weights, momentum and variance). With Psi parameters and a
data-parallel degree N the bytes per device are

    stage 0, DP      (2 + 2 + K) Psi                 = 16 Psi
    stage 1, P_os    2 Psi + 2 Psi + K Psi / N       = 4 Psi + 12 Psi / N
    stage 2, P_os+g  2 Psi + (2 + K) Psi / N         = 2 Psi + 14 Psi / N
    stage 3, P_os+g+p (2 + 2 + K) Psi / N            = 16 Psi / N

The paper counts 1 GB as 1e9 bytes (Figure 1: 7.5e9 x 16 bytes = 120 GB), so :data:`GB` is 1e9.
Plain fp32 training keeps 4-byte weights and gradients and K = 8 (Adam's two moments; the
weights themselves are the master copy). ``dtype="autocast"`` is what ``torch.autocast`` holds
(the course trainer with ``--dtype=bfloat16/float16``): model states as in fp32, 4 + 4 + 8, and
16-bit activations with autocast's extras (:func:`course_lib.analysis.activations.autocast_activation_bytes`).

ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX
ATC, Sec. 3-4) keeps only the 16-bit weights on the GPU and moves gradients (as backward produces
them), optimizer states and the Adam step to CPU memory: ``offload=True`` leaves 2 Psi (2 Psi / N
at stage 3) on the device, 8x less than 16 Psi; the paper trains 13B parameters on one 32 GB V100.

Not modelled (the paper's "residual states" besides activations): temporary buffers, memory
fragmentation, ZeRO-3's gathered copy of the layer being computed and the CUDA context (a few
hundred MB), so a "fits" with little to spare may still run out of memory on a real GPU.

Everything is in bytes (floats: a shard of Psi / N need not be whole). :func:`breakdown` is the
one call a notebook calculator needs: model states plus activations (Korthikanti et al. 2022, see
:mod:`course_lib.analysis.activations`) for a parameter count or a model preset. ``course memory``
is in :mod:`course_lib.analysis.memory_cli`. :func:`step_peak` is the peak of one step of the
course trainer itself, at the op where it happens (the last section of this module).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from course_lib.analysis.activations import (
    RECOMPUTE,
    activation_bytes,
    autocast_activation_bytes,
    trainer_activation_bytes,
)
from course_lib.hardware import GB, PROFILES
from course_lib.utils import check_count

# dtype name -> (bytes per parameter, bytes per gradient, default K)
DTYPES: dict[str, tuple[int, int, int]] = {
    "mixed": (2, 2, 12),  # fp16/bf16 weights and gradients, fp32 master + Adam m, v
    "fp16": (2, 2, 12),
    "bf16": (2, 2, 12),
    "fp32": (4, 4, 8),  # fp32 weights and gradients, Adam m, v
    # torch.autocast (what the course trainer runs with --dtype=bfloat16/float16): fp32 weights and
    # gradients, Adam m, v; 16-bit activations plus autocast's extras (analysis.activations)
    "autocast": (4, 4, 8),
}
STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DP", 1: "ZeRO-1 (P_os)", 2: "ZeRO-2 (P_os+g)", 3: "ZeRO-3 (P_os+g+p)"}


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states held by one device."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def to_gb(self, unit: float = GB) -> dict[str, float]:
        return {"params": self.params / unit, "grads": self.grads / unit,
                "optimizer": self.optimizer / unit, "total": self.total / unit}


def dtype_bytes(dtype: str, k: float | None = None) -> tuple[int, int, float]:
    """(bytes per parameter, bytes per gradient, K) for a dtype name; ``k`` overrides K."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    p, g, default_k = DTYPES[dtype]
    if k is None:
        k = default_k
    if not k >= 0:
        raise ValueError(f"k (optimizer bytes per parameter) must be >= 0, got {k!r}")
    return p, g, float(k)


def model_state_bytes(num_params: float, dp: int = 1, stage: int = 0, k: float | None = None,
                      dtype: str = "mixed", tp: int = 1, offload: bool = False) -> ModelStates:
    """Model-state bytes per device for ZeRO ``stage`` (0 = plain data parallel).

    num_params: Psi, the parameter count (float allowed, e.g. 7.5e9).
    dp: data-parallel degree N_d, the number of shards for the partitioned states.
    k: optimizer-state bytes per parameter (default 12 for "mixed", 8 for "fp32").
    tp: tensor-parallel degree; each device holds Psi / tp parameters before ZeRO sharding
        (Megatron splits the large matrices; the small replicated LayerNorm vectors are ignored).
    offload: ZeRO-Offload (module docstring): gradients and optimizer states live in CPU memory.
    """
    if isinstance(num_params, bool) or not isinstance(num_params, numbers.Real) or not num_params > 0:
        raise ValueError(f"num_params must be a number > 0 (e.g. 7.5e9), got {num_params!r}")
    dp = check_count("dp (data-parallel degree)", dp)
    tp = check_count("tp (tensor-parallel degree)", tp)
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be 0 (plain DP), 1, 2 or 3, got {stage!r}")
    p_bytes, g_bytes, k = dtype_bytes(dtype, k)
    psi = float(num_params) / tp
    on_gpu = 0.0 if offload else 1.0
    return ModelStates(
        params=p_bytes * psi / (dp if stage >= 3 else 1),
        grads=on_gpu * g_bytes * psi / (dp if stage >= 2 else 1),
        optimizer=on_gpu * k * psi / (dp if stage >= 1 else 1),
    )


def zero_stages(num_params: float, dp: int = 1, k: float | None = None, dtype: str = "mixed",
                tp: int = 1) -> dict[int, ModelStates]:
    """Model states per device for every stage 0-3: one row of the ZeRO paper's Table 1."""
    return {s: model_state_bytes(num_params, dp, s, k, dtype, tp) for s in STAGES}


def max_params(memory_bytes: float, dp: int = 1, stage: int = 0, k: float | None = None,
               dtype: str = "mixed", tp: int = 1) -> float:
    """The largest Psi whose model states fit in ``memory_bytes`` per device (states only)."""
    per_param = model_state_bytes(1.0, dp, stage, k, dtype, tp).total
    return memory_bytes / per_param


def shard_numel(numel: int, world_size: int) -> int:
    """Elements per rank when ``numel`` is padded to a multiple of ``world_size`` (as ZeRO does)."""
    numel = check_count("numel", numel, minimum=0)
    world_size = check_count("world_size", world_size)
    return -(-numel // world_size)


def resolve_gpu(gpu) -> tuple[str, float]:
    """(name, memory bytes) for a profile name ('t4', 'a100-80gb', ...), a HardwareProfile, or a
    number of bytes."""
    if isinstance(gpu, (int, float)) and not isinstance(gpu, bool):
        if gpu <= 0:
            raise ValueError(f"GPU memory must be > 0 bytes, got {gpu!r}")
        return f"{gpu / GB:g} GB", float(gpu)
    if isinstance(gpu, str):
        key = gpu.lower()
        if key not in PROFILES or PROFILES[key].memory_bytes <= 0:
            names = ", ".join(n for n, p in PROFILES.items() if p.memory_bytes > 0)
            raise ValueError(f"unknown GPU {gpu!r}; choose one of: {names}")
        return key, float(PROFILES[key].memory_bytes)
    if hasattr(gpu, "memory_bytes") and hasattr(gpu, "name"):
        return gpu.name, float(gpu.memory_bytes)
    raise TypeError(f"gpu must be a profile name, a HardwareProfile or bytes, got {type(gpu).__name__}")


def fits(nbytes: float, gpu) -> bool:
    """Whether ``nbytes`` fit in the memory of ``gpu`` (see :func:`resolve_gpu`)."""
    return nbytes <= resolve_gpu(gpu)[1]


@dataclass(frozen=True)
class ModelShape:
    """A GPT's shape (names as in :class:`course_lib.gpt.model.GPTConfig`) and a typical micro-batch."""

    name: str
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    batch_size: int  # the micro-batch its recipe trains with
    bias: bool = True
    dropout: float = 0.0

    def num_params(self) -> int:
        """Parameters of :class:`course_lib.gpt.model.GPT` with this shape (lm_head tied to wte):
        embeddings V h + T h, per layer 12 h^2 (+ 13 h with biases, 2 h LayerNorm gains without),
        final LayerNorm h (+ h bias)."""
        h, ln = self.n_embd, (2 if self.bias else 1)
        per_layer = 12 * h * h + (9 * h if self.bias else 0) + 2 * ln * h
        return (self.vocab_size + self.block_size) * h + self.n_layer * per_layer + ln * h


# GPT-2 (Radford et al. 2019; shapes of the released checkpoints, vocabulary 50257, context 1024)
# with nanoGPT's micro-batch of 12; the course's Shakespeare character models (vocabulary 65).
PRESETS: dict[str, ModelShape] = {p.name: p for p in (
    ModelShape("gpt2", 12, 12, 768, 1024, 50257, 12),  # 124M
    ModelShape("gpt2-medium", 24, 16, 1024, 1024, 50257, 12),  # 350M
    ModelShape("gpt2-large", 36, 20, 1280, 1024, 50257, 12),  # 774M
    ModelShape("gpt2-xl", 48, 25, 1600, 1024, 50257, 12),  # 1558M
    ModelShape("shakespeare_char", 6, 6, 384, 256, 65, 64, dropout=0.2),
    ModelShape("shakespeare_char_cpu", 4, 4, 128, 64, 65, 16),
)}


def get_preset(name: str | ModelShape) -> ModelShape:
    if isinstance(name, ModelShape):
        return name
    key = {"gpt2-small": "gpt2", "gpt2-124m": "gpt2"}.get(name, name)
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[key]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device: model states (for one ZeRO stage) and activations."""

    params: float
    grads: float
    optimizer: float
    activations: float = 0.0
    stage: int = 0
    num_params: float = 0.0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations

    def to_gb(self, unit: float = GB) -> dict[str, float]:
        """The four parts and the total in GB (1e9 bytes; pass unit=GiB for 2**30)."""
        return {"params": self.params / unit, "grads": self.grads / unit,
                "optimizer": self.optimizer / unit, "activations": self.activations / unit,
                "total": self.total / unit}

    def fits(self, gpu) -> bool:
        return fits(self.total, gpu)


def stage_params(n_layer: int, n_embd: int, vocab_size: int, block_size: int, bias: bool, tp: int = 1,
                 pp: int = 1, pp_rank: int = 0) -> dict[str, int]:
    """Parameters a rank holds, split into "sharded" (divided over tp) and "replicated" (the
    same on every tp rank), for stage ``pp_rank`` of ``pp`` with n_layer / pp layers."""
    h, L = n_embd, n_layer // pp
    vocab_size = -(-vocab_size // tp) * tp  # padded to a multiple of tp (course_lib.parallel.tensor.vocab)
    sharded = L * (12 * h * h + (7 * h if bias else 0)) // tp  # c_attn, c_fc (with biases), both c_proj
    replicated = L * (6 * h if bias else 2 * h)  # 2 LayerNorms (gains, biases) and the row-parallel biases
    if pp_rank == 0:
        sharded += vocab_size * h // tp
        replicated += block_size * h  # wpe
    if pp_rank == pp - 1:
        sharded += vocab_size * h // tp if pp > 1 else 0  # the last stage's copy of the tied weight
        replicated += h * (2 if bias else 1)  # ln_f
    return {"sharded": sharded, "replicated": replicated, "total": sharded + replicated}


def stage_states(shape: ModelShape, *, dp: int = 1, tp: int = 1, pp: int = 1, stage: int = 0,
                 dtype: str = "mixed") -> ModelStates:
    """Model states of the rank of a dp x pp x tp layout that holds the most (:func:`stage_params`
    of the first or last pipeline stage), ZeRO ``stage`` over ``dp`` ranks (count dp x cp as dp)."""
    params = max(stage_params(shape.n_layer, shape.n_embd, shape.vocab_size, shape.block_size, shape.bias, tp, pp,
                              r)["total"] for r in {0, pp - 1})
    return model_state_bytes(params, dp, stage, dtype=dtype)  # params is one rank's: no tp left to divide


def micro_batches_in_flight(pp: int, micro_batches: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations the first pipeline stage holds at once: all of them under AFAB
    (GPipe), at most pp under 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model
    Training on GPU Clusters", Sec. 2.2)."""
    return micro_batches if schedule == "afab" else min(pp, micro_batches)


def breakdown(num_params: float | None = None, *, preset: str | ModelShape | None = None,
              dp: int = 1, stage: int = 0, k: float | None = None, dtype: str = "mixed",
              tp: int = 1, sequence_parallel: bool = False, recompute: str = "none",
              batch_size: int | None = None, seq_len: int | None = None,
              flash_attention: bool = False, dropout: bool | None = None,
              offload: bool = False) -> MemoryBreakdown:
    """Per-device memory of training a model: model states for ZeRO ``stage`` plus activations.

    Give ``num_params`` (model states only) or a ``preset`` (name from :data:`PRESETS` or a
    :class:`ModelShape`: parameter count from its shape, and activations for ``batch_size``
    sequences of ``seq_len`` tokens, defaulting to the preset's micro-batch and block size).
    Activations are 2-byte in mixed precision, 4-byte in fp32, and under ``dtype="autocast"``
    16-bit with autocast's fp32 residual stream and weight copies; ``dropout`` defaults to whether
    the preset uses dropout (masks cost 1 byte per element).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    shape = get_preset(preset) if preset is not None else None
    if num_params is None:
        if shape is None:
            raise ValueError("give num_params (e.g. 7.5e9) or a preset (e.g. 'gpt2')")
        num_params = shape.num_params()
    states = model_state_bytes(num_params, dp, stage, k, dtype, tp, offload)
    acts = 0.0
    if shape is not None:
        if seq_len is not None and seq_len > shape.block_size:
            raise ValueError(f"seq_len {seq_len} exceeds the {shape.name} block size "
                             f"{shape.block_size}; use seq_len <= {shape.block_size}")
        s = shape.block_size if seq_len is None else check_count("seq_len", seq_len)  # 0 is refused
        b = shape.batch_size if batch_size is None else check_count("batch_size", batch_size)
        drop = (shape.dropout > 0) if dropout is None else dropout
        if dtype == "autocast":
            if tp > 1 or sequence_parallel:
                raise ValueError("dtype 'autocast' models one device's activations: use tp=1")
            acts = autocast_activation_bytes(shape.n_layer, s, b, shape.n_embd, shape.n_head,
                                             shape.vocab_size, recompute, drop, flash_attention,
                                             shape.bias)
        else:
            acts = activation_bytes(
                shape.n_layer, s, b, shape.n_embd, shape.n_head, shape.vocab_size, tp,
                sequence_parallel, recompute, bytes_per_value=DTYPES[dtype][0],
                flash_attention=flash_attention, dropout=drop)
    elif batch_size is not None or seq_len is not None:
        raise ValueError("activations need a model shape: pass preset=... as well")
    return MemoryBreakdown(states.params, states.grads, states.optimizer, acts, stage,
                           float(num_params))


# --- the peak of one step of the course trainer ---------------------------------------------------

LOGITS_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class StepPeak:
    """Bytes of one step's peak, by what holds them."""

    weights: float  # fp32 parameters
    optimizer: float  # Adam's exp_avg and exp_avg_sq, fp32
    activations: float  # kept for backward, the fp32 log-probabilities included
    loss_grads: float  # the loss's fp32 (b s, v) tensors beside the saved ones at its peak (step_peak says which)
    logits: float  # logits the caller still holds (0 in the trainer)
    grads: float  # every gradient, fp32 (the end-of-backward candidate)

    @property
    def at_loss(self) -> float:
        """Start of backward: states without gradients, every activation, the loss's gradients."""
        return self.weights + self.optimizer + self.activations + self.loss_grads + self.logits

    @property
    def at_end(self) -> float:
        """End of backward: states with every gradient, the activations freed."""
        return self.weights + self.optimizer + self.grads

    @property
    def total(self) -> float:
        return max(self.at_loss, self.at_end)

    def parts(self) -> dict[str, float]:
        """What holds the bytes at the peak (the larger candidate), in the order created."""
        if self.at_end > self.at_loss:
            return {"weights": self.weights, "optimizer": self.optimizer, "gradients": self.grads}
        parts = {"weights": self.weights, "optimizer": self.optimizer, "activations": self.activations,
                 "loss gradients": self.loss_grads, "held logits": self.logits}
        return {k: v for k, v in parts.items() if v}


def step_peak(n_layer: int, n_head: int, n_embd: int, block_size: int, vocab_size: int,
              batch_size: int, dtype: str = "float32", num_params: int | None = None,
              device_type: str = "cuda", dropout: float = 0.0, bias: bool = True,
              recompute: str = "none", logits_held: bool = False, tp: int = 1,
              sequence_parallel: bool = False) -> StepPeak:
    """The peak of one training step of the course GPT on one device, for ``batch_size``
    sequences of ``block_size`` tokens in ``dtype`` ("float32", or "bfloat16"/"float16" autocast).
    ``num_params`` defaults to the tied GPT-2 count of this shape.

    With ``tp`` > 1 the activations and the loss are one rank's of a tensor-parallel group (with
    ``sequence_parallel`` as asked): Korthikanti et al.'s Table 2 for the layers, and the
    vocabulary-parallel loss (:mod:`course_lib.parallel.tensor.vocab`), whose peak is the end of
    its forward: the logits, the shifted logits and the softmax (fp32, s b v / tp values each) are
    alive together, and under autocast the 16-bit logits beside their fp32 copy: 8 s b v / tp bytes
    beside the saved softmax's 4 (10 under autocast). Backward's first op reaches the same 12 in
    fp32 (the softmax, the gradient and its product with the incoming one). Measured against the
    live tensors of a real tp = 2 step on a CPU (tests/test_step_peak.py).
    The weights, moments and gradients stay the whole model's: a rank's shards are
    :func:`stage_states`'.

        peak = step_peak(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304,
                         batch_size=12, dtype="bfloat16", device_type="cuda")
        peak.total, peak.parts()      # bytes; where they go

    What a step holds at its highest point, in the order the trainer creates it
    (:func:`course_lib.parallel.step.train_step`, a single process, AdamW, gradients set to None by
    ``zero_grad``):

    * the fp32 weights (4 bytes per parameter) and Adam's two moments (8): the step begins with
      these and no gradients;
    * the activations autograd keeps for backward
      (:func:`course_lib.analysis.activations.trainer_activation_bytes`: Korthikanti et al. 2022, with
      autocast's fp32 residual stream and 16-bit weight copies). They include the fp32 log-probabilities
      of the cross-entropy, 4 s b v bytes (Korthikanti et al. 2022, Sec. 4.3): ``cross_entropy``,
      ``log_softmax`` and ``nll_loss`` run in fp32 whatever the matmuls use (PyTorch documentation,
      "Automatic Mixed Precision package", CUDA ops that can autocast to float32);
    * then backward begins at the loss, and its first two ops each make a (b s, v) fp32 tensor while
      the saved log-probabilities are still alive: the gradient of ``nll_loss`` and that of
      ``log_softmax``, 8 s b v bytes more. This is the peak of a GPT whose vocabulary is large against
      its width (nanoGPT's GPT-2, its vocabulary padded to v = 50304; h = 768): every layer's
      activations plus 12 s b v bytes of loss.
      For GPT-2 small at 12 x 1024 tokens that loss term is 12 * 12 * 1024 * 50304 bytes = 6.9 GiB, more than
      the 12 layers' activations (about 4 GiB in bf16).
    * On a GPU under 16-bit autocast the loss's share is 6 s b v bytes instead of 8, as measured on an
      H200 with torch 2.11 (issue 28, benchmarks/RESULTS.md): after forward the step keeps 2 s b v
      bytes more than the CPU's count (a 16-bit tensor of the logits' size; which op keeps it is not
      pinned down), and its peak comes at ``nll_loss``'s 4-byte gradient, before ``log_softmax``'s
      gradient exists. With that, the model met ``max_memory_allocated`` within 0.2 % for two shapes
      (GPT-2 small at 12 x 1024 tokens: 11.24 GiB; 4 x 512 wide, 8 x 512 tokens) and the live tensors
      at the same op; fp32 on a GPU keeps the CPU's count (not measured there).
    * A caller that keeps the logits (``logits, loss = model(x, y)``, as nanoGPT's train.py does)
      keeps s b v more values (2 bytes under autocast, 4 in fp32) to the peak; the trainer's step
      drops them (``logits_held=False``).

    The other candidate is the end of backward: weights, moments and every gradient (4 bytes per
    parameter) with the activations freed; it wins only for small batches. ``total`` is the larger of
    the two. Not counted: the allocator's rounding and cached blocks, the CUDA context, and the math
    libraries' workspaces (cuBLAS keeps 2 x 32 MiB on Hopper), which a GPU measurement subtracts
    (:mod:`course_lib.experiments.gpu_check`). Checked against the live tensors of a real step
    on a CPU in tests/test_step_peak.py; on a GPU by ``course check-gpu``.
    """
    if dtype not in LOGITS_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(LOGITS_BYTES)}; got {dtype!r}")
    for name, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd),
                        ("block_size", block_size), ("vocab_size", vocab_size), ("batch_size", batch_size),
                        ("tp", tp)):
        check_count(name, value)
    s, b, h, v = block_size, batch_size, n_embd, vocab_size
    if num_params is None:
        num_params = ModelShape("", n_layer, n_head, h, s, v, b, bias).num_params()
    acts = trainer_activation_bytes(n_layer, s, b, h, n_head, v, dtype, recompute, dropout, bias, device_type,
                                    t=tp, sequence_parallel=sequence_parallel)
    sbv = s * b * v / tp
    if tp > 1:  # the vocabulary-parallel loss, see above
        loss = (8.0 if dtype == "float32" else 10.0) * sbv
    else:
        loss = 6.0 * sbv if device_type == "cuda" and dtype != "float32" else 8.0 * sbv
    return StepPeak(weights=4.0 * num_params, optimizer=8.0 * num_params, activations=float(acts),
                    loss_grads=loss, logits=float(LOGITS_BYTES[dtype] * sbv) if logits_held else 0.0,
                    grads=4.0 * num_params)
