"""``course train``: check a config, write RUN_DIR/config.json, train here or launch N workers.

    course train --config=shakespeare_char_cpu --nproc=2 --out_dir=runs/x
    course train --resume --out_dir=runs/x --max_iters=3000
    course train --help                      # every field, its default and the presets

Everything that can be wrong with the input (fields, types, data not prepared, device, an
out_dir that already holds a run, an incompatible resume) is reported before any process starts.
With ``nproc > 1`` (or a distributed strategy) the workers run
``python -m course_lib.gpt.train --config-file RUN_DIR/config.json`` under torchrun on this host:
rendezvous on 127.0.0.1 at a free port, gloo on CPUs and NCCL on GPUs (chosen by each worker),
``cores // nproc`` threads per CPU worker. Ctrl-C stops the whole process tree: SIGTERM, then
SIGKILL after a grace period.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from course_lib.gpt.config import FIELDS, PRESETS, ConfigError, TrainConfig, make_config, parse_overrides

RUN_FILES = ("last.pt", "best.pt", "metrics.csv", "summary.json", "run.json", "config.json")


class TrainError(RuntimeError):
    """A training run that failed; its output (above) says why."""


def _device_type(cfg: TrainConfig) -> str:
    import torch

    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if cfg.device.startswith("cuda") else "cpu"


def needs_launch(cfg: TrainConfig) -> bool:
    """More than one worker, or a strategy that needs a process group even for one."""
    return cfg.nproc > 1 or cfg.resolved_strategy(1) != "single"


def preflight(cfg: TrainConfig, overwrite: bool = False) -> None:
    """Raise a clear error for anything that would make the workers fail at start."""
    import torch

    from course_lib.gpt import checkpoint as ckpt_io
    from course_lib.gpt.data import load_meta, load_tokens
    from course_lib.hardware import detect, pick_dtype
    from course_lib.parallel.strategy import STRATEGIES

    load_meta(cfg.data_dir or None, cfg.dataset)  # DataError: "run course data prepare ..."
    if load_tokens(cfg.data_dir or None, cfg.dataset, "val").numel() <= cfg.block_size + 1:
        raise ConfigError(f"block_size {cfg.block_size} is longer than the {cfg.dataset} val split")
    device_type = _device_type(cfg)
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {cfg.device!r} needs CUDA, which is not available here; use --device=cpu")
        if cfg.nproc > torch.cuda.device_count():
            raise ConfigError(f"nproc={cfg.nproc} but only {torch.cuda.device_count()} GPU(s); one worker per GPU")
    try:
        pick_dtype(detect("cuda" if device_type == "cuda" else "cpu"), cfg.dtype)
    except ValueError as e:
        raise ConfigError(f"dtype: {e}") from None
    strategy = cfg.resolved_strategy(cfg.nproc)
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy {strategy!r} is not available; choose one of {', '.join(STRATEGIES)}")
    out = Path(cfg.out_dir)
    if cfg.init_from == "resume":
        ck = ckpt_io.load_checkpoint(out / ckpt_io.LAST, mmap=True)
        ckpt_io.check_resumable(ck["config"], cfg, out / ckpt_io.LAST, ck["iter_num"])
    elif (out / ckpt_io.LAST).exists() and not overwrite:
        raise ConfigError(f"{out} already holds a run (last.pt); pass --resume to continue it, "
                          "--overwrite to start it again, or choose another --out_dir")


def prepare_run_dir(cfg: TrainConfig, overwrite: bool = False) -> Path:
    """Preflight, clear an overwritten run, write config.json; returns its path."""
    from course_lib.utils import atomic_write_bytes

    preflight(cfg, overwrite)
    out = Path(cfg.out_dir)
    if cfg.init_from == "scratch" and overwrite:
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
    path = out / "config.json"
    atomic_write_bytes(path, cfg.to_json().encode())
    return path


def launch_torchrun(config_file: str | os.PathLike, nproc: int, *, threads: int | None = None,
                    progress: bool = True, grace_s: float = 10.0) -> int:
    """Run the workers through torchrun on this host and wait; returns its exit code.

    The process handling is the launch package's (:mod:`course_lib.launch.procs`): torchrun gets
    its own session and dies with us (parent-death signal); on any interruption its whole tree
    gets SIGTERM, then SIGKILL after ``grace_s``. Rendezvous on 127.0.0.1 at a free port, through
    the loopback-only agent (:func:`course_lib.launch.torchrun.agent_argv`). Output goes straight
    to this terminal, with the trainer's own progress bar.
    """
    from course_lib.launch.procs import ProcessTree, spawn
    from course_lib.launch.torchrun import agent_argv, single_node_flags

    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("PYTHONUNBUFFERED", "1")
    argv = agent_argv(single_node_flags(nproc, rdzv="static")) + [
        "-m", "course_lib.gpt.train", "--config-file", str(config_file)] + ([] if progress else ["--no-progress"])
    proc = spawn(argv, env=env)
    tree = ProcessTree(proc)
    try:
        return proc.wait()
    except BaseException:
        tree.terminate(grace_s)
        raise


def run(cfg: TrainConfig, overwrite: bool = False, progress: bool = True) -> dict:
    """Train ``cfg`` (in this process, or on ``cfg.nproc`` torchrun workers); returns the summary."""
    config_file = prepare_run_dir(cfg, overwrite)
    if not needs_launch(cfg):
        from course_lib.gpt.train import train
        return train(cfg, progress=progress)
    threads = None
    if _device_type(cfg) == "cpu":
        threads = cfg.threads or max(1, len(os.sched_getaffinity(0)) // cfg.nproc)
    rc = launch_torchrun(config_file, cfg.nproc, threads=threads, progress=progress)
    if rc != 0:
        raise TrainError(f"training failed: torchrun exited with code {rc} (the workers' errors are above)")
    return json.loads((Path(cfg.out_dir) / "summary.json").read_text())


def _help_epilog() -> str:
    d = TrainConfig()
    fields = "\n".join(f"  {f'--{name}={getattr(d, name)!r}':<42} {f.type.__name__}" for name, f in FIELDS.items())
    return (f"presets (--config=NAME): {', '.join(PRESETS)}\n\nfields (default values; any one as --field=value):\n"
            f"{fields}\n\nbool fields also accept a bare --field (true); --nproc=auto uses every GPU, or 2 CPU workers.")


def build_config(argv: list[str]) -> tuple[TrainConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="course train", allow_abbrev=False, epilog=_help_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Train the nanoGPT-style model, one process or N workers (torchrun).")
    p.add_argument("--config", metavar="PRESET", help=f"start from a preset: {', '.join(PRESETS)}")
    p.add_argument("--config-file", metavar="PATH", help="start from a config.json (what workers use)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out_dir (= --init_from=resume)")
    p.add_argument("--overwrite", action="store_true", help="start again in an out_dir that holds a run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args, rest = p.parse_known_args(argv)
    overrides = parse_overrides(rest)
    if args.resume:
        overrides["init_from"] = "resume"
    if args.config and args.config_file:
        raise ConfigError("give either --config or --config-file, not both")
    base = None
    if args.config_file:
        base = TrainConfig.load(args.config_file)
    elif args.resume and not args.config:  # continue with the run's own config
        out_dir = overrides.get("out_dir")
        if not out_dir:
            raise ConfigError("--resume needs --out_dir=DIR (the run to continue)")
        base = TrainConfig.load(Path(out_dir) / "config.json")
    return make_config(args.config, overrides, base=base), args


def cli(argv: list[str]) -> int:
    from course_lib.gpt.checkpoint import CheckpointError
    from course_lib.gpt.data import DataError

    try:
        cfg, args = build_config(argv)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a torchrun worker
            from course_lib.gpt.train import train
            train(cfg, progress=not args.no_progress)
        else:
            run(cfg, overwrite=args.overwrite, progress=not args.no_progress)
    except (ConfigError, DataError, CheckpointError, TrainError) as e:
        print(f"course train: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        print("course train: interrupted", file=sys.stderr)
        return 130
    return 0
