"""Tensor parallelism equals one process: the course's split product, Megatron's MLP and a GPT
with tied embeddings whose blocks are split across 2 and 4 gloo ranks (and 3 for the example).

Every rank sees the same batch (tensor parallelism splits the layers, not the data). After 10
AdamW steps the loss must equal the reference's and each rank's shards must equal the same
shards cut from the reference model, to ~1e-6 (1e-4 for the float32 GPT's parameters after 10
AdamW steps, 1e-10 for the same run in float64: see the test). Shapes that do not divide are clear errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from course_lib.gpt.model import GPT, MLP, GPTConfig
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.comms import Comms
from course_lib.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelMLP,
    split_matmul_example,
    tensor_parallel_gpt,
)
from course_lib.parallel.toy import adamw

STEPS, TOL = 10, 1e-6
# bias=False for the GPT: see tests/test_parallel_data.py (the key bias has a zero gradient)
GPT_CFG = GPTConfig(block_size=8, vocab_size=29, n_layer=2, n_head=4, n_embd=16, bias=False)
MLP_CFG = GPTConfig(n_embd=12, n_head=1, n_layer=1, bias=True)  # 12 -> 48 -> 12: tp 2, 3, 4


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def train(model, batches, loss_fn):
    opt = adamw(model, lr=3e-3)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def mlp_loss(model, x, y):
    return F.mse_loss(model(x), y)


def gpt_loss(model, x, y):
    return model(x, y)[1]


def tp_worker(rank: int, world_size: int) -> dict:
    comms = Comms()
    out = {}
    # the course's example: y = x0 W0 + x1 W1 (+ x2 W2 ...), rank i holding W_i
    g = torch.Generator().manual_seed(0)
    x, W = torch.randn(5, 12, generator=g), torch.randn(12, 7, generator=g)
    out["example"] = (split_matmul_example(x, W, comms) - x @ W).abs().max().item()

    # Megatron's MLP, with biases
    torch.manual_seed(0)
    ref = MLP(MLP_CFG)
    tp = TensorParallelMLP(copy.deepcopy(ref.c_fc), copy.deepcopy(ref.c_proj), comms)
    batches = [(torch.randn(6, 4, 12, generator=g), torch.randn(6, 4, 12, generator=g))
               for _ in range(STEPS)]
    ref_losses, tp_losses = train(ref, batches, mlp_loss), train(tp, batches, mlp_loss)
    out["mlp loss"] = max(abs(a - b) for a, b in zip(ref_losses, tp_losses))
    ref_sharded = TensorParallelMLP(ref.c_fc, ref.c_proj, comms)  # the reference, cut the same way
    out["mlp params"] = max_diff(tp.state_dict(), ref_sharded.state_dict())
    out["mlp shapes"] = (tuple(tp.c_fc.weight.shape), tuple(tp.c_proj.weight.shape))

    # GPT with tied wte / lm_head: blocks split, the rest replicated
    batches = []
    for _ in range(STEPS):
        idx = torch.randint(0, GPT_CFG.vocab_size, (4, GPT_CFG.block_size + 1), generator=g)
        batches.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        ref = GPT(GPT_CFG).to(dtype)
        try:
            tp = tensor_parallel_gpt(copy.deepcopy(ref), comms)
        except ValueError as e:  # tp = 3 does not divide n_head = 4
            out["gpt error"] = str(e)
            return out
        ref_losses, tp_losses = train(ref, batches, gpt_loss), train(tp, batches, gpt_loss)
        name = str(dtype).split(".")[1]
        out[f"gpt loss {name}"] = max(abs(a - b) / a for a, b in zip(ref_losses, tp_losses))
        out[f"gpt params {name}"] = max_diff(tp.state_dict(),
                                             tensor_parallel_gpt(ref, comms).state_dict())
    out["gpt tied"] = tp.lm_head.weight is tp.transformer.wte.weight
    comms.reset()
    gpt_loss(tp, *batches[0]).backward()
    out["gpt all-reduces per step"] = comms.calls["all_reduce"]
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_tensor_parallel_equals_single_process(world_size):
    for rank, res in enumerate(run_ranks(tp_worker, world_size)):
        assert res["example"] < 1e-5, res
        assert res["mlp loss"] < TOL and res["mlp params"] < TOL, res
        assert res["mlp shapes"] == ((48 // world_size, 12), (12, 48 // world_size))
        if world_size == 3:
            assert "n_head (4) must be divisible by the tensor-parallel size" in res["gpt error"]
            continue
        assert res["gpt loss float32"] < TOL, (rank, res)  # relative: the loss is about 3.4
        # Split matmuls sum in another order (rounding ~1e-8 in the first step's gradients).
        # AdamW divides each gradient element by its own running magnitude, so for elements with
        # small gradients that rounding becomes a relative error of the update, and over 10 steps
        # the fp32 parameters drift apart by up to ~1e-4 (proportional to lr; 2 ranks: ~1e-5).
        # In float64 the same run agrees to 1e-10: the computation itself is exact.
        assert res["gpt params float32"] < 100 * TOL, (rank, res)
        assert res["gpt params float64"] < 1e-10, (rank, res)
        assert res["gpt tied"]
        # Megatron, Sec. 3: two all-reduces in forward and two in backward per transformer layer
        assert res["gpt all-reduces per step"] == 4 * GPT_CFG.n_layer


def test_shapes_that_do_not_divide_are_clear_errors():
    class FakeComms:  # the layers only need the group's size and this rank
        rank, world_size = 0, 4

    with pytest.raises(ValueError, match=r"out_features of a column-parallel linear \(10\) must be "
                                         r"divisible by the tensor-parallel size tp_world_size \(4\)"):
        ColumnParallelLinear(8, 10, FakeComms())
    with pytest.raises(ValueError, match=r"in_features of a row-parallel linear \(6\)"):
        RowParallelLinear(6, 8, FakeComms())
    with pytest.raises(ValueError, match=r"the inner dimension d of x W \(6\)"):
        split_matmul_example(torch.zeros(2, 6), torch.zeros(6, 3), FakeComms())
