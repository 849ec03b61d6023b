"""Audit of the course's GPT (course_lib.gpt.model), its checkpoints and the chunked loss: corners
the main tests do not reach, each found failing before its fix."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib.gpt.chunked_loss import chunked_linear_cross_entropy


def _relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()


def test_the_chunked_loss_gradients_survive_fp16_loss_scaling():
    # fp16 autocast with GradScaler's loss scale (2**16): the plain loss's gradient is scaled before
    # it is cast to fp16; the chunked one makes its gradient in forward, so it must not cast the
    # mean's tiny dL/dz (softmax / N, here ~5e-4 / 2048) to fp16, where it underflows.
    g = torch.Generator().manual_seed(0)
    n, c, v = 2048, 4, 2048  # a near-uniform softmax: every dL/dz about 1 / (n v) = 2.4e-7
    x = torch.randn(n, c, generator=g, requires_grad=True)
    w = (0.02 * torch.randn(v, c, generator=g)).requires_grad_()
    t = torch.randint(v, (n,), generator=g)
    ref = torch.autograd.grad(F.cross_entropy(x @ w.T, t), (x, w))  # fp32
    scale = 2.0**16
    errors = {}
    for name, loss_fn in [("plain", lambda: F.cross_entropy(x @ w.T, t, ignore_index=-1)),
                          ("chunked", lambda: chunked_linear_cross_entropy(x, w, t, 4))]:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn()
        grads = torch.autograd.grad(loss * scale, (x, w))
        errors[name] = [_relative_error(gr / scale, r) for gr, r in zip(grads, ref)]
    # plain: ~3e-4 (fp16 rounding) for both gradients; chunked must be as close (it was 1.7e-2)
    for plain, chunked in zip(errors["plain"], errors["chunked"]):
        assert chunked < 2 * plain, errors


def test_the_chunked_loss_passes_gradcheck_in_fp64():
    # torch.autograd.gradcheck, the check of a hand-written backward, runs in float64: the loss must
    # be computed (and returned) in x's float64, not rounded to float32 on the way
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)  # (N, C)
    w = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)  # (V, C)
    t = torch.tensor([0, 4, -1, 2, 2, 1])  # one ignored row
    loss = chunked_linear_cross_entropy(x, w, t, 4)  # chunks of 2, 2, 2
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, F.cross_entropy(x @ w.T, t, ignore_index=-1), rtol=1e-12, atol=0)
    assert torch.autograd.gradcheck(lambda a, b: chunked_linear_cross_entropy(a, b, t, 4), (x, w))
