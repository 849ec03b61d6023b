"""A whole GPT-2 training step, kernel by kernel: weakest PRAM model, steps, work, processors.

``step_table(GPTShape())`` classifies and runs every modelled kernel of one step (forward of
the embedding, one transformer block and the head; the backward kernels we model; AdamW) on a
small configuration. ``cost(label, shape)`` gives the same counts by formula, so
``scaling("C", [64, 128, 256])`` shows how steps and work grow with batch, sequence length or
width at sizes too large to simulate. The tests check every formula against the simulator.

Not modelled: layernorm_backward and attention_backward (their weight gradients accumulate
like matmul_backward's; their input gradients are per-row reductions like the forward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from . import kernels as K
from . import kernels_backward as KB
from .classify import classify
from .program import Program

__all__ = ["GPTShape", "StepKernel", "STEP_KERNELS", "step_kernel", "cost", "step_table",
           "scaling", "growth"]


@dataclass(frozen=True)
class GPTShape:
    """Sizes of the modelled step: batch B, sequence T, width C, heads NH, vocabulary V."""

    B: int = 2
    T: int = 4
    C: int = 8
    NH: int = 2
    V: int = 16

    def __post_init__(self):
        for k, v in vars(self).items():
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GPTShape.{k} must be a positive int, got {v!r}")
        if self.C % self.NH:
            raise ValueError(f"C={self.C} must be divisible by NH={self.NH}")

    @property
    def n_params(self) -> int:
        """Parameters of a one-layer GPT-2 of this shape (tied head): what AdamW updates."""
        C = self.C
        return self.V * C + self.T * C + 12 * C * C + 13 * C + 2 * C


Counts = tuple[int, int, int]  # (steps, work, processors)


@dataclass(frozen=True)
class StepKernel:
    """One kernel call of the step: a label, a builder and a cost formula of the shape."""

    label: str
    build: Callable[[GPTShape], Program]
    cost: Callable[[GPTShape], Counts]


def _mm_fwd(C_in: int, OC: int, s: GPTShape) -> Counts:
    BT = s.B * s.T
    return C_in, BT * OC * C_in, BT * OC


def _mm_bwd(C_in: int, OC: int, s: GPTShape) -> Counts:
    BT = s.B * s.T
    return 1 + OC, BT * OC * (C_in + 1) + BT * C_in * OC, BT * OC * (C_in + 1)


def _elementwise(n: int) -> Counts:
    return 1, n, n


def _attention(s: GPTShape) -> Counts:
    hs, pairs = s.C // s.NH, s.T * (s.T + 1) // 2
    return (hs + 3 * s.T + 1, s.B * s.NH * pairs * (hs + 3) + s.B * s.C * pairs,
            max(s.B * s.NH * s.T * s.T, s.B * s.T * s.C))


def _matmuls(fwd: bool) -> list[StepKernel]:
    """The four matmuls of a block and the head, as (label, C_in, OC) of the shape."""
    table = [("qkv", 1, 3), ("attproj", 1, 1), ("fc", 1, 4), ("fcproj", 4, 1), ("lm_head", 1, 0)]
    out = []
    for name, cin, oc in table:
        def dims(s, cin=cin, oc=oc):
            return cin * s.C, (oc * s.C if oc else s.V)
        if fwd:
            out.append(StepKernel(f"matmul_forward ({name})",
                                  lambda s, d=dims: K.matmul_forward(s.B, s.T, *d(s)),
                                  lambda s, d=dims: _mm_fwd(*d(s), s)))
        else:
            out.append(StepKernel(f"matmul_backward ({name})",
                                  lambda s, d=dims: KB.matmul_backward(s.B, s.T, *d(s)),
                                  lambda s, d=dims: _mm_bwd(*d(s), s)))
    return out


def _kernels() -> list[StepKernel]:
    mf, mb = {k.label: k for k in _matmuls(True)}, {k.label: k for k in _matmuls(False)}
    ln = StepKernel("layernorm_forward", lambda s: K.layernorm_forward(s.B, s.T, s.C),
                    lambda s: (2 * s.C + 2, 3 * s.B * s.T * s.C + s.B * s.T, s.B * s.T * s.C))
    res = StepKernel("residual_forward", lambda s: K.residual_forward(s.B * s.T * s.C),
                     lambda s: _elementwise(s.B * s.T * s.C))
    return [
        StepKernel("encoder_forward", lambda s: K.encoder_forward(s.B, s.T, s.C, s.V),
                   lambda s: _elementwise(s.B * s.T * s.C)),
        ln, mf["matmul_forward (qkv)"],
        StepKernel("attention_forward", lambda s: K.attention_forward(s.B, s.T, s.C, s.NH),
                   _attention),
        mf["matmul_forward (attproj)"], res, ln, mf["matmul_forward (fc)"],
        StepKernel("gelu_forward", lambda s: K.gelu_forward(4 * s.B * s.T * s.C),
                   lambda s: _elementwise(4 * s.B * s.T * s.C)),
        mf["matmul_forward (fcproj)"], res, ln, mf["matmul_forward (lm_head)"],
        StepKernel("softmax_crossentropy_forward",
                   lambda s: K.softmax_crossentropy_forward(s.B, s.T, s.V),
                   lambda s: (2 * s.V + 2, 3 * s.B * s.T * s.V + s.B * s.T, s.B * s.T * s.V)),
        StepKernel("crossentropy_backward", lambda s: KB.crossentropy_backward(s.B, s.T, s.V),
                   lambda s: _elementwise(s.B * s.T * s.V)),
        mb["matmul_backward (lm_head)"], mb["matmul_backward (fcproj)"],
        StepKernel("gelu_backward", lambda s: KB.gelu_backward(4 * s.B * s.T * s.C),
                   lambda s: _elementwise(4 * s.B * s.T * s.C)),
        mb["matmul_backward (fc)"], mb["matmul_backward (attproj)"],
        mb["matmul_backward (qkv)"],
        StepKernel("encoder_backward", lambda s: KB.encoder_backward(s.B, s.T, s.C, s.V),
                   lambda s: (1, 2 * s.B * s.T * s.C, s.B * s.T * s.C)),
        StepKernel("adamw_update", lambda s: KB.adamw_update(s.n_params),
                   lambda s: _elementwise(s.n_params)),
    ]


#: The kernel calls of one step, in execution order (a label may appear more than once).
STEP_KERNELS: tuple[StepKernel, ...] = tuple(_kernels())


def step_kernel(label: str) -> StepKernel:
    """The :class:`StepKernel` called ``label``, e.g. ``"matmul_forward (qkv)"``."""
    for k in STEP_KERNELS:
        if k.label == label:
            return k
    labels = ", ".join(dict.fromkeys(k.label for k in STEP_KERNELS))
    raise ValueError(f"unknown kernel {label!r}; choose one of: {labels}")


def cost(label: str, shape: GPTShape = GPTShape()) -> dict:
    """``{"steps", "work", "processors"}`` of kernel ``label`` at ``shape``, by formula."""
    steps, work, procs = step_kernel(label).cost(shape)
    return {"steps": steps, "work": work, "processors": procs}


def step_table(shape: GPTShape = GPTShape(), distinct: bool = True) -> list[dict]:
    """Rows ``{kernel, model, steps, work, processors, reason}`` for one training step,
    classified and counted by the simulator; ``distinct=False`` repeats kernels called twice.
    A last row totals steps and work (kernels run one after another)."""
    rows, seen = [], {}
    for k in STEP_KERNELS:
        if k.label not in seen:
            v = classify(k.build(shape))
            seen[k.label] = {"kernel": k.label, "model": v.model, "steps": v.result.steps,
                             "work": v.result.work, "processors": v.result.processors,
                             "reason": v.reason}
            rows.append(seen[k.label])
        elif not distinct:
            rows.append(seen[k.label])
    rows.append({"kernel": "total" + (" (distinct kernels)" if distinct else ""), "model": "",
                 "steps": sum(r["steps"] for r in rows), "work": sum(r["work"] for r in rows),
                 "processors": max(r["processors"] for r in rows), "reason": ""})
    return rows


def _check_dim(dim: str) -> None:
    """One of the step's sizes: B, T, C, NH or V."""
    if dim not in ("B", "T", "C", "NH", "V"):
        raise ValueError(f"dim must be one of B, T, C, NH, V (got {dim!r})")


