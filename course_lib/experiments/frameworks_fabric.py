"""Lightning Fabric inside the course's ranks: its strategies on the process group already running,
its training step, the bytes its collectives move, and what it refuses on this machine (notebook 11).

    from course_lib.experiments.frameworks_fabric import make_fabric, fabric_step, refusals
    fabric = make_fabric("ddp")                        # on every rank started by run_ranks / launch
    model, opt = fabric_setup(fabric, GPT(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    loss = fabric_step(fabric, model, opt, x, y)       # x, y: this rank's (B, T) slice
    refusals(["dp", "fsdp", "deepspeed"])              # {name: what Fabric says on this machine}

How Fabric finds its ranks (read in Lightning's source, ``lightning/fabric/connector.py`` and
``plugins/environments/``): it asks each cluster environment in turn (torchelastic first, as
torchrun can run inside a SLURM job; then SLURM, LSF, MPI) whether it is running under it; otherwise ``LightningEnvironment``, which
counts the processes as started from outside when ``LOCAL_RANK`` is set, and then does not spawn
any. The course's rank runner sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` and has already
joined the gloo group; Fabric's ``_init_dist_connection`` returns at once when a group exists, so
Fabric trains on the course's own group. :func:`make_fabric` names ``LightningEnvironment``
explicitly, so that a notebook running inside a SLURM allocation does not take the job's srun
variables for its own (under ``srun`` itself, :mod:`frameworks_job` lets Fabric find SLURM).

``lightning`` is the optional extra ``course-lib[frameworks]``, and nothing else in course_lib
needs it: this module imports it when it is installed (:func:`fabric_package` says what to install
when it is not). A kernel that imported it before its first ``run_ranks`` has the rank runner's fork
server import it once (:data:`course_lib.launch.ranks.PRELOAD_IF_IMPORTED`), instead of every rank
of every run: about 4.5 s a rank on a laptop CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import fully_shard

from course_lib.experiments.memory_measure import CommCounter
from course_lib.parallel.zero.units import default_units

try:  # the optional extra (module docstring)
    import lightning.fabric as _fabric
except ImportError:
    _fabric = None

# Fabric's names for what this module builds; "fsdp2" is ModelParallelStrategy with fully_shard.
FABRIC_STRATEGIES = ("single", "ddp", "fsdp2")
LIGHTNING_NAMED = ("dp", "fsdp", "deepspeed")  # what the labs ran, by Lightning's names
MISSING = ("Lightning is not installed: pip install 'course-lib[frameworks]' "
           "(lightning and transformers, the optional extra of this lesson)")


def fabric_package():
    """``lightning.fabric``, or an ImportError that says what to install."""
    if _fabric is None:
        raise ImportError(MISSING)
    return _fabric


def fsdp2_parallelize(units: Callable | None = None) -> Callable:
    """A ``parallelize_fn`` for Fabric's ``ModelParallelStrategy``: FSDP2's ``fully_shard`` on the
    same units as the course's ZeRO-3 (:func:`course_lib.parallel.zero.units.default_units`: each
    transformer block), then on the whole model, over the mesh's data-parallel dimension."""
    def parallelize(model: torch.nn.Module, mesh) -> torch.nn.Module:
        dp_mesh = mesh["data_parallel"]
        for unit in (units or default_units)(model):
            fully_shard(unit, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        return model
    return parallelize


def make_fabric(strategy: str, *, accelerator: str = "cpu", devices: int | None = None, launch: bool = True,
                parallelize: Callable | None = None, **ddp_kwargs):
    """A Fabric on the ranks this process belongs to (one rank alone: ``"single"``).

    ``strategy``: "single" (one process, Fabric's SingleDeviceStrategy), "ddp" (DDPStrategy,
    the group's backend; ``ddp_kwargs`` such as ``bucket_cap_mb`` go to DistributedDataParallel,
    as in Lightning) or "fsdp2" (ModelParallelStrategy, FSDP2 over all ranks, tensor_parallel_size
    1; ``parallelize`` replaces :func:`fsdp2_parallelize` as its ``parallelize_fn``). Lightning's
    own names "dp", "fsdp" and "deepspeed" are passed to Fabric as they are, for a GPU machine
    (:func:`refusals` says what a CPU machine answers); "dp" is one process driving ``devices``
    GPUs, so it runs on one rank. An argument the strategy would not use (``parallelize`` but for
    "fsdp2", ``ddp_kwargs`` but for "ddp", ``devices`` other than the ranks there are, "single" on
    one of several ranks) is a ValueError or TypeError, not another run than the one asked for.
    """
    fabric_pkg = fabric_package()
    # lightning is the optional extra: imported when used (fabric_package says what to install)
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

    if strategy not in FABRIC_STRATEGIES + LIGHTNING_NAMED:
        raise ValueError(f"strategy must be one of {FABRIC_STRATEGIES + LIGHTNING_NAMED}, got {strategy!r}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    # An argument the chosen strategy would not use is an error: dropped silently, another run
    # than the one asked for would train (DDP instead of the caller's FSDP2, say).
    if strategy == "single" and world > 1:
        raise ValueError(f'"single" is one process alone, but this process is one of {world} ranks: each rank '
                         'would train its own model on its share of the batch, no gradient exchanged; '
                         'run it on 1 rank, or use "ddp" or "fsdp2" here')
    if parallelize is not None and strategy != "fsdp2":
        raise ValueError(f'parallelize is the parallelize_fn of "fsdp2"; {strategy!r} would not call it')
    if ddp_kwargs and strategy != "ddp":
        raise TypeError(f'{sorted(ddp_kwargs)} go to DistributedDataParallel, under "ddp" only; '
                        f'{strategy!r} would ignore them')
    ranks_of = {"single": 1, "ddp": world, "fsdp2": world}  # the devices these strategies train on
    if strategy in ranks_of and devices not in (None, ranks_of[strategy]):
        raise ValueError(f'{strategy!r} trains on the {ranks_of[strategy]} ranks there are (one device each), '
                         f'not devices={devices}')
    if strategy == "single":
        chosen, devices = "auto", 1
    elif strategy == "ddp":
        chosen, devices = DDPStrategy(process_group_backend=dist.get_backend() if world > 1 else None,
                                      cluster_environment=LightningEnvironment(), **ddp_kwargs), world
    elif strategy == "fsdp2":
        chosen, devices = ModelParallelStrategy(parallelize or fsdp2_parallelize(), data_parallel_size=world,
                                                tensor_parallel_size=1), world
    else:
        chosen, devices = strategy, devices or world
    plugins = [] if strategy == "ddp" else [LightningEnvironment()]
    fabric = fabric_pkg.Fabric(accelerator=accelerator, devices=devices, num_nodes=1, strategy=chosen,
                               plugins=plugins or None)
    if launch:
        fabric.launch()
    return fabric


def fabric_setup(fabric, model: torch.nn.Module, make_optimizer: Callable):
    """Fabric's order for sharded strategies: the module first, then an optimizer of its (now
    sharded) parameters. DeepSpeed (and XLA) take the two only together, ``fabric.setup(model,
    optimizer)``: ``setup_optimizers`` refuses them (Lightning's ``Fabric._validate_setup_optimizers``),
    and DeepSpeed's engine shards the optimizer itself. Returns (fabric module, fabric optimizer)."""
    # lightning is the optional extra: imported when used (fabric_package says what to install)
    from lightning.fabric.strategies import DeepSpeedStrategy, XLAStrategy

    if isinstance(fabric.strategy, (DeepSpeedStrategy, XLAStrategy)):
        return fabric.setup(model, make_optimizer(model))
    module = fabric.setup_module(model)
    return module, fabric.setup_optimizers(make_optimizer(module))


def wrapped(module) -> torch.nn.Module:
    """What Fabric wrapped the model in: DistributedDataParallel under "ddp", the FSDP2 module
    itself under "fsdp2" (``_FabricModule._forward_module``, Lightning's own attribute)."""
    return module._forward_module


def fabric_step(fabric, model, optimizer, *inputs, **named) -> torch.Tensor:
    """Lightning Fabric's training step, written as its documentation writes it: the forward, then
    ``fabric.backward`` (DDP's reducer or FSDP2's hooks do the communication inside it), then the
    optimizer. The model returns (logits, loss) like the course GPT (``x, y``) or an output with
    ``.loss`` like a Hugging Face model (keyword inputs). Returns this rank's loss (detached).

    Under "dp" a model that computes its own loss returns one per GPU: DataParallel's gather turns
    the replicas' scalars into a vector (``Gather`` in ``torch/nn/parallel/_functions.py`` warns
    so), and ``backward`` needs a scalar. Their mean is the batch's loss when the chunks are equal,
    as Hugging Face's ``Trainer`` takes it with several GPUs in one process."""
    out = model(*inputs, **named)
    loss = out.loss if hasattr(out, "loss") else out[1]
    # A loss is a scalar, or one per DataParallel replica. More dimensions: out[1] was not a loss
    # (a Hugging Face model called with return_dict=False puts its loss first and logits second),
    # and a step on its mean would train the model on the logits.
    if loss is None or loss.dim() > 1:
        raise ValueError("fabric_step needs the model's loss: (logits, loss) like the course GPT, or an output "
                         "with .loss (a Hugging Face model given its labels, with return_dict=True); got "
                         + ("loss=None" if loss is None else f"a tensor of shape {tuple(loss.shape)} in its place"))
    if loss.dim():  # (devices,): one loss per DataParallel replica
        loss = loss.mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer behind Fabric's wrapper (the one that holds the states)."""
    return getattr(optimizer, "optimizer", optimizer)


# function name in torch.distributed -> (op, which argument holds the full buffer)
class CollectiveCounter(CommCounter):
    """The collectives run inside ``with counter:`` (FSDP2's all-gathers and reduce-scatters),
    counted by :class:`course_lib.experiments.memory_measure.CommCounter` in the ZeRO paper's
    accounting, plus the order they came in (``events``) beside what :meth:`note` adds. DDP's
    reducer calls its process group from C++, out of the counter's sight, so DDP is counted with a
    communication hook instead (:func:`ddp_counting_hook`)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str, int]] = []  # (kind, what, bytes) in the order they happened

    @property
    def volume_bytes(self) -> int:
        return sum(self.volume.values())

    def count(self, op: str, nbytes: int) -> None:
        super().count(op, nbytes)
        self.events.append(("collective", op, nbytes))

    def note(self, kind: str, what: str) -> None:
        """Put something else that happened (a module's forward, say) in line with the collectives."""
        self.events.append((kind, what, 0))


def ddp_counting_hook(counter: CollectiveCounter, bucket):
    """A DDP communication hook (``state`` = a :class:`CollectiveCounter`): count the bucket, then
    all-reduce it as DDP does by default (sum, divided by the world size)."""
    buf = bucket.buffer()
    counter.count("all_reduce", buf.numel() * buf.element_size())
    return allreduce_hook(None, bucket)


def refusals(rank: int, world: int, names=("dp", "fsdp", "deepspeed"), accelerator: str = "cpu") -> dict[str, str]:
    """On every rank (``run_ranks(refusals, 2)``): what Fabric says when asked for each strategy by
    its name on this machine, set up as far as its launch. "" where it builds and launches what
    was asked (then it runs); "refused: " and the framework's error; or "replaced: " and its
    warning where it builds another strategy instead (``dp`` on a CPU becomes ``ddp``), word for word."""
    fabric_pkg = fabric_package()
    # lightning is the optional extra: imported when used (fabric_package says what to install)
    from lightning.fabric.plugins.environments import LightningEnvironment

    out = {}
    for name in names:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                fabric = fabric_pkg.Fabric(accelerator=accelerator, devices=world, strategy=name,
                                           plugins=[LightningEnvironment()])
                fabric.launch()
            except (ValueError, RuntimeError, ImportError, TypeError) as e:
                out[name] = f"refused: {type(e).__name__}: {e}"
                continue
        built = type(fabric.strategy).__name__
        replaced = [str(w.message) for w in said if f"'{name}'" in str(w.message)]
        out[name] = (f"replaced: {replaced[0]} (Fabric built {built})" if replaced else "")
    return out
