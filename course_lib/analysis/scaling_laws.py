"""python -m course_lib.analysis.scaling_laws --procs 1,2 --serial-units 10 --parallel-units 190

Amdahl's and Gustafson's laws, and how to measure a serial fraction on the machine you have.

Amdahl (1967): if a fraction s of a job's single-processor time cannot be parallelised, p
processors give at most

    S(p) = 1 / (s + (1 - s) / p)          -> 1 / s when p grows   (strong scaling: fixed job)

Gustafson (1988): if the job grows with p so that the parallel run takes as long as before, and
s' is the serial share of *that* run's time, the scaled speedup is

    S(p) = s' + (1 - s') p                                         (weak scaling: growing job)

Karp and Flatt (1990): from a measured speedup S on p > 1 processors, the experimentally
determined serial fraction

    e(p) = (1 / S - 1 / p) / (1 - 1 / p)

is the s for which Amdahl's law gives exactly S. It stays constant when Amdahl's model holds,
and grows with p when the overhead of running in parallel (starting work, collecting results,
contention) grows with p.

Sources: G. M. Amdahl, "Validity of the single processor approach to achieving large scale
computing capabilities", AFIPS Spring Joint Computer Conference, 1967; J. L. Gustafson,
"Reevaluating Amdahl's law", Communications of the ACM 31(5), 1988; A. H. Karp and H. P. Flatt,
"Measuring parallel processor performance", Communications of the ACM 33(5), 1990.

The measured workload (:func:`measure_strong`, :func:`measure_weak`) is a job with a known serial
part: ``serial_units`` units of pure-Python work done by one process, then ``parallel_units``
units split evenly over a pool of p worker processes. The fraction we wrote in is known, so the
measured e(p) shows how much overhead running in parallel adds on this machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Sequence

UNIT_ITERS = 20_000  # loop iterations in one unit of work (about 1 ms on a laptop core)


# ------------------------------------------------------------------------------------- the laws

def _check_fraction(s: float) -> float:
    if not 0.0 <= s <= 1.0:
        raise ValueError(f"a serial fraction is between 0 and 1, got {s!r}")
    return float(s)


def _check_p(p: float) -> float:
    if not p >= 1:
        raise ValueError(f"the number of processors p must be >= 1, got {p!r}")
    return float(p)


def amdahl_speedup(s: float, p: float) -> float:
    """Amdahl's speedup on p processors of a job with serial fraction s: 1 / (s + (1 - s) / p)."""
    s, p = _check_fraction(s), _check_p(p)
    return 1.0 / (s + (1.0 - s) / p)


def gustafson_speedup(s: float, p: float) -> float:
    """Gustafson's scaled speedup: s + (1 - s) p, s the serial share of the parallel run's time."""
    s, p = _check_fraction(s), _check_p(p)
    return s + (1.0 - s) * p


def karp_flatt(speedup: float, p: float) -> float:
    """The experimentally determined serial fraction (1/S - 1/p) / (1 - 1/p), for p > 1."""
    p = _check_p(p)
    if p == 1:
        raise ValueError("the Karp-Flatt metric needs p > 1 (on one processor every job is 'serial')")
    if not speedup > 0:
        raise ValueError(f"a speedup is > 0, got {speedup!r}")
    return (1.0 / speedup - 1.0 / p) / (1.0 - 1.0 / p)


def fit_serial_fraction(procs: Sequence[float], speedups: Sequence[float]) -> float:
    """The s of Amdahl's law that best fits measured (p, S) pairs, clipped to [0, 1].

    1/S = s + (1 - s)/p, i.e. 1/S - 1/p = s (1 - 1/p): least squares on that line through the
    origin (points with p = 1 carry no information and are ignored).
    """
    if len(procs) != len(speedups):
        raise ValueError("procs and speedups must have the same length")
    pairs = [(_check_p(p), float(S)) for p, S in zip(procs, speedups) if p > 1]
    if not pairs:
        raise ValueError("fitting a serial fraction needs at least one measurement with p > 1")
    if any(S <= 0 for _, S in pairs):
        raise ValueError("speedups must be > 0")
    num = sum((1 - 1 / p) * (1 / S - 1 / p) for p, S in pairs)
    den = sum((1 - 1 / p) ** 2 for p, _ in pairs)
    return min(1.0, max(0.0, num / den))