def scaling(dim: str, values: Sequence[int], shape: GPTShape = GPTShape(),
            kernels: Sequence[str] | None = None) -> list[dict]:
    """Steps and work of each kernel as ``dim`` ("B", "T", "C", "NH" or "V") takes ``values``,
    the other sizes as in ``shape``: rows ``{kernel, dim: value, steps, work, processors}``."""
    _check_dim(dim)
    labels = kernels or list(dict.fromkeys(k.label for k in STEP_KERNELS))
    rows = []
    for label in labels:
        for v in values:
            rows.append({"kernel": label, dim: v, **cost(label, replace(shape, **{dim: v}))})
    return rows


def growth(dim: str, lo: int, hi: int, shape: GPTShape = GPTShape()) -> list[dict]:
    """How each kernel grows when ``dim`` goes from ``lo`` to ``hi``: the exponent k in
    ``steps ~ dim^k`` and ``work ~ dim^k`` (log ratio, rounded to 0.1)."""
    _check_dim(dim)
    if not 1 <= lo < hi:
        raise ValueError(f"need 1 <= lo < hi, got lo={lo}, hi={hi}")
    rows, span = [], math.log(hi / lo)
    for label in dict.fromkeys(k.label for k in STEP_KERNELS):
        a, b = cost(label, replace(shape, **{dim: lo})), cost(label, replace(shape, **{dim: hi}))
        rows.append({"kernel": label,
                     "steps_exponent": round(math.log(b["steps"] / a["steps"]) / span, 1),
                     "work_exponent": round(math.log(b["work"] / a["work"]) / span, 1)})
    return rows
