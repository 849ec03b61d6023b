"""Inputs that hidden tests draw at grading time, from a seed per submission.

    from course_lib.exercises import draws
    rng = draws.rng("q2")                    # a random.Random for this question
    torch.manual_seed(draws.seed("q1"))      # or an integer seed for torch

The solutions are public (exercises/README.md), and so are the values they print. A hidden test
that checked fixed inputs would reward a submission that memorises those values; drawn inputs do
not. ``course grade`` sets ``COURSE_GRADING_SEED`` for each submission (:func:`submission_seed`:
from the notebook's bytes, or ``--seed``) and records it in the report and the gradebook, so a
grade can be reproduced. Without it (an instructor's own run, ``grader.check``) the seed is 0.

The seed is read from the kernel's environment as it started (``/proc/self/environ`` where the
system has it): a cell of the submission that sets ``os.environ`` cannot pick its own inputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
from pathlib import Path

SEED_ENV = "COURSE_GRADING_SEED"


def submission_seed(path: str | os.PathLike) -> int:
    """The seed of a submission: 31 bits of the SHA-256 of its bytes (the same file, the same inputs)."""
    return int(hashlib.sha256(Path(path).read_bytes()).hexdigest()[:8], 16) & 0x7FFFFFFF


def _initial_environ() -> dict[str, str]:
    try:
        with open("/proc/self/environ", "rb") as f:
            pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
    except OSError:  # not Linux: the environment as it is now
        return dict(os.environ)


def grading_seed() -> int:
    """This grading's seed: ``COURSE_GRADING_SEED`` as the process started, else 0."""
    value = _initial_environ().get(SEED_ENV, "")
    try:
        return int(value) if value else 0
    except ValueError:
        raise ValueError(f"{SEED_ENV}={value!r} is not an integer") from None


def rng(salt: str) -> random.Random:
    """A generator for one test (``salt``: its name), determined by the grading seed."""
    return random.Random(f"{grading_seed()}:{salt}")


def seed(salt: str) -> int:
    """An integer seed (for ``torch.manual_seed`` or a ``torch.Generator``) for one test."""
    return rng(salt).randrange(2**31)


@contextlib.contextmanager
def seeded(value: int):
    """``COURSE_GRADING_SEED=value`` for the processes started inside (otter's kernel), then the
    environment as it was."""
    saved = os.environ.get(SEED_ENV)
    os.environ[SEED_ENV] = str(int(value))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(SEED_ENV, None)
        else:
            os.environ[SEED_ENV] = saved
