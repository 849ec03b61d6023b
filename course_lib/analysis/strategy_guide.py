"""Choosing a parallelism strategy: the decision guide of notebook 5, computed.

    from course_lib.analysis.strategy_guide import choose_strategy
    advice = choose_strategy("gpt2-xl", n_gpus=8, gpus_per_node=8, gpu="a100-40gb")
    advice.strategy, advice.path        # "zero3", the questions asked and their answers
    advice                              # in a notebook: the same as a short report

The questions are those of the diagram ``images/diagrams/strategy_guide.mmd``: how many GPUs
(one, one node with several, several nodes), does the model fit on one GPU, does it fit when
sharded with ZeRO-3 over the node (or over all GPUs, given a fast inter-node network). "Fits"
is :func:`course_lib.analysis.memory.breakdown` against the GPU's memory: model states (Rajbhandari et
al. 2020) plus the activations of one micro-batch (Korthikanti et al. 2022). The rule behind the
ordering: the chattier a parallelism, the faster the links it needs. Tensor parallelism
all-reduces activations twice per layer in forward and twice in backward, so it stays inside a
node (NVLink); pipeline parallelism sends one activation per micro-batch between neighbouring
stages and tolerates slower links; data parallelism communicates once per step and goes across
nodes (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", Sec. 3).

A memory estimate only answers "can it run"; what is fastest must still be measured
(notebook 8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

from course_lib.analysis.memory import GB, breakdown, get_preset, resolve_gpu
from course_lib.utils import check_count

# The guide's outcomes -> what to do. Not trainer strategies: ``"tp_pp"`` or ``"does_not_fit"`` name
# an answer of the diagram, not a :data:`course_lib.registry.STRATEGIES` entry.
RECOMMENDATIONS = {
    "single": "one GPU: mixed precision, gradient accumulation for a larger batch",
    "single_memory": "one GPU, with less memory: activation recomputation, a smaller micro-batch, "
                     "CPU offload of the optimizer (ZeRO-Offload), or more GPUs",
    "ddp": "data parallel (DDP); ZeRO-1/2 if you want memory for larger micro-batches",
    "zero3": "ZeRO-3 / FSDP: shard parameters, gradients and optimizer states over the GPUs",
    "tp": "tensor parallel inside each node; data parallel (ZeRO-1) over the model replicas",
    "tp_pp": "tensor parallel inside each node, pipeline parallel across nodes (3D parallelism "
             "with data parallel over the model replicas)",
    "does_not_fit": "does not fit even fully split: recomputation, a smaller micro-batch, "
                    "offloading, or more GPUs",
}


@dataclass
class Advice:
    """The guide's answer: a key of :data:`RECOMMENDATIONS`, and why."""

    strategy: str
    path: list[tuple[str, str]] = field(default_factory=list)  # (question, answer)
    totals_gb: dict[str, float] = field(default_factory=dict)  # what was compared, GB per GPU
    degrees: dict[str, int] = field(default_factory=dict)  # dp, tp, pp chosen
    notes: list[str] = field(default_factory=list)

    @property
    def description(self) -> str:
        return RECOMMENDATIONS[self.strategy]

    def __str__(self) -> str:
        lines = [f"{q} {a}" for q, a in self.path]
        deg = ", ".join(f"{k} = {v}" for k, v in self.degrees.items())
        lines.append(f"=> {self.description}" + (f" ({deg})" if deg else ""))
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def _repr_html_(self) -> str:
        items = "".join(f"<li>{escape(q)} <b>{escape(a)}</b></li>" for q, a in self.path)
        deg = ", ".join(f"{k} = {v}" for k, v in self.degrees.items())
        notes = "".join(f"<br/><i>{escape(n)}</i>" for n in self.notes)
        return (f'<div class="course-strategy-advice"><ol>{items}</ol>&rArr; '
                f'<b>{escape(self.description)}</b>{" (" + deg + ")" if deg else ""}{notes}</div>')


def choose_strategy(model: str | float, n_gpus: int, gpus_per_node: int | None = None,
                    gpu: str = "a100-80gb", *, fast_internode: bool = True, dtype: str = "mixed",
                    recompute: str = "none", batch_size: int | None = None,
                    flash_attention: bool = True) -> Advice:
    """Walk the decision guide for ``model`` (a preset name or a parameter count) on ``n_gpus``
    GPUs of type ``gpu``, ``gpus_per_node`` per node (default: all in one node).

    A bare parameter count has no shape, so only its model states are compared (noted in the
    advice). ``fast_internode``: InfiniBand-class links between nodes, which ZeRO-3's all-gathers
    of parameters need to run at speed across nodes.
    """
    per_node = _gpus_per_node(n_gpus, gpus_per_node)
    gpu_name, gpu_bytes = resolve_gpu(gpu)
    if isinstance(model, str):
        shape = get_preset(model)
        what = {"preset": shape, "batch_size": batch_size, "flash_attention": flash_attention,
                "recompute": recompute}
    else:
        shape, what = None, {"num_params": float(model)}
    advice = Advice("single")
    if shape is None:
        advice.notes.append("a bare parameter count: activations not included (give a preset for them)")

    def total(**kw) -> float:
        b = breakdown(**what, dtype=dtype, **kw)
        return b.total

    def fits(label: str, **kw) -> bool:
        t = total(**kw)
        advice.totals_gb[label] = t / GB
        return t <= gpu_bytes

    on_one = fits("one GPU, plain DP (GB)")
    where = "one GPU" if n_gpus == 1 else "one node" if n_gpus == per_node else f"{n_gpus // per_node} nodes"
    advice.path.append(("How many GPUs?", f"{n_gpus} ({where}, {per_node} per node, {gpu_name})"))
    advice.path.append((f"Does it fit on one {gpu_name} ({gpu_bytes / GB:.0f} GB)?",
                        f"{'yes' if on_one else 'no'}: {advice.totals_gb['one GPU, plain DP (GB)']:.3g} GB"))
    b = breakdown(**what, dtype=dtype)
    if not on_one and b.activations > b.model_states and recompute != "full":
        advice.notes.append(f"activations ({b.activations / GB:.3g} GB) outweigh the model states "
                            f"({b.model_states / GB:.3g} GB): try recomputation or a smaller "
                            "micro-batch before splitting the model")
    if n_gpus == 1:
        advice.strategy = "single" if on_one else "single_memory"
        return advice
    if on_one:
        advice.strategy, advice.degrees = "ddp", {"dp": n_gpus}
        if n_gpus > per_node:
            advice.notes.append("across nodes: accumulate gradients to all-reduce less often")
        return advice
    shard_over = n_gpus if (n_gpus == per_node or fast_internode) else per_node
    sharded = fits(f"ZeRO-3 over {shard_over} GPUs (GB)", dp=shard_over, stage=3)
    q = (f"Does it fit sharded with ZeRO-3 over {shard_over} GPUs"
         + ("" if n_gpus == per_node else " (needs a fast inter-node network)" if fast_internode
            else " (one node: the inter-node network is slow)") + "?")
    answer = f"{advice.totals_gb[f'ZeRO-3 over {shard_over} GPUs (GB)']:.3g} GB"
    advice.path.append((q, f"{'yes' if sharded else 'no'}: {answer}"))
    if sharded:
        advice.strategy, advice.degrees = "zero3", {"dp": n_gpus}
        return advice
    return _split_model(advice, shape, what, dtype, n_gpus, per_node, gpu_bytes)


def _gpus_per_node(n_gpus: int, gpus_per_node: int | None) -> int:
    """GPUs per node (default: all ``n_gpus`` in one), or a ValueError saying what is wrong."""
    check_count("n_gpus", n_gpus)
    per_node = check_count("gpus_per_node", n_gpus if gpus_per_node is None else gpus_per_node)
    if n_gpus > per_node and n_gpus % per_node:
        raise ValueError(f"n_gpus ({n_gpus}) must be a multiple of gpus_per_node ({per_node}) "
                         "when it spans several nodes")
    return min(per_node, n_gpus)


def _split_model(advice: Advice, shape, what: dict, dtype: str, n_gpus: int, per_node: int,
                 gpu_bytes: float) -> Advice:
    """The guide's last question: tensor parallel inside a node (it must divide the heads and the
    node's GPUs), then the fewest pipeline stages that make one GPU's share fit; ZeRO-1 over the
    model replicas."""
    # tp divides the heads and the node's GPUs: each tp group inside one node, tp x pp x dp = n_gpus
    tp = math.gcd(shape.n_head, per_node) if shape is not None else per_node
    n_layer = shape.n_layer if shape is not None else None
    for pp in range(1, (n_gpus // tp) + 1):
        if (n_gpus // tp) % pp or (n_layer is not None and n_layer % pp):
            continue
        # Each pipeline stage holds 1/pp of the layers' states; with 1F1B the first stage keeps
        # pp micro-batches of L/pp layers in flight: about one micro-batch of the whole model.
        states = breakdown(**what, dtype=dtype, tp=tp, dp=n_gpus // (tp * pp), stage=1)
        t = states.model_states / pp + states.activations
        if t <= gpu_bytes:
            advice.totals_gb[f"TP {tp} x PP {pp}, ZeRO-1 over the rest (GB)"] = t / GB
            advice.path.append((f"With tensor parallel {tp} in the node and {pp} pipeline stage(s)?",
                                f"fits: {t / GB:.3g} GB"))
            advice.strategy = "tp" if pp == 1 else "tp_pp"
            advice.degrees = {"tp": tp, "pp": pp, "dp": n_gpus // (tp * pp)}
            return advice
    advice.path.append((f"With tensor parallel {tp} in the node and up to {n_gpus // tp} pipeline stages?",
                        "no"))
    advice.strategy = "does_not_fit"
    return advice


def scenarios() -> list[tuple[str, dict]]:
    """The notebook's examples: (title, keyword arguments of :func:`choose_strategy`)."""
    return [
        ("GPT-2 small, one T4 (Colab)", {"model": "gpt2", "n_gpus": 1, "gpu": "t4"}),
        ("GPT-2 XL, one T4", {"model": "gpt2-xl", "n_gpus": 1, "gpu": "t4"}),
        ("GPT-2 XL, 4 x T4 in one node", {"model": "gpt2-xl", "n_gpus": 4, "gpu": "t4"}),
        ("GPT-2 XL, 4 x T4, full recomputation",
         {"model": "gpt2-xl", "n_gpus": 4, "gpu": "t4", "recompute": "full"}),
        ("GPT-2 medium, 8 x A100 40 GB", {"model": "gpt2-medium", "n_gpus": 8, "gpu": "a100-40gb"}),
        ("7.5 B parameters, 8 x A100 80 GB", {"model": 7.5e9, "n_gpus": 8, "gpu": "a100-80gb"}),
        ("70 B parameters, 8 nodes x 8 H100, slow network",
         {"model": 70e9, "n_gpus": 64, "gpus_per_node": 8, "gpu": "h100", "fast_internode": False}),
    ]
