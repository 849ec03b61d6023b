"""Helpers for graded exercises: run an answer on N gloo ranks or in a process of its own, never
hang, compare with a reference and say what is wrong.

    from course_lib.exercises.grading import run_ranks, assert_close, isolated, p2p_only
    results = run_ranks(fn, 2)              # fn(rank, world_size) on 2 ranks -> [value of rank 0, 1]
    value = isolated(check, timeout=10)     # check() in a process of its own, killed after 10 s
    out = returned(f(x), "f(x)")            # f's value, or the failure "f(x) returned None (...)"

Students call :func:`run_ranks` in the exercise notebooks to try their multi-rank code; the
exercises' tests call it too (it is :func:`course_lib.launch.spawn.run_ranks`, with the
grading timeout), and run every single-process check through :func:`isolated`: the answer runs in
a child process that the test's process kills when it runs past its limit, so an endless loop
costs its question, never the grader. ``isolated(..., forbid=[f, ...])`` makes the course's own
reference implementations raise inside that child, so an answer that calls one where the
question says "write your own" fails.

Tests load a fresh copy of this module (:func:`fresh_copy`'s three lines, written into each
test): a notebook cell that replaces ``assert_close`` here changes the kernel's copy only.

A wrong answer must never stall grading: every collective has a timeout
(``COURSE_GRADING_TIMEOUT`` seconds, default 60; ``course grade`` sets 10) and the whole run a
wall-clock limit, after which the ranks are stopped and :class:`RanksTimeoutError` says what
happened. A rank that raises stops the run with :class:`RankError`. :func:`p2p_only`
(:mod:`course_lib.exercises.p2p`) lets a test forbid the library collectives and count the bytes a rank sends.
"""

from __future__ import annotations

import importlib.util
import os
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from course_lib.launch import ranks as _ranks  # the one local rank runner
from course_lib.utils import check_seconds

RUN_TIMEOUT_S = 60.0
TIMEOUT_ENV = "COURSE_GRADING_TIMEOUT"
MAX_RANKS = 8


def fresh_copy(name: str = "course_lib.exercises.grading"):
    """A new module object for ``name``, executed from its file: not the one in ``sys.modules``
    that a notebook cell may have patched. (Tests inline these lines rather than call this.)"""
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_spawn = fresh_copy("course_lib.launch.spawn")  # run_ranks, as its file says
RankError, RanksTimeoutError = _spawn.RankError, _spawn.RanksTimeoutError
# convention "grader's copy" (tests/test_one_home.py): the name students know, from a fresh copy of its module
p2p_only = fresh_copy("course_lib.exercises.p2p").p2p_only  # point-to-point only, bytes counted


def default_timeout() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    if not value:
        return RUN_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be > 0 seconds, got {value!r}")
    return seconds


