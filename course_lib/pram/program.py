"""What a PRAM run is made of: a :class:`Program` and the :class:`Result` of running it.

Helpers for writing programs: :func:`coords` splits a processor id into array coordinates and
:func:`phases` chains step functions (e.g. a reduction loop, then a normalisation step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from course_lib.utils import check_count

from .shared_memory import Memory, flatten, value_text
from .trace import format_table

__all__ = ["Concurrency", "Program", "Result", "StepStats", "StepTrace", "coords", "phases"]

StepFn = Callable[[int, int, Any], Any]   # step(pid, step, mem) -> None


def coords(pid: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Split a processor id into row-major coordinates: ``coords(5, (2, 3)) == (1, 2)``."""
    out = []
    for size in reversed(shape):
        pid, r = divmod(pid, size)
        out.append(r)
    return tuple(reversed(out))


def phases(*parts: tuple) -> StepFn:
    """Run step functions one after another: ``phases((scores, hs), (softmax, 1))``.

    Each part is ``(fn, steps)`` or ``(fn, steps, processors)``: a phase that uses only
    processors ``0 .. processors-1`` (the others idle) says so, and the machine skips calling
    the idle ones. Each part gets its own local step numbered from 0. The result has
    ``.steps`` (the total) and ``.processors_at(step)`` (None where a phase uses them all).
    """
    starts, total = [], 0
    for fn, n, *procs in parts:
        check_count(f"phases: steps of {getattr(fn, '__name__', fn)}", n, minimum=0)
        if procs:
            check_count(f"phases: processors of {getattr(fn, '__name__', fn)}", procs[0])
        starts.append((total, fn, procs[0] if procs else None))
        total += n

    def part(step: int) -> tuple:
        for start, fn, procs in reversed(starts):
            if step >= start:
                return start, fn, procs
        raise IndexError(step)

    def step_fn(pid: int, step: int, mem: Any) -> None:
        start, fn, _ = part(step)
        return fn(pid, step - start, mem)

    step_fn.steps = total
    step_fn.processors_at = lambda step: part(step)[2] if step < total else None
    return step_fn


@dataclass
class Program:
    """A PRAM program with its processors and initial memory, ready to :func:`run`.

    ``expected()`` returns the correct final arrays for :meth:`verify`: ``{name: values}``,
    or ``{name: {flat_index: value}}`` to check only some cells;
    ``model`` is the model it was written for; ``note`` explains its design for a reader.
    """

    name: str
    step: StepFn
    processors: int
    memory: Mapping[str, Any]
    steps: int | None = None
    model: str = "EREW"
    expected: Callable[[], Mapping[str, Any]] | None = None
    note: str = ""
    rtol: float = 1e-9
    atol: float = 1e-9
    _reference: dict | None = field(default=None, init=False, repr=False, compare=False)

    def reference(self) -> dict:
        """``expected()`` as flat lists (or ``{index: value}``), computed once and kept."""
        if self._reference is None:
            self._reference = {name: want if isinstance(want, dict) else flatten(want).data
                               for name, want in (self.expected or dict)().items()}
        return self._reference

    def verify(self, result: Result) -> list[str]:
        """Differences between ``result`` and ``expected()``; an empty list means correct."""
        problems, mem = [], result.memory
        for name, want in self.reference().items():
            got = mem.flat(name)
            if isinstance(want, dict):   # {flat index: value}: check only those cells
                pairs = [(i, got[i], w) for i, w in want.items()]
            else:
                if len(got) != len(want):
                    problems.append(f"{name} has {len(got)} values, expected {len(want)}")
                pairs = list(zip(range(len(got)), got, want))
            for i, g, w in pairs:
                try:
                    close = abs(g - w) <= self.atol + self.rtol * abs(w)
                except TypeError:       # e.g. a cell still None
                    close = g == w
                if not close:
                    shown = value_text(g), value_text(w)
                    if shown[0] == shown[1]:  # they differ beyond 6 digits: every digit then
                        shown = repr(g), repr(w)
                    problems.append(f"{mem.location(mem.bases[name] + i)} is {shown[0]}, expected {shown[1]}")
                    break
        return problems


@dataclass(frozen=True)
class StepStats:
    """Counts for one step: processors active, distinct (processor, address) reads, writes, ops."""

    step: int
    active: int
    reads: int
    writes: int
    ops: dict


@dataclass(frozen=True)
class StepTrace:
    """What a notebook draws for one step: who read and wrote which address, memory after."""

    step: int
    reads: dict      # address -> tuple of processor ids
    writes: dict     # address -> tuple of processor ids
    memory: list     # every cell after the step's writes


@dataclass(frozen=True)
class Concurrency:
    """The most processors that touched one address in one step (reads or writes)."""

    count: int = 0
    step: int = -1
    address: int = -1
    location: str = ""


@dataclass
class Result:
    """Counts and final memory of one run: ``steps`` (time), ``work``, ``processors``."""

    program: str
    model: str
    processors: int
    steps: int
    work: int
    ops: dict
    per_step: list
    memory: Memory
    initial: Memory
    max_readers: Concurrency = field(default_factory=Concurrency)
    max_writers: Concurrency = field(default_factory=Concurrency)
    trace: list | None = None

    def __getitem__(self, name: str) -> list:
        """Final contents of array ``name`` as a nested list."""
        return self.memory[name]

    def summary(self) -> dict:
        """The JSON the CLI prints: steps, work, processors, model, program, ops."""
        return {"program": self.program, "model": self.model, "steps": self.steps,
                "work": self.work, "processors": self.processors, "ops": dict(self.ops)}

    def table(self) -> str:
        """A work-time table: one row per step, then the totals."""
        rows = [{"step": s.step, "active": s.active, "reads": s.reads, "writes": s.writes,
                 "ops": sum(s.ops.values())} for s in self.per_step]
        rows.append({"step": "total", "active": "", "reads": sum(s.reads for s in self.per_step),
                     "writes": sum(s.writes for s in self.per_step), "ops": self.work})
        return format_table(rows)
