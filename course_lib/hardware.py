"""Hardware profiles: memory, peak FLOP/s per dtype and the dtype to train with.

    course info            # what was detected and what it implies

Peak figures are the vendors' dense (no sparsity) tensor-core numbers from their data sheets:
NVIDIA T4 (Turing, 65 TFLOP/s fp16, 8.1 fp32), V100 SXM2 (125 fp16, 15.7 fp32), V100 PCIe (112
fp16, 14 fp32: lower clocks), A100 (312
bf16/fp16, 156 tf32, 19.5 fp32), L4 (121 bf16/fp16, 60 tf32, 30.3 fp32), H100 SXM5 (989 bf16/fp16,
495 tf32, 67 fp32), H100 PCIe (756, 378, 51), H100 NVL (835, 417, 60; 94 GB), H200 (same compute as
H100 SXM5), H200 NVL (same compute as H100 NVL; 141 GB). Memory is the data sheet's "GB" read as
10^9 bytes; the cards hold more (an "80GB" H100: 85.0e9 bytes in torch), which :func:`detect`
measures. MFU (PaLM,
Chowdhery et al. 2022, App. B) divides achieved model FLOP/s by the peak of the dtype in use.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass, field, replace

import psutil

# The units, one home: every module that counts bytes imports them from here.
TFLOP = 1e12
MB = 1e6
GB = 1e9  # the ZeRO paper's gigabyte
MiB = 2**20  # torch's bucket_cap_mb is in MiB
GiB = 2**30  # what nvidia-smi and torch.cuda report


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    kind: str  # "cuda" or "cpu"
    memory_bytes: int
    peak_flops: dict[str, float] = field(default_factory=dict)  # dtype -> FLOP/s (dense)
    train_dtype: str = "float32"  # what the trainer uses by default
    needs_grad_scaler: bool = False  # fp16 training needs loss scaling
    estimated: bool = False  # peak figures are an estimate (CPU), not a data sheet

    def peak(self, dtype: str) -> float | None:
        """Peak FLOP/s for ``dtype`` ('bfloat16', 'float16', 'tf32', 'float32'), None if unknown."""
        return self.peak_flops.get(dtype)

    def training_peak(self, dtype: str) -> float | None:
        """The peak a run training in ``dtype`` computes at (MFU's denominator): fp32 on a GPU runs
        its matmuls in TF32 (the trainer allows it), so the TF32 peak where the GPU has one; a GPU
        without TF32 (T4, V100) computes in fp32. None if unknown."""
        if dtype == "float32" and self.kind == "cuda":
            return self.peak("tf32") or self.peak("float32")
        return self.peak(dtype)

    def fits(self, nbytes: float) -> bool:
        return nbytes <= self.memory_bytes


def _gpu(name, mem_gb, bf16, fp16, tf32, fp32, dtype, scaler=False) -> HardwareProfile:
    peaks = {"float16": fp16 * TFLOP, "float32": fp32 * TFLOP}
    if bf16:
        peaks["bfloat16"] = bf16 * TFLOP
    if tf32:
        peaks["tf32"] = tf32 * TFLOP
    return HardwareProfile(name, "cuda", int(mem_gb * GB), peaks, dtype, scaler)


PROFILES: dict[str, HardwareProfile] = {
    "t4": _gpu("t4", 16, None, 65, None, 8.1, "float16", scaler=True),
    "v100": _gpu("v100", 32, None, 125, None, 15.7, "float16", scaler=True),
    "v100-pcie": _gpu("v100-pcie", 32, None, 112, None, 14, "float16", scaler=True),
    "a100-40gb": _gpu("a100-40gb", 40, 312, 312, 156, 19.5, "bfloat16"),
    "a100-80gb": _gpu("a100-80gb", 80, 312, 312, 156, 19.5, "bfloat16"),
    "l4": _gpu("l4", 24, 121, 121, 60, 30.3, "bfloat16"),
    "h100": _gpu("h100", 80, 989, 989, 495, 67, "bfloat16"),
    "h100-pcie": _gpu("h100-pcie", 80, 756, 756, 378, 51, "bfloat16"),
    "h100-nvl": _gpu("h100-nvl", 94, 835, 835, 417, 60, "bfloat16"),
    "h200": _gpu("h200", 141, 989, 989, 495, 67, "bfloat16"),
    "h200-nvl": _gpu("h200-nvl", 141, 835, 835, 417, 60, "bfloat16"),
    "cpu": HardwareProfile("cpu", "cpu", 0, {}, "float32", estimated=True),
}


def _match_gpu(device_name: str, total_memory: int) -> str | None:
    """Map a CUDA device name (e.g. 'NVIDIA A100-SXM4-80GB') to a profile key."""
    n = device_name.upper()
    nvl = re.search(r"\bNVL\b", n) is not None  # the NVL boards: PCIe cards, lower clocks than SXM
    if "H200" in n:
        return "h200-nvl" if nvl else "h200"
    if "H100" in n:
        return "h100-pcie" if "PCIE" in n else "h100-nvl" if nvl else "h100"
    if re.search(r"\bV100\b", n):
        return "v100-pcie" if "PCIE" in n else "v100"
    if "A100" in n:
        return "a100-80gb" if total_memory > 50 * GB else "a100-40gb"
    for key in ("t4", "l4"):
        # whole words: "L4" is not the L40S, "T4" not the Quadro T400
        if re.search(rf"\b{key.upper()}\b", n):
            return key
    return None


def cpu_profile(threads: int | None = None) -> HardwareProfile:
    """An estimated CPU profile: cores x 2.5 GHz x FLOP/cycle (32 with AVX2 FMA, 64 with AVX-512)."""
    cores = threads or len(os.sched_getaffinity(0))
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    per_cycle = 64 if "avx512f" in flags else 32 if "fma" in flags else 8
    fp32 = cores * 2.5e9 * per_cycle
    return replace(PROFILES["cpu"], memory_bytes=psutil.virtual_memory().total, peak_flops={"float32": fp32})


def detect(device: str | None = None) -> HardwareProfile:
    """Profile of the device this process would train on ("cuda" if available, else "cpu")."""
    import torch  # here: the launching process imports this module without torch

    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if not use_cuda:
        return cpu_profile(torch.get_num_threads())
    index = torch.device(device or "cuda").index
    if index is None:  # plain "cuda": the rank's own GPU (after torch.cuda.set_device), not GPU 0
        index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    key = _match_gpu(props.name, props.total_memory)
    if key is not None:
        return replace(PROFILES[key], memory_bytes=props.total_memory)
    # An unknown GPU: no data-sheet peak (MFU unavailable); bf16 if the hardware supports it.
    bf16 = torch.cuda.is_bf16_supported()
    return HardwareProfile(props.name, "cuda", props.total_memory, {},
                           "bfloat16" if bf16 else "float16", needs_grad_scaler=not bf16)


def gpu_count() -> int:
    """CUDA devices this process can see (honours CUDA_VISIBLE_DEVICES).

    ``torch.cuda.device_count()`` asks NVML first, so it neither creates a CUDA context nor
    "poisons" a later fork (torch.multiprocessing docs, "Poison fork in multiprocessing").
    """
    import torch  # here: the launching process imports this module without torch

    return torch.cuda.device_count()


# The launcher's device plan (course_lib.launch.placement), as the ranks receive it.
RANK_DEVICES_ENV = "COURSE_RANK_DEVICES"  # e.g. "cuda:0,cuda:0": this host's ranks in order
BACKEND_ENV = "COURSE_BACKEND"  # "gloo" or "nccl"


def planned_device(env=None) -> tuple[str, str] | None:
    """(device, backend) the launcher chose for this rank, or None when it was started otherwise.

    Node g's local rank k takes entry ``g * LOCAL_WORLD_SIZE + k`` when the list holds every
    simulated node's ranks (torchrun sets GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE), else entry k.
    """
    env = os.environ if env is None else env
    if not env.get(RANK_DEVICES_ENV) or not env.get(BACKEND_ENV):
        return None
    devices = env[RANK_DEVICES_ENV].split(",")
    local_rank, local_world = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))
    index = local_rank + (int(env.get("GROUP_RANK", 0)) * local_world if len(devices) > local_world else 0)
    return devices[index % len(devices)], env[BACKEND_ENV]


def planned_gpu_share(env=None) -> float:
    """GPUs per rank under the launcher's plan: 1.0 (a GPU each, or no plan), 0.5 (2 ranks, 1 GPU).
    MFU divides by the peak of the GPUs the run has, not of its ranks."""
    env = os.environ if env is None else env
    devices = env.get(RANK_DEVICES_ENV, "").split(",")
    gpus = {d for d in devices if d.startswith("cuda")}
    return len(gpus) / len(devices) if gpus else 1.0


def default_nproc(device: str = "auto") -> int:
    """``nproc="auto"``: one rank per GPU; on CPU (or without GPUs) 2 ranks."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    n_gpu = 0 if device == "cpu" else gpu_count()
    return n_gpu if n_gpu else 2


def threads_per_rank(nproc_per_node: int) -> int:
    """CPU threads each rank should use so N ranks share this machine's cores (at least 1)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, nproc_per_node))


def pick_dtype(profile: HardwareProfile, override: str | None = None) -> str:
    """The dtype to train with: bf16 on A100/H100/L4, fp16 (+ grad scaler) on T4/V100, fp32 on CPU."""
    allowed = ("float32", "bfloat16", "float16")
    if override not in (None, "auto"):
        if override not in allowed:
            raise ValueError(f"dtype must be one of {allowed} or 'auto', got {override!r}")
        if profile.kind == "cpu" and override != "float32" and override not in cpu_autocast_dtypes():
            import torch  # only for this message (course --help stays fast)
            raise ValueError(f"{override} autocast is not supported on CPU by torch {torch.__version__}; "
                             f"use float32 or one of: {', '.join(cpu_autocast_dtypes()) or 'none'}")
        return override
    return profile.train_dtype


def cpu_autocast_dtypes() -> tuple[str, ...]:
    """The 16-bit dtypes ``torch.autocast("cpu", ...)`` accepts in this torch: bfloat16 always,
    float16 in recent releases (older ones warn and disable autocast: we ask the context itself)."""
    import torch  # here, not at the top: `course --help` does not import torch

    ok = []
    for name in ("bfloat16", "float16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ctx = torch.autocast("cpu", dtype=getattr(torch, name))
        if ctx._enabled:  # False when torch disabled it for an unsupported dtype
            ok.append(name)
    return tuple(ok)


def environment() -> str:
    """Where we run: 'colab', 'slurm', 'pbs', 'jupyterhub' or 'local'."""
    env = os.environ
    if "COLAB_RELEASE_TAG" in env or "COLAB_GPU" in env:
        return "colab"
    if "SLURM_JOB_ID" in env:
        return "slurm"
    if "PBS_JOBID" in env:
        return "pbs"
    if "JUPYTERHUB_USER" in env or "JUPYTERHUB_API_TOKEN" in env:
        return "jupyterhub"
    return "local"


def info() -> dict:
    """A summary of the machine for ``course info`` and notebook 1."""
    import torch  # here: the launching process imports this module without torch

    profile = detect()
    n_gpu = torch.cuda.device_count()
    dtype = pick_dtype(profile)
    return {
        "environment": environment(),
        "torch": torch.__version__,
        "device": "cuda" if n_gpu else "cpu",
        "gpus": n_gpu,
        "cpus": len(os.sched_getaffinity(0)),
        "profile": profile.name,
        "memory_gb": round(profile.memory_bytes / GB, 1),
        "train_dtype": dtype,
        "grad_scaler": profile.needs_grad_scaler and dtype == "float16",
        "peak_tflops": round((profile.training_peak(dtype) or 0) / TFLOP, 1) or None,
        "peak_is_estimate": profile.estimated,
        "backend": "nccl" if n_gpu else "gloo",
        "default_nproc": n_gpu if n_gpu else 2,  # = default_nproc(), without a second lookup
        "threads_per_rank": threads_per_rank(n_gpu if n_gpu else 2),
    }


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="course info", description="Show the detected hardware and what it implies.")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    d = info()
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"environment : {d['environment']}  (torch {d['torch']})")
    print(f"device      : {d['device']}  gpus={d['gpus']}  cpus={d['cpus']}")
    print(f"profile     : {d['profile']}  memory={d['memory_gb']} GB")
    est = " (estimate)" if d["peak_is_estimate"] else ""
    print(f"train dtype : {d['train_dtype']}{' + grad scaler' if d['grad_scaler'] else ''}  "
          f"peak={d['peak_tflops']} TFLOP/s{est}")
    print(f"distributed : backend={d['backend']}  nproc=auto -> {d['default_nproc']} ranks "
          f"x {d['threads_per_rank']} threads")
    return 0


def profile_dict(profile: HardwareProfile) -> dict:
    return asdict(profile)
