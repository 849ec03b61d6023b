"""Generate text from a run directory's checkpoint.

    course sample --out_dir=out-shakespeare-char-cpu --num_samples=2 --max_new_tokens=300
    course sample --out_dir=runs/demo --start="ROMEO:" --temperature=0.9 --ckpt=last

Defaults follow nanoGPT's sample.py (start "\\n", temperature 0.8, top_k 200, seed 1337). The
checkpoint carries the model's shape and the dataset's tokenizer, so no data folder is needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from course_lib import registry
from course_lib.gpt import checkpoint as ckpt_io
from course_lib.gpt.data import tokenizer
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.utils import check_count


def load_model(out_dir: str | Path, which: str = "best", device: str = "cpu"):
    """(model in eval mode, dataset meta, checkpoint iteration) from OUT_DIR/{best,last}.pt."""
    if which not in ("best", "last"):
        raise ValueError(f"which must be 'best' or 'last', got {which!r}")
    ck = ckpt_io.load_checkpoint(Path(out_dir) / f"{which}.pt", map_location=device)
    model = GPT(GPTConfig(**ck["model_args"]))
    model.load_state_dict(ck["model"])
    return model.to(device).eval(), ck["meta"], ck["iter_num"]


def _check(start, num_samples, max_new_tokens, temperature, top_k, seed, device: str) -> str:
    """sample()'s arguments, each with what to change; returns the device ("auto" resolved)."""
    if not isinstance(start, str):
        raise ValueError(f"start must be text (or 'FILE:path'), got {start!r}")
    # torch.Generator.manual_seed takes 64 bits (a negative seed is only another name for one of them)
    if check_count("seed", seed, minimum=0) >= 2**64:
        raise ValueError(f"seed must be below 2**64, got {seed!r}")
    check_count("num_samples", num_samples)
    check_count("max_new_tokens", max_new_tokens)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0 (1.0: the model's own distribution), got {temperature!r}")
    if top_k is not None:  # None: every token
        check_count("top_k", top_k)
    if (why := registry.device_error(device)) is not None:  # the rule of a run's device, too
        raise ValueError(why)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but this machine has no CUDA GPU; use device='cpu' (or 'auto')")
        count, index = torch.cuda.device_count(), int(device.partition(":")[2] or 0)
        if index >= count:
            have = "1 CUDA GPU (cuda:0)" if count == 1 else f"{count} CUDA GPUs (cuda:0 to cuda:{count - 1})"
            raise ValueError(f"device={device!r} but this machine has {have}; use one of them, or device='auto'")
    return device


def _mask_from(vocab_size: int):
    """A forward hook for the LM head: logits of the ids from ``vocab_size`` on become -inf."""
    def hook(_module, _inputs, logits):
        return logits.masked_fill(torch.arange(logits.size(-1), device=logits.device) >= vocab_size, float("-inf"))
    return hook


def sample(out_dir: str | Path, start: str = "\n", num_samples: int = 1, max_new_tokens: int = 500,
           temperature: float = 0.8, top_k: int | None = 200, seed: int = 1337, which: str = "best",
           device: str = "auto") -> list[str]:
    """``num_samples`` continuations of ``start`` (``FILE:path`` reads the prompt from a file).
    Bad arguments raise ValueError before the checkpoint is read."""
    device = _check(start, num_samples, max_new_tokens, temperature, top_k, seed, device)
    if start.startswith("FILE:"):
        try:
            start = Path(start[5:]).read_text()
        except OSError as e:
            raise ValueError(f"cannot read the prompt file {start[5:]!r} ({e.strerror or e})") from None
    model, meta, _ = load_model(out_dir, which, device)
    if model.config.vocab_size > meta["vocab_size"]:
        # GPT-2's 50257 tokens have 50304 logits (padded for speed, data.model_vocab_size): the
        # padding ids are no tokens and cannot be decoded, so they must never be drawn
        model.lm_head.register_forward_hook(_mask_from(meta["vocab_size"]))
    encode, decode = tokenizer(meta)
    ids = encode(start)
    if not ids:
        raise ValueError("the start text encodes to no tokens; give at least one character")
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)  # (num_samples, T)
    generator = torch.Generator(device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    return [decode(row.tolist()) for row in out]


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="course sample", description="Generate text from a trained run.")
    p.add_argument("--out_dir", "--out-dir", required=True, help="the run directory (holds best.pt / last.pt)")
    p.add_argument("--ckpt", choices=("best", "last"), default="best",
                   help="best.pt (lowest validation loss, default) or last.pt (the latest iteration)")
    p.add_argument("--start", default="\n", help='prompt text, or FILE:path (default "\\n")')
    p.add_argument("--num_samples", type=int, default=1, help="how many texts (default 1)")
    p.add_argument("--max_new_tokens", type=int, default=500, help="tokens generated per text (default 500)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="> 0; below 1 sharpens the distribution, above 1 flattens it (default 0.8)")
    p.add_argument("--top_k", type=int, default=200, help="keep the k likeliest tokens; 0 = all")
    p.add_argument("--seed", type=int, default=1337, help="the same seed, the same texts (default 1337)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto: a GPU if there is one)")
    args = p.parse_args(argv)
    try:  # a usage error (exit 2) before the checkpoint is read; what the run holds is checked after
        _check(args.start, args.num_samples, args.max_new_tokens, args.temperature, args.top_k or None, args.seed,
               args.device)
    except ValueError as e:
        p.error(str(e))
    try:
        texts = sample(args.out_dir, args.start, args.num_samples, args.max_new_tokens, args.temperature,
                       args.top_k or None, args.seed, args.ckpt, args.device)
    except (ckpt_io.CheckpointError, ValueError, OSError) as e:
        print(f"course sample: error: {e}", file=sys.stderr)
        return 1
    for i, text in enumerate(texts):
        if i:
            print("-" * 40)
        print(text)
    return 0
