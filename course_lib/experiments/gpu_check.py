"""course check-gpu [--dry-run] [--out runs/gpu-check] [--results benchmarks/RESULTS.md]

One command that checks the course on one CUDA GPU in under 12 minutes, with a verdict per check:

1. the hardware profile and dtype :mod:`course_lib.hardware` detects (bf16 on A100/H100/L4);
2. nanoGPT's ``shakespeare_char`` recipe trained in bf16: the best validation loss against the
   1.4697 nanoGPT's README publishes for it ("On one A100 GPU this training run takes about 3
   minutes and the best validation loss is 1.4697"), within :data:`LOSS_MARGIN`;
3. the T4 path forced on the same GPU (fp16 autocast with loss scaling), trained side by side
   with (2): the same loss within :data:`FP16_MATCH`;
4. a 1-rank NCCL process group through torchrun (the trainer with ``--nproc=1 --strategy=ddp``)
   and the collectives benchmark (``course bench comm --backend nccl --nproc 1``);
5. the memory of a GPT-2-small training step against the memory model
   (:mod:`course_lib.analysis.step_peak`): weights + Adam moments within :data:`STATES_TOLERANCE`,
   ``torch.cuda.max_memory_allocated`` within :data:`MEMORY_BAND` of the modelled peak;
6. the MFU of a GPT-2-small-shaped bf16 step, eager and with ``torch.compile``;
7. the in-kernel rank helpers after a CUDA backward, and ``course train --nproc=2`` on one GPU
   (:mod:`course_lib.experiments.gpu_check_course`: what broke when the course first met a GPU);
8. with ``--full`` (``make test-gpu``) also the tests marked ``gpu`` and every lesson in full
   mode, each with its wall time.

It writes ``gpu_check.json`` (after every step, so a crash loses nothing) and ``gpu_check.md`` in
``--out`` and appends the Markdown to ``benchmarks/RESULTS.md`` (in a clone). ``--dry-run`` prints
the plan. The measurements are in :mod:`course_lib.experiments.gpu_check_steps`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from course_lib.experiments import gpu_check_course
from course_lib.utils import atomic_write_bytes, repo_root

NANOGPT_VAL_LOSS = 1.4697  # nanoGPT README, shakespeare_char, best val loss on one A100
# One published run, not a mean: our trainer draws its batches and its fixed eval batches from its
# own generators and runs in eager mode, so the curve differs from nanoGPT's by seed-level noise
# (dropout 0.2 on a 10M-parameter model). 0.05 (3.4%) covers that; a real fault shows up larger
# (the loss is ~1.6 after half the iterations, ~2.5 at the character-frequency level).
LOSS_MARGIN = 0.05
FP16_MATCH = 0.03  # |fp16 - bf16| best val loss: both round to 16 bits; loss scaling keeps the small grads
# Weights + Adam moments after a step: exact up to the allocator's 512-byte rounding.
STATES_TOLERANCE = 0.02
# Peak / modelled peak of the whole step (course_lib.analysis.step_peak: states, activations and
# the cross-entropy's two fp32 gradients at the start of backward), within 10 % as issue 21 asks.
# On a CPU the model meets the live tensors of a real step within 1 % (tests/test_step_peak.py);
# on a GPU the allocator's rounding adds a little. On an H200 (issue 28): x0.91 with the CPU's loss
# term, x1.00 with the GPU's (analysis.step_peak).
MEMORY_BAND = (0.9, 1.1)
TIME_LIMIT_S = 720.0  # the plan below sums to 680 s
STATUSES = ("pass", "fail", "error")


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    budget_s: int  # the time this step should take on an A100/H100 (the plan's arithmetic)
    does: str


PLAN = (
    Step("profile", "profile and dtype", 10, "course_lib.hardware.detect('cuda') and pick_dtype"),
    Step("data", "data", 10, "course data prepare shakespeare_char (nothing if prepared)"),
    Step("recipes", "shakespeare_char bf16 + fp16", 330,
         "course train --config=shakespeare_char --dtype=bfloat16 | --dtype=float16 (loss scaling), side by side"),
    Step("nccl", "NCCL through torchrun", 60,
         "course train --nproc=1 --strategy=ddp (torchrun, NCCL), 20 iters; course bench comm --backend nccl --nproc 1"),
    Step("memory", "GPT-2 small memory", 30, "max_memory_allocated of a bf16 step (batch 12 x 1024) vs step_peak()"),
    Step("mfu", "GPT-2 small MFU", 150, "bf16 steps (batch 12 x 1024), eager then torch.compile; MFU vs peak"),
    Step("ranks", "in-kernel ranks after CUDA", 30,
         "run_ranks, notebook_launcher, grading.isolated from a process that ran a CUDA backward"),
    Step("share", "--nproc=2 on one GPU", 60, "course train --nproc=2, 20 iters: both ranks on the GPU, or refused"),
)
# make test-gpu: the check plus the suite's GPU tests and every lesson in full mode
FULL_PLAN = PLAN + (
    Step("gpu_tests", "tests marked gpu", 120, "python -m pytest -m gpu (in a clone)"),
    Step("lessons", "lessons in full mode", 1500, "notebooks/01..10 executed in full mode, each timed"),
)
COURSE_STEPS = ("ranks", "share", "gpu_tests", "lessons")  # measured in gpu_check_course


def time_limit(plan=PLAN) -> float:
    """The base check's limit, plus the planned time of each step beyond it (``--full``)."""
    return TIME_LIMIT_S + sum(s.budget_s for s in plan if s not in PLAN)


