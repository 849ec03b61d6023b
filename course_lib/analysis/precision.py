"""Number formats of mixed-precision training and where the bytes go: closed forms, no torch needed.

    from course_lib.analysis.precision import FORMATS, number_format_rows, state_bytes_per_param

Formats (sign, exponent and mantissa bits; the range follows from them): IEEE 754 binary32 (fp32)
and binary16 (fp16); NVIDIA's TensorFloat-32 (tf32: fp32's 8 exponent bits, fp16's 10 mantissa
bits, a matmul input format of A100/H100 tensor cores, NVIDIA A100 whitepaper 2020); Google Brain's
bfloat16 (bf16: fp32's exponent, 7 mantissa bits), designed for TPUs (Wang and Kanwar 2019,
"BFloat16: The secret to high performance on Cloud TPUs", Google Cloud blog) and shown to train
networks to fp32 accuracy by Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning
Training" (arXiv:1905.12322), who studied it and did not introduce it; the two
FP8 formats of Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (arXiv:2209.05433): E4M3
(max 448, no infinities, one NaN pattern) and E5M2 (max 57344, IEEE-like). For a format with E
exponent bits (bias 2^(E-1) - 1) and M mantissa bits:

    smallest normal      2^(1 - bias)
    smallest subnormal   2^(1 - bias - M)
    machine epsilon      2^-M                      (the gap after 1.0)
    largest finite       (2 - 2^-M) 2^bias         (E4M3: 1.75 x 2^8 = 448, its top code is NaN)

Mixed-precision training (Micikevicius et al. 2018, "Mixed Precision Training", ICLR,
arXiv:1710.03740): 16-bit weights, activations and gradients, an fp32 master copy of the weights
for the update, and loss scaling so small fp16 gradients do not flush to zero (Sec. 3.2 and
Fig. 3: many of a Multibox SSD model's activation-gradient values lay below fp16's smallest
subnormal, 2^-24, and would become zeros, while much of fp16's range went unused). The ZeRO paper's
accounting of that recipe is 2 + 2 + 12 bytes per parameter (:mod:`course_lib.analysis.memory`).
``torch.autocast`` holds the bytes differently: the parameters and their gradients stay fp32 (4 + 4),
Adam's moments 8, and each matmul casts its weight to 16 bits during forward and keeps that copy
for backward (2 bytes per matmul parameter, an activation-like cost that lives only from forward
to backward). :func:`autocast_activation_bytes` adds that, and the fp32 residual stream that
autocast's LayerNorms see, to Korthikanti et al.'s 16-bit activation count.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.analysis.activations import activation_bytes


@dataclass(frozen=True)
class NumberFormat:
    """A binary floating-point format: 1 sign bit, ``exponent`` and ``mantissa`` bits."""

    name: str
    exponent: int
    mantissa: int
    ieee_max: bool = True  # False for E4M3: its all-ones exponent still holds numbers (no inf)
    source: str = ""

    @property
    def bits(self) -> int:
        return 1 + self.exponent + self.mantissa

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent - 1) - 1

    @property
    def max(self) -> float:
        if self.ieee_max:  # the top exponent is reserved for inf/NaN
            return (2 - 2.0 ** -self.mantissa) * 2.0 ** self.bias
        # E4M3: the top exponent is used, only its all-ones mantissa is NaN (Micikevicius 2022, Table 1)
        return (2 - 2.0 ** (1 - self.mantissa)) * 2.0 ** (self.bias + 1)

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa)

    @property
    def eps(self) -> float:
        return 2.0 ** -self.mantissa

    def row(self) -> dict:
        return {"format": self.name, "bits": self.bits, "exponent": self.exponent,
                "mantissa": self.mantissa, "max": self.max, "smallest normal": self.smallest_normal,
                "smallest subnormal": self.smallest_subnormal, "eps": self.eps, "source": self.source}


FORMATS: dict[str, NumberFormat] = {f.name: f for f in (
    NumberFormat("fp32", 8, 23, source="IEEE 754 binary32"),
    NumberFormat("tf32", 8, 10, source="NVIDIA A100 whitepaper (tensor-core input)"),
    NumberFormat("bf16", 8, 7, source="Google Brain (Wang and Kanwar 2019)"),
    NumberFormat("fp16", 5, 10, source="IEEE 754 binary16"),
    NumberFormat("fp8_e5m2", 5, 2, source="Micikevicius et al. 2022"),
    NumberFormat("fp8_e4m3", 4, 3, ieee_max=False, source="Micikevicius et al. 2022"),
)}

# torch dtype names of the formats torch has (tf32 is a matmul mode, not a storage dtype)
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
                "fp8_e5m2": "float8_e5m2", "fp8_e4m3": "float8_e4m3fn"}


def number_format_rows() -> list[dict]:
    """One row per format, widest first: bits, max, smallest normal and subnormal, epsilon."""
    return [f.row() for f in FORMATS.values()]


# bytes per parameter: (weights, gradients, optimizer states) of each way of holding them
STATE_LAYOUTS: dict[str, tuple[int, int, int]] = {
    "fp32": (4, 4, 8),  # fp32 weights and gradients, Adam m and v
    "zero_mixed": (2, 2, 12),  # ZeRO paper Sec. 3.1: 16-bit weights/grads, fp32 master + m + v
    "autocast": (4, 4, 8),  # torch.autocast: fp32 weights and grads (the master), m and v
}


def state_bytes_per_param(layout: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter for a layout in :data:`STATE_LAYOUTS`."""
    if layout not in STATE_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(STATE_LAYOUTS)}; got {layout!r}")
    return STATE_LAYOUTS[layout]


