"""check_replicas: the bugs that do not hang, made visible (data-parallel replicas compared).

    from course_lib.parallel.replicas import check_replicas, local_grads
    loss.backward(); mine = local_grads(model)          # this rank's own gradients, before the sync
    sync_gradients(model)                                # the code under test
    print(check_replicas(model, optimizer, batch=x, local=mine))   # every rank calls it

Data parallelism promises that after each step every rank holds the same model, computed from
different data. Each rank hashes (BLAKE2b of the bytes) and measures (L2 norm) every parameter,
gradient and optimizer-state tensor, and the batch it read; one ``all_gather_object`` brings every
rank's list to every rank, and the report names the first tensor that differs and the ranks on each
side ("parameter 'fc.weight' differs: rank 0 norm 3.1416 | rank 1 norm 3.1420"). A batch that is
*equal* on two ranks is the bug there (the data is not sharded by rank). With ``local`` (the
gradients before the sync), each gradient is compared with the mean of the ranks' local gradients
(a rank without one, a branch it did not take, counts zero, as the course's DDP does): a sum
(world size times the mean) is named as such, a gradient left as this rank's own too (a parameter
missing from the sync). Where the two are the same tensor (a parameter used on one rank only: its
own gradient is the sum), the other ranks decide, as :func:`_name_sync_bugs` explains. Not
caught: a bug that is the same on every rank (a wrong learning rate everywhere), sharded states
(ZeRO-3, FSDP, tensor parallel: they are meant to differ; the trainer refuses the check there, and
a DTensor parameter, FSDP2's or PyTorch's tensor parallel's, is refused here by name).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.tensor import DTensor


class ReplicaMismatchError(RuntimeError):
    """The replicas are not what data parallelism promises; the message is the report."""


@dataclass
class ReplicaReport:
    """What :func:`check_replicas` found; ``problems`` is empty when the replicas agree."""

    world_size: int
    counts: dict[str, int]
    problems: list[str] = field(default_factory=list)
    first: str | None = None  # the first tensor that differs, e.g. "parameter 'fc.weight'"

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        what = ", ".join(f"{n} {kind}" for kind, n in self.counts.items() if n)
        if self.ok:
            return f"replicas agree on {self.world_size} ranks: {what} compared"
        return "\n".join([f"replicas DIFFER ({what} compared on {self.world_size} ranks):"]
                         + [f"  {p}" for p in self.problems])

    def raise_if_bad(self) -> ReplicaReport:
        if not self.ok:
            raise ReplicaMismatchError(str(self))
        return self


def digest(t: torch.Tensor) -> tuple[str, float]:
    """(hash of the bytes, L2 norm) of a tensor."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    norm = float((flat.abs() if flat.is_complex() else flat).double().norm())
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return hashlib.blake2b(data + str(flat.dtype).encode(), digest_size=8).hexdigest(), norm


def local_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of this rank's gradients (take it after backward, before the gradient sync)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _entries(model, optimizer, batch, grads: bool) -> list[tuple[str, str, str, float]]:
    """(kind, name, hash, norm) of everything that must be equal, then the batch (must differ)."""
    out, names = [], {}
    if model is not None:
        for n, p in model.named_parameters():
            if isinstance(p, DTensor):  # the same on every rank: each raises here, before the exchange
                raise TypeError(f"parameter {n!r} is a DTensor sharded over {p.device_mesh} (FSDP2, tensor "
                                 "parallel): each rank holds its own shard, so replicas cannot be compared")
            names[id(p)] = n
            out.append(("parameter", n, *digest(p)))
        if grads:
            out += [("gradient", n, *digest(p.grad)) for n, p in model.named_parameters() if p.grad is not None]
    if optimizer is not None:
        for i, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                for key, value in sorted(optimizer.state.get(p, {}).items()):
                    value = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
                    out.append(("optimizer state", f"{key} of {names.get(id(p), f'group {i} #{j}')}", *digest(value)))
    if batch is not None:
        out.append(("batch", "x", *digest(batch)))
    return out


# What _grad_sync_problem finds on one rank, before the ranks' findings are put together.
SUM, OWN, SUM_OR_OWN, NO_GRAD = "sum", "own", "sum or own", "no gradient"


def _grad_sync_problem(model, local: dict[str, torch.Tensor], world: int, group) -> list[tuple[str, str]]:
    """(name, finding) for each gradient that is not the mean of the ranks' local gradients: SUM,
    OWN, SUM_OR_OWN (it is both), NO_GRAD (none here, though some rank had one) or a sentence."""
    found, params = [], list(model.named_parameters())
    # Every rank must all-reduce the same parameters, but which have a local gradient may differ
    # (a branch taken on some ranks only): the ranks first count, one flag each, where there is one.
    device = params[0][1].device if params else torch.device("cpu")  # NCCL: a CUDA tensor
    present = torch.tensor([float(n in local) for n, _ in params], device=device)
    c10d.all_reduce(present, group=group)  # c10d's own: not a call of the code under test
    for (n, p), anywhere in zip(params, present.tolist(), strict=True):
        if not anywhere:
            continue
        mine = local[n] if n in local else torch.zeros_like(p.detach())  # none here counts as zero
        mean = mine.clone()
        c10d.all_reduce(mean, group=group)
        mean /= world
        if p.grad is None:  # nothing to compare on this rank (it took part in the all-reduce), but
            found.append((n, NO_GRAD))  # evidence for the others: no sum reached this rank
            continue
        g = p.grad.detach()
        if torch.allclose(g, mean, rtol=1e-4, atol=1e-6):
            continue
        summed = torch.allclose(g, mean * world, rtol=1e-4, atol=1e-6)
        own = torch.allclose(g, mine, rtol=1e-4, atol=1e-6)
        if summed or own:
            found.append((n, SUM_OR_OWN if summed and own else SUM if summed else OWN))
        else:
            found.append((n, (f"is neither the mean nor the sum of the ranks' gradients (norm {float(g.norm()):.4g}, "
                             f"mean's {float(mean.norm()):.4g})")))
    return found


