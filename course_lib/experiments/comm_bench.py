"""Collectives benchmark over torch.distributed (gloo, NCCL) and mpi4py: ``course bench comm``.

    course bench comm --backend gloo --nproc 2 --sizes 1K:256M
    course bench comm --backend mpi --nproc 4 --sizes 1K,1M,16M --ops all_reduce --csv comm.csv
    course bench comm --backend nccl --nproc 8 --plot busbw.png

The command starts the ranks itself: torch backends spawn one process per rank joined on a free
port of 127.0.0.1; ``mpi`` runs ``mpiexec -n N`` from the Python environment's bin (the PyPI
``mpich`` wheel) or from PATH. Each row reports, with the nccl-tests definitions
(doc/PERFORMANCE.md), the size S, the time per call t (slowest rank, mean of ``iters`` calls),
the algorithm bandwidth algbw = S / t and the bus bandwidth busbw = algbw x 2(n-1)/n for
all_reduce, (n-1)/n for reduce_scatter and all_gather and 1 for broadcast and reduce (GB/s with
GB = 1e9 bytes), plus whether the collective's result was correct. The workers are in
:mod:`course_lib.experiments.comm_bench_workers`; the model they are compared with in :mod:`course_lib.analysis.comm_cost`.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from course_lib.analysis.comm_cost import OPS
from course_lib.experiments.comm_bench_workers import ITEMSIZE, torch_worker
from course_lib.launch.mpi import find_mpiexec, launcher_options
from course_lib.utils import atomic_write_bytes, check_count, free_port

BENCH_BACKENDS = ("gloo", "nccl", "mpi")
_UNITS = {"": 1, "B": 1, "K": 2**10, "KIB": 2**10, "M": 2**20, "MIB": 2**20, "G": 2**30, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """'1K' -> 1024, '256M' -> 268435456, '64' -> 64: binary units, as nccl-tests' sizes (also
    written 1KiB, 256MiB). '1MB' is refused: elsewhere the course's MB is 1e6 bytes (hardware.MB)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Z]*)\s*", str(text).upper())
    if m and m.group(2) in ("KB", "MB", "GB"):
        raise ValueError(f"bad size {text!r}: K, M and G are binary here, as in nccl-tests (1M = 2**20 bytes), "
                         f"while the course's MB is 1e6 bytes; write {m.group(1)}{m.group(2)[0]} or "
                         f"{m.group(1)}{m.group(2)[0]}iB")
    if not m or m.group(2) not in _UNITS or float(m.group(1)) * _UNITS[m.group(2)] < 1:
        raise ValueError(f"bad size {text!r}: use bytes or K/M/G units, e.g. 1K, 64K, 256M")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_sizes(text: str, factor: int = 2) -> list[int]:
    """'1K:256M' (every ``factor``-fold step from 1K to 256M) or a list '1K,1M,16M'."""
    if ":" in text:
        lo, hi = (parse_size(t) for t in text.split(":", 1))
        if hi < lo:
            raise ValueError(f"size range {text!r} goes down: write MIN:MAX, e.g. 1K:256M")
        if factor < 2:
            raise ValueError(f"size factor must be >= 2, got {factor}")
        sizes = [lo]
        while sizes[-1] * factor <= hi:
            sizes.append(sizes[-1] * factor)
        return sizes
    return [parse_size(t) for t in text.split(",") if t.strip()]


def _check_config(backend: str, nproc: int, ops, sizes, iters: int, warmup: int) -> None:
    """Everything that can be wrong, raised before any process starts."""
    if backend not in BENCH_BACKENDS:
        raise ValueError(f"backend must be one of {BENCH_BACKENDS}, got {backend!r}")
    check_count("nproc", nproc)
    bad = [op for op in ops if op not in OPS]
    if bad or not ops:
        raise ValueError(f"unknown collective(s) {bad or ops}: choose from {', '.join(OPS)}")
    if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"sizes must be positive byte counts, got {sizes!r}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    # Each rank holds about 2 S (in + out buffers): refuse what cannot fit in RAM.
    need = 2 * max(sizes) * nproc
    if backend != "nccl" and need > 0.8 * psutil.virtual_memory().available:
        raise ValueError(f"{nproc} ranks x 2 x {max(sizes) / 2**20:.0f} MiB buffers need "
                         f"{need / 2**30:.1f} GiB; lower the largest size or --nproc")
    if backend == "nccl":
        import torch  # only for NCCL: `course bench comm --help` and gloo runs start without it

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < nproc:
            raise ValueError(f"NCCL needs one GPU per rank: {nproc} ranks, {gpus} GPU(s) here; "
                             "use --backend gloo or mpi, or --nproc <= number of GPUs")
    if backend == "mpi":
        try:
            import mpi4py  # noqa: F401  # is it installed? (imported by the workers, not here)
        except ImportError as e:
            raise ValueError("the mpi backend needs mpi4py: pip install mpi4py mpich") from e
        find_mpiexec()  # the mpiexec of mpi4py's MPI, else refused (a ValueError) before anything starts


