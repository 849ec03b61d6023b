"""``course memory``: per-device memory of DP and ZeRO stages 1-3, as a table or JSON.

    course memory --params 7.5e9 --dp 64 --json
    course memory --preset gpt2 --dp 2 --gpu t4
    course memory --preset gpt2-xl --dp 8 --tp 2 --sp --recompute selective --gpu a100-80gb

Figures are bytes in the JSON and GB (1e9 bytes, the ZeRO paper's unit) in the table.
"""

from __future__ import annotations

import argparse
import json
import math

from course_lib.analysis.activations import RECOMPUTE
from course_lib.analysis.memory import (
    DTYPES,
    GB,
    PRESETS,
    STAGE_NAMES,
    STAGES,
    breakdown,
    dtype_bytes,
    get_preset,
    resolve_gpu,
)


def _finite(text: str) -> float:
    """A float option's value; float() alone reads "inf" and "1e400" as infinity: a table of inf."""
    try:
        value = float(text)
    except ValueError:  # argparse would name this function in its message: say what float() says
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="course memory",
        description="Per-device memory of data parallelism and ZeRO stages 1-3 (Rajbhandari et "
                    "al. 2020), plus activations for a model preset (Korthikanti et al. 2022).")
    what = p.add_argument_group("model")
    what.add_argument("--params", type=_finite, help="parameter count Psi, e.g. 7.5e9")
    what.add_argument("--preset", choices=sorted(PRESETS),
                      help="a model shape: parameter count and activations")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree N_d (default 1)")
    p.add_argument("--k", type=_finite, default=None,
                   help="optimizer bytes per parameter (default 12 for mixed, 8 for fp32)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="mixed",
                   help="mixed/fp16/bf16: 2-byte weights and gradients (ZeRO paper); fp32: 4-byte; "
                        "autocast: torch.autocast's fp32 states with 16-bit activations (the trainer)")
    p.add_argument("--stage", type=int, choices=STAGES, action="append",
                   help="only this ZeRO stage (repeatable; default all four)")
    p.add_argument("--gpu", help="compare with a hardware profile, e.g. t4, v100, a100-80gb")
    act = p.add_argument_group("activations (with --preset)")
    act.add_argument("--batch-size", type=int, help="micro-batch size (default: the preset's)")
    act.add_argument("--seq-len", type=int, help="tokens per sequence (default: block size)")
    act.add_argument("--tp", type=int, default=1, help="tensor-parallel degree t (default 1)")
    act.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    act.add_argument("--recompute", choices=RECOMPUTE, default="none",
                     help="activation recomputation (default none)")
    act.add_argument("--flash-attention", action="store_true",
                     help="fused attention: no s x s attention scores are stored")
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    return p


def report(args: argparse.Namespace) -> dict:
    """The figures ``course memory`` prints, as a JSON-ready dict (bytes)."""
    _, _, k = dtype_bytes(args.dtype, args.k)
    gpu = resolve_gpu(args.gpu) if args.gpu else None
    rows = []
    for stage in sorted(set(args.stage or STAGES)):
        m = breakdown(args.params, preset=args.preset, dp=args.dp, stage=stage, k=args.k,
                      dtype=args.dtype, tp=args.tp, sequence_parallel=args.sp,
                      recompute=args.recompute, batch_size=args.batch_size,
                      seq_len=args.seq_len, flash_attention=args.flash_attention)
        rows.append({"stage": stage, "name": STAGE_NAMES[stage], "params": m.params,
                     "grads": m.grads, "optimizer": m.optimizer, "model_states": m.model_states,
                     "activations": m.activations, "total": m.total, "total_gb": m.total / GB,
                     "fits": (m.total <= gpu[1]) if gpu else None})
    shape = get_preset(args.preset) if args.preset else None
    return {
        "num_params": float(args.params if args.params is not None else shape.num_params()),
        "dp": args.dp, "k": k, "dtype": args.dtype, "tp": args.tp, "unit": "bytes", "gb": GB,
        "preset": shape.name if shape else None,
        "activations": None if shape is None else {
            "batch_size": args.batch_size or shape.batch_size,
            "seq_len": args.seq_len or shape.block_size, "sequence_parallel": args.sp,
            "recompute": args.recompute, "flash_attention": args.flash_attention},
        "gpu": None if gpu is None else {"name": gpu[0], "memory_bytes": gpu[1]},
        "stages": rows,
        "source": "Rajbhandari et al. 2020 (arXiv:1910.02054) Sec. 5; activations Korthikanti "
                  "et al. 2022 (arXiv:2205.05198) Table 2",
    }


def format_report(rep: dict) -> str:
    head = (f"Psi = {rep['num_params']:.4g} parameters, N_d = {rep['dp']}, K = {rep['k']:g}, "
            f"dtype {rep['dtype']}" + (f", tp {rep['tp']}" if rep["tp"] > 1 else ""))
    if rep["preset"]:
        a = rep["activations"]
        head += (f"\nmodel {rep['preset']}: micro-batch {a['batch_size']} x {a['seq_len']} tokens, "
                 f"recompute {a['recompute']}" + (", sequence parallel" if a["sequence_parallel"] else "")
                 + (", fused attention" if a["flash_attention"] else ""))
    gpu = rep["gpu"]
    cols = ["params", "grads", "optimizer", "activations", "total"]
    lines = [head, "per device, GB = 1e9 bytes", ""]
    hdr = f"{'stage':<18}" + "".join(f"{c:>12}" for c in cols)
    if gpu:
        hdr += f"  fits {gpu['name']} ({gpu['memory_bytes'] / GB:g} GB)"
    lines.append(hdr)
    for r in rep["stages"]:
        line = f"{r['name']:<18}" + "".join(f"{r[c] / GB:>12.4g}" for c in cols)
        if gpu:
            line += "  " + ("yes" if r["fits"] else "no")
        lines.append(line)
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.params is None and args.preset is None:
        parser.error("give --params (e.g. --params 7.5e9) or --preset (e.g. --preset gpt2)")
    if args.preset is None and (args.batch_size or args.seq_len or args.sp or args.flash_attention
                                or args.recompute != "none"):
        parser.error("activation options need --preset (a model shape)")
    try:
        rep = report(args)
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    return 0
