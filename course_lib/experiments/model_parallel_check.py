"""The experiments of notebook 5, each run on every rank of a process group and compared with one
process computing the same thing.

    from course_lib.launch import notebook_launcher
    from course_lib.experiments.model_parallel_check import compare_split_weights
    results = notebook_launcher(compare_split_weights, (64, 96, 48), nproc=3)   # a list, one dict per rank

* :func:`chain_matmul`: the split-weights example y = x0 W0 + x1 W1 + x2 W2 as in the diagram
  ``model_parallel_split``: rank i holds only W_i, adds its term to the partial sum it receives
  from rank i-1 and sends the result on. Memory per rank 1/N of W, but the ranks work one after
  the other (this is what pipeline parallelism then fills with micro-batches).
* The same product with all ranks working at once and one all-reduce
  (:func:`course_lib.parallel.tensor.layers.split_matmul_example`): tensor parallelism.
  :func:`compare_split_weights` runs both and compares them with x @ W on one process.
* :func:`compare_tensor_parallel`: Megatron's MLP and a whole GPT split over the ranks, against the
  unsplit model: same outputs and gradients, 1/N of the big matrices per rank, and the number of
  all-reduces in forward and backward (Shoeybi et al. 2019, Sec. 3: two per block each way).
* :func:`measure_pipeline_bubble`: a GPT cut into pipeline stages, the bubble of each schedule
  against the number of micro-batches (drawn by :func:`course_lib.notebook.plots.plot_pipeline_bubble`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from course_lib.gpt.model import GPT, GPTConfig
from course_lib.parallel.comms import Comms
from course_lib.parallel.pipeline.schedules import Pipeline, gpt_stage
from course_lib.parallel.tensor.layers import TensorParallelMLP, split_matmul_example, tensor_parallel_gpt


def chain_matmul(x: torch.Tensor, W: torch.Tensor, comms: Comms) -> torch.Tensor:
    """y = x W = sum_i x_i W_i computed one rank after the other; rank i uses only its block W_i.

    x: (B, d) with its d columns cut into N blocks; W: (d, out) cut into the matching N row blocks.
    Rank 0 computes y_0 = x_0 W_0 and sends it to rank 1, which adds x_1 W_1, and so on. Every rank
    returns the partial sum it produced: the last rank's is y.
    """
    n, rank = comms.world_size, comms.rank
    if W.shape[0] % n:
        raise ValueError(f"the inner dimension d = {W.shape[0]} must divide into {n} ranks")
    d = W.shape[0] // n
    rows = slice(rank * d, (rank + 1) * d)
    y = x[:, rows] @ W[rows]  # this rank's term x_i W_i, (B, out)
    if rank > 0:
        received = torch.empty_like(y)
        comms.recv(received, src=rank - 1)  # y_{i-1}: wait for the previous rank
        y = received + y
    if rank < n - 1:
        comms.send(y, dst=rank + 1)
    return y


def compare_split_weights(batch: int, d: int, out: int, repeats: int = 3, seed: int = 0) -> dict:
    """Run both versions of the split-weights example; compare with x @ W on one process.

    Returns, for this rank: the largest difference from the one-process result, the bytes of W
    it needs, the bytes it sent, and the time of each version (best of ``repeats``).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    x, W = torch.randn(batch, d, generator=g), torch.randn(d, out, generator=g)  # same on every rank
    reference = x @ W
    out_ = {"rank": rank, "W bytes (whole)": W.numel() * W.element_size(),
            "W bytes (this rank)": W.numel() * W.element_size() // n}
    for name, fn in (("chain", chain_matmul), ("all_reduce", split_matmul_example)):
        comms = Comms()
        best = float("inf")
        for _ in range(repeats):
            comms.reset()
            dist.barrier()
            t0 = time.perf_counter()
            y = fn(x, W, comms)
            best = min(best, time.perf_counter() - t0)
        has_y = name == "all_reduce" or rank == n - 1  # in the chain only the last rank has y
        out_[f"{name}: max |y - xW|"] = (y - reference).abs().max().item() if has_y else None
        out_[f"{name}: sent bytes"] = comms.sent_bytes
        out_[f"{name}: ms"] = 1e3 * best
    return out_


def compare_tensor_parallel(n_embd: int = 64, n_head: int = 4, n_layer: int = 2, batch: int = 4,
                         block_size: int = 32, seed: int = 0) -> dict:
    """Split a GPT's MLP, then the whole GPT, over the ranks; compare with the unsplit model.

    Returns this rank's: max output and input-gradient differences for the MLP, the forward and
    backward all-reduce counts of one MLP, the loss of the split and unsplit GPT, the largest
    gradient difference (a split weight against the matching slice of the full gradient is
    checked through the LayerNorm and embedding gradients, which are replicated), and the
    parameter bytes per rank of both.
    """
    rank = dist.get_rank()
    comms = Comms()
    cfg = GPTConfig(block_size=block_size, vocab_size=65, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd, bias=True)
    torch.manual_seed(seed)  # the same full model on every rank; each keeps its slices
    full = GPT(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, block_size, n_embd, generator=g, requires_grad=True)

    # --- one MLP: column-parallel c_fc, row-parallel c_proj --------------------------------------
    mlp = full.transformer.h[0].mlp
    y_ref = mlp(x)
    (gx_ref,) = torch.autograd.grad(y_ref.sum(), x)
    tp_mlp = TensorParallelMLP(mlp.c_fc, mlp.c_proj, comms)
    comms.reset()
    y = tp_mlp(x)
    forward_calls = dict(comms.calls)
    comms.reset()
    (gx,) = torch.autograd.grad(y.sum(), x)
    backward_calls = dict(comms.calls)
    result = {"rank": rank,
              "mlp: max |y - y_ref|": (y - y_ref).abs().max().item(),
              "mlp: max |dx - dx_ref|": (gx - gx_ref).abs().max().item(),
              "mlp: all-reduces forward": forward_calls.get("all_reduce", 0),
              "mlp: all-reduces backward": backward_calls.get("all_reduce", 0),
              "mlp: c_fc weight shape (this rank)": tuple(tp_mlp.c_fc.weight.shape),
              "mlp: c_fc weight shape (whole)": tuple(mlp.c_fc.weight.shape)}

    # --- the whole GPT ---------------------------------------------------------------------------
    idx = torch.randint(0, cfg.vocab_size, (batch, block_size + 1), generator=g)
    inputs, targets = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    torch.manual_seed(seed)
    reference = GPT(cfg)
    ref_loss = reference(inputs, targets)[1]
    ref_loss.backward()
    param_bytes_full = sum(p.numel() * p.element_size() for p in reference.parameters())
    torch.manual_seed(seed)
    model = tensor_parallel_gpt(GPT(cfg), comms)
    comms.reset()
    loss = model(inputs, targets)[1]
    gpt_forward = comms.calls.get("all_reduce", 0)
    loss.backward()
    replicated = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"]
    ref_grads = dict(reference.named_parameters())
    tp_grads = dict(model.named_parameters())
    result.update({
        "gpt: loss (one process)": ref_loss.item(), "gpt: loss (tensor parallel)": loss.item(),
        "gpt: max grad diff (replicated params)": max(
            (tp_grads[k].grad - ref_grads[k].grad).abs().max().item() for k in replicated),
        "gpt: all-reduces forward": gpt_forward,
        "gpt: all-reduces forward + backward": comms.calls.get("all_reduce", 0),
        "gpt: param MB (one process)": param_bytes_full / 1e6,
        "gpt: param MB (this rank)": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6,
    })
    return result


def measure_pipeline_bubble(schedules: tuple[str, ...] = ("afab", "1f1b"), n_micros: tuple[int, ...] = (1, 2, 4, 8),
                  n_layer: int = 4, n_embd: int = 32, n_head: int = 4, block_size: int = 16,
                  micro_batch: int = 2, seed: int = 0) -> list[dict]:
    """One training step of a GPT cut into ``world_size`` pipeline stages, for every schedule and
    number of micro-batches m; this rank's measurements, one dict per (schedule, m).

    Each dict (of the second of two identical steps: the first pays for one-time set-up): the
    bubble on the logical clock (forward 1 tick, backward 2) and in wall time,
    (p - 1) / (m + p - 1) to compare with, the most micro-batches in flight on this stage, the
    pipeline's loss and the loss of the unsplit model on the same batch (one process).
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(block_size=block_size, vocab_size=65, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd, bias=True)
    comms, rows = Comms(), []
    for schedule in schedules:
        for m in n_micros:
            torch.manual_seed(seed)
            model = GPT(cfg)
            g = torch.Generator().manual_seed(seed + m)
            idx = torch.randint(0, cfg.vocab_size, (m * micro_batch, block_size + 1), generator=g)
            x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
            with torch.no_grad():
                reference = model(x, y)[1].item()
            pipe = Pipeline(gpt_stage(model, rank, p), comms, schedule)
            for _ in range(2):  # the first step pays for one-time set-up: measure the second
                pipe.stage.zero_grad(set_to_none=True)
                loss, stats = pipe.train_step(x, y, n_micro=m)
            rows.append({"schedule": schedule, "m": m, "p": p, "stage": rank,
                         "bubble (ticks)": stats.bubble, "bubble (wall)": stats.bubble_wall,
                         "(p-1)/(m+p-1)": (p - 1) / (m + p - 1),
                         "micro-batches in flight": stats.peak_in_flight,
                         "loss": loss, "loss (one process)": reference, "step ms": 1e3 * stats.step_s})
    return rows
