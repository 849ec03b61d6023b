"""python -m course_lib.experiments.gpu_check_course --probe cuda   (what ``course check-gpu`` runs)

The checks of ``course check-gpu`` that cover what broke when the course first met a GPU (the
plan and report are in :mod:`course_lib.experiments.gpu_check`):

* ``ranks``: the in-kernel helpers (``run_ranks``, ``notebook_launcher``, ``grading.isolated``)
  called from a process that has already run a CUDA backward and started a thread, as a notebook
  kernel has. Forked ranks died there ("Unable to handle autograd's threading in combination with
  fork-based multiprocessing", "CUDA error: initialization error"). The probe runs in a fresh
  process (``--probe``), so the state it builds is its own, and prints one JSON line.
* ``share``: ``course train --nproc=2`` on one GPU, which must use the GPU (both ranks on it) or
  refuse before it starts; it once ran the GPU recipe on two CPU ranks without a word.
* ``gpu_tests`` (``--full``): the tests marked ``gpu``, run by pytest in the clone.
* ``lessons`` (``--full``): every lesson executed in full mode, with its wall time.

Each step takes the output folder and returns JSON-ready figures; :func:`judge` turns them into
verdicts. Devices and arguments are parameters, so the tests run the steps on a CPU.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from course_lib.utils import repo_root

SHARE_RUN = ("--config=shakespeare_char", "--max_iters=20", "--eval_interval=10", "--eval_iters=2",
             "--log_interval=5", "--nproc=2")
PROBE_TIMEOUT_S = 300.0


# -- the probe: runs in a process of its own ------------------------------------------------------

def _all_reduce_rank(rank: int, world_size: int, device: str) -> list[float]:
    # torch in the rank only: planning and judging a check need no torch
    import torch
    import torch.distributed as dist

    t = torch.full((2,), float(rank + 1), device=device)
    dist.all_reduce(t)  # gloo reduces CUDA tensors too (through host copies)
    return t.cpu().tolist()


def _launcher_rank() -> float:
    # torch in the rank only: planning and judging a check need no torch
    import torch
    import torch.distributed as dist

    w = torch.ones(3, requires_grad=True)
    (w * (dist.get_rank() + 1)).sum().backward()  # autograd in the rank, after the kernel's own
    g = w.grad.clone()
    dist.all_reduce(g)
    return float(g[0])


def _isolated_check() -> float:
    # torch in the checked process only: planning and judging a check need no torch
    import torch

    w = torch.ones(2, requires_grad=True)
    (3 * w).sum().backward()
    return float(w.grad.sum())


def probe(device: str = "cuda") -> dict:
    """Put this process in a notebook kernel's state (a backward on ``device``, a live thread), then
    call each in-kernel helper; return what each gave and how long it took."""
    # the probe's own process loads torch and the helpers; `course check-gpu --dry-run` needs none
    import torch

    from course_lib.exercises import grading
    from course_lib.launch.forked import notebook_launcher
    from course_lib.launch.spawn import run_ranks

    x = torch.randn(64, 64, device=device, requires_grad=True)
    (x @ x).sum().backward()  # CUDA initialised and autograd's device threads started
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()  # a kernel has threads of its own
    out = {"device": device, "cuda_initialized": torch.cuda.is_initialized()}
    calls = {
        "run_ranks": (lambda: run_ranks(_all_reduce_rank, 2, device, timeout=60), [[3.0, 3.0]] * 2),
        "notebook_launcher": (lambda: notebook_launcher(_launcher_rank, nproc=2, timeout=60), [3.0, 3.0]),
        "isolated": (lambda: grading.isolated(_isolated_check, timeout=60), 6.0),
    }
    for name, (call, expected) in calls.items():
        t0 = time.perf_counter()
        try:
            got = call()
            out[name] = {"ok": got == expected, "result": got, "expected": expected}
        except Exception as e:  # noqa: BLE001 - the failure is the figure
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500]}
        out[name]["seconds"] = round(time.perf_counter() - t0, 2)
    stop.set()
    return out


def ranks_step(out: Path, device: str = "cuda", timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """The probe in a fresh interpreter; its last stdout line is the JSON figures."""
    proc = subprocess.run([sys.executable, "-m", "course_lib.experiments.gpu_check_course", "--probe", device],
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    (out / "ranks_probe.log").write_text(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the probe exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-1500:]}")
    return json.loads(lines[-1])


# -- several ranks on one GPU ---------------------------------------------------------------------

def share_step(out: Path, args: Sequence[str] = SHARE_RUN) -> dict:
    """``course train --nproc=2`` where there is one GPU: what each rank ran on, or the refusal."""
    # gpu_check_steps imports torch: only when measuring
    from course_lib.experiments.gpu_check_steps import train_runs

    shutil.rmtree(out / "share", ignore_errors=True)  # a metrics.csv left here would read as "started"
    try:
        run = train_runs(out, {"share": args}, timeout_s=600.0)["share"]
        return {"ran": True, **run}
    except (RuntimeError, ValueError) as e:  # ValueError: the arguments were refused here, in-process
        log = str(e) if isinstance(e, ValueError) or not (out / "share.log").exists() \
            else (out / "share.log").read_text()
        spawned = not isinstance(e, ValueError) and (out / "share" / "metrics.csv").exists()
        return {"ran": False, "refused_before_start": not spawned, "message": log[-1500:]}


# -- the suite's GPU tests and the lessons (--full) ------------------------------------------------

def gpu_tests_step(out: Path, root: Path | None = None, marker: str = "gpu") -> dict:
    """``pytest -m gpu`` in the clone: counts of passed, failed and skipped tests."""
    root = root or repo_root()
    if root is None:
        raise RuntimeError("the tests are in a clone of the course, not in the wheel")
    xml = out / "gpu_tests.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider",
                           f"--junitxml={xml}"], cwd=root, capture_output=True, text=True, check=False)
    (out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"exit_code": proc.returncode, "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
            "failed": n["failures"] + n["errors"], "skipped": n["skipped"], "tail": proc.stdout[-800:]}


def lessons_step(out: Path, notebooks: Sequence[Path] | None = None, smoke: bool = False) -> dict:
    """Execute every lesson (full mode unless ``smoke``), each in its own ``python -m
    course_lib.notebook.book --lesson`` process (nbclient; a crash ends only that lesson); its wall
    time or its error."""
    root = repo_root()
    if notebooks is None:
        if root is None:
            raise RuntimeError("the lessons are run from a clone of the course")
        notebooks = sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    result = {}
    for path in notebooks:
        cmd = [sys.executable, "-m", "course_lib.notebook.book", "--lesson", str(path), "--out", str(out / "lessons")]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd + (["--smoke"] if smoke else []), capture_output=True, text=True)
        entry = {"ok": proc.returncode == 0, "seconds": round(time.perf_counter() - t0, 1)}
        if proc.returncode != 0:
            entry["error"] = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
        result[Path(path).stem] = entry
    return result


# -- verdicts ---------------------------------------------------------------------------------------

def judge_course(planned: set[str], need) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for each of this module's steps in ``planned``; ``need(step,
    check)`` returns the step's figures, or records an error verdict and returns None."""
    out = []
    if "ranks" in planned and (r := need("ranks", "in-kernel ranks after a CUDA backward")):
        names = ("run_ranks", "notebook_launcher", "isolated")
        ok = all(r.get(k, {}).get("ok") for k in names)
        detail = ", ".join(f"{k} {'ok' if r[k]['ok'] else r[k].get('error', r[k].get('result'))} "
                           f"({r[k]['seconds']} s)" for k in names if k in r)
        out.append(("in-kernel ranks after a CUDA backward", ok, detail))
    if "share" in planned and (s := need("share", "--nproc=2 on one GPU")):
        if s["ran"]:
            ok = s["world_size"] == 2 and str(s["device"]).startswith("cuda")
            detail = f"{s['world_size']} ranks on {s['device']}, backend {s['backend']}"
        else:
            ok = s["refused_before_start"]
            detail = ("refused before starting: " if ok else "failed after starting: ") + \
                     s["message"].strip().splitlines()[-1][:300]
        out.append(("--nproc=2 on one GPU", ok, detail))
    if "gpu_tests" in planned and (t := need("gpu_tests", "tests marked gpu")):
        ok = t["failed"] == 0 and t["skipped"] == 0 and t["passed"] > 0
        out.append(("tests marked gpu", ok, f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped"))
    if "lessons" in planned and (ls := need("lessons", "lessons in full mode")):
        ok = bool(ls) and all(v["ok"] for v in ls.values())
        out.append(("lessons in full mode", ok,
                    ", ".join(f"{k[:2]} {v['seconds']:.0f} s{'' if v['ok'] else ' FAILED'}" for k, v in ls.items())))
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        print(json.dumps(probe(sys.argv[2] if len(sys.argv) > 2 else "cuda")))
    else:
        sys.exit("usage: python -m course_lib.experiments.gpu_check_course --probe cuda|cpu")
