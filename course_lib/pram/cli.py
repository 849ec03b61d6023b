"""course pram ALGORITHM --n N --model MODEL [--json]

Run a classic algorithm on the PRAM simulator and print its steps, work and processors, or
exit 1 with the access violation when the model forbids the algorithm. Bad input (unknown
algorithm or model, n not a power of two where needed, too many processors) exits 2 before
anything runs. ``course pram step-table`` prints the whole GPT training step, kernel by kernel.
"""

from __future__ import annotations

import argparse
import json
import sys

from .algorithms import check_n
from .catalog import ALGORITHMS, get_algorithm
from .classify import classify
from .gpt_step import GPTShape, step_table
from .machine import MAX_PROCESSORS, run
from .models import MODELS, AccessViolation, ProcessorLimitError, get_model
from .trace import format_table

__all__ = ["cli", "build_parser"]

STEP_TABLE = "step-table"


def _epilog() -> str:
    width = max(map(len, ALGORITHMS))
    lines = ["algorithms (model it is written for; * = n must be a power of two):"]
    for a in ALGORITHMS.values():
        star = "*" if a.power_of_two else " "
        lines.append(f"  {a.name:<{width}} {star} {a.model:<12} {a.summary}")
    lines += [f"  {STEP_TABLE:<{width}}   {'':<12} the kernels of a GPT step: weakest model, "
              "steps, work, processors", "", "models:"]
    width = max(map(len, MODELS))
    lines += [f"  {m.name:<{width}}  {m.description}" for m in MODELS.values()]
    lines += ["", "examples:", "  course pram tree-sum --n 8", "  course pram max-crcw --n 8 "
              "--model CREW   # exits 1: concurrent writes", "  course pram matmul --n 4 --json"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="course pram", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a classic algorithm on a PRAM with the access model you choose.",
        epilog=_epilog())
    p.add_argument("algorithm", metavar="ALGORITHM", help="one of the algorithms below")
    p.add_argument("--n", type=int, default=8, help="problem size (default 8)")
    p.add_argument("--model", metavar="MODEL", default=None,
                   help="access model (default: the one the algorithm is written for)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seed", type=int, default=0, help="input data and CRCW-arbitrary winners")
    p.add_argument("--table", action="store_true", help="also print the per-step work table")
    p.add_argument("--classify", action="store_true",
                   help="also find the weakest model that runs the algorithm correctly")
    p.add_argument("--max-processors", type=int, default=MAX_PROCESSORS,
                   help=f"refuse programs needing more processors (default {MAX_PROCESSORS:,})")
    p.add_argument("--shape", metavar="B,T,C,NH,V", default="2,4,8,2,16",
                   help="step-table only: batch, sequence, width, heads, vocabulary "
                        "(default 2,4,8,2,16)")
    return p


def _fail(message: str, code: int) -> int:
    print(f"course pram: {message}", file=sys.stderr)
    return code


def _step_table(as_json: bool, shape_arg: str) -> int:
    try:
        sizes = [int(x) for x in shape_arg.split(",")]
        if len(sizes) != 5:
            raise ValueError(f"expected 5 sizes, got {len(sizes)}")
        shape = GPTShape(*sizes)
    except ValueError as e:
        return _fail(f"--shape must be B,T,C,NH,V, e.g. 2,4,8,2,16 ({e})", 2)
    rows = step_table(shape)
    if as_json:
        print(json.dumps({"shape": vars(shape), "rows": rows}, indent=2))
    else:
        print(f"one training step, {shape}")
        print(format_table(rows, ["kernel", "model", "steps", "work", "processors"]))
    return 0


def cli(argv: list[str] | None = None) -> int:
    """``course pram ...``; returns the exit status (0 ok, 1 violation, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:            # --help, or argparse's own usage error
        return int(e.code or 0)
    if args.algorithm == STEP_TABLE:
        return _step_table(args.json, args.shape)
    try:
        algo = get_algorithm(args.algorithm)
        model = get_model(args.model or algo.model)
        check_n(algo.name, args.n, algo.power_of_two)
        needed = algo.processors(args.n)
        if needed > args.max_processors:
            raise ProcessorLimitError(
                f"{algo.name} with n={args.n} needs {needed:,} processors, more than the "
                f"{args.max_processors:,} allowed; use a smaller --n or raise --max-processors")
        program = algo.build(args.n, seed=args.seed)
    except ValueError as e:
        return _fail(str(e), 2)
    try:
        result = run(program, model, seed=args.seed, trace=False,
                     max_processors=args.max_processors)
    except AccessViolation as e:
        return _fail(str(e), 1)
    wrong = program.verify(result)
    out = {"algorithm": algo.name, "n": args.n, **result.summary(), "correct": not wrong}
    out.pop("program")
    if args.classify:
        verdict = classify(program, max_processors=args.max_processors)
        out.update(weakest_model=verdict.model, reason=verdict.reason)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        ops = ", ".join(f"{k}: {v:,}" for k, v in result.ops.items())
        print(f"{algo.name}, n={args.n}, {model.name}: {result.steps} steps, "
              f"work {result.work:,} ({ops or 'none'}), {result.processors:,} processors")
        if args.classify:
            print(f"weakest model: {out['weakest_model']}. {out['reason']}")
        if args.table:
            print(result.table())
    if wrong:
        return _fail(f"{algo.name} gives a wrong result on {model.name}: {wrong[0]}", 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
