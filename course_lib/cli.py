"""course --help   (or: course COMMAND --help)

``course``: the command line of the course package.

Each command lives in the module that implements it and exposes ``cli(argv) -> int``;
this file only dispatches, importing the module lazily so ``course --help`` is fast.
"""

from __future__ import annotations

import importlib
import sys

import course_lib

# name -> (module:function, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "data": ("course_lib.gpt.data:cli", "prepare datasets (course data prepare shakespeare_char)"),
    "train": ("course_lib.launch.training:cli", "train the nanoGPT-style model, one process or distributed"),
    "sample": ("course_lib.gpt.sample:cli", "generate text from a run directory's checkpoint"),
    "info": ("course_lib.hardware:cli", "show the detected hardware and what it implies"),
    "submit": ("course_lib.launch.cluster:cli", "write (and submit) a SLURM or PBS batch script"),
    "memory": ("course_lib.analysis.memory_cli:cli", "per-device memory of DP and ZeRO stages 1-3"),
    "bench": ("course_lib.experiments.comm_bench:cli", "benchmarks: course bench comm"),
    "check-gpu": ("course_lib.experiments.gpu_check:cli", "check a CUDA GPU: recipe loss, fp16, NCCL, memory, MFU"),
    "pram": ("course_lib.pram.cli:cli", "run a classic algorithm on the PRAM simulator"),
    "images": ("course_lib.notebook.diagrams_build:cli", "render Mermaid diagrams (images/diagrams/*.mmd)"),
    "exercises": ("course_lib.exercises:cli", "build student and autograder releases of the exercises"),
    "grade": ("course_lib.exercises:grade_cli", "grade a submitted exercise notebook locally"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: course COMMAND [ARGS...]", "       course --version", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'course COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"course {course_lib.__version__}")  # pyproject.toml's (tests/test_cli_audit.py)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"course: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
