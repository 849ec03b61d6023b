"""Amdahl's and Gustafson's laws, the Karp-Flatt serial fraction, and what a training run costs.

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

The measured side (a job with a serial part we write in, run on real processes) is
:mod:`course_lib.experiments.scaling_measure`; the figure is
:func:`course_lib.notebook.plots.plot_scaling`.
"""

from __future__ import annotations

from collections.abc import Sequence

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
