"""python benchmarks/launch_overhead.py --repeat 5

What the ``%%torchrun`` magic costs on top of torchrun itself, and how fast the stop button
cleans up:

* wall time of a trivial ``%%torchrun -n 2`` cell (all-reduce one number, print it) executed
  through a real Jupyter kernel, from execute request to idle;
* wall time of bare ``torchrun --nproc-per-node=2`` running the same code as a script (with the
  init_process_group the magic does for the cell), started from Python with subprocess;
* interrupt (the notebook's stop button) of a running ``%%torchrun -n 2`` cell: time until no
  process of the run is left, and until the cell has returned; the same for a kernel restart.

The two launch kinds alternate so a busy machine slows both alike; medians and minima are
printed (``--json`` for a machine-readable copy).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from jupyter_client.manager import KernelManager

from course_lib.launch.procs import find_by_env
from course_lib.utils import free_port

CELL = "t = torch.ones(1) * (RANK + 1)\ndist.all_reduce(t)\nprint(RANK, t.item())\n"
PRELUDE = ("import os, datetime, torch, torch.distributed as dist\n"
           "RANK, WORLD_SIZE, LOCAL_RANK = (int(os.environ[k]) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'))\n"
           "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))\n")
SLEEP_CELL = "import time\nprint('ready', RANK, flush=True)\ntime.sleep(300)\n"
MARK = "COURSE_BENCH_MARKER"


def drain(kc, msg_id: str, until=None, timeout: float = 300.0) -> tuple[str, dict | None]:
    """Read a cell's output until ``until(text)`` holds, or (without ``until``) it goes idle."""
    text, error = "", None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.05)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, c = msg["msg_type"], msg["content"]
        if kind == "stream":
            text += c["text"]
            if until and until(text):
                return text, error
        elif kind == "error":
            error = c
        elif kind == "status" and c["execution_state"] == "idle" and until is None:
            return text, error
    raise TimeoutError(f"cell did not get there in {timeout} s:\n{text}")


def execute(kc, code: str) -> tuple[str, dict | None]:
    return drain(kc, kc.execute(code))


def gone_after(marker: str, t0: float, limit: float = 60.0) -> float:
    while time.monotonic() - t0 < limit:
        if not find_by_env(MARK, marker):
            return time.monotonic() - t0
        time.sleep(0.01)
    return float("nan")


def both_ready(text: str) -> bool:
    return "ready 0" in text and "ready 1" in text


def started(marker: str) -> None:
    """The run's processes are there (found by their marker): else the stop timings would read 0 s."""
    if not find_by_env(MARK, marker):
        raise RuntimeError(f"no process of the %%torchrun run carries {MARK}={marker}: the stop timings "
                           "would measure nothing (does %%torchrun --env still reach the ranks?)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="launch-bench-")  # removed in the finally below
    work = Path(tmp.name)
    script = work / "bare.py"
    script.write_text(PRELUDE + CELL)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=env, cwd=str(work))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    magic, bare, stop, cell_back, restart = [], [], [], [], []
    try:
        execute(kc, "%load_ext course_lib")
        execute(kc, f"%%torchrun -n 2\n{CELL}")  # warm-up: the kernel imports torch once
        for i in range(a.repeat):
            for kind in (("magic", "bare") if i % 2 == 0 else ("bare", "magic")):
                t0 = time.perf_counter()
                if kind == "magic":
                    out, err = execute(kc, f"%%torchrun -n 2\n{CELL}")
                    assert err is None and "[rank1] 1 3.0" in out, (out, err)
                    magic.append(time.perf_counter() - t0)
                else:
                    subprocess.run([torchrun, "--nproc-per-node=2", "--master-addr=127.0.0.1",
                                    f"--master-port={free_port()}", str(script)],
                                   env=env, check=True, capture_output=True)
                    bare.append(time.perf_counter() - t0)
            print(f"  run {i + 1}: magic {magic[-1]:.2f} s, bare torchrun {bare[-1]:.2f} s", flush=True)
        for i in range(a.repeat):
            marker = uuid.uuid4().hex
            msg_id = kc.execute(f"%%torchrun -n 2 --env {MARK}={marker}\n{SLEEP_CELL}")
            drain(kc, msg_id, both_ready)
            started(marker)
            t0 = time.monotonic()
            km.interrupt_kernel()
            stop.append(gone_after(marker, t0))
            drain(kc, msg_id)
            cell_back.append(time.monotonic() - t0)
        marker = uuid.uuid4().hex
        drain(kc, kc.execute(f"%%torchrun -n 2 --env {MARK}={marker}\n{SLEEP_CELL}"), both_ready)
        started(marker)
        t0 = time.monotonic()
        km.restart_kernel(now=True)
        restart.append(gone_after(marker, t0))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        tmp.cleanup()
    med_m, med_b = statistics.median(magic), statistics.median(bare)
    figures = {
        "repeat": a.repeat, "magic_s": magic, "bare_torchrun_s": bare,
        "magic_median_s": med_m, "bare_median_s": med_b,
        "overhead_median_pct": 100 * (med_m - med_b) / med_b,
        "overhead_min_pct": 100 * (min(magic) - min(bare)) / min(bare),
        "interrupt_to_no_process_s": stop, "interrupt_to_cell_returned_s": cell_back,
        "restart_to_no_process_s": restart, "cpus": len(os.sched_getaffinity(0)),
        "load_avg_1min": os.getloadavg()[0],
    }
    print(f"trivial %%torchrun -n 2 cell : median {med_m:.2f} s, min {min(magic):.2f} s")
    print(f"bare torchrun, same code     : median {med_b:.2f} s, min {min(bare):.2f} s")
    print(f"magic overhead               : {figures['overhead_median_pct']:+.1f} % (medians), "
          f"{figures['overhead_min_pct']:+.1f} % (minima)")
    print(f"interrupt -> no process left : median {statistics.median(stop):.2f} s, max {max(stop):.2f} s")
    print(f"interrupt -> cell returned   : median {statistics.median(cell_back):.2f} s")
    print(f"kernel restart -> no process : {restart[0]:.2f} s")
    print(f"(machine: {figures['cpus']} CPUs, 1-min load average {figures['load_avg_1min']:.1f})")
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