def plan_text(plan=PLAN) -> str:
    lines = [(f"course check-gpu: {len(plan)} steps, about {sum(s.budget_s for s in plan)} s "
              f"(limit {time_limit(plan):.0f} s) on one A100/H100-class GPU")]
    lines += [f"  {i}. {s.name:<9} ~{s.budget_s:>4} s  {s.does}" for i, s in enumerate(plan, 1)]
    lines += ["pass if:", f"  bf16 best val loss within {LOSS_MARGIN} of nanoGPT's {NANOGPT_VAL_LOSS}",
              f"  fp16 (loss scaling) best val loss within {FP16_MATCH} of bf16's",
              (f"  weights + Adam moments within {STATES_TOLERANCE:.0%} of the memory model; "
               f"peak / modelled total in [{MEMORY_BAND[0]}, {MEMORY_BAND[1]}]"),
              "  NCCL: 1 rank under torchrun, every benchmarked collective correct; 0 < MFU <= 1",
              "  run_ranks, notebook_launcher and isolated give the right values after a CUDA backward",
              "  --nproc=2 on one GPU: both ranks on cuda, or refused before any rank starts",
              f"  the whole check within {time_limit(plan):.0f} s"]
    return "\n".join(lines)


@dataclass(frozen=True)
class CheckVerdict:
    check: str
    status: str  # pass | fail | error (the step it needs did not run)
    detail: str


def _verdict(check: str, ok: bool, detail: str) -> CheckVerdict:
    return CheckVerdict(check, "pass" if ok else "fail", detail)


