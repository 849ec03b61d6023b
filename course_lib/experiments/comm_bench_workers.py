"""mpiexec -n 2 python -m course_lib.experiments.comm_bench_workers CONFIG.json OUT.jsonl

Worker side of ``course bench comm``: one process per rank times each collective
(``course bench comm --backend mpi`` runs that line itself; the torch backends spawn
:func:`torch_worker` instead.) For every (collective, size) each rank fills its buffers with
rank + 1, runs the collective once and checks the result, then runs ``warmup`` untimed and
``iters`` timed calls. The time per call is the slowest rank's mean; rank 0 appends one JSON
row per measurement to OUT.jsonl as soon as it has it, so a crash keeps what was measured.

Sizes follow nccl-tests: S is the buffer of all_reduce, broadcast and reduce, the whole input of
reduce_scatter and the whole output of all_gather (each rank holds S / p of it); S is rounded
down to a multiple of the element size (times p for the scattered/gathered collectives).
This module imports neither torch nor mpi4py at import time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial

import numpy as np
from tqdm import tqdm

from course_lib.analysis.comm_cost import algbw, busbw, bytes_per_rank
from course_lib.hardware import GB
from course_lib.utils import init_process_group

ITEMSIZE = 4  # float32


def bench_plan(ops, sizes, p: int) -> list[tuple[str, int]]:
    """(op, S in bytes) pairs actually measured: S rounded down to whole elements per rank (up
    to one element per rank where it is smaller)."""
    out = []
    for op in ops:
        unit = ITEMSIZE * (p if op in ("reduce_scatter", "all_gather") else 1)
        for size in sizes:
            out.append((op, max(unit, int(size) // unit * unit)))
    return out


def expected(op: str, rank: int, p: int):
    """What rank ``rank`` holds after ``op`` when rank r contributed r + 1 everywhere: a number,
    a list (one value per chunk, all_gather) or None (nothing defined: reduce off the root)."""
    total = p * (p + 1) / 2
    return {"all_reduce": total, "broadcast": 1.0, "reduce_scatter": total,
            "reduce": total if rank == 0 else None,
            "all_gather": [float(r + 1) for r in range(p)]}[op]


def make_row(backend, op, p, size, seconds, iters, in_bytes, out_bytes, correct) -> dict:
    return {"backend": backend, "op": op, "nproc": p, "size_bytes": size,
            "count": size // ITEMSIZE, "dtype": "float32", "in_bytes": in_bytes,
            "out_bytes": out_bytes, "iters": iters, "time_us": seconds * 1e6,
            "algbw_GBps": algbw(size, seconds) / GB, "busbw_GBps": busbw(op, size, seconds, p) / GB,
            "model_bytes_per_rank": bytes_per_rank(op, size, p), "correct": bool(correct)}


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    return tqdm(items, desc=desc, unit="size", file=sys.stderr)


# ---------------------------------------------------------------- torch.distributed (gloo, nccl)
def torch_worker(rank: int, cfg: dict, port: int, out_path: str) -> None:
    """One rank of the torch.distributed benchmark (spawned by course_lib.experiments.comm_bench)."""
    import torch  # here, not at the top: MPI ranks import this module and must not load torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    p, backend = cfg["nproc"], cfg["backend"]
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    init_process_group(backend, timeout_s=cfg["timeout_s"], init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                       world_size=p)
    # torch >= 2.13 names the tensor-in/tensor-out collectives *_single; older: all_gather_into_tensor
    # and reduce_scatter_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        for op, size in _progress(bench_plan(cfg["ops"], cfg["sizes"], p), cfg["progress"] and rank == 0,
                                  f"{backend} x{p}"):
            count = size // ITEMSIZE
            n_in = count // p if op == "all_gather" else count
            n_out = count // p if op == "reduce_scatter" else count
            x = torch.empty(n_in, dtype=torch.float32, device=device)
            y = x if op in ("all_reduce", "broadcast", "reduce") else torch.empty(
                n_out, dtype=torch.float32, device=device)
            call = {"all_reduce": partial(dist.all_reduce, x),
                    "broadcast": partial(dist.broadcast, x, 0),
                    "reduce": partial(dist.reduce, x, 0),
                    "reduce_scatter": partial(scatter, y, x),
                    "all_gather": partial(gather, y, x)}[op]
            x.fill_(rank + 1)
            call()
            sync()
            want = expected(op, rank, p)
            if want is None:
                ok = True
            elif isinstance(want, list):
                ok = torch.equal(y.view(p, -1).cpu(), torch.tensor(want).repeat_interleave(
                    n_in).view(p, -1))
            else:
                ok = bool((y == want).all())
            x.zero_()  # timed calls on zeros: values stay finite however many iterations
            for _ in range(cfg["warmup"]):
                call()
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(cfg["iters"]):
                call()
            sync()
            stats = torch.tensor([(time.perf_counter() - t0) / cfg["iters"], -float(ok)],
                                 dtype=torch.float64, device=device)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # slowest rank; any failed check
            if rank == 0:
                row = make_row(backend, op, p, size, stats[0].item(), cfg["iters"],
                               x.numel() * x.element_size(), y.numel() * y.element_size(),
                               stats[1].item() == -1.0)
                with open(out_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            del call, x, y  # free the buffers before the next size
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------- mpi4py
def mpi_main(cfg: dict, out_path: str) -> None:
    """One rank of the mpi4py benchmark (run under mpiexec)."""
    from mpi4py import MPI  # here, not at the top: importing mpi4py.MPI initialises MPI

    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    if p != cfg["nproc"]:
        raise RuntimeError(f"started with {p} MPI ranks but the config asks for {cfg['nproc']}")
    for op, size in _progress(bench_plan(cfg["ops"], cfg["sizes"], p), cfg["progress"] and rank == 0,
                              f"mpi x{p}"):
        count = size // ITEMSIZE
        n_in = count // p if op == "all_gather" else count
        n_out = count // p if op == "reduce_scatter" else count
        x = np.empty(n_in, dtype=np.float32)
        y = x if op == "broadcast" else np.empty(n_out, dtype=np.float32)  # out of place
        call = {"all_reduce": partial(comm.Allreduce, x, y, op=MPI.SUM),
                "broadcast": partial(comm.Bcast, x, root=0),
                "reduce": partial(comm.Reduce, x, y, op=MPI.SUM, root=0),
                "reduce_scatter": partial(comm.Reduce_scatter_block, x, y, op=MPI.SUM),
                "all_gather": partial(comm.Allgather, x, y)}[op]
        x.fill(rank + 1)
        call()
        want = expected(op, rank, p)
        if want is None:
            ok = True
        elif isinstance(want, list):
            ok = bool((y.reshape(p, -1) == np.array(want, dtype=np.float32)[:, None]).all())
        else:
            ok = bool((y == want).all())
        x.fill(0)
        for _ in range(cfg["warmup"]):
            call()
        comm.Barrier()
        t0 = MPI.Wtime()
        for _ in range(cfg["iters"]):
            call()
        seconds = comm.allreduce((MPI.Wtime() - t0) / cfg["iters"], op=MPI.MAX)
        all_ok = comm.allreduce(ok, op=MPI.LAND)
        if rank == 0:
            row = make_row("mpi", op, p, size, seconds, cfg["iters"], x.nbytes, y.nbytes, all_ok)
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: mpiexec -n N python -m course_lib.experiments.comm_bench_workers CONFIG.json OUT.jsonl")
    with open(sys.argv[1]) as f:
        mpi_main(json.load(f), sys.argv[2])
