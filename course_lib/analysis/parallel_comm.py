"""Closed-form model of one rank's share of a GPT under dp x pp x cp x tp: bytes sent per training
step in each group, to choose a layout before running it (the parameters each rank holds:
:func:`course_lib.analysis.memory.stage_params`).

Notation as in Megatron-LM (Shoeybi et al. 2019; Narayanan et al. 2021) and Korthikanti et al.
2022: L layers (L/p on a stage), h = n_embd, v vocabulary (padded to a multiple of t), s sequence length, b micro-batch per
dp rank, m micro-batches per step, t = tp, c = cp, e bytes per value; s' = s/c tokens per rank.
A "ring" collective on S bytes sends 2(t-1)/t S (all-reduce) or (t-1)/t S (reduce-scatter,
all-gather) per rank (:func:`~course_lib.analysis.comm_cost.bytes_per_rank`). Per micro-batch:

* tp, per layer: 2 all-reduces of the (b, s', h) activation forward, 2 backward (Megatron,
  Sec. 3); the first stage adds the vocab-parallel embedding's all-reduce, the last the LM head's
  (backward) and the vocab-parallel cross-entropy's three all-reduces of b s' numbers.
* sp (sequence parallel): each of those all-reduces becomes a reduce-scatter plus an all-gather,
  the same bytes (Korthikanti et al. 2022, Sec. 4.2.2); per step one all-reduce of the gradients
  of the parameters replicated over tp (LayerNorms, row-parallel biases, wpe).
* cp: per layer K and V, 2 b s' h/t values, hop cp - 1 times forward and their gradients as many
  times backward (Ring Attention, Liu et al. 2023).
* pp: the (b, s' [/t with sp], h) activation forward and its gradient backward (one each, plus an
  8-byte clock tick, on the stages that have a neighbour); per step the tied embedding's gradient
  (v h / t) between the first and last stage.
* dp (the dp x cp group): the gradients of the stage, all-reduced (DDP), or reduce-scattered and
  the parameters all-gathered (ZeRO-1/2): the same bytes (Rajbhandari et al. 2020, Sec. 7).
  ZeRO-3 per micro-batch: the blocks all-gathered for forward and again for backward, the rest of
  the stage (the root unit: embeddings, ln_f, head) once, and every gradient reduce-scattered
  (paper Sec. 7.2.2: 3 Psi; no ``no_sync``, so m times a step).
"""

from __future__ import annotations

from course_lib.analysis.comm_cost import bytes_per_rank
from course_lib.analysis.memory import stage_params
from course_lib.registry import divisibility_error


def sent_bytes_per_step(n_layer: int, n_embd: int, vocab_size: int, block_size: int, bias: bool,
                        batch_size: int, micro_batches: int, dp: int = 1, tp: int = 1, pp: int = 1,
                        cp: int = 1, sequence_parallel: bool = False, pp_rank: int = 0,
                        bytes_per_value: int = 4, zero_stage: int = 0, n_tensors: int = 0) -> dict[str, float]:
    """Bytes this rank sends per optimizer step in each group (module docstring). ``n_tensors``:
    the stage's parameter tensors; our DDP sends one presence flag per tensor with the gradients
    (so ranks agree which parameters got a gradient anywhere: parallel/data/ddp.py). ``zero_stage``
    1 or 2: the optimizer holds gradient shards, so the sp and tied-gradient exchanges move
    1/(dp cp) of them. Stage 2 sends what stage 1 does: under gradient accumulation its ``no_sync``
    keeps the micro-batches' gradients and reduce-scatters once, on the last one (as FSDP's no_sync).
    A layout the trainer refuses (:func:`course_lib.registry.divisibility_error`: blocks over pp,
    sequences over cp and sp) is a ValueError with the trainer's message."""
    # the trainer's rule: n_layer / pp or block_size / cp floored would count another model
    if error := divisibility_error(n_layer=n_layer, block_size=block_size, tp=tp, pp=pp, cp=cp,
                                   sequence_parallel=sequence_parallel):
        raise ValueError(error)
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank must be in 0..{pp - 1}, got {pp_rank!r}")
    zero = zero_stage > 0
    e, h, m, L = bytes_per_value, n_embd, micro_batches, n_layer // pp
    v_pad = -(-vocab_size // tp) * tp
    first, last = pp_rank == 0, pp_rank == pp - 1
    tokens = batch_size * block_size // cp  # b s' per micro-batch
    act = tokens * h * e  # one (b, s', h) activation
    allreduce = bytes_per_rank("all_reduce", act, tp) if tp > 1 else 0.0
    per_micro_tp = (4 * L + first + last) * allreduce  # layers, embedding (fwd), head (bwd)
    ce = 3 * bytes_per_rank("all_reduce", tokens * e, tp) if last and tp > 1 else 0.0
    out = {"tp": 0.0, "sp": 0.0, "cp": 0.0, "pp": 0.0, "dp": 0.0}
    if sequence_parallel:
        out["sp"] = m * per_micro_tp  # reduce-scatter + all-gather = one all-reduce's bytes
        rep = stage_params(n_layer, n_embd, vocab_size, block_size, bias, tp, pp, pp_rank)["replicated"]
        out["sp"] += bytes_per_rank("all_reduce", rep * e / (dp * cp if zero else 1), tp) if tp > 1 else 0.0
        out["tp"] = m * ce
    else:
        out["tp"] = m * (per_micro_tp + ce)
    if cp > 1:
        out["cp"] = m * L * 2 * (cp - 1) * 2 * tokens * (h // tp) * e  # K and V, forward and backward
    if pp > 1:
        boundary = (act // tp if sequence_parallel else act) + 8  # + the clock tick
        out["pp"] = m * boundary * ((not last) + (not first))
        if first or last:
            out["pp"] += v_pad * h // tp * e / (dp * cp if zero else 1)  # the tied gradient
        # the step's length on the logical clock (max) and the loss, from the last stage
        out["pp"] += bytes_per_rank("all_reduce", 8, pp) + bytes_per_rank("broadcast", max(e, 4), pp)
    n_dp = dp * cp
    if n_dp > 1:
        total = stage_params(n_layer, n_embd, vocab_size, block_size, bias, tp, pp, pp_rank)["total"]
        flags = n_tensors if not zero else 0  # ZeRO's flags ride in its padded rows (within 1 %)
        out["dp"] = bytes_per_rank("all_reduce", (total + flags) * e, n_dp)  # = reduce-scatter + all-gather
        if zero_stage == 3:
            blocks = stage_params(n_layer, n_embd, vocab_size, block_size, bias, tp, pp, 0)["total"] - \
                stage_params(0, n_embd, vocab_size, block_size, bias, tp, pp, 0)["total"]  # this stage's L layers
            gathered = 2 * blocks + (total - blocks)
            out["dp"] = m * (bytes_per_rank("all_gather", gathered * e, n_dp)
                             + bytes_per_rank("reduce_scatter", total * e, n_dp))
    return out
