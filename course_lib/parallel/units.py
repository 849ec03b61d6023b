"""ZeRO-3 / FSDP units: the modules whose parameters are gathered and freed together.

By default every entry of every ``nn.ModuleList`` (GPT's transformer blocks, the toy's layers) is
a unit, and the root module is one more unit for whatever parameters are left (embeddings, final
norm, head), as FSDP's auto-wrap policies do (Zhao et al. 2023, "PyTorch FSDP", Sec. 3.2.1).
A parameter belongs to the innermost unit that contains it; a parameter used by two units would be
freed under the other's feet, so that is an error (tie weights inside one unit, e.g. the root).
"""

from __future__ import annotations

import torch
from torch import nn


def default_units(model: nn.Module) -> list[nn.Module]:
    """Every entry of every ModuleList (transformer blocks, toy layers)."""
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]


def owners(model: nn.Module, units: list[nn.Module]) -> dict[nn.Parameter, nn.Module]:
    """Each parameter -> the innermost unit (or the root ``model``) that holds it."""
    unit_ids = {id(u) for u in units}
    users: dict[nn.Parameter, dict[int, nn.Module]] = {}
    names: dict[nn.Parameter, str] = {}

    def visit(module: nn.Module, unit: nn.Module, prefix: str) -> None:
        unit = module if id(module) in unit_ids else unit
        for name, p in module.named_parameters(recurse=False):
            users.setdefault(p, {})[id(unit)] = unit
            names.setdefault(p, prefix + name)
        for name, child in module.named_children():
            visit(child, unit, f"{prefix}{name}.")

    visit(model, model, "")
    for p, by in users.items():
        if len(by) > 1:
            raise ValueError(f"parameter {names[p]!r} is used by {len(by)} ZeRO-3 units "
                             f"({', '.join(type(u).__name__ for u in by.values())}); tie weights "
                             "inside one unit (e.g. the root) or pass units= without the split")
    return {p: next(iter(by.values())) for p, by in users.items()}


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors of a module's output (a tensor, or tuples / lists / dicts of them)."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []
