"""python -m course_lib.experiments.scaling_measure --procs 1,2 --serial-units 10 --parallel-units 190

Strong and weak scaling measured on this machine, for a job whose serial fraction we know.

The job: ``serial_units`` units of pure-Python work done by one process, then ``parallel_units``
units split evenly over a pool of p worker processes. The fraction we wrote in is known, so the
measured Karp-Flatt fraction e(p) (:func:`course_lib.analysis.scaling_laws.karp_flatt`) shows how
much overhead running in parallel adds here (starting work, collecting results, contention).
:func:`measure_strong` keeps the job fixed (Amdahl), :func:`measure_weak` grows it with p
(Gustafson).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Sequence

from course_lib.analysis.scaling_laws import fit_serial_fraction, gustafson_speedup, karp_flatt
from course_lib.utils import progress_bar

UNIT_ITERS = 20_000  # loop iterations in one unit of work (about 1 ms on a laptop core)


# ------------------------------------------------------------------------- the measured workload

def burn(units: int) -> int:
    """``units`` units of single-threaded CPU work (pure Python: no library runs it in parallel)."""
    acc = 0
    for i in range(int(units) * UNIT_ITERS):
        acc = (acc + i * i) % 1_000_003
    return acc


def _split(total: int, parts: int) -> list[int]:
    """``total`` units as ``parts`` near-equal chunks (the first ones one unit larger)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _pool(p: int):
    # spawn: a notebook kernel always runs threads (ipykernel's heartbeat and output), and a fork
    # copies the locks they hold into a child that cannot release them (Python 3.12+ warns). Not
    # forkserver either: a process has one fork server, which launch/ranks.py starts with torch
    # preloaded for the ranks. A worker imports this module (no torch) before anything is timed.
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(p)
    pool.map(burn, [0] * p, chunksize=1)  # start every worker before anything is timed
    return pool


def run_job(serial_units: int, parallel_units: int, pool=None, p: int = 1) -> tuple[float, float]:
    """One run of the job: (total seconds, seconds of the serial part).

    p = 1 without a pool runs everything in this process: the single-processor baseline.
    """
    t0 = time.perf_counter()
    burn(serial_units)  # the serial part: one process, the others wait
    t1 = time.perf_counter()
    if pool is None:
        burn(parallel_units)
    else:
        pool.map(burn, _split(parallel_units, p), chunksize=1)
    return time.perf_counter() - t0, t1 - t0


def _timed(serial_units: int, parallel_units: int, p: int, repeats: int) -> tuple[float, float]:
    """Median (total, serial) seconds over ``repeats`` runs on p processes (p = 1: this one)."""
    pool = _pool(p) if p > 1 else None
    try:
        runs = [run_job(serial_units, parallel_units, pool, p) for _ in range(repeats)]
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def _check_procs(procs: Sequence[int]) -> list[int]:
    procs = sorted({int(p) for p in procs})
    if not procs or procs[0] < 1:
        raise ValueError(f"procs must be process counts >= 1, got {procs!r}")
    return procs


def measure_strong(procs: Sequence[int], serial_units: int = 10, parallel_units: int = 190,
                   repeats: int = 3, progress: bool = True) -> list[dict]:
    """Strong scaling: the same job on p = each of ``procs`` processes (median of ``repeats``).

    Rows: p, seconds, speedup T(1)/T(p), efficiency speedup/p, karp_flatt e(p) (None at p = 1).
    ``progress``: a bar of the process counts timed (a many-core machine takes a minute or more).
    """
    procs = _check_procs(procs)
    if serial_units < 0 or parallel_units < 1 or repeats < 1:
        raise ValueError("need serial_units >= 0, parallel_units >= 1 and repeats >= 1")
    rows = []
    with progress_bar(total=len(procs) + (1 not in procs), desc="strong scaling", unit="p",
                      disable=not progress) as bar:
        t1, _ = _timed(serial_units, parallel_units, 1, repeats)
        bar.update(1 not in procs)
        for p in procs:
            t = t1 if p == 1 else _timed(serial_units, parallel_units, p, repeats)[0]
            bar.update(1)
            speedup = t1 / t
            rows.append({"p": p, "seconds": t, "speedup": speedup, "efficiency": speedup / p,
                         "karp_flatt": karp_flatt(speedup, p) if p > 1 else None})
    return rows


def measure_weak(procs: Sequence[int], serial_units: int = 10, parallel_units_per_proc: int = 95,
                 repeats: int = 3, progress: bool = True) -> list[dict]:
    """Weak scaling: p processes on a job whose parallel part is p times larger.

    Rows: p, seconds (on p processes), seconds_1 (the same job on one process), scaled_speedup
    seconds_1 / seconds, serial_share s' (serial time / seconds, measured in the p-process run)
    and gustafson = s' + (1 - s') p, the law's prediction from that share. ``progress``: a bar of
    the process counts done (the one-process baselines grow with p: minutes on 64 cores).
    """
    procs = _check_procs(procs)
    if serial_units < 0 or parallel_units_per_proc < 1 or repeats < 1:
        raise ValueError("need serial_units >= 0, parallel_units_per_proc >= 1 and repeats >= 1")
    rows = []
    for p in progress_bar(procs, desc="weak scaling", unit="p", disable=not progress):
        work = parallel_units_per_proc * p
        t1, ts1 = _timed(serial_units, work, 1, repeats)
        t, ts = (t1, ts1) if p == 1 else _timed(serial_units, work, p, repeats)
        share = min(1.0, ts / t)
        rows.append({"p": p, "seconds": t, "seconds_1": t1, "scaled_speedup": t1 / t,
                     "serial_share": share, "gustafson": gustafson_speedup(share, p)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.experiments.scaling_measure",
                                 description="Measure strong scaling of a job with a known serial part.")
    cores = os.cpu_count() or 1
    ap.add_argument("--procs", default=",".join(str(2 ** k) for k in range(cores.bit_length())),
                    help="process counts, e.g. 1,2,4 (default: powers of 2 up to the cores)")
    ap.add_argument("--serial-units", type=int, default=10)
    ap.add_argument("--parallel-units", type=int, default=190)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    try:
        procs = [int(x) for x in a.procs.split(",")]
    except ValueError:
        ap.error(f"--procs takes whole numbers separated by commas, got {a.procs!r}")
    strong = measure_strong(procs, a.serial_units, a.parallel_units, a.repeats)
    print(f"serial part written in: s = {a.serial_units / (a.serial_units + a.parallel_units):.3f}")
    for r in strong:
        kf = "" if r["karp_flatt"] is None else f"  Karp-Flatt e = {r['karp_flatt']:.3f}"
        print(f"p = {r['p']:3d}: {r['seconds'] * 1e3:8.1f} ms  speedup {r['speedup']:.2f}{kf}")
    if max(procs) > 1:
        print(f"fitted Amdahl serial fraction s = "
              f"{fit_serial_fraction([r['p'] for r in strong], [r['speedup'] for r in strong]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
