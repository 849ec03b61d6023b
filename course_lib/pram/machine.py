"""A synchronous PRAM simulator: p processors run one program step by step on shared memory.

A program is a plain function ``step(pid, step, mem)`` called for every processor at every
step (steps and processors numbered from 0). Inside it, ``mem["A"][i]`` reads a cell and
``mem["A"][i] = v`` writes one; ``mem.op("add")`` names the operation the processor did (work).
Every read in a step sees memory as it was when the step began; all writes land together at
the end of the step, after the access model has checked them (read phase, compute, write)::

    def tree_sum(pid, step, mem):        # n/2 processors, A holds n numbers
        stride = 2 ** step
        i = 2 * pid
        if pid % stride == 0 and i + stride < len(mem["A"]):
            mem["A"][i] = mem["A"][i] + mem["A"][i + stride]
            mem.op("add")

    result = run(tree_sum, "EREW", processors=4, memory={"A": [3, 1, 4, 1, 5, 9, 2, 6]})
    result.steps, result.work, result["A"][0]     # (3, 7, 31)

Without a fixed ``steps`` the machine halts at the first step in which no processor reads,
writes or operates. Work counts named operations; a processor that touches memory in a step
without naming one counts as one ``"op"``.
"""

from __future__ import annotations

import numbers
import random
from collections import Counter
from collections.abc import Mapping
from typing import Any

from course_lib.utils import check_count

from .models import AccessViolation, Model, PRAMError, ProcessorLimitError, get_model
from .program import (
    Concurrency,
    Program,
    Result,
    StepFn,
    StepStats,
    StepTrace,
    coords,
    phases,
)
from .shared_memory import Memory

# Program, Result, coords and phases are re-exported so programs can import all from here.
__all__ = ["MAX_PROCESSORS", "MAX_STEPS", "ArrayView", "Program", "Result", "View", "coords",
           "phases", "run"]

MAX_PROCESSORS = 1 << 20  # the default cap: a million processors simulate in a few seconds
MAX_STEPS = 100_000

class _State:
    """What one step records: reads, buffered writes, active processors, named operations."""

    def __init__(self, memory: Memory):
        self.memory, self.cells = memory, memory.cells
        self.pid = self.step = 0
        self.begin(0)

    def begin(self, step: int) -> None:
        self.step = step
        self.reads: dict[int, int] = {}            # address -> first reader
        self.shared_reads: dict[int, set] = {}     # address -> all readers, when > 1
        self.n_reads = 0
        self.writes: dict[int, dict] = {}          # address -> {pid: value}
        self.active: set[int] = set()
        self.ops: Counter = Counter()
        self.named: set[int] = set()

    def read(self, address: int) -> Any:
        pid, first = self.pid, self.reads.get(address)
        if first is None:
            self.reads[address] = pid
            self.n_reads += 1
        elif first != pid:
            readers = self.shared_reads.setdefault(address, {first})
            if pid not in readers:
                readers.add(pid)
                self.n_reads += 1
        self.active.add(pid)
        return self.cells[address]

    def write(self, address: int, value: Any) -> None:
        self.writes.setdefault(address, {})[self.pid] = value
        self.active.add(self.pid)


class ArrayView:
    """One shared array as a processor sees it: ``a[i]``, ``a[i, j]``, ``a[i] = v``, ``len(a)``.

    A tuple indexes row-major; a single int indexes the flattened array.
    """

    __slots__ = ("_base", "_state", "_strides", "name", "shape", "size")

    def __init__(self, state: _State, name: str):
        self._state, self.name = state, name
        self.shape = state.memory.shapes[name]
        self.size = state.memory.size(name)
        self._base = state.memory.bases[name]
        strides, acc = [], 1
        for n in reversed(self.shape):
            strides.append(acc)
            acc *= n
        self._strides = tuple(reversed(strides))

    def _address(self, index: Any) -> int:
        for i in index if isinstance(index, tuple) else (index,):
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):  # 2.0 from pid / 2; True as 1
                s = self._state
                raise TypeError(f"processor {s.pid} at step {s.step}: index {index!r} of {self.name} is not "
                                "a whole number (pid // 2, not pid / 2)")
        if isinstance(index, tuple):
            if len(index) != len(self.shape):
                self._bad(index)
            address = self._base
            for i, n, s in zip(index, self.shape, self._strides):
                if not 0 <= i < n:
                    self._bad(index)
                address += i * s
            return address
        if not 0 <= index < self.size:
            self._bad(index)
        return self._base + index

    def _bad(self, index: Any) -> None:
        s = self._state
        raise IndexError(f"processor {s.pid} at step {s.step}: index {index!r} is outside "
                         f"{self.name} of shape {self.shape}")

    def __getitem__(self, index: Any) -> Any:
        return self._state.read(self._address(index))

    def __setitem__(self, index: Any, value: Any) -> None:
        self._state.write(self._address(index), value)

    def __len__(self) -> int:
        return self.shape[0]


