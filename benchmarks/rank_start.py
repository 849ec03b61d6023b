"""python benchmarks/rank_start.py --rounds 3 --calls 5

How long the local rank runner (course_lib/launch/ranks.py) takes to start its ranks: wall time
of ``run_ranks(fn, n)`` for a function that all-reduces one number, so start, rendezvous,
barrier, one collective, results back and stop. For each start method ("forkserver", the
runner's; "fork", what the course used before, inheriting the caller's CUDA and threads;
"spawn", the fallback where there is no fork server) and 2 and 4 ranks, a fresh interpreter
that has imported torch (as a notebook kernel has) times its first call (the fork server starts
then) and ``--calls`` more. The configurations alternate round by round, so a busy machine
slows them alike; medians are printed (``--json`` for a machine-readable copy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = [("fork", 2), ("forkserver", 2), ("spawn", 2), ("fork", 4), ("forkserver", 4), ("spawn", 4)]


def all_reduce_one(rank, world_size):
    # torch in the ranks and in one_case only: the parent, which just starts fresh interpreters, stays light
    import torch
    import torch.distributed as dist

    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    return t.item()


def one_case(method: str, nproc: int, calls: int) -> dict:
    """In a fresh interpreter: the first call and ``calls`` more, in seconds."""
    import torch  # noqa: F401 - a kernel has it imported before its first call

    from course_lib.launch.spawn import run_ranks

    times = []
    for _ in range(1 + calls):
        t0 = time.perf_counter()
        out = run_ranks(all_reduce_one, nproc, start_method=method, timeout=120)
        times.append(time.perf_counter() - t0)
        assert out == [nproc * (nproc + 1) / 2] * nproc, out
    return {"method": method, "nproc": nproc, "first_s": times[0], "later_s": times[1:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--rounds", type=int, default=3, help="fresh interpreters per configuration")
    p.add_argument("--calls", type=int, default=5, help="calls after the first in each")
    p.add_argument("--one", nargs=2, metavar=("METHOD", "NPROC"), help=argparse.SUPPRESS)
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(one_case(a.one[0], int(a.one[1]), a.calls)))
        return 0
    runs: dict[tuple, list[dict]] = {case: [] for case in CASES}
    for r in range(a.rounds):
        for method, nproc in CASES if r % 2 == 0 else CASES[::-1]:
            out = subprocess.run([sys.executable, __file__, "--one", method, str(nproc), "--calls", str(a.calls)],
                                 capture_output=True, text=True, check=False)
            if out.returncode != 0:  # its output was captured: show why, not just the exit code
                sys.stderr.write(out.stdout + out.stderr)
                print(f"rank_start: the {method} x {nproc} interpreter failed (exit {out.returncode})", file=sys.stderr)
                return 1
            runs[(method, nproc)].append(json.loads(out.stdout.splitlines()[-1]))
        print(f"  round {r + 1} of {a.rounds} done", flush=True)
    rows = []
    for (method, nproc), found in runs.items():
        first = [f["first_s"] for f in found]
        later = [t for f in found for t in f["later_s"]]
        rows.append({"method": method, "nproc": nproc, "first_median_s": statistics.median(first),
                     "first_s": first, "later_median_s": statistics.median(later),
                     "later_min_s": min(later)})
    print(f"{'method':<11} {'ranks':>5} {'first call (median)':>20} {'later calls (median)':>21} {'later (min)':>12}")
    for row in rows:
        print(f"{row['method']:<11} {row['nproc']:>5} {row['first_median_s']:>19.3f}s "
              f"{row['later_median_s']:>20.3f}s {row['later_min_s']:>11.3f}s")
    print(f"cpus: {len(os.sched_getaffinity(0))}, load average: {os.getloadavg()[0]:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "rounds": a.rounds, "calls": a.calls,
                       "cpus": len(os.sched_getaffinity(0)), "load": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
