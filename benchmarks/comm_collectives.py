"""python benchmarks/comm_collectives.py --backend gloo --nproc 2 --sizes 1K:256M

Time the five collectives on N local ranks (gloo here, nccl on GPUs, mpi through mpiexec) with
course_lib.experiments.comm_bench, print the nccl-tests style table, fit the alpha-beta model of
course_lib.analysis.comm_cost to each collective (latency alpha and link bandwidth), and save the rows (CSV and
JSONL, the JSONL written while measuring) and a bus-bandwidth plot under --out-dir. Sizes are
nccl-tests': 1K = 2**10 bytes, 1M = 2**20; bandwidths in GB/s, GB = 1e9 bytes. Each fit is followed
by how well it explains the measured times (a busy machine gives times no alpha and bandwidth fit).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from course_lib.analysis.comm_cost import fit_alpha_beta, fit_report
from course_lib.experiments.comm_bench import (
    BENCH_BACKENDS,
    OPS,
    format_bench_table,
    parse_sizes,
    plot_comm_bench,
    run_benchmark,
    to_csv,
)
from course_lib.utils import atomic_write_bytes

# The algorithm each library most likely uses for large messages (for the fit only).
FIT_ALGORITHM = {"all_reduce": "ring", "reduce_scatter": "ring", "all_gather": "ring",
                 "broadcast": "binomial", "reduce": "binomial"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--backend", choices=BENCH_BACKENDS, default="gloo")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizes", default="1K:256M", help="MIN:MAX or a list (default 1K:256M)")
    p.add_argument("--factor", type=int, default=4, help="step of a MIN:MAX range (default 4)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out-dir", default="runs/comm_bench",
                   help="where the CSV, JSONL and PNG go (default runs/comm_bench)")
    args = p.parse_args(argv)

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"comm_{args.backend}_{args.nproc}"
    jsonl = stem.with_suffix(".jsonl")
    jsonl.unlink(missing_ok=True)
    try:
        rows = run_benchmark(args.backend, args.nproc, parse_sizes(args.sizes, args.factor),
                             [o.strip() for o in args.ops.split(",") if o.strip()], args.iters,
                             args.warmup, progress=True,
                             timeout_s=3600, jsonl_path=jsonl)
    except ValueError as e:
        p.error(str(e))
    print(format_bench_table(rows))
    print(f"\nalpha-beta fit (course_lib.analysis.comm_cost), {args.nproc} ranks:")
    for op in dict.fromkeys(r["op"] for r in rows):
        rs = [r for r in rows if r["op"] == op]
        sizes, seconds = [r["size_bytes"] for r in rs], [r["time_us"] * 1e-6 for r in rs]
        label = f"{op} ({FIT_ALGORITHM[op]})"
        try:
            alpha, bw = fit_alpha_beta(op, args.nproc, sizes, seconds, FIT_ALGORITHM[op])
        except ValueError as e:
            print(f"  {label:>25}: no fit ({e})")
            continue
        print(f"  {label:>25}: alpha = {alpha * 1e6:8.1f} us, bandwidth = {bw / 1e9:7.3f} GB/s; "
              + fit_report(op, args.nproc, sizes, seconds, alpha, bw, algorithm=FIT_ALGORITHM[op]))
    atomic_write_bytes(stem.with_suffix(".csv"), to_csv(rows).encode())
    plot_comm_bench(rows).savefig(stem.with_suffix(".png"), dpi=120)
    print(f"\nwrote {stem}.csv, {stem}.jsonl, {stem}.png")
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