def _read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_benchmark(backend: str = "gloo", nproc: int = 2, sizes=("1K", "1M"), ops=OPS,
                  iters: int = 20, warmup: int = 5, progress: bool = False,
                  timeout_s: float = 600.0, jsonl_path: str | os.PathLike | None = None) -> list[dict]:
    """Start ``nproc`` ranks, time each collective in ``ops`` at each size; return the rows.

    sizes: bytes or strings like "64K" (S as nccl-tests defines it per collective).
    jsonl_path: where the rows are appended as they are measured (a temporary file if None).
    """
    sizes = [parse_size(s) for s in sizes]
    ops = list(ops)
    _check_config(backend, nproc, ops, sizes, iters, warmup)
    cfg = {"backend": backend, "nproc": nproc, "ops": ops, "sizes": sizes, "iters": iters,
           "warmup": warmup, "progress": progress, "timeout_s": timeout_s, "itemsize": ITEMSIZE}
    with tempfile.TemporaryDirectory(prefix="course_comm_bench_") as tmp:
        out = Path(jsonl_path) if jsonl_path else Path(tmp) / "rows.jsonl"
        start = len(_read_rows(out))
        if backend == "mpi":
            cfg_path = Path(tmp) / "bench.json"  # the benchmark's settings, for the MPI ranks
            cfg_path.write_text(json.dumps(cfg))
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            mpiexec, family = find_mpiexec(env)
            options, launcher_env = launcher_options(family)  # e.g. Open MPI as root, more ranks than cores
            env.update(launcher_env)
            cmd = [mpiexec, "-n", str(nproc), *options, sys.executable, "-m",
                   "course_lib.experiments.comm_bench_workers", str(cfg_path), str(out)]
            proc = subprocess.run(cmd, check=False, env=env, timeout=timeout_s, stdout=subprocess.PIPE,
                                  stderr=None if progress else subprocess.PIPE, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n"
                                   f"{proc.stdout}{proc.stderr or ''}")
        else:
            import torch.multiprocessing as mp  # torch only once a benchmark really starts

            mp.start_processes(torch_worker, args=(cfg, free_port(), str(out)), nprocs=nproc,
                               join=True, start_method="spawn")
        return _read_rows(out)[start:]


BENCH_COLUMNS = ("backend", "op", "nproc", "size_bytes", "count", "time_us", "algbw_GBps",
           "busbw_GBps", "correct")


def format_bench_table(rows: list[dict]) -> str:
    """The rows as an aligned text table in the style of nccl-tests' output."""
    head = f"{'backend':>7} {'op':>14} {'ranks':>5} {'size (B)':>11} {'count':>10} " \
           f"{'time (us)':>11} {'algbw GB/s':>10} {'busbw GB/s':>10} {'ok':>3}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['backend']:>7} {r['op']:>14} {r['nproc']:>5} {r['size_bytes']:>11} "
                     f"{r['count']:>10} {r['time_us']:>11.1f} {r['algbw_GBps']:>10.3f} "
                     f"{r['busbw_GBps']:>10.3f} {'yes' if r['correct'] else 'NO':>3}")
    return "\n".join(lines)


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else list(BENCH_COLUMNS))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def plot_comm_bench(rows: Sequence[Mapping], metric: str = "busbw_GBps", ax=None):
    """Bandwidth (or time) against message size, one line per (backend, collective, nproc).

    rows: result rows of :func:`run_benchmark`. metric: "busbw_GBps",
    "algbw_GBps" or "time_us".
    """
    if not rows:
        raise ValueError("plot_comm_bench needs benchmark rows to draw")
    if metric not in ("busbw_GBps", "algbw_GBps", "time_us"):
        raise ValueError(f"metric must be busbw_GBps, algbw_GBps or time_us, got {metric!r}")
    from matplotlib.figure import Figure  # matplotlib only when a figure is asked for

    if ax is None:
        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.add_subplot()
    fig = ax.figure
    series: dict[tuple, list] = {}
    for r in rows:
        series.setdefault((r["backend"], r["op"], r["nproc"]), []).append(r)
    for (backend, op, nproc), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["size_bytes"])
        ax.plot([r["size_bytes"] for r in rs], [r[metric] for r in rs], marker="o",
                markersize=3, label=f"{op} ({backend}, {nproc} ranks)")
    ax.set_xscale("log", base=2)
    if metric == "time_us":
        ax.set_yscale("log")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel({"busbw_GBps": "bus bandwidth (GB/s)", "algbw_GBps": "algorithm bandwidth (GB/s)",
                   "time_us": "time per call (us)"}[metric])
    ax.set_title("Collectives (nccl-tests definitions)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def cli(argv: list[str] | None = None) -> int:
    """``course bench comm ...`` (the only ``course bench`` benchmark so far)."""
    parser = argparse.ArgumentParser(prog="course bench", description="course benchmarks")
    sub = parser.add_subparsers(dest="bench", required=True)
    p = sub.add_parser(
        "comm", help="collectives: time, algbw and busbw (nccl-tests definitions)",
        description="Time broadcast, reduce, all_reduce, reduce_scatter and all_gather on N local "
                    "ranks; report algorithm and bus bandwidth as nccl-tests defines them.")
    p.add_argument("--backend", choices=BENCH_BACKENDS, default="gloo")
    p.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--sizes", default="1K:256M",
                   help="MIN:MAX (steps of --factor) or a list, e.g. 1K,1M (default 1K:256M)")
    p.add_argument("--factor", type=int, default=4, help="size step of a MIN:MAX range (default 4)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {','.join(OPS)}")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before giving up")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--csv", help="also write the rows to this CSV file")
    p.add_argument("--jsonl", help="append rows here while measuring (kept on a crash)")
    p.add_argument("--plot", help="save a bus-bandwidth plot (PNG/SVG/PDF) here")
    args = parser.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes, args.factor)
        rows = run_benchmark(args.backend, args.nproc, sizes,
                             [o.strip() for o in args.ops.split(",") if o.strip()], args.iters,
                             args.warmup, progress=not args.json, timeout_s=args.timeout,
                             jsonl_path=args.jsonl)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(rows, indent=1) if args.json else format_bench_table(rows))
    if args.csv:
        atomic_write_bytes(args.csv, to_csv(rows).encode())
    if args.plot:
        plot_comm_bench(rows).savefig(args.plot, dpi=120)
    return 0 if all(r["correct"] for r in rows) else 1
