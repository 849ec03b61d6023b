"""Choose a dp x pp x cp x tp layout before running it: every layout that divides the model and
the GPUs, with its memory per GPU and its communication time per step from the closed-form models.

    from course_lib.analysis.layout_plan import plan_layouts
    rows = plan_layouts("gpt2-xl", n_nodes=2, gpus_per_node=8, gpu="a100-80gb", global_batch=512)

Per layout (tp innermost, so a tp group stays inside a node when tp <= gpus_per_node; Narayanan
et al. 2021, Sec. 3):

* memory per GPU: model states of the stage's parameters (:mod:`course_lib.analysis.memory`,
  mixed precision, ZeRO stage over the dp x cp group) plus the activations of the micro-batches
  in flight (:mod:`course_lib.analysis.activations`, Korthikanti et al. 2022; 1F1B keeps p of them
  on the first stage, Narayanan et al. 2021);
* communication seconds per step: the bytes of each group
  (:func:`course_lib.analysis.parallel_comm.sent_bytes_per_step`) over the link that group uses:
  the node's (NVLink) when all its ranks share a node, else the network;
* the pipeline bubble (p - 1) / (m + p - 1) (GPipe, Huang et al. 2019);
* a step time: compute 6 N tokens / world / (MFU x peak) (Kaplan et al. 2020's 6N FLOPs per token)
  stretched by the bubble, compute / (1 - bubble), plus the communication, none of it overlapped.

What it leaves out (so: measure, as the notebook does): overlap of communication with compute,
latency terms, kernel efficiency at small matrix sizes.
"""

from __future__ import annotations

from course_lib.analysis.activations import activation_bytes_per_layer
from course_lib.analysis.memory import get_preset, micro_batches_in_flight, resolve_gpu, stage_states
from course_lib.analysis.parallel_comm import sent_bytes_per_step
from course_lib.hardware import PROFILES
from course_lib.registry import divisibility_error

NVLINK_BPS, NETWORK_BPS = 300e9, 25e9  # A100 NVLink 3 per direction; InfiniBand HDR 200 Gb/s


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _in_node(group_span: int, gpus_per_node: int) -> bool:
    """Consecutive ranks [k span, (k+1) span) share a node when span divides the node's GPUs."""
    return group_span <= gpus_per_node and gpus_per_node % group_span == 0


def plan_layouts(model: str = "gpt2-xl", *, n_nodes: int = 2, gpus_per_node: int = 8, gpu: str = "a100-80gb",
                 global_batch: int = 512, micro_batch: int = 1, cp_options=(1,), zero_stage: int = 1,
                 sequence_parallel: bool = True, recompute: str = "none", mfu: float = 0.4) -> list[dict]:
    """Every layout of the model on ``n_nodes`` x ``gpus_per_node`` GPUs that the trainer accepts
    (:func:`course_lib.registry.divisibility_error`) and that splits ``global_batch`` evenly; those
    that fit first, fastest estimated step first."""
    shape = get_preset(model)
    name, memory = resolve_gpu(gpu)
    world = n_nodes * gpus_per_node
    profile = PROFILES[name]  # bf16 where the GPU has it; a T4 or V100 trains in fp16 (no bf16 peak)
    peak = profile.training_peak(profile.train_dtype)
    compute_s = 6 * shape.num_params() * global_batch * shape.block_size / world / (mfu * peak)
    L, a, s = shape.n_layer, shape.n_head, shape.block_size
    rows = []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            for cp in cp_options:
                if (world // (tp * pp)) % cp:
                    continue
                # the trainer's rule (heads over tp, blocks over pp, sequences over cp and sp), so that
                # every layout listed is one it runs; sequence parallelism only where there is a tp
                if divisibility_error(n_head=a, n_layer=L, block_size=s, tp=tp, pp=pp, cp=cp,
                                      sequence_parallel=sequence_parallel and tp > 1):
                    continue
                dp = world // (tp * pp * cp)
                if global_batch % (dp * micro_batch):
                    continue
                m = global_batch // (dp * micro_batch)  # micro-batches per step = pipeline depth
                row = _layout(shape, dp, tp, pp, cp, m, micro_batch, zero_stage, sequence_parallel,
                              recompute, gpus_per_node, memory)
                row["step_s"] = compute_s / (1 - row["bubble"]) + row["comm_s"]
                rows.append(row)
    rows.sort(key=lambda r: (not r["fits"], r["step_s"]))
    return rows


def _layout(shape, dp, tp, pp, cp, m, b, zero_stage, sp, recompute, gpus_per_node, memory) -> dict:
    L, h, a, s, v = shape.n_layer, shape.n_embd, shape.n_head, shape.block_size, shape.vocab_size
    states = stage_states(shape, dp=dp * cp, tp=tp, pp=pp, stage=zero_stage, dtype="mixed").total
    in_flight = micro_batches_in_flight(pp, m)  # 1F1B
    act = (L // pp) * in_flight * activation_bytes_per_layer(s // cp, b, h, a, tp, sequence_parallel=sp and tp > 1,
                                                             recompute=recompute, flash_attention=True)
    sent = sent_bytes_per_step(L, h, v, s, shape.bias, b, m, dp=dp, tp=tp, pp=pp, cp=cp,
                               sequence_parallel=sp and tp > 1, pp_rank=0, bytes_per_value=2, zero_stage=zero_stage)
    spans = {"tp": tp, "sp": tp, "cp": tp * cp, "dp": tp * cp * dp, "pp": tp * cp * dp * pp}
    link = {k: "nvlink" if _in_node(span, gpus_per_node) else "network" for k, span in spans.items()}
    comm_s = sum(sent[k] / (NVLINK_BPS if link[k] == "nvlink" else NETWORK_BPS) for k in sent)
    return {"layout": f"dp{dp}-tp{tp}-pp{pp}" + (f"-cp{cp}" if cp > 1 else ""), "dp": dp, "tp": tp, "pp": pp,
            "cp": cp, "micro_batches": m, "states_GB": states / 1e9, "activations_GB": act / 1e9,
            "fits": states + act < 0.9 * memory, "comm_s": comm_s, "bubble": (pp - 1) / (m + pp - 1),
            **{f"{k}_GB": sent[k] / 1e9 for k in sent}, "network_groups": ",".join(k for k in sent if
                                                                                  sent[k] and link[k] == "network")}