class View:
    """The shared memory as the program sees it: ``mem["A"]`` is an :class:`ArrayView`."""

    def __init__(self, state: _State):
        self._state = state
        self._arrays = {name: ArrayView(state, name) for name in state.memory}

    def __getitem__(self, name: str) -> ArrayView:
        try:
            return self._arrays[name]
        except KeyError:
            raise KeyError(f"no array {name!r} in PRAM memory; arrays: "
                           f"{', '.join(self._arrays)}") from None

    def op(self, name: str = "op", count: int = 1) -> None:
        """Count ``count`` operations called ``name`` for this processor in this step."""
        s = self._state
        s.ops[name] += count
        s.named.add(s.pid)
        s.active.add(s.pid)


def run(program: Program | StepFn, model: str | Model | None = None, *,
        processors: int | None = None, memory: Mapping[str, Any] | None = None,
        steps: int | None = None, trace: bool = True, seed: int = 0,
        max_processors: int = MAX_PROCESSORS, max_steps: int = MAX_STEPS) -> Result:
    """Run ``program`` on a PRAM with access model ``model``; raise :class:`AccessViolation`.

    ``program`` is a :class:`Program`, or a step function given with ``processors`` and
    ``memory`` (and optionally a fixed number of ``steps``). ``seed`` picks the winners of
    the CRCW-arbitrary rule. ``trace=False`` skips the per-step memory snapshots.
    """
    if not isinstance(program, Program):
        if processors is None or memory is None:
            raise ValueError("run(step_fn, ...) needs processors= and memory=")
        program = Program(getattr(program, "__name__", "program"), program, processors,
                          memory, steps if steps is not None else getattr(program, "steps", None))
    model = get_model(model if model is not None else program.model)
    p = program.processors
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"{program.name}: processors must be a positive int, got {p!r}")
    if p > max_processors:
        raise ProcessorLimitError(
            f"{program.name} needs {p:,} processors, more than the {max_processors:,} allowed; "
            "use a smaller n or raise max_processors")
    initial = Memory(program.memory)
    mem = initial.copy()
    state, rng = _State(mem), random.Random(seed)
    view, fn = View(state), program.step
    limit = getattr(fn, "processors_at", None)   # phases() knows which processors idle
    n_steps = program.steps if steps is None else steps
    if n_steps is not None:   # a loop bound of -1 or 1.5 would run 0 or 2 steps without a word
        check_count(f"{program.name}: steps", n_steps, minimum=0)
    per_step, snapshots, work, ops = [], [] if trace else None, 0, Counter()
    max_r = max_w = Concurrency()
    step = 0
    while n_steps is None or step < n_steps:
        if step >= max_steps:
            raise PRAMError(f"{program.name} did not halt within {max_steps} steps")
        state.begin(step)
        for pid in range(p if limit is None else min(p, limit(step) or p)):
            state.pid = pid
            fn(pid, step, view)
        if n_steps is None and not state.active:
            break
        for address in sorted(state.shared_reads):
            readers = state.shared_reads[address]
            if not model.concurrent_read:
                raise AccessViolation(model.name, "read", step, address,
                                      mem.location(address), readers)
            if len(readers) > max_r.count:
                max_r = Concurrency(len(readers), step, address, mem.location(address))
        n_writes, stored = 0, {}
        for address in sorted(state.writes):     # resolve every write, then store them all
            by_pid = state.writes[address]
            n_writes += len(by_pid)
            if len(by_pid) > 1 and len(by_pid) > max_w.count:
                max_w = Concurrency(len(by_pid), step, address, mem.location(address))
            stored[address] = _resolve(model, step, address, by_pid, mem, rng)
        for address, value in stored.items():
            state.cells[address] = value
        unnamed = len(state.active - state.named)
        if unnamed:
            state.ops["op"] += unnamed
        work += sum(state.ops.values())
        ops.update(state.ops)
        per_step.append(StepStats(step, len(state.active), state.n_reads, n_writes,
                                  dict(state.ops)))
        if trace:
            reads = {a: (pid,) for a, pid in state.reads.items()}
            reads.update((a, tuple(sorted(s))) for a, s in state.shared_reads.items())
            writes = {a: tuple(sorted(w)) for a, w in state.writes.items()}
            snapshots.append(StepTrace(step, reads, writes, list(state.cells)))
        step += 1
    return Result(program.name, model.name, p, step, work, dict(ops), per_step, mem, initial,
                  max_r, max_w, snapshots)


def _resolve(model: Model, step: int, address: int, by_pid: dict, mem: Memory,
             rng: random.Random) -> Any:
    """The value stored at ``address`` after this step's writes, or an AccessViolation."""
    if len(by_pid) == 1:
        return next(iter(by_pid.values()))
    pids = sorted(by_pid)
    if not model.concurrent_write:
        raise AccessViolation(model.name, "write", step, address, mem.location(address), pids)
    values = [by_pid[pid] for pid in pids]
    if model.rule == "common":
        if any(v != values[0] for v in values):
            raise AccessViolation(model.name, "disagree", step, address, mem.location(address),
                                  pids, values)
        return values[0]
    if model.rule == "arbitrary":
        return by_pid[rng.choice(pids)]
    if model.rule == "priority":
        return values[0]
    total = values[0]
    for v in values[1:]:
        total = model.combine(total, v)
    return total