def judge(figures: dict, errors: dict[str, str], wall_s: float, plan=PLAN) -> list[CheckVerdict]:
    """The pass/fail of each check from the figures the steps returned (a pure function)."""
    out = []

    planned = {s.name for s in plan}

    def need(step: str, check: str) -> dict | None:
        if step in figures:
            return figures[step]
        if step not in planned:  # --only left it out: no verdict
            return None
        out.append(CheckVerdict(check, "error", errors.get(step, f"step {step!r} did not run").splitlines()[0]))
        return None

    if p := need("profile", "profile and dtype"):
        ok = p["known_profile"] and p["dtype"] == p["expected_dtype"] and (p["dtype"] != "float16" or p["grad_scaler"])
        out.append(_verdict("profile and dtype", ok, f"{p['device']}: profile {p['profile']}, dtype {p['dtype']}"
                            + ("" if p["known_profile"] else " (unknown GPU: add it to hardware.PROFILES)")))
    if r := need("recipes", "bf16 recipe vs nanoGPT"):
        bf, fp = r["bf16"], r["fp16"]
        gap = bf["best_val_loss"] - NANOGPT_VAL_LOSS
        out.append(_verdict("bf16 recipe vs nanoGPT", bf["dtype"] == "bfloat16" and abs(gap) <= LOSS_MARGIN,
                            f"best val {bf['best_val_loss']:.4f} vs {NANOGPT_VAL_LOSS} ({gap:+.4f}, margin "
                            f"{LOSS_MARGIN}), {bf['iters']} iters, {bf['ms_per_iter']:.1f} ms/iter"))
        diff = fp["best_val_loss"] - bf["best_val_loss"]
        scale = fp.get("loss_scale")
        ok = fp["dtype"] == "float16" and bool(scale) and math.isfinite(scale) and abs(diff) <= FP16_MATCH
        out.append(_verdict("fp16 + loss scaling (T4 path)", ok,
                            f"best val {fp['best_val_loss']:.4f}, {diff:+.4f} from bf16 (margin {FP16_MATCH}), "
                            f"final loss scale {scale}"))
    if n := need("nccl", "NCCL through torchrun"):
        run = n["run"]
        ok = (run["backend"] == "nccl" and run["world_size"] == 1 and run["torchrun"]
              and n["bench_backend"] == "nccl" and n["bench_all_correct"])
        out.append(_verdict("NCCL through torchrun", ok,
                            f"trainer: backend {run['backend']}, {run['world_size']} rank, torchrun "
                            f"{'yes' if run['torchrun'] else 'no'}; bench: {len(n['bench'])} rows, "
                            f"{'all correct' if n['bench_all_correct'] else 'WRONG RESULTS'}"))
    if m := need("memory", "GPT-2 small memory vs model"):
        lo, hi = MEMORY_BAND
        ok = abs(m["states_ratio"] - 1) <= STATES_TOLERANCE and lo <= m["ratio"] <= hi
        out.append(_verdict("GPT-2 small memory vs model", ok,
                            f"weights + Adam {m['states_measured_bytes'] / 2**30:.3f} GiB vs model "
                            f"{m['states_model_bytes'] / 2**30:.3f} (x{m['states_ratio']:.3f}"
                            + (f", cuBLAS workspaces {m['library_workspace_bytes'] / 2**20:.0f} MiB apart"
                               if "library_workspace_bytes" in m else "") + "); peak "
                            f"{m['measured_bytes'] / 2**30:.2f} GiB vs model {m['model_bytes'] / 2**30:.2f} "
                            f"({', '.join(f'{k} {v / 2**30:.2f}' for k, v in m['parts'].items())}), "
                            f"x{m['ratio']:.2f} in [{lo}, {hi}]"))
    if f := need("mfu", "GPT-2 small MFU"):
        modes = [k for k in ("eager", "compiled") if k in f]
        ok = len(modes) == 2 and all(0 < f[k]["mfu"] <= 1 for k in modes)  # NaN fails: no known peak
        parts = [f"{k} {f[k]['mfu']:.1%} ({f[k]['ms_per_step']:.1f} ms/step)" for k in modes]
        speed = f", torch.compile x{f['compile_speedup']:.2f} faster" if "compile_speedup" in f else ""
        out.append(_verdict("GPT-2 small MFU", ok, ", ".join(parts) + speed))
    out += [_verdict(*v) for v in gpu_check_course.judge_course({s.name for s in plan}, need)]
    limit = time_limit(plan)
    if planned >= {s.name for s in PLAN}:  # the limit is the whole check's
        out.append(_verdict("within the time limit", wall_s <= limit, f"{wall_s:.0f} s of {limit:.0f} s"))
    return out


def report_markdown(report: dict) -> str:
    """The report as a RESULTS.md section."""
    p = report["figures"].get("profile", {})
    head = (f"## GPU check (`course check-gpu`), {report['date']}, {p.get('device', '?')}\n\n"
            f"Profile {p.get('profile', '?')}, dtype {p.get('dtype', '?')}, torch {p.get('torch', '?')}, "
            f"CUDA {p.get('cuda', '?')}. Total {report['wall_s']:.0f} s. "
            f"{sum(v['status'] == 'pass' for v in report['verdicts'])} of {len(report['verdicts'])} checks pass.\n")
    rows = "".join(f"| {v['check']} | {v['status'].upper() if v['status'] != 'pass' else 'pass'} | {v['detail']} |\n"
                   for v in report["verdicts"])
    steps = "".join(f"| {s['name']} | {s['wall_s']:.0f} | {s['budget_s']} | {s['status']} |\n" for s in report["steps"])
    return (f"{head}\n| check | result | figures |\n|---|---|---|\n{rows}\n"
            f"| step | seconds | planned | status |\n|---|---:|---:|---|\n{steps}")


