"""Shared memory of the PRAM: named arrays laid out one after another in one address space.

``Memory({"A": [3, 1, 4, 1], "W": [[1, 2], [3, 4]]})`` gives ``A`` addresses 0-3 and ``W``
addresses 4-7 (row-major). Error messages name both the address and the array cell
(``"address 5 (W[0, 1])"``) so a notebook can point at either.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Array", "Memory", "filled", "flatten", "value_text"]


def value_text(v: Any) -> str:
    """A cell's value in a message: floats to 6 significant digits, anything else as its repr."""
    return f"{v:.6g}" if isinstance(v, float) else repr(v)


@dataclass(frozen=True)
class Array:
    """An array given by its ``shape`` and its row-major ``data`` (a flat list)."""

    shape: tuple[int, ...]
    data: list

    def __post_init__(self):
        if math.prod(self.shape) != len(self.data):
            raise ValueError(f"shape {self.shape} needs {math.prod(self.shape)} values, "
                             f"got {len(self.data)}")


def filled(shape: int | tuple[int, ...], value: Any = 0) -> Array:
    """An array of ``shape`` with every cell set to ``value`` (e.g. ``filled((2, 3), 0.0)``)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return Array(shape, [value] * math.prod(shape))


def flatten(value: Any) -> Array:
    """An :class:`Array` from a nested list, a numpy array, a torch tensor or a scalar."""
    if isinstance(value, Array):
        return Array(value.shape, list(value.data))
    if hasattr(value, "tolist") and hasattr(value, "shape"):  # numpy array, torch tensor
        shape, value = tuple(value.shape), value.tolist()
        if not shape:
            return Array((1,), [value])
        return Array(shape, _flat_list(value, len(shape)))
    if not isinstance(value, (list, tuple)):
        return Array((1,), [value])
    shape, node = [], value
    while isinstance(node, (list, tuple)):
        shape.append(len(node))
        node = node[0] if node else None
    _check_rectangular(value, shape)
    return Array(tuple(shape), _flat_list(value, len(shape)))


def _check_rectangular(nested: Any, shape: list[int]) -> None:
    """A ValueError naming the first row that does not match ``shape``, the shape read off the
    first element at each depth: without it [[1, 2], [3, 4, 5], [6]] (6 values) would load
    silently as a (3, 2) array with its values shifted between rows."""

    def index(position: int, depth: int) -> list[int]:   # row-major position -> [i, j, ...]
        out = []
        for size in reversed(shape[:depth]):
            position, r = divmod(position, size)
            out.append(r)
        return out[::-1]

    level = [nested]
    for depth, n in enumerate(shape):
        for k, node in enumerate(level):
            if not isinstance(node, (list, tuple)) or len(node) != n:
                got = f"a list of {len(node)}" if isinstance(node, (list, tuple)) else repr(node)
                raise ValueError(f"ragged nested list: element {index(k, depth)} is {got}, "
                                 f"expected a list of {n} like element {[0] * depth}")
        level = [x for node in level for x in node]
    for k, leaf in enumerate(level):
        if isinstance(leaf, (list, tuple)):
            raise ValueError(f"ragged nested list: element {index(k, len(shape))} is the list "
                             f"{leaf!r}, expected a single value like element {[0] * len(shape)}")


def _flat_list(nested: Any, depth: int) -> list:
    for _ in range(depth - 1):
        nested = [x for row in nested for x in row]
    return list(nested)


def _nest(flat: list, shape: tuple[int, ...]) -> list:
    for size in reversed(shape[1:]):
        flat = [flat[i:i + size] for i in range(0, len(flat), size)]
    return flat


class Memory:
    """Named arrays in one flat list of cells (``cells``); ``bases[name]`` is the first address."""

    def __init__(self, arrays: Mapping[str, Any]):
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.bases: dict[str, int] = {}
        self.cells: list = []
        if not isinstance(arrays, Mapping):
            raise ValueError(f"memory must be a dict of named arrays, such as {{'A': [3, 1, 4]}}, got {arrays!r}")
        for name, value in arrays.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"array names must be identifiers like 'A' or 'dweight', "
                                 f"got {name!r}")
            try:
                array = flatten(value)
            except ValueError as e:   # say which array: memory often holds several
                raise ValueError(f"array {name!r}: {e}") from None
            self.shapes[name] = array.shape
            self.bases[name] = len(self.cells)
            self.cells.extend(array.data)
        # an empty array owns no address but shares its base with the next array: leave it
        # out, or location() could pick it for that array's first cell (and divide by 0)
        self._starts = sorted((base, name) for name, base in self.bases.items()
                              if self.size(name))

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.cells)

    def size(self, name: str) -> int:
        return math.prod(self.shapes[name])

    def flat(self, name: str) -> list:
        """A copy of array ``name`` as a flat list."""
        self._check_name(name)
        base = self.bases[name]
        return self.cells[base:base + self.size(name)]

    def __getitem__(self, name: str) -> list:
        """Array ``name`` as a nested list of its shape."""
        return _nest(self.flat(name), self.shapes[name])

    def location(self, address: int) -> str:
        """``"W[0, 1]"`` for the address of that cell."""
        i = bisect.bisect_right(self._starts, (address, "\uffff")) - 1
        base, name = self._starts[i]
        offset, index = address - base, []
        for size in reversed(self.shapes[name]):
            offset, r = divmod(offset, size)
            index.append(r)
        return f"{name}[{', '.join(map(str, reversed(index)))}]"

    def copy(self) -> Memory:
        return Memory({name: Array(self.shapes[name], self.flat(name)) for name in self.shapes})

    def _check_name(self, name: str) -> None:
        if name not in self.shapes:
            raise KeyError(f"no array {name!r} in PRAM memory; arrays: {', '.join(self.shapes)}")