def matmul_params(n_layer: int, h: int, v: int, bias: bool = True) -> tuple[int, int]:
    """(per layer, output layer) parameters that autocast casts to 16 bits in a GPT: the four
    Linear weights of a block, 12 h^2 (+ 9 h of biases), and the tied v x h output matrix."""
    return 12 * h * h + (9 * h if bias else 0), v * h


def autocast_activation_bytes(n_layer: int, s: int, b: int, h: int, a: int, v: int,
                              recompute: str = "none", dropout: bool = True,
                              flash_attention: bool = False, bias: bool = True,
                              low_bytes: int = 2) -> float:
    """Bytes autograd keeps from forward to backward under ``torch.autocast`` (16-bit matmuls).

    Korthikanti et al. 2022's count with 2-byte values (:func:`activation_bytes`), plus what
    autocast holds in 4 bytes instead: the residual stream that each LayerNorm saves stays fp32
    (+2 sbh per LayerNorm: two per layer and the final one; with full recomputation the kept
    layer input is fp32, +2 sbh per layer), plus the 16-bit copies of the matmul weights that
    autocast makes in forward and backward needs (2 bytes per matmul parameter; recomputed, not
    kept, inside a fully recomputed block).
    """
    extra_bytes = 4 - low_bytes  # an fp32 tensor where the count assumes a 16-bit one
    per_layer_w, head_w = matmul_params(n_layer, h, v, bias)
    sbh = s * b * h
    base = activation_bytes(n_layer, s, b, h, a, v, recompute=recompute, bytes_per_value=low_bytes,
                            dropout=dropout, flash_attention=flash_attention)
    if recompute == "full":
        per_layer_extra = extra_bytes * sbh  # the fp32 block input
    else:
        per_layer_extra = 2 * extra_bytes * sbh + low_bytes * per_layer_w
    return base + n_layer * per_layer_extra + extra_bytes * sbh + low_bytes * head_w


def sdpa_is_fused(device_type: str, dropout: float) -> bool:
    """Whether the trainer's ``scaled_dot_product_attention`` runs a fused kernel that keeps no
    s x s scores for backward: on CUDA always (flash, cuDNN or memory-efficient), on a CPU only
    without dropout (with dropout it takes the unfused math path)."""
    return device_type == "cuda" or dropout == 0.0


def trainer_activation_bytes(n_layer: int, s: int, b: int, h: int, a: int, v: int, dtype: str,
                             recompute: str = "none", dropout: float = 0.0,
                             bias: bool = True, device_type: str = "cpu") -> float:
    """The activation model for a course trainer run: fp32 -> Korthikanti with 4-byte values,
    bfloat16/float16 -> :func:`autocast_activation_bytes`, the attention's scores kept unless
    :func:`sdpa_is_fused` (a CPU with dropout keeps more than the paper counts: the model is then
    ~10-60 % low, see tests/test_precision.py)."""
    flash = sdpa_is_fused(device_type, dropout)
    if dtype == "float32":
        return activation_bytes(n_layer, s, b, h, a, v, recompute=recompute, bytes_per_value=4,
                                dropout=dropout > 0, flash_attention=flash)
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16; got {dtype!r}")
    return autocast_activation_bytes(n_layer, s, b, h, a, v, recompute, dropout > 0, flash, bias)


def selective_overhead(s: int, h: int, v: int = 0, n_layer: int = 1) -> float:
    """Extra FLOPs of selective recomputation as a share of a training step's model FLOPs:
    Korthikanti et al. 2022, Sec. 5, model FLOPs 72 B L s h^2 (1 + s/6h + V/12hL), of which
    recomputing the attention core adds 72 B L s h^2 (s/6h): (s/6h) / (1 + s/6h + V/12hL)
    (2.7% for GPT-3 175B, their Table 4's setting)."""
    core = s / (6 * h)
    return core / (1 + core + v / (12 * h * n_layer))


def recompute_flops_factor(recompute: str, s: int = 1024, h: int = 768, v: int = 0,
                           n_layer: int = 1) -> float:
    """Training FLOPs relative to no recomputation. Forward is 2N and backward 4N per token
    (Kaplan et al. 2020), so recomputing every block's forward adds 2N / 6N = 1/3 ("full";
    Narayanan et al. 2021's 96 B s L h^2 against 72); "selective" adds only the attention core
    (:func:`selective_overhead`)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full; got {recompute!r}")
    return {"none": 1.0, "full": 4 / 3,
            "selective": 1.0 + selective_overhead(s, h, v, n_layer)}[recompute]
