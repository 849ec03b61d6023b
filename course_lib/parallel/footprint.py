"""What one rank really holds: bytes of parameters, gradients and optimizer states.

These are the ZeRO paper's "model states" (Rajbhandari et al. 2020, Sec. 3.1), measured on the
live tensors of any strategy, ours or PyTorch's, to compare with :mod:`course_lib.analysis.memory`.
Each storage is counted once (a shard that is a view into a full parameter costs nothing extra;
a freed ZeRO-3 parameter, its storage resized to zero, costs nothing). Communication buffers
and activations are "residual states" and are not counted here.

    states = measure_model_states(strategy)      # memory.ModelStates(params, grads, optimizer)
"""

from __future__ import annotations

import torch

from course_lib.analysis.memory import ModelStates


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _optimizers(strategy) -> list[torch.optim.Optimizer]:
    opt = strategy.optimizer
    inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer wraps this rank's optimizer
    return [opt] + ([inner] if isinstance(inner, torch.optim.Optimizer) else [])


def measure_model_states(strategy) -> ModelStates:
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not torch.is_tensor(t):
                continue
            storage = _local(t).untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    # the module's parameters and, where they differ (ZeRO-3: whole tensors while gathered), those
    # forward and backward compute with
    compute = getattr(strategy, "compute_parameters", None)  # a Strategy; else anything with module, optimizer
    params = list(strategy.module.parameters()) + (list(compute()) if compute else [])
    for opt in _optimizers(strategy):
        params += [p for g in opt.param_groups for p in g["params"]]
    states = [v for opt in _optimizers(strategy) for s in opt.state.values() for v in s.values()]
    return ModelStates(params=nbytes(params), grads=nbytes(p.grad for p in params),
                       optimizer=nbytes(states))


def peak(*snapshots: ModelStates) -> ModelStates:
    """Per category, the most held at any of the snapshots (e.g. after backward, after step)."""
    return ModelStates(params=max(s.params for s in snapshots),
                       grads=max(s.grads for s in snapshots),
                       optimizer=max(s.optimizer for s in snapshots))
