"""python benchmarks/step_memory_gpu.py [--device cuda] [--shape test|gpt2]   (issue 28: where a GPU step's peak differs)

One training step's peak memory on a GPU read three ways, beside the model
(:func:`course_lib.analysis.memory.step_peak`): the allocator's ``max_memory_allocated``; the live tensors
(:class:`course_lib.experiments.step_memory.LiveTensorBytes`, the CPU method) with the op that
reached their peak; and ``memory_allocated`` right after forward, before backward begins, against
the model's states + activations. On the first GPU run (H200, torch 2.11) the allocator's peak was
0.90 of the model for the test shape and 0.91 for GPT-2 small; this says which part differs.
Prints one JSON object (bytes). ``--device cpu`` runs the same on a CPU at a tiny shape (2 layers,
64 wide, block 64, vocabulary 4096, batch 4; ``--shape`` ignored: a smoke run), where
``kept_after_forward_bytes`` is null (it reads the CUDA allocator).
"""

from __future__ import annotations

import argparse
import json

import torch

from course_lib.experiments.step_memory import LiveTensorBytes, measure_step_peak
from course_lib.gpt.model import GPT, GPTConfig, make_adamw
from course_lib.parallel.step import Precision, forward_backward
from course_lib.parallel.strategy import build_strategy

SHAPES = {"test": (GPTConfig(n_layer=4, n_head=8, n_embd=512, block_size=512, vocab_size=50304), 8),
          "gpt2": (GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304), 12)}


def after_forward(cfg: GPTConfig, batch: int, device: str) -> dict:
    """Bytes allocated after the loss is computed (forward only), less the states and the batch."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    single = build_strategy("single", model, lambda m: make_adamw(m, lr=1e-4, weight_decay=0.1))
    x = torch.randint(cfg.vocab_size, (batch, cfg.block_size), device=device)
    cuda = device.startswith("cuda")
    ctx = torch.autocast(device.split(":")[0], dtype=torch.bfloat16)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    with ctx:
        logits, loss = single.model(x, x)
    del logits  # the trainer's step drops them
    kept = (torch.cuda.memory_allocated(device) - before) if cuda else None  # the CUDA allocator's figure
    del loss
    return {"kept_after_forward_bytes": kept}


def live_peak(cfg: GPTConfig, batch: int, device: str) -> dict:
    """The CPU method (live tensor storages through a dispatch mode) on ``device``."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    single = build_strategy("single", model, lambda m: make_adamw(m, lr=1e-4, weight_decay=0.1))
    x = torch.randint(cfg.vocab_size, (1, batch, cfg.block_size), device=device)
    precision = Precision(torch.autocast(device.split(":")[0], dtype=torch.bfloat16))
    meter = LiveTensorBytes()
    with meter:
        forward_backward(single, x, x, precision)
    return {"live_peak_bytes": meter.peak, "live_peak_op": meter.peak_op}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="test", choices=sorted(SHAPES))
    a = p.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device} needs a CUDA GPU (torch {torch.__version__}: torch.cuda.is_available() "
                "is False); --device cpu runs a smoke test")
    cfg, batch = SHAPES[a.shape]
    if a.device == "cpu":
        cfg, batch = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=4096), 4
    r = measure_step_peak(cfg, batch, "bfloat16", device=a.device)
    r.update(after_forward(cfg, batch, a.device))
    r.update(live_peak(cfg, batch, a.device))
    parts = r["parts"]
    r["model_states_plus_activations"] = parts.get("weights", 0) + parts.get("optimizer", 0) + parts.get("activations", 0)
    print(json.dumps(r, indent=1, default=str))


if __name__ == "__main__":
    main()