def training_flops(n_params: float, n_tokens: float) -> float:
    """FLOPs to train a dense transformer: about 6 N D (2 N per token forward, 4 N backward;
    Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Sec. 2.1)."""
    if not (n_params > 0 and n_tokens > 0):
        raise ValueError("n_params and n_tokens must be > 0")
    return 6.0 * n_params * n_tokens


def training_time_s(n_params: float, n_tokens: float, peak_flops: float, mfu: float = 0.4,
                    n_devices: int = 1) -> float:
    """Seconds to train on ``n_devices`` devices that each reach ``mfu`` of ``peak_flops``
    (perfect scaling assumed: the best case)."""
    if not peak_flops > 0 or not 0 < mfu <= 1 or n_devices < 1:
        raise ValueError("need peak_flops > 0, 0 < mfu <= 1 and n_devices >= 1")
    return training_flops(n_params, n_tokens) / (peak_flops * mfu * n_devices)


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
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
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
                   repeats: int = 3) -> list[dict]:
    """Strong scaling: the same job on p = each of ``procs`` processes (median of ``repeats``).

    Rows: p, seconds, speedup T(1)/T(p), efficiency speedup/p, karp_flatt e(p) (None at p = 1).
    """
    procs = _check_procs(procs)
    if serial_units < 0 or parallel_units < 1 or repeats < 1:
        raise ValueError("need serial_units >= 0, parallel_units >= 1 and repeats >= 1")
    t1, _ = _timed(serial_units, parallel_units, 1, repeats)
    rows = []
    for p in procs:
        t = t1 if p == 1 else _timed(serial_units, parallel_units, p, repeats)[0]
        speedup = t1 / t
        rows.append({"p": p, "seconds": t, "speedup": speedup, "efficiency": speedup / p,
                     "karp_flatt": karp_flatt(speedup, p) if p > 1 else None})
    return rows


def measure_weak(procs: Sequence[int], serial_units: int = 10, parallel_units_per_proc: int = 95,
                 repeats: int = 3) -> list[dict]:
    """Weak scaling: p processes on a job whose parallel part is p times larger.

    Rows: p, seconds (on p processes), seconds_1 (the same job on one process), scaled_speedup
    seconds_1 / seconds, serial_share s' (serial time / seconds, measured in the p-process run)
    and gustafson = s' + (1 - s') p, the law's prediction from that share.
    """
    procs = _check_procs(procs)
    if serial_units < 0 or parallel_units_per_proc < 1 or repeats < 1:
        raise ValueError("need serial_units >= 0, parallel_units_per_proc >= 1 and repeats >= 1")
    rows = []
    for p in procs:
        work = parallel_units_per_proc * p
        t1, ts1 = _timed(serial_units, work, 1, repeats)
        t, ts = (t1, ts1) if p == 1 else _timed(serial_units, work, p, repeats)
        share = min(1.0, ts / t)
        rows.append({"p": p, "seconds": t, "seconds_1": t1, "scaled_speedup": t1 / t,
                     "serial_share": share, "gustafson": gustafson_speedup(share, p)})
    return rows


