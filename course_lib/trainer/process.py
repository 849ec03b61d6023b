"""Where a training process runs: its rank, device, dtype and threads, resolved from the config.

Imported by :mod:`course_lib.trainer.loop`; under torchrun it joins the process group (gloo on CPUs,
NCCL on GPUs) with the config's timeout, on the device and backend the launcher planned for it
(``COURSE_RANK_DEVICES``/``COURSE_BACKEND``: two ranks may share one GPU over gloo).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib.hardware import detect, pick_dtype, planned_device, planned_gpu_share
from course_lib.parallel.collective_check import install_collective_check
from course_lib.trainer.config import TrainConfig
from course_lib.utils import init_process_group


@dataclass
class Runtime:
    """Where this process runs: rank, device, dtype, threads (resolved from the config)."""
    rank: int
    world_size: int
    local_world_size: int
    device: str
    dtype: str
    threads: int
    distributed: bool
    devices: float = 1.0  # devices the run has: world_size, or fewer GPUs when ranks share them

    @property
    def device_type(self) -> str:
        return "cuda" if self.device.startswith("cuda") else "cpu"


def setup_runtime(cfg: TrainConfig) -> Runtime:
    """Join the process group when launched by torchrun; pick device, threads and dtype."""
    env = os.environ
    distributed = "RANK" in env and "WORLD_SIZE" in env
    rank, world = (int(env["RANK"]), int(env["WORLD_SIZE"])) if distributed else (0, 1)
    local_rank, local_world = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))
    device, backend = cfg.device, None
    planned = planned_device() if distributed else None
    if planned:  # the launcher's plan (course_lib.launch.placement): ranks may share a GPU over gloo
        device, backend = planned
    elif device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("device cuda requested but torch.cuda.is_available() is False; use --device=cpu")
        if not planned:
            device = f"cuda:{local_rank}" if distributed else (device if ":" in device else "cuda:0")
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (as nanoGPT)
        torch.backends.cudnn.allow_tf32 = True
        threads = torch.get_num_threads()
    else:  # N workers share the cores: cores // N threads each, so they do not oversubscribe
        threads = cfg.threads or max(1, len(os.sched_getaffinity(0)) // local_world)
        torch.set_num_threads(threads)
    if distributed and not dist.is_initialized():
        backend = backend or ("nccl" if device.startswith("cuda") else "gloo")
        init_process_group(backend, timeout_s=cfg.timeout_s, device=device)
    if distributed and cfg.check_collectives:
        install_collective_check(True, cfg.timeout_s)  # every rank: it makes a side group
    dtype = pick_dtype(detect(device), cfg.dtype)
    share = planned_gpu_share() if planned and device.startswith("cuda") else 1.0
    return Runtime(rank, world, local_world, device, dtype, threads, distributed, world * share)


# Variables set by the launchers (torchrun's docs, "Environment Variables"; sbatch/srun "OUTPUT
# ENVIRONMENT VARIABLES"): TORCHELASTIC_RUN_ID is torchrun's --rdzv-id, GROUP_WORLD_SIZE its agents
# (one per node); SLURM_STEP_ID exists only inside an srun step.
LAUNCH_VARS = {"torchrun_run_id": "TORCHELASTIC_RUN_ID", "torchrun_agents": "GROUP_WORLD_SIZE",
               "slurm_job_id": "SLURM_JOB_ID", "slurm_step_id": "SLURM_STEP_ID",
               "slurm_step_nodes": "SLURM_STEP_NODELIST", "pbs_job_id": "PBS_JOBID"}


def launcher_info(env=None) -> dict:
    """Who started this process (recorded in run.json): the launch variables that are set."""
    env = os.environ if env is None else env
    return {key: env[var] for key, var in LAUNCH_VARS.items() if var in env}
