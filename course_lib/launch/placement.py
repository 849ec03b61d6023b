"""Where ranks run: the device of each rank and the backend, decided before anything starts.

    from course_lib.launch.placement import choose_placement
    choose_placement(2, gpus=1).line()    # '2 ranks · cuda:0 (ranks share it) · gloo'

gloo on CPU; NCCL with one GPU per rank; with more ranks than GPUs the ranks share the GPUs over
gloo, which handles CUDA tensors, because NCCL refuses two ranks on one device ("NCCL invalid
usage"). A GPU recipe never moves to CPU ranks without being asked to.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.launch.checks import LaunchConfigError


@dataclass(frozen=True)
class Placement:
    """Where each rank runs and over which backend, decided before anything starts."""

    world_size: int
    backend: str
    devices: tuple[str, ...]

    def line(self) -> str:
        shown = sorted(set(self.devices))
        where = shown[0] if len(shown) == 1 else ", ".join(self.devices)
        shared = " (ranks share it)" if len(shown) == 1 and self.world_size > 1 and where != "cpu" else ""
        return f"{self.world_size} ranks · {where}{shared} · {self.backend}"


def choose_placement(world_size, backend: str = "auto", device: str = "auto", gpus: int | None = None) -> Placement:
    """gloo on CPU; NCCL with one GPU per rank; gloo on shared GPUs with more ranks than GPUs
    (NCCL refuses two ranks on one device). Bad requests are refused here, before any start."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= 64:
        raise LaunchConfigError(f"the number of ranks must be a whole number from 1 to 64, got {world_size!r}")
    if backend not in ("auto", "gloo", "nccl") or device not in ("auto", "cpu", "cuda"):
        raise LaunchConfigError(f"backend must be auto, gloo or nccl and device auto, cpu or cuda "
                                f"(got {backend!r}, {device!r})")
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()  # asks the driver; no CUDA context here
    if device == "auto":
        device = "cuda" if gpus and backend != "gloo" else "cpu"  # gloo asked for by name: CPU ranks
    if device == "cpu":
        if backend == "nccl":
            raise LaunchConfigError("NCCL needs GPUs: use backend='gloo' on the CPU")
        return Placement(world_size, "gloo", ("cpu",) * world_size)
    if gpus == 0:
        raise LaunchConfigError("device='cuda' but this machine has no GPU: use device='cpu'")
    if backend == "nccl" and gpus < world_size:
        raise LaunchConfigError(f"NCCL allows one rank per GPU: {world_size} ranks, {gpus} GPU(s). Start "
                                f"{gpus} rank(s), or use backend='gloo' (the ranks then share the GPUs)")
    if backend == "auto":
        backend = "nccl" if gpus >= world_size else "gloo"
    return Placement(world_size, backend, tuple(f"cuda:{r % gpus}" for r in range(world_size)))
