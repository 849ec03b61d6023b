"""Alpha-beta cost model of collective communication, and the bytes each rank moves.

A message of n bytes between two ranks takes alpha + n * beta seconds: alpha is the latency
(start-up) and beta = 1 / bandwidth the time per byte; gamma is the time per byte of a reduction
(an addition), 0 by default. p is the number of ranks. Formulas from Thakur, Rabenseifner and
Gropp, "Optimization of Collective Communication Operations in MPICH", IJHPCA 19(1), 2005,
Sections 4.1-4.5 (lg p = log2 p, taken as ceil(log2 p) when p is not a power of two); the ring
all-reduce from Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 69(2), 2009:

    broadcast       linear              (p-1)(alpha + n beta)        root sends p-1 copies
                    binomial            lg p (alpha + n beta)
                    scatter_allgather   (lg p + p - 1) alpha + 2 (p-1)/p n beta   (van de Geijn)
    reduce          linear              (p-1)(alpha + n beta + n gamma)   everyone sends to root
                    binomial            lg p (alpha + n beta + n gamma)
                    rabenseifner        2 lg p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
    all_reduce      naive               linear reduce + linear broadcast through one root
                    tree                binomial reduce + binomial broadcast
                    recursive_doubling  lg p (alpha + n beta + n gamma)
                    ring                2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
                    rabenseifner        2 lg p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
    reduce_scatter  ring (pairwise)     (p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma
                    recursive_halving   lg p alpha + (p-1)/p n beta + (p-1)/p n gamma
    all_gather      ring                (p-1) alpha + (p-1)/p n beta
                    recursive_doubling  lg p alpha + (p-1)/p n beta
                    bruck               lg p alpha + (p-1)/p n beta
    all_to_all      pairwise            (p-1) alpha + (p-1)/p n beta     one exchange per peer
                    bruck               lg p alpha + lg p n/2 beta       (Bruck et al. 1997)

For reduce_scatter n is the size of the whole input (p pieces) and for all_gather the size of the
whole output, as in nccl-tests; for all_to_all n is one rank's whole send buffer (p blocks, one per
destination, its own included: the (p-1)/p of it that leaves the rank is what nccl-tests'
alltoall bus bandwidth counts). MPICH's all-to-all (Thakur et al., the all-to-all section) uses
Bruck's index algorithm for short messages (lg p steps, each moving about half the buffer) and the
pairwise exchange for long ones (p-1 steps, each to one peer). Mixture-of-experts layers send
their tokens to the experts' ranks and back with it: :func:`moe_all_to_all_bytes`.
Bruck, Ho, Kipnis, Upfal and Weathersby, "Efficient algorithms for all-to-all communications in
multiport message-passing systems", IEEE TPDS 8(11), 1997: the index algorithm.

2 (p-1)/p n beta is the least any all-reduce can take (Patarasuk
and Yuan, Section 3): it does not grow with p, while the naive reduce makes the root receive
(p-1) n bytes through one link -- the congestion of :func:`congestion_example`.

Units: n in bytes, bandwidth in bytes per second, alpha in seconds (any consistent units work:
bits and bits per second give the same seconds).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from course_lib.analysis.memory import model_state_bytes
from course_lib.utils import check_count

COLLECTIVE_ALGORITHMS: dict[str, tuple[str, ...]] = {
    "broadcast": ("binomial", "linear", "scatter_allgather"),
    "reduce": ("binomial", "linear", "rabenseifner"),
    "all_reduce": ("ring", "naive", "tree", "recursive_doubling", "rabenseifner"),
    "reduce_scatter": ("ring", "recursive_halving"),
    "all_gather": ("ring", "recursive_doubling", "bruck"),
    "all_to_all": ("pairwise", "bruck"),
}
# the collectives `course bench comm` runs (the all-to-all is modelled here, measured in lesson 13)
OPS = tuple(op for op in COLLECTIVE_ALGORITHMS if op != "all_to_all")


def _lg(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def _check(op: str, nbytes: float, p: int, bandwidth: float, alpha: float, gamma: float,
           algorithm: str | None) -> str:
    if op not in COLLECTIVE_ALGORITHMS:
        raise ValueError(f"collective must be one of {OPS}, got {op!r}")
    algorithm = algorithm or COLLECTIVE_ALGORITHMS[op][0]
    if algorithm not in COLLECTIVE_ALGORITHMS[op]:
        raise ValueError(f"{op} algorithm must be one of {COLLECTIVE_ALGORITHMS[op]}, got {algorithm!r}")
    check_count("p (number of ranks)", p)
    if not nbytes >= 0:
        raise ValueError(f"message size must be >= 0, got {nbytes!r}")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0 (bytes/s), got {bandwidth!r}")
    if not (alpha >= 0 and gamma >= 0):
        raise ValueError(f"alpha and gamma must be >= 0, got alpha={alpha!r}, gamma={gamma!r}")
    return algorithm


def collective_time(op: str, nbytes: float, p: int, *, bandwidth: float, alpha: float = 0.0,
                    gamma: float = 0.0, algorithm: str | None = None) -> float:
    """Seconds for collective ``op`` on ``nbytes`` among ``p`` ranks (table in the module doc).

    ``algorithm`` defaults to the first of ``COLLECTIVE_ALGORITHMS[op]`` (ring for all_reduce).
    """
    algo = _check(op, nbytes, p, bandwidth, alpha, gamma, algorithm)
    if p == 1:
        return 0.0
    n, a, b, g, lg = float(nbytes), alpha, 1.0 / bandwidth, gamma, _lg(p)
    frac = (p - 1) / p
    if op == "broadcast":
        return {"linear": (p - 1) * (a + n * b), "binomial": lg * (a + n * b),
                "scatter_allgather": (lg + p - 1) * a + 2 * frac * n * b}[algo]
    if op == "reduce":
        return {"linear": (p - 1) * (a + n * b + n * g), "binomial": lg * (a + n * b + n * g),
                "rabenseifner": 2 * lg * a + 2 * frac * n * b + frac * n * g}[algo]
    if op == "all_reduce":
        if algo == "naive":
            return (collective_time("reduce", n, p, bandwidth=bandwidth, alpha=a, gamma=g,
                                    algorithm="linear")
                    + collective_time("broadcast", n, p, bandwidth=bandwidth, alpha=a,
                                      algorithm="linear"))
        if algo == "tree":
            return (collective_time("reduce", n, p, bandwidth=bandwidth, alpha=a, gamma=g,
                                    algorithm="binomial")
                    + collective_time("broadcast", n, p, bandwidth=bandwidth, alpha=a,
                                      algorithm="binomial"))
        return {"recursive_doubling": lg * (a + n * b + n * g),
                "ring": 2 * (p - 1) * a + 2 * frac * n * b + frac * n * g,
                "rabenseifner": 2 * lg * a + 2 * frac * n * b + frac * n * g}[algo]
    if op == "reduce_scatter":
        steps = {"ring": p - 1, "recursive_halving": lg}[algo]
        return steps * a + frac * n * b + frac * n * g
    if op == "all_to_all":
        return {"pairwise": (p - 1) * a + frac * n * b, "bruck": lg * a + lg * n / 2 * b}[algo]
    steps = {"ring": p - 1, "recursive_doubling": lg, "bruck": lg}[algo]  # all_gather
    return steps * a + frac * n * b


def _binomial_children(rank: int, p: int) -> list[int]:
    """Children of ``rank`` in a binomial tree rooted at 0 (rank r's parent is r with its lowest
    set bit cleared: 6 -> 4, 5 -> 4, 3 -> 2)."""
    children, bit = [], 1
    while bit < p:
        if rank & bit:
            break  # bits below the lowest set bit of rank are where its children hang
        if rank + bit < p:
            children.append(rank + bit)
        bit <<= 1
    return children


def traffic(op: str, nbytes: float, p: int, algorithm: str | None = None) -> list[tuple[float, float]]:
    """(bytes sent, bytes received) by each rank 0..p-1 (rank 0 is the root) for one call.

    Covered: the linear/naive, binomial/tree and ring algorithms, recursive doubling for
    all_reduce when p is a power of two, and the all-to-all (pairwise: (p-1)/p n each way;
    Bruck, p a power of two: n/2 in each of lg p steps).
    """
    algo = _check(op, nbytes, p, 1.0, 0.0, 0.0, algorithm)
    n, frac = float(nbytes), (p - 1) / p
    if p == 1:
        return [(0.0, 0.0)]
    if op == "all_to_all":
        if algo == "pairwise":
            return [(frac * n, frac * n)] * p
        if p & (p - 1) == 0:
            return [(_lg(p) * n / 2, _lg(p) * n / 2)] * p
    if algo == "ring":
        per = {"all_reduce": 2 * frac * n, "reduce_scatter": frac * n, "all_gather": frac * n}[op]
        return [(per, per)] * p
    if algo in ("linear", "naive"):
        root_out = (p - 1) * n if op in ("broadcast", "all_reduce") else 0.0
        root_in = (p - 1) * n if op in ("reduce", "all_reduce") else 0.0
        leaf_out = n if op in ("reduce", "all_reduce") else 0.0
        leaf_in = n if op in ("broadcast", "all_reduce") else 0.0
        return [(root_out, root_in)] + [(leaf_out, leaf_in)] * (p - 1)
    if algo in ("binomial", "tree"):
        # reduce: each rank receives from its children and sends once to its parent;
        # broadcast: the same edges the other way; the tree all-reduce does both.
        up = [(0.0 if r == 0 else n, len(_binomial_children(r, p)) * n) for r in range(p)]
        down = [(rv, sd) for sd, rv in up]
        if op == "reduce":
            return up
        if op == "broadcast":
            return down
        return [(u[0] + d[0], u[1] + d[1]) for u, d in zip(up, down)]
    if algo == "recursive_doubling" and op == "all_reduce" and p & (p - 1) == 0:
        return [(_lg(p) * n, _lg(p) * n)] * p
    raise ValueError(f"traffic() does not model {op} with {algo!r} for p={p}; use ring, "
                     "linear/naive or binomial/tree")


def bytes_per_rank(op: str, nbytes: float, p: int) -> float:
    """Bytes each rank sends in a bandwidth-optimal ``op`` (what nccl-tests' bus bandwidth and the
    ZeRO paper count): all_reduce 2 (p-1)/p n; reduce_scatter and all_gather (p-1)/p n (n the
    whole array); broadcast and reduce n (all of it leaves the root / arrives at the root);
    all_to_all (p-1)/p n (n one rank's send buffer, in p equal blocks; it receives as much)."""
    _check(op, nbytes, p, 1.0, 0.0, 0.0, None)
    return busbw_factor(op, p) * float(nbytes)


def zero_comm_volume(num_params: float, stage: int, dp: int, bytes_per_elem: float = 2,
                     exact: bool = True) -> dict[str, float]:
    """Bytes each data-parallel rank sends per training step, by collective (ZeRO paper, Sec. 7).

    Stage 0 all-reduces the gradients (2 Psi). Stages 1 and 2 reduce-scatter the gradients and
    all-gather the updated parameters (Psi + Psi = 2 Psi, no more than DP). Stage 3 all-gathers
    the parameters for the forward and again for the backward and reduce-scatters the gradients
    (3 Psi, 1.5x DP). ``exact`` keeps the (N-1)/N of a ring; False gives the paper's 2 Psi / 3 Psi.
    """
    model_state_bytes(num_params, dp, stage)  # validates num_params, dp and stage
    if isinstance(bytes_per_elem, bool) or not (isinstance(bytes_per_elem, numbers.Real) and bytes_per_elem > 0):
        raise ValueError(f"bytes_per_elem must be a number > 0 (2 for bf16/fp16, 4 for fp32), got {bytes_per_elem!r}")
    size = float(num_params) * bytes_per_elem
    frac = (dp - 1) / dp if exact else 1.0
    if stage == 0:
        return {"all_reduce grads": 2 * frac * size}
    if stage in (1, 2):
        return {"reduce_scatter grads": frac * size, "all_gather params": frac * size}
    return {"all_gather params (forward)": frac * size,
            "all_gather params (backward)": frac * size, "reduce_scatter grads": frac * size}


def moe_all_to_all_bytes(tokens: float, top_k: int, hidden: int, ep: int, bytes_per_value: float = 2,
                         backward: bool = True) -> dict[str, float]:
    """Bytes one rank sends per mixture-of-experts layer through the all-to-alls of expert parallelism.

    Each of this rank's ``tokens`` goes to ``top_k`` experts: the dispatch sends each of the
    tokens x top_k rows of ``hidden`` values to the rank that owns its expert, the combine sends
    the experts' outputs back (the "dispatch" and "combine" of GShard, Lepikhin et al. 2020,
    arXiv:2006.16668, each an AllToAll across the devices that hold the experts). With the experts spread evenly over ``ep`` ranks and the
    router's choices spread evenly over the experts, (ep-1)/ep of each buffer leaves the rank:
    tokens x top_k x hidden x bytes x (ep-1)/ep per all-to-all (:func:`bytes_per_rank`).
    Backward runs the two again in reverse (the combine's gradient is a dispatch and vice versa),
    so a training step sends 4x that per layer, ``backward=False`` (inference) 2x. An imbalanced
    router sends more from some ranks and less from others; dropped tokens (a capacity factor)
    send nothing.
    """
    for name, v in (("tokens", tokens), ("hidden", hidden), ("bytes_per_value", bytes_per_value)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")
    check_count("top_k", top_k)
    buffer = float(tokens) * top_k * hidden * bytes_per_value  # one all-to-all's send buffer
    one = bytes_per_rank("all_to_all", buffer, ep)
    out = {"dispatch (forward)": one, "combine (forward)": one}
    if backward:
        out.update({"combine (backward)": one, "dispatch (backward)": one})
    return out


def moe_all_to_all_time(tokens: float, top_k: int, hidden: int, ep: int, *, bandwidth: float,
                        alpha: float = 0.0, bytes_per_value: float = 2, backward: bool = True,
                        algorithm: str = "pairwise") -> float:
    """Seconds of the all-to-alls of one mixture-of-experts layer (:func:`moe_all_to_all_bytes`),
    each timed by the alpha-beta model of ``algorithm`` (nothing overlapped with computation)."""
    calls = len(moe_all_to_all_bytes(tokens, top_k, hidden, ep, bytes_per_value, backward))
    buffer = float(tokens) * top_k * hidden * bytes_per_value
    return calls * collective_time("all_to_all", buffer, ep, bandwidth=bandwidth, alpha=alpha,
                                   algorithm=algorithm)


def fit_alpha_beta(op: str, p: int, sizes, seconds, algorithm: str | None = None) -> tuple[float, float]:
    """(alpha, bandwidth) that make the model's ``op`` times match measured ones.

    The model time is linear in alpha and beta = 1/bandwidth (gamma taken as 0): a two-column
    least-squares fit, each row weighted by 1/time so that small (latency-bound) and large
    (bandwidth-bound) messages count alike; alpha is kept >= 0.
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("fit_alpha_beta needs at least two (size, seconds) pairs")
    t = np.asarray(seconds, dtype=float)
    if not (t > 0).all():
        raise ValueError("measured times must be > 0")
    c_alpha = collective_time(op, 0, p, bandwidth=1.0, alpha=1.0, algorithm=algorithm)
    c_beta = np.array([collective_time(op, n, p, bandwidth=1.0, algorithm=algorithm)
                       for n in sizes])
    design = np.column_stack([np.full(len(t), c_alpha), c_beta]) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones(len(t)), rcond=None)
    if alpha < 0:  # refit with no latency
        alpha, beta = 0.0, float(np.sum(c_beta / t) / np.sum((c_beta / t) ** 2))
    if not beta > 0:
        raise ValueError("the measured times do not grow with size; include larger messages")
    return float(alpha), float(1.0 / beta)


def fit_report(op: str, p: int, sizes, seconds, alpha: float, bandwidth: float, tolerance: float = 0.3,
               algorithm: str | None = None) -> str:
    """One line on how well a fit (:func:`fit_alpha_beta`) explains the measured times: its worst
    relative miss, and a warning above ``tolerance`` (a busy machine, or sizes that fall out of the
    caches, give times that no alpha and bandwidth explain; the fit then says little). ``algorithm``:
    the one the fit assumed (None: :func:`collective_time`'s default)."""
    model = [collective_time(op, n, p, bandwidth=bandwidth, alpha=alpha, algorithm=algorithm) for n in sizes]
    misses = [abs(m - t) / t for m, t in zip(model, seconds)]
    worst = max(range(len(misses)), key=misses.__getitem__)
    if misses[worst] <= tolerance:
        return f"the model is within {misses[worst]:.0%} of every measured time"
    return (f"warning: the model misses the {sizes[worst]:,}-byte time by {misses[worst]:.0%}: these times are "
            "too noisy (or the large sizes fall out of the caches) to read alpha and the bandwidth from; "
            "rerun on an idle machine")


# nccl-tests, doc/PERFORMANCE.md: busbw = algbw x factor, so busbw compares with the link speed.
def busbw_factor(op: str, n: int) -> float:
    """The nccl-tests correction factor: all_reduce 2(n-1)/n; reduce_scatter, all_gather,
    all_to_all (n-1)/n; broadcast, reduce 1."""
    if op not in COLLECTIVE_ALGORITHMS:
        raise ValueError(f"collective must be one of {tuple(COLLECTIVE_ALGORITHMS)}, got {op!r}")
    check_count("number of ranks", n)
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_gather": (n - 1) / n, "all_to_all": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}[op]


def algbw(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth S / t in bytes per second (nccl-tests)."""
    if not seconds > 0:
        raise ValueError(f"time must be > 0 s, got {seconds!r}")
    return size_bytes / seconds


def busbw(op: str, size_bytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth algbw x factor in bytes per second (nccl-tests)."""
    return algbw(size_bytes, seconds) * busbw_factor(op, n)


def congestion_example(n_senders: int = 4, message: float = 1e9, link: float = 10e9,
                       alpha: float = 0.0) -> dict[str, float]:
    """Seconds for n_senders nodes each sending ``message`` (1 Gb of gradients) to one node
    through its ``link`` (10 Gb/s), against the collectives that avoid the hot spot.

    With the defaults the naive reduce takes 4 x 1 Gb / 10 Gb/s = 0.4 s at the receiving node
    (the update-phase bottleneck of the distributed GPT-2 wiki); a ring all-reduce among the
    p = 5 nodes takes 2 (p-1)/p x 0.1 s = 0.16 s and leaves every node with the sum.
    """
    p = n_senders + 1
    kw = {"bandwidth": link, "alpha": alpha}
    return {
        "p": p,
        "naive_reduce": collective_time("reduce", message, p, algorithm="linear", **kw),
        "naive_all_reduce": collective_time("all_reduce", message, p, algorithm="naive", **kw),
        "tree_all_reduce": collective_time("all_reduce", message, p, algorithm="tree", **kw),
        "ring_reduce_scatter": collective_time("reduce_scatter", message, p, **kw),
        "ring_all_reduce": collective_time("all_reduce", message, p, algorithm="ring", **kw),
        "lower_bound_all_reduce": 2 * (p - 1) / p * message / link,
    }
