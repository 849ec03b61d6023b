"""course train --config=shakespeare_char_cpu --nproc=2 --out_dir=runs/x

launch_training(config) and ``course train``: one way to run the course trainer on N ranks.

    course train --resume --out_dir=runs/x --max_iters=3000
    course train --help                      # every field, its default and the presets

    from course_lib.trainer.config import make_config
    from course_lib.launch import launch_training
    cfg = make_config("shakespeare_char_cpu", {"max_iters": 200, "out_dir": "runs/ddp2"})
    result = launch_training(cfg, nproc=2)
    result.metrics.plot(x="iter", y="train_loss")

Both front ends are :func:`run_training`, and differ only in how the run is shown:

* ``display="notebook"`` (:func:`launch_training`): rank-prefixed live output and a tqdm bar in
  the launcher that follows ``RUN_DIR/metrics.csv``; the workers draw no bar.
* ``display="terminal"`` (``course train``, :func:`cli`): rank 0's own
  output byte for byte, its own progress bar included, as if it ran in this terminal.

Either way: :func:`course_lib.launch.checks.check_request` refuses a bad request before anything
is spawned, with one line that says what to change; :func:`prepare_run_dir` writes
``RUN_DIR/config.json`` (RUN_DIR = ``config.out_dir``; one that cannot be written is refused the
same way); then ``python -m course_lib.trainer.loop --config-file RUN_DIR/config.json``
runs on every rank under torchrun through :func:`course_lib.launch.api.launch` (its process
handling, logs in ``RUN_DIR/logs``, failure diagnosis). One process can also train right here,
after the same checks: :func:`train_in_process`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import course_lib.launch.checks as checks
from course_lib.gpt.checkpoint import CheckpointError
from course_lib.gpt.data import DataError
from course_lib.launch.api import LaunchResult, LaunchSpec, check_fields, launch
from course_lib.launch.checks import TrainRequest, check_request
from course_lib.launch.placement import LaunchConfigError
from course_lib.launch.supervise import MetricsProgress
from course_lib.registry import ConfigError
from course_lib.trainer.config import CONFIG_FILE, TrainConfig, arg_parser, clear_run, config_from_args

TRAIN_MODULE = "course_lib.trainer.loop"
# LaunchSpec fields a training run sets itself, from its config and its own arguments
SET_HERE = ("module", "device", "collective_timeout", "run_dir", "progress", "output", "before_start")
DISPLAYS = ("notebook", "terminal")


def prepare_run_dir(req: TrainRequest) -> Path:
    """Clear an overwritten run (and, either way, a stopped worker's half-written files:
    trainer.config.clear_run), write RUN_DIR/config.json; returns its path."""
    cfg, out = req.config, Path(req.config.out_dir)
    try:
        clear_run(out, files=cfg.init_from == "scratch" and req.overwrite)
        return cfg.save().resolve()
    except OSError as e:  # a read-only or mistyped path: one line, still before any worker starts
        raise LaunchConfigError(f"cannot write the run directory {out} ({e.strerror or e}); "
                                "choose another --out_dir") from None


def prepare_run(config: TrainConfig, *, nproc=None, nnodes: int = 1, overwrite: bool = False,
                recipe: str = "", backend: str = "auto") -> TrainRequest:
    """check_request, then prepare_run_dir: what comes before the workers (or an in-process train)."""
    req = check_request(config, nproc=nproc, nnodes=nnodes, overwrite=overwrite, recipe=recipe, backend=backend)
    prepare_run_dir(req)
    return req


def train_in_process(config: TrainConfig, *, overwrite: bool = False, progress: bool = True) -> dict:
    """The same checks and run directory, then one process training right here (a notebook's
    kernel, a test): :func:`course_lib.trainer.loop.train`. Returns its summary."""
    req = check_request(config, overwrite=overwrite)
    if req.world_size > 1 or req.strategy != "single":  # refused before the run directory is touched
        raise LaunchConfigError(f"{req.world_size} rank(s) with strategy {req.strategy} need workers: "
                                "use launch_training (or course train)")
    prepare_run_dir(req)
    # the trainer (torch, every strategy) only for a run in this process: course train's launcher loads none of it
    from course_lib.trainer.loop import train

    return train(req.config, progress=progress)


def run_training(config: TrainConfig, *, display: str = "notebook", nproc=None, nnodes: int = 1,
                 overwrite: bool = False, progress: bool = True, timeout: float | None = None,
                 show_ranks=(0,), env=None, check: bool = False, recipe: str = "", backend: str = "auto",
                 **launch_kwargs) -> LaunchResult:
    """Check, prepare the run directory, and train on ``nproc`` ranks per node under torchrun.

    display: "notebook" (rank-prefixed output, a bar following metrics.csv) or "terminal" (rank
    0's raw output with the trainer's own bar). ``timeout`` is a wall-clock limit; the collective
    timeout is ``config.timeout_s``. ``recipe`` names the run in the plan line (default: the
    config's name). ``backend``: "auto", "gloo" or "nccl", checked with the ranks' devices before
    anything starts. Other keyword arguments go to :func:`launch`.
    """
    if display not in DISPLAYS:
        raise LaunchConfigError(f"display must be one of {', '.join(DISPLAYS)}, got {display!r}")
    check_fields(launch_kwargs, "launch_training", taken=SET_HERE,
                 hint="device, timeout_s and out_dir are fields of the config: make_config(name, {'device': ...})")
    checks.check_show_ranks_and_env(show_ranks, env)
    req = check_request(config, nproc=nproc, nnodes=nnodes, overwrite=overwrite, recipe=recipe, backend=backend)
    cfg, config_file = req.config, Path(req.config.out_dir).resolve() / CONFIG_FILE
    env = dict(env or {})
    if cfg.threads:
        env.setdefault("OMP_NUM_THREADS", str(cfg.threads))
    args = ["--config-file", str(config_file)]
    bar = None
    if display == "terminal":
        args += [] if progress else ["--no-progress"]
    else:  # the workers draw no bar: the launcher's follows metrics.csv (iterations 0..max_iters)
        args.append("--no-progress")
        if progress:
            err = launch_kwargs.get("err")
            bar = lambda rd: MetricsProgress(str(rd / "metrics.csv"), cfg.max_iters + 1, desc=cfg.name, file=err)
    spec = LaunchSpec(module=True, nproc=cfg.nproc, nnodes=req.nnodes, device=req.device, backend=req.plan.backend,
                      recipe=req.plan.recipe, timeout=timeout, collective_timeout=cfg.timeout_s, env=env,
                      run_dir=config_file.parent, show_ranks=show_ranks, progress=bar,
                      output="raw" if display == "terminal" else "ranks", check=check,
                      before_start=lambda: prepare_run_dir(req)).replace(**launch_kwargs)  # after every check
    return launch(TRAIN_MODULE, args, spec)


def launch_training(config: TrainConfig, *, nproc=None, nnodes: int = 1, timeout: float | None = None,
                    progress: bool = True, show_ranks=(0,), env=None, check: bool = False,
                    overwrite: bool = True, **launch_kwargs) -> LaunchResult:
    """Train ``config`` on ``nproc`` ranks per node from Python or a notebook (None = ``config.nproc``).

    :func:`run_training` with the notebook display; ``overwrite`` (default, so a re-run cell
    starts afresh) clears a finished run in ``out_dir``, False refuses it. Returns a LaunchResult
    whose ``metrics`` is RUN_DIR/metrics.csv as a DataFrame.
    """
    return run_training(config, display="notebook", nproc=nproc, nnodes=nnodes, overwrite=overwrite,
                        progress=progress, timeout=timeout, show_ranks=show_ranks, env=env, check=check,
                        **launch_kwargs)


# --- ``course train``: the same, from the terminal -------------------------------------------------

def build_config(argv: list[str]) -> tuple[TrainConfig, argparse.Namespace]:
    """``course train``'s arguments: the worker's (preset or file, ``--resume``, fields) and ``--overwrite``."""
    parser = arg_parser("course train", "Train the nanoGPT-style model on N workers (torchrun), checked first.")
    parser.add_argument("--overwrite", action="store_true", help="start again in an out_dir that holds a run")
    return config_from_args(parser, argv)


def cli(argv: list[str]) -> int:
    try:
        cfg, args = build_config(argv)
        result = run_training(cfg, display="terminal", overwrite=args.overwrite, progress=not args.no_progress,
                              recipe=args.config or "")
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"course train: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        print("course train: interrupted", file=sys.stderr)
        return 130
    if not result.ok:
        print(f"course train: error: {result.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
