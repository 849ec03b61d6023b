"""course train --config=shakespeare_char_cpu --nproc=2 --out_dir=runs/x

``course train``: check a training request, write RUN_DIR/config.json, launch the workers.

    course train --resume --out_dir=runs/x --max_iters=3000
    course train --help                      # every field, its default and the presets

This is :func:`course_lib.launch.training.run_training` with the terminal display (rank 0's own
output and progress bar), the same code as :func:`course_lib.launch.launch_training` in a
notebook. Everything that can be wrong with the input (fields, types, data not prepared, device,
ranks vs GPUs, memory, an out_dir that already holds a run, an incompatible resume) is reported in
one line before any process starts; where the ranks run (each one's device, the backend) is
printed as one line too (:mod:`course_lib.launch.placement`). The workers run
``python -m course_lib.trainer.loop --config-file RUN_DIR/config.json`` under torchrun on this host
(one of them for ``--nproc=1``). Ctrl-C stops the whole process tree (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import argparse
import sys

from course_lib.gpt.checkpoint import CheckpointError
from course_lib.gpt.config import ConfigError, TrainConfig, arg_parser, config_from_args
from course_lib.gpt.data import DataError
from course_lib.launch.training import run_training


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
