"""Which PRAM model does a program need? Run it under EREW, then CREW, then the CRCW rules.

The weakest model under which the program runs without an access violation *and* gives the
right result (``Program.expected``) is its verdict. The result check matters for the CRCW
rules: accumulating a gradient under CRCW-arbitrary raises no error, it just keeps one
contribution and loses the rest, so the classifier moves on to CRCW-sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .machine import run
from .models import MODEL_ORDER, AccessViolation, Model, PRAMError, get_model
from .program import Program, Result

__all__ = ["Attempt", "Verdict", "classify"]


@dataclass(frozen=True)
class Attempt:
    """One model tried: ``ok``, and ``why`` (the violation, the wrong cell, or "runs")."""

    model: str
    ok: bool
    why: str


@dataclass
class Verdict:
    """The weakest model for a program, why, and the run under that model."""

    program: str
    model: str
    reason: str
    result: Result
    attempts: list = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.program}: {self.model}. {self.reason}"


def _short(message: str) -> str:
    """A violation message without the rule's explanation after the ';'."""
    return message.split(";")[0]


def classify(program: Program, models: Sequence[str | Model] = MODEL_ORDER,
             seeds: Sequence[int] = (0, 1, 2), max_processors: int | None = None) -> Verdict:
    """Try ``models`` in order (weakest first) and return the first that runs ``program``
    correctly. CRCW-arbitrary must be correct for every seed in ``seeds``."""
    attempts: list[Attempt] = []
    limit = {} if max_processors is None else {"max_processors": max_processors}
    # resolve names once, keeping Model objects: a custom combining() model is no name that
    # get_model could look up again when the reason and the error message are written
    resolved = [get_model(m) for m in models]
    for model in resolved:
        why, result = "", None
        for seed in seeds if model.rule == "arbitrary" else seeds[:1]:
            try:
                result = run(program, model, trace=False, seed=seed, **limit)
            except AccessViolation as e:
                why = _short(str(e))
                break
            wrong = program.verify(result)
            if wrong:
                why = f"{model.name}: runs, but gives a wrong result ({wrong[0]})"
                if model.rule == "arbitrary":
                    why += f" with seed {seed}"
                break
        if why:
            attempts.append(Attempt(model.name, False, why))
            continue
        attempts.append(Attempt(model.name, True, "runs"))
        return Verdict(program.name, model.name, _reason(model, result, attempts, program),
                       result, attempts)
    raise PRAMError(f"{program.name} runs correctly under none of: "
                    f"{', '.join(m.name for m in resolved)}; "
                    + "; ".join(a.why for a in attempts))


def _reason(model: Model, result: Result, attempts: list, program: Program) -> str:
    r, w = result.max_readers, result.max_writers
    if w.count > 1:
        combined = model.name.split("-", 1)[-1]       # "CRCW-sum" -> "sum"
        how = {"common": "all writers agree, so the common rule suffices",
               "arbitrary": "any one writer's value is a correct result",
               "priority": "the lowest-numbered writer's value is the correct result",
               "combine": f"the values must be combined ({combined})"}[model.rule]
        text = (f"Up to {w.count} processors write one address in the same step "
                f"({w.location} at step {w.step}) and {how}")
    elif r.count > 1:
        text = (f"Every address has at most one writer per step, while up to {r.count} "
                f"processors read one address in the same step ({r.location} at step {r.step})")
    else:
        text = "No address is read or written by two processors in the same step"
    failed = [a.why for a in attempts if not a.ok]
    if failed:
        text += ". Weaker models fail: " + "; ".join(failed)
    if program.note:
        text += f". Note: {program.note}"
    return text + "."