# convention "grader's copy" (tests/test_one_home.py): launch.spawn.run_ranks under the name the lessons
# teach, run from a fresh copy of spawn, with the grader's arguments and time limit
def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any, timeout: float | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` gloo ranks (started clean, ``fn`` sent by
    value) and return their values (:func:`course_lib.launch.spawn.run_ranks`).

    ``timeout`` (default ``COURSE_GRADING_TIMEOUT`` or 60 s) bounds every collective; the whole
    call gets timeout + 5 s of wall clock. Raises :class:`RanksTimeoutError` when ranks hang,
    :class:`RankError` when a rank raises or dies.
    """
    __tracebackhide__ = True  # the runner's own frame: a notebook's traceback ends at the caller
    if not callable(fn):
        raise TypeError(f"run_ranks needs a function fn(rank, world_size, ...), got {fn!r}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= MAX_RANKS:
        raise ValueError(f"nproc must be a whole number from 1 to {MAX_RANKS}, got {nproc!r}")
    timeout = default_timeout() if timeout is None else check_seconds("timeout", timeout)
    return _spawn.run_ranks(fn, nproc, *args, timeout=timeout)


# --------------------------------------------------------------------------------------------
# One check in a process of its own
# --------------------------------------------------------------------------------------------

REFUSED = ("this answer called the course's own implementation, which this question asks you to "
           "write yourself")


def _refuse(*args, **kwargs):
    # Only literals and builtins: this code object runs with the globals of the function it replaces.
    raise PermissionError("this answer called the course's own implementation, which this "
                          "question asks you to write yourself")


def _disable(functions: Iterable) -> None:
    """Make every function in ``functions`` raise, wherever it is referenced from (its code object
    is swapped, so ``from module import f`` copies are caught too)."""
    for f in functions:
        f = getattr(f, "__func__", f)  # a bound or class method
        if f.__code__.co_freevars:  # a closure: the swap must keep the cell count
            raise ValueError(f"cannot forbid {f.__qualname__}: it is a closure")
        f.__code__ = _refuse.__code__


class AnswerTimeoutError(AssertionError):
    """The answer ran past its limit in :func:`isolated` and was stopped."""


def _graded(check: Callable[..., Any], args: tuple, forbid: list, stand_ins: dict) -> tuple:
    """In the child: forbid, put the stand-ins in, run ``check``; its outcome as a message.
    ``check``, the answers and the forbidden functions arrived in one pickle, so the functions
    changed here are the ones the answer calls (the child's copies: the notebook keeps its own)."""
    try:
        _disable(forbid)
        for answer, names in stand_ins.items():
            answer.__globals__.update(names)
        return ("ok", check(*args))
    except AssertionError as e:
        return ("assert", str(e) or "a check failed (no message)")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        refused = isinstance(e, PermissionError) and str(e) == REFUSED
        return ("refused" if refused else "error", f"{type(e).__name__}: {e}",
                "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next)[-6:]))


def isolated(check: Callable[..., Any], *args: Any, timeout: float | None = None,
             forbid: Iterable = (), stand_ins: dict | None = None) -> Any:
    """Run ``check(*args)`` in a process of its own and return its value; kill it after
    ``timeout`` seconds (default: the grading timeout) and raise :class:`AnswerTimeoutError`.

    The process is one rank without a group of :func:`course_lib.launch.ranks.run_local`:
    started clean, with ``check`` and its arguments sent by value. An ``AssertionError`` in the
    child is raised here with the same message; any other exception becomes an
    ``AssertionError`` that names it (the answer crashed). ``forbid``: functions that raise
    ``PermissionError`` inside the child (reference implementations the answer must not use).
    ``stand_ins``: ``{answer: {name: value}}``, global names an answer function sees in the
    child instead of the notebook's (a correct earlier answer it calls, so that a mistake in an
    earlier question is not charged twice); the notebook never sees the change.
    """
    timeout = default_timeout() if timeout is None else float(timeout)
    try:
        message, = _ranks.run_local(_graded, 1, (check, args, list(forbid), dict(stand_ins or {})),
                                    backend=None, time_limit=timeout, prefix="")
    except _ranks.SendError as e:  # a global of the answer that no process can receive
        raise AssertionError(f"the answer cannot be checked in a process of its own: {e}") from None
    except _ranks.RanksTimeoutError as e:
        if e.phase == "start":
            raise AssertionError(f"the answer's process did not start: {e}") from None
        raise AnswerTimeoutError(
            f"the answer ran longer than {timeout:g} s and was stopped (an endless loop, "
            "or a wait that never ends?)") from None
    except _ranks.RankError as e:
        if e.what.startswith("the process"):
            raise AssertionError("the answer's process died without a result (it called os._exit, "
                                 "or was killed for memory?)") from None
        if "cannot be sent back" in e.what:
            raise AssertionError(f"the answer returned something that cannot be sent back ({e.what})") from None
        raise AssertionError(f"the answer raised {e.what}\n{e.traceback}") from None
    if message[0] == "ok":
        return message[1]
    if message[0] == "assert":
        raise AssertionError(message[1])
    if message[0] == "refused":
        raise AssertionError(f"{REFUSED}:\n{message[2]}")
    raise AssertionError(f"the answer raised {message[1]}\n{message[2]}")


# --------------------------------------------------------------------------------------------
# Comparing with a reference, and saying what the mistake probably is
# --------------------------------------------------------------------------------------------

def factor_hint(found: float, expected: float, factors: dict[str, float] | None) -> str:
    """' (found / expected = 3 = the world size: ...)' when ``found`` is a named factor (or its
    inverse) times ``expected``; '' otherwise."""
    if not factors or expected == 0 or found == 0:
        return ""
    ratio = found / expected
    for name, k in factors.items():
        if k not in (0, 1) and abs(ratio - k) <= 1e-3 * abs(k):
            return f" (found = {k:g} x expected: a factor of {name} too many?)"
        if k not in (0, 1) and abs(ratio * k - 1) <= 1e-3:
            return f" (found = expected / {k:g}: divided by {name} once too often?)"
    return ""


NONE_HINT = "does the function return its result?"  # what a None found instead of an answer usually means


def returned(value, call: str):
    """``value``, what the answer's ``call`` (its text, e.g. ``"dispatch(x, idx, 4)"``) returned, when
    it is not None; else the failure a student can act on, instead of the TypeError that the test's
    next line would raise on None (a body still ``...``, or no ``return``)."""
    __tracebackhide__ = True  # a failed check, not a fault of this frame: tracebacks end at the test's line
    if value is None:
        raise AssertionError(f"{call} returned None ({NONE_HINT})")
    return value


def assert_number(found, expected, what: str, rel: float = 1e-9, abs_tol: float = 1e-12,
                  factors: dict[str, float] | None = None, hint: str = "") -> None:
    """``found`` must be within ``abs_tol + rel * |expected|`` of ``expected``; the message says
    both, and the likely mistake (a named factor, or ``hint``)."""
    __tracebackhide__ = True  # a failed check, not a fault of this frame: tracebacks end at the test's line
    if found is None:
        raise AssertionError(f"{what}: expected the number {expected!r}, found None ({NONE_HINT})")
    if not isinstance(found, (int, float)) or isinstance(found, bool):
        try:
            found = float(found)
        except (TypeError, ValueError):
            raise AssertionError(f"{what}: expected the number {expected!r}, found "
                                 f"{type(found).__name__} {found!r}") from None
    if not abs(found - expected) <= abs_tol + rel * abs(expected):  # "not <=": a NaN fails too
        if found != found:
            raise AssertionError(f"{what}: expected {expected!r}, found nan (an overflow, or 0/0, on the way?)")
        raise AssertionError(f"{what}: expected {expected!r}, found {found!r}"
                             + (factor_hint(found, expected, factors) or (f" ({hint})" if hint else "")))


def assert_close(actual, expected, what: str = "result", atol: float = 1e-6, rtol: float = 1e-5,
                 factors: dict[str, float] | None = None) -> None:
    """Assert two tensors (or equally long lists of tensors) match; the message gives the first
    element that differs (expected and found) and, with ``factors`` ({"the world size": 3}),
    the factor by which the whole result is off."""
    __tracebackhide__ = True  # a failed check, not a fault of this frame: tracebacks end at the test's line
    # torch only to compare tensors: importing the grading helpers loads no torch
    import torch

    if isinstance(expected, torch.Tensor):
        actual, expected = [actual], [expected]
    actual, expected = list(actual), list(expected)
    if len(actual) != len(expected):
        raise AssertionError(f"{what}: expected {len(expected)} tensors, found {len(actual)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        if not isinstance(a, torch.Tensor):
            # a failed check like the others below, not a caller's type error
            raise AssertionError(f"{what}: item {i}: expected a tensor, found {type(a).__name__}")  # noqa: TRY004
        e = e.detach()
        if a.shape != e.shape:
            raise AssertionError(f"{what}: item {i}: expected shape {tuple(e.shape)}, found {tuple(a.shape)}")
        a = a.detach().to(e.dtype)
        if not torch.allclose(a, e, atol=atol, rtol=rtol):
            bad = (~torch.isclose(a, e, atol=atol, rtol=rtol)).nonzero()[0].tolist()
            where = tuple(bad)
            ratio = ""
            if factors and e.abs().sum() > 0:  # the whole tensor off by one factor?
                k = (a.double() * e.double()).sum() / (e.double() ** 2).sum()
                if torch.allclose(a.double(), k * e.double(), atol=atol, rtol=1e-3):
                    ratio = factor_hint(float(k), 1.0, factors)
            raise AssertionError(
                f"{what}: item {i} at {list(where)}: expected {e[where].item():.6g}, found "
                f"{a[where].item():.6g}; max difference {(a - e).abs().max().item():.3g} (allowed "
                f"{atol:g} + {rtol:g} x |expected|){ratio}")
