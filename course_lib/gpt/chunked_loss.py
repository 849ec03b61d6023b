"""The LM head and the cross-entropy in one pass over row chunks, gradients computed in forward.

    loss = chunked_linear_cross_entropy(x, weight, targets, chunks=8)   # x (N, C), weight (V, C), targets (N,)

equals ``F.cross_entropy(x @ weight.T, targets, ignore_index=-1)`` in value and in the gradients
of ``x`` and ``weight``, without ever holding the full (N, V) logits or their gradient: each chunk
of rows makes its logits (n, V), its log-sum-exp, its share of the loss and the gradient
softmax - onehot of its logits, then at once its rows of dL/dx = g W and its part of dL/dW = g^T x.
Backward only scales the two saved gradients by the incoming one. GPT-2 small's head at 12 x 1024
tokens and a 50,304-word vocabulary has 1.24 GB of bf16 logits; a chunk holds 1/chunks of them.

Why the gradient is softmax - onehot: for one row, L = lse(z) - z_t, so dL/dz_j = softmax(z)_j - [j = t]
(the mean over the N' counted rows divides it by N'). The trick of fusing the head with the loss
and chunking over rows is Liger Kernel's "fused linear cross entropy" (Hsu et al. 2024, "Liger
Kernel: Efficient Triton Kernels for LLM Training", arXiv:2410.10989, Sec. 3.2); this is the plain
PyTorch form of the idea, left to ``torch.compile`` to fuse.

What it buys is memory, not time. On the CPU (tests/test_chunked_loss.py) a step of a 1-layer,
32-wide model with a 2,048-word vocabulary peaks at 4.4 MiB of tensors instead of 14.1 MiB. On an
H200 with ``torch.compile``, GPT-2 small's step took 26.43 ms against the plain 25.48 ms
(benchmarks/RESULTS.md), so the course's default stays the plain head and loss.

Under autocast the matrix multiplies run in the autocast dtype, as ``nn.Linear`` would, and the
softmax, the loss and the weight gradient's sum over chunks in fp32 (fp64 for fp64 inputs, so
``torch.autograd.gradcheck`` applies). Under fp16 the saved gradients are kept near 1 in size, not
divided by the token count, until backward brings the loss scale. Rows whose target is -1 are
ignored (``ignore_index=-1``, the course's convention).
"""

from __future__ import annotations

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` would multiply in here: autocast's, where it is on, else x's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``x @ weight.T`` against ``targets``; see the module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):  # the casts are explicit below
            xc, wc = x.to(dtype), weight.to(dtype)  # (N, C), (V, C)
            acc = torch.promote_types(dtype, torch.float32)  # softmax, loss, sums: fp32, or fp64 for fp64
            valid = targets != -1  # (N,)
            count = valid.sum().clamp(min=1).to(acc)  # the rows the mean is over
            # a power of two >= count: the saved gradients are the mean's times it, scaled back in
            # backward, where the loss scale comes too. Exact (a power of two only moves the exponent),
            # and it keeps softmax / count (e.g. 1e-5 / 12,288 tokens) from underflowing in fp16
            unit = torch.exp2(torch.ceil(torch.log2(count)))
            loss = torch.zeros((), device=x.device, dtype=acc)
            grad_x = torch.empty_like(xc)  # (N, C) in the compute dtype, as Linear's backward makes it
            grad_w = torch.zeros(weight.shape, device=x.device, dtype=acc)  # (V, C), summed in fp32 (or fp64)
            n = -(-x.shape[0] // chunks)  # rows per chunk (the last may have fewer)
            for lo in range(0, x.shape[0], n):
                hi = min(lo + n, x.shape[0])
                logits = (xc[lo:hi] @ wc.T).to(acc)  # (n, V)
                t, keep = targets[lo:hi].clamp(min=0), valid[lo:hi]
                lse = torch.logsumexp(logits, dim=-1)  # (n,)
                picked = logits.gather(1, t[:, None]).squeeze(1)  # z_t, (n,)
                loss = loss + torch.where(keep, lse - picked, 0.0).sum()
                g = torch.exp(logits - lse[:, None])  # softmax, (n, V)
                g.scatter_add_(1, t[:, None], torch.full_like(picked[:, None], -1.0))  # - onehot
                g = (g * (keep.to(acc) / count * unit)[:, None]).to(dtype)  # unit x dL/dz, ignored rows 0
                grad_x[lo:hi] = g @ wc  # (n, C)
                grad_w += (g.T @ xc[lo:hi]).to(acc)  # (V, C)
        ctx.save_for_backward(grad_x, grad_w, unit)
        ctx.dtypes = (x.dtype, weight.dtype)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_w, unit = ctx.saved_tensors  # unit times the mean's gradients
        x_dtype, w_dtype = ctx.dtypes
        scale = grad_loss / unit  # 0-dim: it does not change the dtype of what it scales
        return grad_x.to(x_dtype) * scale, (grad_w * scale).to(w_dtype), None, None


def chunked_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 chunks: int = 8) -> torch.Tensor:
    """``F.cross_entropy(x @ weight.T, targets, ignore_index=-1)`` over ``chunks`` row chunks.
    x (N, C), weight (V, C), targets (N,) int64."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if x.dim() != 2 or targets.shape != x.shape[:1] or weight.shape[1] != x.shape[1]:
        raise ValueError(f"expected x (N, C), weight (V, C), targets (N,); got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    return ChunkedLinearCrossEntropy.apply(x, weight, targets, min(chunks, x.shape[0]))
