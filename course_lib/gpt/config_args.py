"""The command line of a training run: presets, a config.json, ``--resume`` and ``--field=value``.

    course train --config=shakespeare_char_cpu --max_iters=500 --nproc=2      (launch/train_cli.py)
    python -m course_lib.trainer.loop --config-file RUN_DIR/config.json           (trainer/loop.py, a worker)

Both parse with :func:`arg_parser` and :func:`config_from_args`, so a field means the same on the
host and in every worker; the result is one :class:`course_lib.gpt.config.TrainConfig`.
"""

import argparse
import difflib
from pathlib import Path

from course_lib.gpt.config import FIELDS, TRAIN_PRESETS, ConfigError, TrainConfig, make_config
from course_lib.hardware import default_nproc


def parse_value(name: str, text: str):
    """Convert ``--name=text`` to the field's type; a ConfigError names the field if it cannot."""
    if name not in FIELDS:
        close = difflib.get_close_matches(name, FIELDS, n=1)
        hint = f" (did you mean --{close[0]}?)" if close else ""
        raise ConfigError(f"unknown option --{name}{hint}")
    typ = FIELDS[name].type
    if typ is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{name}: expected true or false, got {text!r}")
    if typ is int and name == "nproc" and text == "auto":
        return default_nproc()  # one per GPU, else 2 CPU workers
    try:
        return typ(text)
    except ValueError:
        kind = {int: "an integer", float: "a number"}[typ]
        raise ConfigError(f"--{name}: expected {kind}, got {text!r}") from None


def parse_overrides(args: list[str]) -> dict:
    """``['--max_iters=100', '--compile', '--bias=false']`` -> typed dict (bare flag = True for bools).

    ``--name value`` is accepted too, except after a bool field (it would be ambiguous).
    """
    out, i = {}, 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"expected --field=value, got {arg!r}")
        name, eq, text = arg[2:].partition("=")
        name = name.replace("-", "_")
        if not eq:
            if name in FIELDS and FIELDS[name].type is bool:
                text = "true"
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                i, text = i + 1, args[i + 1]
            else:
                if name in FIELDS:
                    raise ConfigError(f"--{name} needs a value (--{name}=VALUE)")
                parse_value(name, "")  # raises: unknown option (with a suggestion)
        out[name] = parse_value(name, text)
        i += 1
    return out


def arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The command line shared by ``course train`` (host) and ``python -m course_lib.trainer.loop``
    (worker): a preset or a config.json, ``--resume``, then any field as ``--field=value``."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, epilog=_help_epilog(), description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="PRESET", help=f"start from a preset: {', '.join(TRAIN_PRESETS)}")
    p.add_argument("--config-file", metavar="PATH", help="start from a config.json (what workers use)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out_dir (= --init_from=resume)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[TrainConfig, argparse.Namespace]:
    """Parse ``argv`` with ``parser`` (from :func:`arg_parser`); the rest are field overrides.
    ``--resume`` without a preset or file continues with the run's own config.json."""
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)
    if args.resume:
        overrides["init_from"] = "resume"
    if args.config and args.config_file:
        raise ConfigError("give either --config or --config-file, not both")
    base = None
    if args.config_file:
        base = TrainConfig.load(args.config_file)
    elif args.resume and not args.config:
        out_dir = overrides.get("out_dir")
        if not out_dir:
            raise ConfigError("--resume needs --out_dir=DIR (the run to continue)")
        base = TrainConfig.load(Path(out_dir) / "config.json")
    return make_config(args.config, overrides, base=base), args


def _help_epilog() -> str:
    d = TrainConfig()
    fields = "\n".join(f"  {f'--{name}={getattr(d, name)!r}':<42} {f.type.__name__}" for name, f in FIELDS.items())
    return (f"presets (--config=NAME): {', '.join(TRAIN_PRESETS)}\n\nfields (default values; any one as --field=value):\n"
            f"{fields}\n\nbool fields also accept a bare --field (true); --nproc=auto uses every GPU, or 2 CPU workers.")
