"""python -m course_lib.experiments.frameworks_job --out_dir DIR [--strategy ddp] [--max_iters 4] [--data_dir D]

The labs' SLURM job: ``srun`` starts one task per rank and Lightning Fabric finds its ranks in
SLURM's own variables (``SLURMEnvironment``: SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID,
SLURM_NTASKS; the main node is the allocation's first, the port MASTER_PORT or one derived from
the job id). No torchrun, no rendezvous of ours: Fabric starts the process group itself. Written by
``course submit --scheduler slurm --launcher srun --module course_lib.experiments.frameworks_job``.

Each rank trains the course GPT (the small shape of :mod:`frameworks_gpt`) on its share of every
global batch; rank 0 writes ``DIR/fabric_run.json``: the cluster environment Fabric chose, the
world, each rank's SLURM task id and node, and the global loss of every step, which must equal
:func:`course_lib.experiments.frameworks_gpt.one_process` for the same arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.experiments.frameworks_fabric import fabric_package, fabric_setup, fabric_step
from course_lib.experiments.frameworks_gpt import SMALL, adamw_with_lr, batches
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.utils import atomic_write_bytes


def _tasks_per_node() -> int:
    """SLURM_NTASKS_PER_NODE (set by --ntasks-per-node, which the course's sbatch script gives): the
    tasks on each node. The "2(x2)" form is SLURM_TASKS_PER_NODE's; it is cut at "(" all the same."""
    return int(os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.experiments.frameworks_job",
                                description=__doc__.split("\n\n")[1])
    p.add_argument("--out_dir", required=True)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"], help="Lightning's name")
    p.add_argument("--max_iters", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=4, help="rows per rank per step")
    p.add_argument("--data_dir", default=None)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    fabric_pkg = fabric_package()
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    fabric = fabric_pkg.Fabric(accelerator=accelerator, devices=_tasks_per_node(),
                               num_nodes=int(os.environ.get("SLURM_NNODES", "1")), strategy=a.strategy)
    fabric.launch()  # under srun: no processes started, the group joined from SLURM's variables
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(0)
    model, opt = fabric_setup(fabric, GPT(cfg).to(fabric.device), adamw_with_lr(1e-3))
    losses = []
    for x, y in batches(a.data_dir, cfg, a.max_iters, a.batch_size, fabric.global_rank, fabric.world_size, 0):
        loss = fabric_step(fabric, model, opt, fabric.to_device(x), fabric.to_device(y))
        dist.all_reduce(loss)
        losses.append(loss.item() / fabric.world_size)
    me = {"global_rank": fabric.global_rank, "slurm_procid": os.environ.get("SLURM_PROCID"),
          "slurm_nodeid": os.environ.get("SLURM_NODEID"), "host": socket.gethostname()}
    ranks = [None] * fabric.world_size
    dist.all_gather_object(ranks, me)
    if fabric.global_rank == 0:
        env = fabric.strategy.cluster_environment
        report = {"cluster_environment": type(env).__name__, "world_size": fabric.world_size,
                  "num_nodes": fabric.strategy.num_nodes, "main_address": env.main_address,
                  "main_port": env.main_port, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                  "strategy": type(fabric.strategy).__name__, "ranks": ranks, "losses": losses,
                  "batch_size": a.batch_size, "max_iters": a.max_iters}
        Path(a.out_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(a.out_dir) / "fabric_run.json", json.dumps(report, indent=1).encode())
        print(json.dumps({k: report[k] for k in ("cluster_environment", "world_size", "losses")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
