"""The LM head and cross-entropy fused over row chunks (course_lib.gpt.chunked_loss) equal the plain
head + ``F.cross_entropy``: the loss and every gradient, in fp32 and under bf16 autocast, with
ignored targets, tied weights, gradient accumulation and under torch.compile; and the step's peak
memory drops by more than the logits' size."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from course_lib.experiments.step_memory import measure_step_peak
from course_lib.gpt.chunked_loss import chunked_linear_cross_entropy
from course_lib.gpt.model import GPT, GPTConfig, make_adamw
from course_lib.parallel.step import Precision, train_step
from course_lib.parallel.strategy import build_strategy


def _inputs(seed=0, n=300, c=32, v=97):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, requires_grad=True)
    w = torch.randn(v, c, generator=g, requires_grad=True)
    t = torch.randint(v, (n,), generator=g)
    t[::7] = -1  # ignored rows
    return x, w, t


@pytest.mark.parametrize("chunks", [1, 3, 8, 300, 1000])
def test_the_chunked_loss_and_its_gradients_equal_the_plain_ones(chunks):
    x, w, t = _inputs()
    ref = F.cross_entropy(x @ w.T, t, ignore_index=-1)
    gx, gw = torch.autograd.grad(3.0 * ref, (x, w))  # an incoming gradient other than 1
    loss = chunked_linear_cross_entropy(x, w, t, chunks)
    cx, cw = torch.autograd.grad(3.0 * loss, (x, w))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cx, gx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-7)


def test_bad_shapes_and_chunks_are_refused():
    x, w, t = _inputs()
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        chunked_linear_cross_entropy(x, w, t, 0)
    with pytest.raises(ValueError, match=r"expected x \(N, C\)"):
        chunked_linear_cross_entropy(x, w, t[:-1])
    with pytest.raises(ValueError, match="loss chunks must be >= 0"):
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)).set_loss_chunks(-1)


def test_all_targets_ignored_gives_zero_loss_and_gradients():
    x, w, t = _inputs()
    loss = chunked_linear_cross_entropy(x, w, torch.full_like(t, -1), 4)
    gx, gw = torch.autograd.grad(loss, (x, w))
    assert loss.item() == 0.0 and not gx.any() and not gw.any()


def _steps(chunks: int, dtype: str, steps: int = 3):
    """Three trainer steps (accumulation over 2 micro-batches, clipping) of a tiny GPT; the losses
    and the final weights."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=61, bias=False)
    model = GPT(cfg).set_loss_chunks(chunks)
    strategy = build_strategy("single", model, lambda m: make_adamw(m, lr=1e-2, weight_decay=0.1))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(cfg.vocab_size, (2, 4, cfg.block_size), generator=g)  # (accum, B, T)
    y = torch.randint(cfg.vocab_size, x.shape, generator=g)
    y[0, 0, :5] = -1
    precision = Precision.for_dtype("cpu", dtype)
    losses = [train_step(strategy, x, y, grad_clip=1.0, precision=precision).loss.item() for _ in range(steps)]
    return losses, copy.deepcopy(model.state_dict())


def test_a_gpt_trained_with_the_chunked_loss_equals_the_plain_one():
    ref_losses, ref_state = _steps(0, "float32")
    losses, state = _steps(4, "float32")
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-6)
    # wte is the tied LM head: its gradient is the embedding's plus the head's. Adam divides by the
    # gradient's own size, so float rounding in a near-zero gradient shows as ~1e-6 in a weight
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-4, atol=1e-5, msg=name)


def _grads(chunks: int, dtype=torch.bfloat16, compiled: bool = False) -> tuple[float, dict]:
    """One forward and backward of a tiny GPT (under CPU autocast to ``dtype``): the loss and the gradients."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=61, bias=False)
    model = GPT(cfg).set_loss_chunks(chunks)
    x = torch.randint(cfg.vocab_size, (4, cfg.block_size), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = (torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model)(x, x.roll(-1, 1))[1]
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_under_bf16_autocast_the_gradients_agree_to_bf16_rounding():
    ref_loss, ref = _grads(0)
    loss, got = _grads(4)
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    for name, g in ref.items():  # bf16 keeps 8 bits: relative differences of a few 1e-3
        assert (got[name] - g).norm() <= 1e-2 * g.norm(), name


def test_the_chunked_loss_compiles_and_evaluation_still_gives_logits():
    ref_loss, ref = _grads(0, torch.float32)
    # dynamo and AOTAutograd trace the autograd.Function, with the rest of the model, as one graph
    # (fullgraph: no silent fallback to eager). The aot_eager backend stops before inductor's code
    # generation, which is torch's own and costs ~20 s of C++ compilation on a cold cache here
    loss, got = _grads(4, torch.float32, compiled=True)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)).set_loss_chunks(2)
    idx = torch.randint(32, (2, 8))
    logits, loss = model(idx, idx)
    assert logits is None and loss.requires_grad  # training: no logits at all
    with torch.no_grad():
        logits, loss_eval = model(idx, idx)
    assert logits.shape == (2, 8, 32)
    torch.testing.assert_close(loss_eval, loss.detach())


def test_the_chunked_loss_never_holds_the_logits():
    """What the option is for: the step's peak (live tensors, as lesson 04's measurement) drops by
    more than the fp32 logits' size (B T V x 4 bytes; the plain step also holds their gradient),
    here where the vocabulary dominates."""
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=2048, bias=False)
    batch, logits = 8, 8 * 64 * 2048 * 4
    plain, chunked = (measure_step_peak(cfg, batch, loss_chunks=c)["measured_bytes"] for c in (0, 8))
    assert plain - chunked > logits, (plain, chunked, logits)
