"""The classic PRAM algorithms, each a short step function wrapped in a :class:`Program`.

Counts (the tests check each one; n a power of two where marked *):

- ``tree_sum``*  EREW, n/2 processors: log2 n steps, n - 1 additions (JaJa 1992, sec. 2.1).
- ``prefix_hillis_steele``*  CREW, n processors: log2 n steps and sum over d = 1..log2 n of
  (n - 2^(d-1)) additions = n log2 n - n + 1 (Hillis & Steele, CACM 29(12), 1986).
- ``prefix_blelloch``*  EREW, n/2 processors: up-sweep, clear, down-sweep: 2 log2 n + 1 steps,
  2(n - 1) additions and n - 1 swaps (Blelloch, CMU-CS-90-190, 1990).
- ``max_crcw``  CRCW-common, n^2 processors, 3 steps; ``tree_max``* EREW in log2 n steps
  (JaJa 1992, sec. 2.6.1; Shiloach & Vishkin 1981).
- ``or_crcw``  CRCW-common, n processors, 1 step; ``or_tree``*  EREW/CREW in log2 n steps
  (OR needs Omega(log n) steps on CREW: Cook, Dwork & Reischuk, SIAM J. Comput. 15, 1986).
- ``matmul``*  CREW, n^3 processors, 1 + log2 n steps (JaJa 1992, sec. 1.3).
- ``broadcast_crew``  CREW, 1 step; ``broadcast_erew``*  EREW by doubling, log2 n steps.

Inputs are random integers from ``seed`` unless given, so results are exact. The names the CLI
and the plots choose from are in :mod:`course_lib.pram.catalog`.
"""

from __future__ import annotations

import itertools
import operator
import random
from collections.abc import Callable

from .machine import MAX_PROCESSORS
from .models import ProcessorLimitError
from .program import Program, coords, phases

__all__ = ["broadcast_crew", "broadcast_erew", "check_n", "matmul", "max_crcw", "or_crcw", "or_tree",
           "prefix_blelloch", "prefix_hillis_steele", "tree_max", "tree_sum"]


