"""PyTorch's own sharded data parallelism behind the Strategy interface, to compare ours with.

* ``torch_zero1``: DistributedDataParallel + ``ZeroRedundancyOptimizer`` (optimizer states
  sharded by whole parameters, updated parameters broadcast by their owners): ZeRO stage 1.
* ``fsdp_grad_op``: FSDP2 ``fully_shard`` with ``reshard_after_forward=False``: parameters stay
  gathered from forward to backward (like FSDP1's SHARD_GRAD_OP), gradients and optimizer states
  sharded: ZeRO stage 2's memory for states, one all-gather per step.
* ``fsdp_full``: ``reshard_after_forward=True``: parameters freed after forward and gathered
  again for backward: ZeRO stage 3.

Units for FSDP are the same as ours (:func:`course_lib.parallel.zero.units.default_units`, then the
root). ``state_dict()`` returns the full state in the unsharded optimizer's format on every rank
(like ours), so checkpoints move freely between strategies. ``comm_s`` stays 0: their
collectives run inside forward, backward and step, which wait for them (the trainer's compute_ms
holds their exposed communication; the profiler separates it: lesson 08, section 6).

A unit that some ranks run and others skip in a step (a data-dependent branch) leaves FSDP2's
collectives unmatched: on gloo the rank aborts (SIGABRT) rather than naming the branch. A
parameter that no rank uses is fine under FSDP2 (it stays put and gets no optimizer state); under
``torch_zero1`` it is DDP's "Expected to have finished reduction" error (see TorchDDP).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from course_lib.parallel.comms import Comms, broadcast_module
from course_lib.parallel.zero.sharding import optimizer_kwargs
from course_lib.parallel.strategy import Strategy, TorchDDP, model_device
from course_lib.parallel.zero.units import default_units


class TorchZero1(TorchDDP):
    name = "torch_zero1"

    def __init__(self, model, make_optimizer, group=None, bucket_cap_mb: float = 25):
        super().__init__(model, make_optimizer, group, bucket_cap_mb=bucket_cap_mb)
        full = self.optimizer
        groups = [{k: v for k, v in g.items()} for g in full.param_groups]
        self.optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=type(full),
                                                 process_group=group, **optimizer_kwargs(full))

    def state_dict(self) -> dict:
        """Consolidated on rank 0, then broadcast: the full state on every rank."""
        self.optimizer.consolidate_state_dict(to=0)
        box = [self.optimizer.state_dict() if self.dp_rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0)
                                   if self.group is not None else 0, group=self.group)
        full = {"state": box[0]["state"], "param_groups": box[0]["param_groups"]}
        return {"model": self.module.state_dict(), "optimizer": full}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        # ZeroRedundancyOptimizer.load_state_dict drops the entries other ranks own from its input
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))


class FSDP2(Strategy):
    reshard_after_forward = True

    def __init__(self, model, make_optimizer, group=None, units=None):
        super().__init__(model, lambda m: None, group)  # the optimizer must see sharded params
        self.comms = Comms(group)
        broadcast_module(model, self.comms)  # fully_shard keeps each rank's own values
        device_type = model_device(model).type
        mesh = (DeviceMesh.from_group(group, device_type) if group is not None
                else init_device_mesh(device_type, (self.dp_world_size,)))
        for unit in default_units(model) if units is None else units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        self.optimizer = make_optimizer(model)
        self.names = {id(p): n for n, p in model.named_parameters()}

    @contextlib.contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _options(self):
        return StateDictOptions(full_state_dict=True, cpu_offload=False)

    def _param_names(self) -> list[str]:
        return [self.names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        """Full state on every rank; optimizer state keyed by index like an unsharded optimizer."""
        model = get_model_state_dict(self.module, options=self._options())
        if not self.optimizer.state:  # before the first step: nothing sharded to gather, and
            # get_optimizer_state_dict would create the state with a zero-gradient step, which
            # counts as a step for Adam's bias correction and changes the training run
            return {"model": model, "optimizer": self.optimizer.state_dict()}
        optim = get_optimizer_state_dict(self.module, self.optimizer, options=self._options())
        index = {name: i for i, name in enumerate(self._param_names())}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in optim["param_groups"]]
        return {"model": model,
                "optimizer": {"state": {index[n]: s for n, s in optim["state"].items()},
                              "param_groups": groups}}

    def load_state_dict(self, state: dict) -> None:
        names = self._param_names()
        full = copy.deepcopy(state["optimizer"])  # set_optimizer_state_dict edits what it gets
        optim = {"state": {names[int(i)]: s for i, s in full["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                  for g in full["param_groups"]]}
        set_model_state_dict(self.module, state["model"], options=self._options())
        if not full["state"]:  # saved before the first step (see state_dict)
            self.optimizer.load_state_dict(full)
            return
        set_optimizer_state_dict(self.module, self.optimizer, optim, options=self._options())


class FSDPGradOp(FSDP2):
    name = "fsdp_grad_op"
    reshard_after_forward = False


class FSDPFull(FSDP2):
    name = "fsdp_full"
    reshard_after_forward = True
