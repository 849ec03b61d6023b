"""Where the ranks may run and where they run: the batch job's resources, each rank's device, the backend.

    plan = plan(nproc=2, recipe="shakespeare_char")      # plan_ranks(gpu_count(), ...)
    plan.line()   # 'plan: 2 ranks · cuda:0, cuda:0 · gloo · recipe shakespeare_char'

Every way of starting ranks (``course train``, :func:`course_lib.launch.launch`, ``%%torchrun``,
``make demo``, lesson 08) asks :func:`plan_ranks`, before anything is spawned, and the launcher
prints :meth:`RankPlan.line` once. The input is plain numbers and names (no torch), so the choice
can be tested on any machine by passing the GPU count.

More ranks than GPUs (2 ranks on Colab's one T4): the ranks take the GPUs in turn and share them
over gloo, which runs collectives on CUDA tensors (torch.distributed docs, "Backends": a table
that has grown with gloo's CUDA support; all_reduce and broadcast for long, all-gather, and
reduce-scatter since torch 2.8: 2.7's gloo has none, measured here) but sends none point to
point (the same table), so pipeline and context parallelism on shared GPUs are refused by the
training checks. NCCL does not allow two ranks of one communicator on one device: it stops at
initialisation with "Duplicate GPU detected", an ``ncclInvalidUsage`` ("NCCL invalid usage", seen with two course
"nodes" on one H100, 2026), so asking for NCCL there is refused with the command lines that work.
A GPU machine never silently falls back to CPU ranks: CPU ranks are what ``device='cpu'`` asks for.

The launcher hands the plan to the ranks in two environment variables (names in
:mod:`course_lib.hardware`, which the workers read without importing the launcher).

The batch job this process runs in (SLURM or PBS), read from the scheduler's environment, limits
what a launch may ask:

    alloc = detect_allocation()                  # None outside a batch job
    check_allocation(nnodes=2, nproc_per_node=4, uses_gpus=True, alloc=alloc)   # or a ValueError

:func:`check_scheduler` refuses a launch that asks for more nodes or GPUs than the job has.
Variables read: SLURM_JOB_ID, SLURM_JOB_NUM_NODES/SLURM_NNODES, SLURM_GPUS_ON_NODE,
SLURM_CPUS_ON_NODE, SLURM_JOB_NODELIST (https://slurm.schedmd.com/sbatch.html#SECTION_OUTPUT-ENVIRONMENT-VARIABLES);
PBS_JOBID, PBS_NODEFILE, NCPUS (PBS Professional reference guide, "PBS environment variables").
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from course_lib.hardware import BACKEND_ENV, RANK_DEVICES_ENV, gpu_count
from course_lib.registry import ConfigError, device_error

BACKENDS = ("auto", "gloo", "nccl")


class LaunchConfigError(ConfigError):
    """A launch that cannot work as asked; the message says what to change. A ConfigError (a
    ValueError): ``course train`` reports both the same way."""


class PlanError(LaunchConfigError):
    """Ranks, devices and backend that cannot work together; the message says what to run instead."""


@dataclass(frozen=True)
class RankPlan:
    """The ranks on this host, in order, run on ``devices``; every rank joins a ``backend`` group.

    One node: rank k on ``devices[k]``. Nodes simulated on this host (``nnodes`` torchrun agents
    here) share its GPUs: node g's local rank k on ``devices[g * nproc + k]``.
    """
    devices: tuple[str, ...]  # 'cpu' or 'cuda:N', one per rank on this host
    backend: str  # 'gloo' or 'nccl'
    recipe: str = ""  # what runs: a training preset, a script, a cell
    nnodes: int = 1
    nproc: int = 0  # ranks per node (0: all of ``devices``)

    def __post_init__(self):
        if not self.nproc:
            object.__setattr__(self, "nproc", len(self.devices))

    @property
    def device_type(self) -> str:
        return "cuda" if self.devices[0].startswith("cuda") else "cpu"

    @property
    def ranks_per_device(self) -> int:
        """The most ranks any one device holds (memory per rank is the device's / this)."""
        return max(self.devices.count(d) for d in self.devices)

    @property
    def gpus_per_node(self) -> int:
        """GPUs the ranks of one node use (0 for CPU ranks): what a batch job must give each node."""
        return len({d for d in self.devices[:self.nproc] if d.startswith("cuda")})

    def line(self) -> str:
        ranks = self.nproc * self.nnodes
        here = self.devices if len(self.devices) == ranks else self.devices + ("...",)
        where = f"{ranks} rank{'s' if ranks > 1 else ''}" + (f" ({self.nnodes} nodes)" if self.nnodes > 1 else "")
        shared = " (ranks share a GPU)" if self.device_type == "cuda" and self.ranks_per_device > 1 else ""
        return (f"plan: {where} · {', '.join(here)}{shared} · {self.backend}"
                + (f" · recipe {self.recipe}" if self.recipe else ""))

    def env(self) -> dict[str, str]:
        """What the launcher puts in the ranks' environment."""
        return {RANK_DEVICES_ENV: ",".join(self.devices), BACKEND_ENV: self.backend}


def _whole(nproc):
    if isinstance(nproc, str) and nproc.isdigit():
        nproc = int(nproc)
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise PlanError(f"nproc must be a whole number >= 1 or 'auto', got {nproc!r}")
    return nproc


def plan_ranks(n_gpu: int, nproc="auto", device: str = "auto", backend: str = "auto", recipe: str = "",
               nnodes: int = 1, same_host: bool = False) -> RankPlan:
    """Devices and backend for ``nproc`` ranks per node on a node with ``n_gpu`` GPUs.

    same_host: the ``nnodes`` nodes are agents on this one host (the course's stand-in for a
    cluster), so all their ranks share its GPUs.

    device: 'auto' (the GPUs if there are any, else the CPU), 'cpu', 'cuda', or 'cuda:N' (one rank
    on GPU N). nproc: 'auto' is one rank per GPU, else 2 CPU ranks. backend: 'auto' is NCCL for one
    rank per GPU, gloo for CPU ranks and for ranks that share a GPU. Raises PlanError before anything starts.
    """
    if error := device_error(device):  # RunConfig's rule: the same strings refused in the same words
        raise PlanError(error)
    kind, _, index = device.partition(":")
    if backend not in BACKENDS:
        raise PlanError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if kind == "auto":
        kind = "cuda" if n_gpu > 0 else "cpu"
    if kind == "cuda" and n_gpu == 0:
        raise PlanError("device='cuda' but this machine has no GPU; use device='cpu' (gloo) or run on a GPU machine")
    nproc = (n_gpu if kind == "cuda" else 2) if nproc == "auto" else _whole(nproc)
    here = nproc * nnodes if same_host else nproc  # ranks on this host
    if kind == "cpu":
        if backend == "nccl":
            raise PlanError("NCCL runs on GPUs only: use backend 'gloo' for CPU ranks")
        return RankPlan(("cpu",) * here, "gloo", recipe, nnodes, nproc)
    if index:  # 'cuda:N': that GPU, not the ranks' turn from cuda:0
        gpus = f"{n_gpu} GPU{'s' if n_gpu > 1 else ''} ({', '.join(f'cuda:{k}' for k in range(n_gpu))})"
        if int(index) >= n_gpu:
            raise PlanError(f"device={device!r} but this machine has {gpus}; use --device=cuda, "
                            "or one of those")
        if here > 1:
            raise PlanError(f"device={device!r} names one GPU, for one rank; for {here} ranks use --device=cuda "
                            f"(rank k on GPU k mod {n_gpu}), or choose their GPUs with CUDA_VISIBLE_DEVICES")
    devices = (device,) if index else tuple(f"cuda:{k % n_gpu}" for k in range(here))
    shared = here > n_gpu
    if shared and backend == "nccl":
        fits = f"--nproc={n_gpu}" if not same_host or nnodes == 1 else f"--nnodes=1 --nproc={n_gpu}"
        raise PlanError(
            f"{here} ranks on {n_gpu} GPU(s) here with NCCL: NCCL allows one rank per GPU. Run one rank per GPU "
            f"({fits}, NCCL), or let the ranks share the GPU(s) over gloo (--backend=gloo), or run CPU ranks "
            "(--device=cpu)")
    if backend == "auto":
        backend = "gloo" if shared else "nccl"
    return RankPlan(devices, backend, recipe, nnodes, nproc)


def plan(nproc, device: str = "auto", backend: str = "auto", recipe: str = "", nnodes: int = 1,
         same_host: bool = False) -> RankPlan:
    """:func:`plan_ranks` on this machine (its GPU count): what every launcher asks."""
    n_gpu = 0 if device == "cpu" else gpu_count()  # CPU ranks: no torch import to count GPUs
    return plan_ranks(n_gpu, nproc, device, backend, recipe, nnodes, same_host)


# --- the batch job: what a launch may ask of it ---------------------------------------------------

@dataclass(frozen=True)
class Allocation:
    """The resources a batch job was given (None where the scheduler does not say)."""

    scheduler: str
    job_id: str
    nodes: int | None
    gpus_per_node: int | None
    cpus_per_node: int | None
    hosts: tuple[str, ...] = ()


def _int(value: str | None) -> int | None:
    m = re.match(r"\d+", value or "")
    return int(m.group()) if m else None


def expand_nodelist(nodelist: str) -> list[str]:
    """'gpu[01-03,07],login1' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1'] (SLURM syntax)."""
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}")
    return hosts


