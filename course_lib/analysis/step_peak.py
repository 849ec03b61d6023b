"""The peak memory of one training step of the course GPT, activations included.

    peak = step_peak(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304,
                     batch_size=12, dtype="bfloat16", device_type="cuda")
    peak.total, peak.parts()      # bytes; where they go

What a step holds at its highest point, in the order the trainer creates it
(:func:`course_lib.parallel.step.train_step`, a single process, AdamW, gradients set to None by
``zero_grad``):

* the fp32 weights (4 bytes per parameter) and Adam's two moments (8): the step begins with
  these and no gradients;
* the activations autograd keeps for backward
  (:func:`course_lib.analysis.precision.trainer_activation_bytes`: Korthikanti et al. 2022, with
  autocast's fp32 residual stream and 16-bit weight copies). They include the fp32 log-probabilities
  of the cross-entropy, 4 s b v bytes (Korthikanti et al. 2022, Sec. 4.3): ``cross_entropy``,
  ``log_softmax`` and ``nll_loss`` run in fp32 whatever the matmuls use (PyTorch documentation,
  "Automatic Mixed Precision package", CUDA ops that can autocast to float32);
* then backward begins at the loss, and its first two ops each make a (b s, v) fp32 tensor while
  the saved log-probabilities are still alive: the gradient of ``nll_loss`` and that of
  ``log_softmax``, 8 s b v bytes more. This is the peak of a GPT whose vocabulary is large against
  its width (GPT-2: v = 50304, h = 768): every layer's activations plus 12 s b v bytes of loss.
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

from __future__ import annotations

from dataclasses import dataclass

from course_lib.analysis.memory import ModelShape
from course_lib.analysis.precision import trainer_activation_bytes

LOGITS_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class StepPeak:
    """Bytes of one step's peak, by what holds them."""

    weights: float  # fp32 parameters
    optimizer: float  # Adam's exp_avg and exp_avg_sq, fp32
    activations: float  # kept for backward, the fp32 log-probabilities included
    loss_grads: float  # the two fp32 (b s, v) gradients at the start of backward
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
              recompute: str = "none", logits_held: bool = False) -> StepPeak:
    """The peak of one training step of the course GPT on one device, for ``batch_size``
    sequences of ``block_size`` tokens in ``dtype`` ("float32", or "bfloat16"/"float16" autocast).
    ``num_params`` defaults to the tied GPT-2 count of this shape."""
    if dtype not in LOGITS_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(LOGITS_BYTES)}; got {dtype!r}")
    for name, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd),
                        ("block_size", block_size), ("vocab_size", vocab_size), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    s, b, h, v = block_size, batch_size, n_embd, vocab_size
    if num_params is None:
        num_params = ModelShape("", n_layer, n_head, h, s, v, b, bias).num_params()
    acts = trainer_activation_bytes(n_layer, s, b, h, n_head, v, dtype, recompute, dropout, bias, device_type)
    sbv = s * b * v
    loss = 6.0 * sbv if device_type == "cuda" and dtype != "float32" else 8.0 * sbv  # see the module docstring
    return StepPeak(weights=4.0 * num_params, optimizer=8.0 * num_params, activations=float(acts),
                    loss_grads=loss, logits=float(LOGITS_BYTES[dtype] * sbv) if logits_held else 0.0,
                    grads=4.0 * num_params)