def _name_sync_bugs(found: list[list[tuple[str, str]]], world: int) -> list[list[tuple[str, str]]]:
    """Each rank's findings (``found[r]``, from :func:`_grad_sync_problem`) as sentences.

    A gradient that is this rank's own *and* the sum (SUM_OR_OWN) is one only this rank's local
    gradient went into: the other ranks' sum to zero, typically a parameter used on this rank only
    (a branch the others did not take). Left out of the sync, it keeps its own gradient; summed and
    not divided, it holds the same tensor. This rank's numbers cannot tell the two apart; the other
    ranks can, because an all-reduce leaves the same tensor on every rank that takes part: where a
    sum was taken, the other ranks hold that sum too (SUM there), and where the parameter was left
    out they hold their own gradient (OWN, often zeros) or none at all (NO_GRAD). So: the other
    ranks' findings only SUM -> a sum; only OWN or NO_GRAD -> missing from the sync. Where they
    say neither (they hold the mean, as when only this rank skipped the division or only this rank
    kept its own, or they disagree), nothing here decides, and the report names both bugs.
    """
    sentences = {SUM: f"is the SUM of the ranks' gradients ({world} x their mean): divide by the world size",
                 OWN: "is this rank's own gradient: the parameter is missing from the gradient sync",
                 SUM_OR_OWN: (f"is both this rank's own gradient and the SUM of the ranks' gradients ({world} x "
                              "their mean: the other ranks' sum to zero), and the other ranks do not tell which: "
                              "the parameter is missing from the gradient sync, or its sum is not divided by "
                              "the world size")}
    by_name: dict[str, dict[int, str]] = {}
    for r, findings in enumerate(found):
        for name, what in findings:
            by_name.setdefault(name, {})[r] = what
    out: list[list[tuple[str, str]]] = [[] for _ in found]
    for r, findings in enumerate(found):
        for name, what in findings:
            if what == NO_GRAD:
                continue  # evidence only: the sets of tensors already differ in the report
            if what == SUM_OR_OWN:
                others = {OWN if w == NO_GRAD else w for q, w in by_name[name].items() if q != r}
                what = others.pop() if others in ({SUM}, {OWN}) else SUM_OR_OWN
            out[r].append((name, sentences.get(what, what)))
    return out


def check_replicas(model: torch.nn.Module | None = None, optimizer=None, batch: torch.Tensor | None = None,
                   local: dict[str, torch.Tensor] | None = None, grads: bool = True, group=None,
                   raise_error: bool = False) -> ReplicaReport:
    """Compare this rank's replica with the others' (collective: every rank of ``group`` calls it);
    the same report on every rank. ``raise_error``: raise :class:`ReplicaMismatchError` if it differs."""
    world = dist.get_world_size(group)
    mine = _entries(model, optimizer, batch, grads)
    sync = _grad_sync_problem(model, local, world, group) if (local is not None and model is not None) else []
    everyone: list = [None] * world
    c10d.all_gather_object(everyone, (mine, sync), group=group)
    counts: dict[str, int] = {}
    for kind, *_ in mine:
        counts[kind] = counts.get(kind, 0) + 1
    report = ReplicaReport(world, {(k if n == 1 else f"{k}s" if k != "batch" else "batches"): n
                                   for k, n in counts.items()})
    lists = [e[0] for e in everyone]
    if len({len(x) for x in lists}) > 1 or len({tuple(e[:2] for e in x) for x in lists}) > 1:
        report.problems.append("the ranks hold different sets of tensors: " + "; ".join(
            f"rank {r}: {len(x)}" for r, x in enumerate(lists)))
        report.first = "the set of tensors"
    else:
        for i, (kind, name, _, _) in enumerate(lists[0]):
            by_hash: dict[str, list[int]] = {}
            for r, x in enumerate(lists):
                by_hash.setdefault(x[i][2], []).append(r)
            if kind == "batch":
                same = [ranks for ranks in by_hash.values() if len(ranks) > 1]
                if same:
                    report.problems.append("batch: ranks " + "; ".join(", ".join(map(str, s)) for s in same)
                                           + " read the SAME batch (is the data sharded by rank?)")
            elif len(by_hash) > 1:
                sides = " | ".join(", ".join(f"rank {r}" for r in ranks) + f" norm {lists[ranks[0]][i][3]:.6g}"
                                   for ranks in by_hash.values())
                report.problems.append(f"{kind} '{name}' differs: {sides}")
            if report.problems and report.first is None:
                report.first = f"{kind} '{name}'"
    on: dict[tuple[str, str], list[int]] = {}
    for r, problems in enumerate(_name_sync_bugs([e[1] for e in everyone], world)):
        for name, what in problems:
            on.setdefault((name, what), []).append(r)
    for (name, what), ranks in on.items():
        report.problems.append(f"gradient '{name}' (rank {', '.join(map(str, ranks))}) {what}")
        report.first = report.first or f"gradient '{name}'"
    return report.raise_if_bad() if raise_error else report