def detect_allocation(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The SLURM or PBS job this process runs in, or None outside a batch job."""
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID"):
        hosts = tuple(expand_nodelist(env.get("SLURM_JOB_NODELIST", "")))
        nodes = _int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")) or (len(hosts) or None)
        return Allocation("slurm", env["SLURM_JOB_ID"], nodes, _int(env.get("SLURM_GPUS_ON_NODE")),
                          _int(env.get("SLURM_CPUS_ON_NODE")), hosts)
    if env.get("PBS_JOBID"):
        hosts: tuple[str, ...] = ()
        try:
            with open(env.get("PBS_NODEFILE", "")) as f:
                hosts = tuple(dict.fromkeys(line.strip() for line in f if line.strip()))
        except OSError:
            pass
        return Allocation("pbs", env["PBS_JOBID"], len(hosts) or None, None, _int(env.get("NCPUS")), hosts)
    return None


def check_allocation(nnodes: int, nproc_per_node: int, uses_gpus: bool,
                     alloc: Allocation | None) -> None:
    """Refuse nodes x GPUs that the batch job does not have, saying what to change."""
    if alloc is None:
        return
    var = {"slurm": "SLURM_JOB_NUM_NODES", "pbs": "PBS_NODEFILE"}[alloc.scheduler]
    if alloc.nodes is not None and nnodes > alloc.nodes:
        raise ValueError(
            f"nnodes={nnodes} but this {alloc.scheduler.upper()} job ({alloc.job_id}) has "
            f"{alloc.nodes} node(s) ({var}); use nnodes<={alloc.nodes} or submit a job with "
            f"{nnodes} nodes (course submit --nodes {nnodes})")
    if uses_gpus and alloc.gpus_per_node is not None and nproc_per_node > alloc.gpus_per_node:
        raise ValueError(
            f"{nproc_per_node} GPU ranks per node but this job has {alloc.gpus_per_node} GPU(s) per "
            f"node (SLURM_GPUS_ON_NODE); use nproc={alloc.gpus_per_node} or submit with "
            f"--gpus-per-node {nproc_per_node}")


def check_scheduler(nnodes: int, nproc_per_node: int, device: str, env: Mapping[str, str] | None = None) -> None:
    """Inside a SLURM/PBS job: refuse more nodes or GPUs than the job was given (a LaunchConfigError)."""
    try:
        check_allocation(nnodes, nproc_per_node, device == "cuda", detect_allocation(env))
    except ValueError as e:
        raise LaunchConfigError(str(e)) from None
