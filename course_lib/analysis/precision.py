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
to backward). :func:`course_lib.analysis.activations.autocast_activation_bytes` adds that, and the
fp32 residual stream that autocast's LayerNorms see, to Korthikanti et al.'s 16-bit activation count.
"""

from __future__ import annotations

from dataclasses import dataclass


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