def speedup_table(runs: Sequence[dict]) -> list[dict]:
    """Throughput speedup and parallel efficiency of training runs on different rank counts.

    runs: dicts with ``ranks``, ``ms_per_iter`` and ``tokens_per_iter`` (other keys are kept).
    Adds ``tokens_per_s``, ``speedup`` = tokens/s over that of the run with the fewest ranks (the
    first such run), and ``efficiency`` = speedup / (ranks / its ranks). With a fixed micro-batch
    per rank this is Gustafson's scaled speedup (the global batch grows with the ranks); with a
    fixed global batch, Amdahl's (tokens per iteration equal, so it is the ratio of times).
    """
    if not runs:
        raise ValueError("speedup_table needs at least one run")
    for r in runs:
        if not (r["ranks"] >= 1 and r["ms_per_iter"] > 0 and r["tokens_per_iter"] > 0):
            raise ValueError(f"each run needs ranks >= 1, ms_per_iter > 0 and tokens_per_iter > 0, got {r!r}")
    base = min(runs, key=lambda r: r["ranks"])
    base_tps = base["tokens_per_iter"] / (base["ms_per_iter"] / 1e3)
    rows = []
    for r in runs:
        tps = r["tokens_per_iter"] / (r["ms_per_iter"] / 1e3)
        speedup = tps / base_tps
        rows.append({**r, "tokens_per_s": tps, "speedup": speedup,
                     "efficiency": speedup / (r["ranks"] / base["ranks"])})
    return rows


# ------------------------------------------------------------------------------------ the plot

def plot_scaling(strong: Sequence[dict], s_fit: float, weak: Sequence[dict] | None = None,
                 s_written: float | None = None, p_max: int = 1024):
    """Two panels: measured strong-scaling speedups with Amdahl's curve for ``s_fit``; and the
    laws extrapolated to ``p_max`` processors (Amdahl's ceiling 1/s vs Gustafson's line), with the
    measured weak-scaling points. Returns a matplotlib Figure."""
    from matplotlib.figure import Figure

    if not strong:
        raise ValueError("plot_scaling needs strong-scaling rows (measure_strong)")
    _check_fraction(s_fit)
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    ps = [r["p"] for r in strong]
    grid = [1 + i * (max(ps) - 1) / 50 for i in range(51)]
    ax1.plot(grid, grid, "k:", label="ideal: S = p")
    ax1.plot(grid, [amdahl_speedup(s_fit, p) for p in grid], label=f"Amdahl, fitted s = {s_fit:.3f}")
    if s_written is not None:
        ax1.plot(grid, [amdahl_speedup(s_written, p) for p in grid], "--",
                 label=f"Amdahl, serial part written in s = {s_written:.3f}")
    ax1.plot(ps, [r["speedup"] for r in strong], "o", color="C3", label="measured")
    ax1.set_xlabel("processes p")
    ax1.set_ylabel("speedup T(1) / T(p)")
    ax1.set_title("Strong scaling on this machine")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)

    big = [2 ** k for k in range(max(1, p_max).bit_length())]
    ax2.plot(big, big, "k:", label="ideal")
    ax2.plot(big, [amdahl_speedup(s_fit, p) for p in big], marker=".",
             label=f"Amdahl (fixed job), fitted s = {s_fit:.3f}, ceiling {1 / s_fit:.0f}" if s_fit
             else "Amdahl (fixed job), fitted s = 0")
    if s_written is not None:
        ax2.plot(big, [amdahl_speedup(s_written, p) for p in big], "--",
                 label=f"Amdahl, s = {s_written:.3f} as written, ceiling {1 / s_written:.0f}" if s_written
                 else "Amdahl, s = 0 as written")
    s_weak = statistics.mean(r["serial_share"] for r in weak) if weak else s_fit
    ax2.plot(big, [gustafson_speedup(s_weak, p) for p in big], marker=".",
             label=f"Gustafson (growing job), s' = {s_weak:.3f}")
    if weak:
        ax2.plot([r["p"] for r in weak], [r["scaled_speedup"] for r in weak], "o", color="C3",
                 label="measured scaled speedup")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel("processes p")
    ax2.set_ylabel("speedup")
    ax2.set_title("Extrapolated: fixed vs growing job")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3, which="both")
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.analysis.scaling_laws",
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