def check_n(name: str, n: int, power_of_two: bool = True) -> int:
    """``n`` itself, or a ValueError saying what to change."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name}: n must be a positive integer, got {n!r}")
    if power_of_two and n & (n - 1):
        lo = 1 << (n.bit_length() - 1)
        raise ValueError(f"{name} needs n to be a power of two, got n={n}; "
                         f"try n={lo} or n={2 * lo}")
    return n


def _numbers(n: int, seed: int, values: list | None = None) -> list:
    if values is not None:
        if len(values) != n:
            raise ValueError(f"got {len(values)} values for n={n}")
        return list(values)
    rng = random.Random(seed)
    return [rng.randint(0, 99) for _ in range(n)]


def _tree(name: str, n: int, values: list, op: Callable, op_name: str) -> Program:
    """Balanced-tree reduction of A into A[0] with n/2 processors (EREW)."""
    check_n(name, n)

    def step(pid, step, mem):
        stride, i = 2 ** step, 2 * pid
        if pid % stride == 0 and i + stride < n:  # at step s, every 2^s-th processor works
            mem["A"][i] = op(mem["A"][i], mem["A"][i + stride])
            mem.op(op_name)

    total = values[0]
    for v in values[1:]:
        total = op(total, v)
    return Program(name, step, max(1, n // 2), {"A": values}, model="EREW",
                   expected=lambda: {"A": {0: total}},
                   note=f"balanced binary tree of '{op_name}': A[0] holds the result")


def tree_sum(n: int, seed: int = 0, values: list | None = None) -> Program:
    """Sum into A[0]: EREW, n/2 processors, log2 n steps, n - 1 additions."""
    return _tree("tree-sum", n, _numbers(check_n("tree-sum", n), seed, values), operator.add, "add")


def tree_max(n: int, seed: int = 0, values: list | None = None) -> Program:
    """Maximum into A[0]: EREW, n/2 processors, log2 n steps, n - 1 comparisons."""
    return _tree("tree-max", n, _numbers(check_n("tree-max", n), seed, values), max, "max")


def or_tree(n: int, seed: int = 0, bits: list | None = None) -> Program:
    """OR of n bits into A[0] on EREW/CREW: log2 n steps (the CREW lower bound is Omega(log n))."""
    bits = _bits("or-tree", n, seed, bits)
    return _tree("or-tree", n, bits, operator.or_, "or")


def prefix_hillis_steele(n: int, seed: int = 0, values: list | None = None) -> Program:
    """Inclusive prefix sums in place: CREW, n processors, log2 n steps.

    At step s processor i >= 2^s adds A[i - 2^s] into A[i]; A[j] is read by processors j and
    j + 2^s in the same step, so the algorithm needs concurrent reads.
    """
    check_n("prefix-hillis-steele", n)
    values = _numbers(n, seed, values)

    def step(pid, step, mem):
        d = 2 ** step
        if d <= pid:
            mem["A"][pid] = mem["A"][pid] + mem["A"][pid - d]
            mem.op("add")

    return Program("prefix-hillis-steele", step, n, {"A": values}, model="CREW",
                   expected=lambda: {"A": list(itertools.accumulate(values))},
                   note="not work-efficient: n log2 n - n + 1 additions instead of n - 1")


def prefix_blelloch(n: int, seed: int = 0, values: list | None = None) -> Program:
    """Exclusive prefix sums in place: EREW, n/2 processors, 2 log2 n + 1 steps.

    Up-sweep builds partial sums up a tree; the root is cleared; the down-sweep swaps each
    left child with its parent and adds: 2(n - 1) additions and n - 1 swaps in all.
    """
    check_n("prefix-blelloch", n)
    values, levels = _numbers(n, seed, values), n.bit_length() - 1

    def up(pid, d, mem):            # level d: nodes 2^(d+1) apart
        width = 2 ** (d + 1)
        right, left = pid * width + width - 1, pid * width + width // 2 - 1
        if right < n:
            mem["A"][right] = mem["A"][left] + mem["A"][right]
            mem.op("add")

    def clear(pid, _, mem):
        if pid == 0:
            mem["A"][n - 1] = 0
            mem.op("clear")

    def down(pid, j, mem):          # levels in reverse: d = levels - 1 - j
        width = 2 ** (levels - j)
        right, left = pid * width + width - 1, pid * width + width // 2 - 1
        if right < n:
            a, b = mem["A"][left], mem["A"][right]
            mem["A"][left], mem["A"][right] = b, a + b
            mem.op("swap")
            mem.op("add")

    step = phases((up, levels), (clear, 1), (down, levels))
    return Program("prefix-blelloch", step, max(1, n // 2), {"A": values}, step.steps,
                   model="EREW", expected=lambda: {"A": [0, *itertools.accumulate(values)][:-1]},
                   note="work-efficient: O(n) operations in O(log n) steps")


def max_crcw(n: int, seed: int = 0, values: list | None = None) -> Program:
    """Maximum in 3 steps with n^2 processors on CRCW-common.

    Step 0: every M[i] = 1 ("A[i] may be the max"). Step 1: processor (i, j) writes M[i] = 0
    when A[i] < A[j]; all such writers write 0, so the common rule holds. Step 2: the i with
    M[i] = 1 write A[i] to R[0]; ties write equal values.
    """
    check_n("max-crcw", n, power_of_two=False)
    values = _numbers(n, seed, values)

    def step(pid, step, mem):
        i, j = coords(pid, (n, n))
        if step == 0 and j == 0:
            mem["M"][i] = 1
            mem.op("init")
        elif step == 1:
            if mem["A"][i] < mem["A"][j]:
                mem["M"][i] = 0
            mem.op("compare")
        elif step == 2 and j == 0:
            if mem["M"][i] == 1:
                mem["R"][0] = mem["A"][i]
            mem.op("select")

    return Program("max-crcw", step, n * n, {"A": values, "M": [0] * n, "R": [None]},
                   model="CRCW-common", expected=lambda: {"R": [max(values)]},
                   note="O(1) time but n^2 processors: work O(n^2) against n - 1 for a tree")


def _bits(name: str, n: int, seed: int, bits: list | None) -> list[int]:
    check_n(name, n, power_of_two=False)
    if bits is None:
        rng = random.Random(seed)
        return [int(rng.random() < 0.5) for _ in range(n)]
    if len(bits) != n or any(b not in (0, 1) for b in bits):
        raise ValueError(f"bits must be n={n} values, each 0 or 1")
    return list(bits)


def or_crcw(n: int, seed: int = 0, bits: list | None = None) -> Program:
    """OR of n bits in 1 step on CRCW-common: every processor holding a 1 writes 1 to R[0]."""
    bits = _bits("or-crcw", n, seed, bits)

    def step(pid, step, mem):
        if step == 0:
            if mem["B"][pid] == 1:
                mem["R"][0] = 1
            mem.op("or")

    return Program("or-crcw", step, n, {"B": bits, "R": [0]}, model="CRCW-common",
                   expected=lambda: {"R": [int(any(bits))]},
                   note="several writers, all writing 1: legal under the common rule")


def matmul(n: int, seed: int = 0, max_processors: int = MAX_PROCESSORS) -> Program:
    """C = A @ B with n^3 processors on CREW: 1 + log2 n steps.

    Step 0: processor (i, j, k) computes P[i, j, k] = A[i, k] * B[k, j] (A[i, k] is read by
    all n processors (i, *, k): concurrent reads). Then log2 n tree steps sum P[i, j, :];
    the last one writes C[i, j].
    """
    check_n("matmul", n)
    if n ** 3 > max_processors:  # before n^3 cells of memory are built (n=1024: a billion)
        raise ProcessorLimitError(f"matmul needs n^3 = {n ** 3:,} processors, more than the {max_processors:,} "
                                  "allowed; use a smaller n or raise max_processors (here and in run)")
    rng = random.Random(seed)
    A = [[rng.randint(-9, 9) for _ in range(n)] for _ in range(n)]
    B = [[rng.randint(-9, 9) for _ in range(n)] for _ in range(n)]

    def step(pid, step, mem):
        i, j, k = coords(pid, (n, n, n))
        if step == 0:
            x = mem["A"][i, k] * mem["B"][k, j]
            mem.op("mul")
        else:
            stride = 2 ** (step - 1)
            if k % (2 * stride) or k + stride >= n:
                return
            x = mem["P"][i, j, k] + mem["P"][i, j, k + stride]
            mem.op("add")
        if 2 ** step < n:
            mem["P"][i, j, k] = x
        elif k == 0:                   # P[i, j, 0] now holds the whole dot product
            mem["C"][i, j] = x

    C = [[sum(A[i][k] * B[k][j] for k in range(n)) for j in range(n)] for i in range(n)]
    memory = {"A": A, "B": B, "P": [[[0] * n for _ in range(n)] for _ in range(n)],
              "C": [[0] * n for _ in range(n)]}
    return Program("matmul", step, n ** 3, memory, model="CREW", expected=lambda: {"C": C},
                   note="n^3 multiplications in one step, then a log-depth sum per output")


def broadcast_crew(n: int, seed: int = 0, value: int | None = None) -> Program:
    """B[0] copied to all of B in 1 step on CREW: processors 1..n-1 all read B[0]."""
    check_n("broadcast-crew", n, power_of_two=False)
    value = _numbers(1, seed)[0] if value is None else value

    def step(pid, step, mem):
        if step == 0 and pid > 0:
            mem["B"][pid] = mem["B"][0]
            mem.op("copy")

    return Program("broadcast-crew", step, n, {"B": [value] + [0] * (n - 1)}, model="CREW",
                   expected=lambda: {"B": [value] * n}, note="O(1) with concurrent reads")


def broadcast_erew(n: int, seed: int = 0, value: int | None = None) -> Program:
    """B[0] copied to all of B by doubling on EREW: at step s, B[i] -> B[i + 2^s], log2 n steps."""
    check_n("broadcast-erew", n)
    value = _numbers(1, seed)[0] if value is None else value

    def step(pid, step, mem):
        d = 2 ** step
        if pid < d and pid + d < n:
            mem["B"][pid + d] = mem["B"][pid]
            mem.op("copy")

    return Program("broadcast-erew", step, n, {"B": [value] + [0] * (n - 1)}, model="EREW",
                   expected=lambda: {"B": [value] * n},
                   note="each copy is read by one processor, so the copies double per step")
