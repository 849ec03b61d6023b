"""The batch job this process runs in (SLURM or PBS), read from the scheduler's environment.

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

from course_lib.launch.placement import LaunchConfigError


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
