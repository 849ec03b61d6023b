"""PRAM access models and the errors a program raises when it breaks one.

A PRAM step has a read phase, a local compute phase and a write phase. The access model says
what happens when several processors touch the same shared address in one step:

- ``EREW``  exclusive read, exclusive write: at most one processor reads, and at most one
  writes, each address per step.
- ``CREW``  concurrent read, exclusive write.
- ``CRCW-*`` concurrent read and concurrent write, with a rule that resolves the writes:
  ``common`` (all writers must write the same value), ``arbitrary`` (one writer, any one,
  wins), ``priority`` (the lowest processor id wins) or a *combining* rule that stores the
  combination of all the written values with an associative operator (``sum``, ``max``, ...).

Definitions follow J. JaJa, *An Introduction to Parallel Algorithms* (1992), ch. 1.2, and
Cormen, Leiserson & Rivest, *Introduction to Algorithms* (1990), ch. 30.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .shared_memory import value_text

__all__ = [
    "MODELS",
    "MODEL_ORDER",
    "AccessViolation",
    "Model",
    "PRAMError",
    "ProcessorLimitError",
    "combining",
    "format_processors",
    "get_model",
]


class PRAMError(Exception):
    """Base class of the simulator's errors."""


class ProcessorLimitError(PRAMError, ValueError):
    """A program asks for more processors than the machine allows."""


def format_processors(pids: Sequence[int], limit: int = 6) -> str:
    """``[3, 5]`` -> ``"3 and 5"``; ``[1, 2, 3]`` -> ``"1, 2 and 3"``; long lists are cut."""
    pids = sorted(pids)
    if len(pids) == 1:
        return str(pids[0])
    if len(pids) > limit:
        head = ", ".join(map(str, pids[: limit - 1]))
        return f"{head}, ... and {pids[-1]} ({len(pids)} processors)"
    return ", ".join(map(str, pids[:-1])) + f" and {pids[-1]}"


class AccessViolation(PRAMError):
    """Processors broke the access model's rule.

    Attributes name what a notebook needs to point at the culprit: ``model``, ``step``
    (numbered from 0), ``address``, ``location`` (e.g. ``"A[3]"``), ``processors`` (sorted
    ids) and ``kind`` (``"read"``, ``"write"`` or ``"disagree"`` for the common rule).
    """

    def __init__(self, model: str, kind: str, step: int, address: int, location: str,
                 processors: Sequence[int], values: Sequence[Any] = ()):
        self.model, self.kind, self.step = model, kind, step
        self.address, self.location = address, location
        self.processors = tuple(sorted(processors))
        self.values = tuple(values)
        who = format_processors(self.processors)
        if kind == "read":
            msg = (f"{model}: processors {who} read address {address} at step {step} "
                   f"({location}); {model} allows one reader per address per step")
        elif kind == "write":
            msg = (f"{model}: processors {who} wrote address {address} at step {step} "
                   f"({location}); {model} allows one writer per address per step")
        else:
            shown = ", ".join(value_text(v) for v in self.values[:4]) + (", ..." if len(self.values) > 4 else "")
            msg = (f"{model}: processors {who} wrote different values to address {address} "
                   f"at step {step} ({location}: {shown}); the common rule needs all "
                   "writers to agree")
        super().__init__(msg)


@dataclass(frozen=True)
class Model:
    """One PRAM access model.

    ``rule`` is None for exclusive write, else ``"common"``, ``"arbitrary"``, ``"priority"``
    or ``"combine"`` (then ``combine`` is the associative operator, applied in processor-id
    order so that non-commutative operators are still deterministic).
    """

    name: str
    concurrent_read: bool
    concurrent_write: bool
    rule: str | None = None
    combine: Callable[[Any, Any], Any] | None = field(default=None, compare=False)
    description: str = ""

    def __str__(self) -> str:
        return self.name


def combining(op: Callable[[Any, Any], Any], name: str, description: str = "") -> Model:
    """A CRCW model whose concurrent writes store ``op`` folded over the written values.

    >>> xor = combining(operator.xor, "CRCW-xor")
    """
    return Model(name, True, True, "combine", op,
                 description or f"concurrent writes store the {name.split('-')[-1]} of the values")


def _build_models() -> dict[str, Model]:
    models = [
        Model("EREW", False, False, None, None, "exclusive read, exclusive write"),
        Model("CREW", True, False, None, None, "concurrent read, exclusive write"),
        Model("CRCW-common", True, True, "common", None,
              "concurrent writers must all write the same value"),
        Model("CRCW-arbitrary", True, True, "arbitrary", None,
              "one of the concurrent writers, any one, succeeds"),
        Model("CRCW-priority", True, True, "priority", None,
              "the writer with the lowest processor id succeeds"),
        combining(operator.add, "CRCW-sum", "concurrent writes store the sum of the values"),
        combining(max, "CRCW-max", "concurrent writes store the largest value"),
        combining(min, "CRCW-min", "concurrent writes store the smallest value"),
        combining(operator.mul, "CRCW-prod", "concurrent writes store the product of the values"),
        combining(lambda a, b: a and b, "CRCW-and", "concurrent writes store the logical AND"),
        combining(lambda a, b: a or b, "CRCW-or", "concurrent writes store the logical OR"),
    ]
    return {m.name: m for m in models}


#: Every named model, weakest first (the order the classifier tries them in).
MODELS: dict[str, Model] = _build_models()
MODEL_ORDER: tuple[str, ...] = tuple(MODELS)


def get_model(model: str | Model) -> Model:
    """The :class:`Model` called ``model`` (case-insensitive), or ``model`` itself."""
    if isinstance(model, Model):
        return model
    by_lower = {name.lower(): m for name, m in MODELS.items()}
    key = str(model).strip().lower()
    if key in by_lower:
        return by_lower[key]
    raise ValueError(f"unknown PRAM model {model!r}; choose one of: {', '.join(MODELS)}")
