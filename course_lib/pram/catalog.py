"""The named PRAM algorithms ``course pram`` and the notebook's plots choose from.

Each :class:`Algorithm` records the builder of :mod:`course_lib.pram.algorithms`, the PRAM model it
is written for, how many processors it uses for a given n, and a one-line summary for ``--help``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import algorithms as A
from .program import Program

__all__ = ["ALGORITHMS", "Algorithm", "get_algorithm"]


@dataclass(frozen=True)
class Algorithm:
    """A named algorithm for the CLI: builder, the model it is written for, processors(n)."""

    name: str
    build: Callable[..., Program]
    model: str
    processors: Callable[[int], int]
    power_of_two: bool
    summary: str


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in [
    Algorithm("tree-sum", A.tree_sum, "EREW", lambda n: max(1, n // 2), True,
              "sum by a balanced tree: log2 n steps, n-1 additions"),
    Algorithm("tree-max", A.tree_max, "EREW", lambda n: max(1, n // 2), True,
              "maximum by a balanced tree: log2 n steps"),
    Algorithm("prefix-hillis-steele", A.prefix_hillis_steele, "CREW", lambda n: n, True,
              "inclusive scan, log2 n steps, n log2 n - n + 1 additions"),
    Algorithm("prefix-blelloch", A.prefix_blelloch, "EREW", lambda n: max(1, n // 2), True,
              "work-efficient exclusive scan: 2(n-1) additions, n-1 swaps"),
    Algorithm("max-crcw", A.max_crcw, "CRCW-common", lambda n: n * n, False,
              "maximum in 3 steps with n^2 processors"),
    Algorithm("or-crcw", A.or_crcw, "CRCW-common", lambda n: n, False, "OR of n bits in 1 step"),
    Algorithm("or-tree", A.or_tree, "EREW", lambda n: max(1, n // 2), True,
              "OR of n bits by a tree: log2 n steps"),
    Algorithm("matmul", A.matmul, "CREW", lambda n: n ** 3, True,
              "n x n matrix product, n^3 processors, 1 + log2 n steps"),
    Algorithm("broadcast-crew", A.broadcast_crew, "CREW", lambda n: n, False,
              "one value to n cells in 1 step"),
    Algorithm("broadcast-erew", A.broadcast_erew, "EREW", lambda n: n, True,
              "one value to n cells by doubling: log2 n steps"),
]}


def get_algorithm(name: str) -> Algorithm:
    """The :class:`Algorithm` called ``name`` (underscores or dashes), or a clear ValueError."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in ALGORITHMS:
        raise ValueError(f"unknown PRAM algorithm {name!r}; choose one of: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[key]