def write_report(report: dict, out: Path, results_md: Path | None) -> None:
    """gpu_check.json and gpu_check.md in ``out``; the Markdown appended to ``results_md``."""
    atomic_write_bytes(out / "gpu_check.json", (json.dumps(report, indent=1, default=str) + "\n").encode())
    text = report_markdown(report)
    atomic_write_bytes(out / "gpu_check.md", text.encode())
    if results_md is not None:
        old = results_md.read_text() if results_md.exists() else "# Benchmark results\n"
        atomic_write_bytes(results_md, (old.rstrip("\n") + "\n\n" + text).encode())


def run_check(out: str | Path, steps: dict[str, Callable[[Path], dict]] | None = None,
              results_md: Path | None = None, plan=PLAN, log=print) -> dict:
    """Run each step of ``plan`` (``steps`` maps a name to its function; default the real ones),
    keep going past a failed step, save the JSON after each, then judge and write the report."""
    if steps is None:
        from course_lib.experiments import gpu_check_steps as m  # imports torch: only when measuring

        steps = {s.name: getattr(gpu_check_course if s.name in COURSE_STEPS else m, f"{s.name}_step")
                 for s in plan}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "figures": {}, "errors": {},
              "steps": [], "verdicts": [], "wall_s": 0.0,
              "thresholds": {"nanogpt_val_loss": NANOGPT_VAL_LOSS, "loss_margin": LOSS_MARGIN,
                             "fp16_match": FP16_MATCH, "states_tolerance": STATES_TOLERANCE,
                             "memory_band": MEMORY_BAND, "time_limit_s": time_limit(plan)}}
    t_start = time.perf_counter()
    for i, step in enumerate(plan, 1):
        log(f"[{i}/{len(plan)}] {step.title}: {step.does}")
        t0 = time.perf_counter()
        try:
            report["figures"][step.name] = steps[step.name](out)
            status = "ok"
        except Exception as e:  # noqa: BLE001 - a failed step is reported, the others still run
            report["errors"][step.name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
            status = "error"
            log(f"    error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        report["steps"].append({"name": step.name, "wall_s": time.perf_counter() - t0, "budget_s": step.budget_s,
                                "status": status})
        report["wall_s"] = time.perf_counter() - t_start
        write_report(report, out, None)  # nothing lost if a later step crashes the process
    report["verdicts"] = [asdict(v) for v in judge(report["figures"], report["errors"], report["wall_s"], plan)]
    write_report(report, out, results_md)
    return report


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="course check-gpu", description=__doc__.split("\n\n")[1])
    p.add_argument("--out", default="runs/gpu-check", help="where the runs and the report go")
    root = repo_root()
    default_md = root / "benchmarks" / "RESULTS.md" if root else None
    p.add_argument("--results", default=default_md, type=Path,
                   help=f"append the Markdown report here (default: {default_md or 'none outside a clone'})")
    p.add_argument("--no-results", action="store_true", help="do not append to a RESULTS.md")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the pass criteria, run nothing")
    p.add_argument("--full", action="store_true",
                   help="also the tests marked gpu and every lesson in full mode (make test-gpu, ~30 min)")
    p.add_argument("--only", default=None, metavar="STEP,...",
                   help=f"run only these steps, in the plan's order (of: {', '.join(s.name for s in FULL_PLAN)}); "
                        "the verdicts of the others are left out")
    a = p.parse_args(argv)
    plan = FULL_PLAN if a.full else PLAN
    if a.only is not None:
        wanted = [w.strip() for w in a.only.split(",") if w.strip()]
        names = [s.name for s in FULL_PLAN]
        if unknown := [w for w in wanted if w not in names]:
            p.error(f"--only: unknown step(s) {', '.join(unknown)}; the steps are {', '.join(names)}")
        plan = tuple(s for s in FULL_PLAN if s.name in wanted)
    if a.dry_run:
        print(plan_text(plan))
        return 0
    import torch  # here: --help and --dry-run stay fast

    if not torch.cuda.is_available():
        print(f"course check-gpu: no CUDA GPU here (torch {torch.__version__}: torch.cuda.is_available() is "
              "False); run it on a machine with an NVIDIA GPU, or --dry-run to see the plan", file=sys.stderr)
        return 2
    report = run_check(a.out, results_md=None if a.no_results else a.results, plan=plan)
    print("\n" + report_markdown(report))
    print(f"report: {Path(a.out) / 'gpu_check.json'}, {Path(a.out) / 'gpu_check.md'}"
          + (f"; appended to {a.results}" if a.results and not a.no_results else ""))
    return 0 if all(v["status"] == "pass" for v in report["verdicts"]) else 1


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
