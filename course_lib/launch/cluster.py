"""course submit --scheduler slurm|pbs --nodes N --gpus-per-node G [--dry-run] -- TRAIN ARGS

Batch scripts that run the trainer on N nodes x G GPUs (what the scheduler gave a running job is
:mod:`course_lib.launch.placement`, :func:`~course_lib.launch.placement.detect_allocation`). SLURM
starts one ``torchrun`` per node with ``srun``; PBS with ``mpiexec -n N -ppn 1`` (MPICH / Cray
PALS / Intel MPI syntax; Open MPI's ``--map-by ppr:1:node`` where its ``mpiexec --version`` says
Open MPI). The torchrun agents meet
in a c10d rendezvous on the first node of the allocation, under the job id, at a port derived
from it (unless --port), with an explicit join timeout. The trainer's arguments are checked before
anything is submitted. Training arguments are quoted for the shell (``shlex.quote``), so spaces and ``;``
reach the trainer literally.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from course_lib.utils import check_port

SCHEDULERS = ("slurm", "pbs")
DEFAULT_MODULE = "course_lib.trainer.loop"
LAUNCHERS = ("torchrun", "srun")  # srun alone: one task per rank (SLURM only), for Lightning Fabric


def _port_lines(port: int | None, job_number: str) -> list[str]:
    """The rendezvous port: given, or 29500 + (job number mod 10000), so two jobs that share a first
    node do not meet in each other's store (the second torchrun would join the first job's)."""
    value = str(port) if port else f"$((29500 + {job_number} % 10000))"
    return [f"rdzv_port={value}"]


def _torchrun_line(nodes: int, nproc: int, head: str, run_id: str, join_timeout: int,
                   target: Sequence[str], train_args: Sequence[str]) -> str:
    args = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f'--rdzv-endpoint="{head}:$rdzv_port"', f'--rdzv-id="{run_id}"',
            f"--rdzv-conf=join_timeout={join_timeout}", "--max-restarts=0"]
    if tuple(target) == ("-m", DEFAULT_MODULE):  # the log is a file: step lines, no progress bar
        train_args = ["--no-progress", *train_args]
    return " ".join(args + [shlex.quote(t) for t in target] + [shlex.quote(a) for a in train_args])


def current_venv_activate() -> str | None:
    """The activate script of the virtual environment this Python runs in, if any."""
    if sys.prefix == sys.base_prefix:
        return None
    return os.path.join(sys.prefix, "bin", "activate")


def _env_lines(nproc: int, cpus_per_node: int | None, nccl_debug: str | None,
               activate: str | None) -> list[str]:
    lines = []
    if cpus_per_node:
        lines.append(f"export OMP_NUM_THREADS={max(1, cpus_per_node // max(1, nproc))}")
    if nccl_debug:
        lines += [f"export NCCL_DEBUG={shlex.quote(nccl_debug)}",
                  'export NCCL_DEBUG_FILE="nccl-%h-%p.log"  # one file per host and process']
    if activate:  # the virtual environment the script was written from
        lines.append(f"source {shlex.quote(activate)}")
    return lines


# What a PBS job must be given by name: qsub passes it none of the submitter's environment but the
# PBS_O_* copies (POSIX qsub; https://pubs.opengroup.org/onlinepubs/9699919799/utilities/qsub.html).
# Not -V: the submitter's PATH would come too, and its venv's mpich wheel would shadow the system MPI.
_PBS_CARRIED_ENV = ("COURSE_DATA_DIR",)  # where `course submit` checked that the dataset is prepared


_WORD = r"[A-Za-z0-9_.+-]+"
_NAME = re.compile(rf"^{_WORD}$")
# what each scheduler takes beyond one name: sbatch -p a list of partitions (the first free runs the
# job); qsub -q a queue at a server, "queue@server" or "@server" (that server's default queue)
_PATTERNS = {"partition": (re.compile(rf"^{_WORD}(,{_WORD})*$"), "a name, or names separated by commas"),
             "queue": (re.compile(rf"^({_WORD})?(@{_WORD})?$"), "a name, queue@server or @server")}
_TIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")


def _validate(nodes: int, gpus_per_node: int, nproc_per_node: int | None, *, port: int | None = None,
              cpus_per_node: int | None = None, **words) -> int:
    """The job's numbers and names, checked before a script is written: what the scheduler or the
    nodes' torchrun would refuse only once the job has waited in the queue."""
    for name, value in words.items():
        pattern, form = _PATTERNS.get(name, (_NAME, "a name"))
        if value is not None and (not str(value) or not pattern.match(str(value))):
            raise ValueError(f"{name} {value!r} must be {form} of letters, digits and _.+-")
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    if gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node must be >= 0 (0 = CPU nodes), got {gpus_per_node}")
    if port is not None:
        check_port("--port", port)
    if cpus_per_node is not None and cpus_per_node < 1:
        raise ValueError(f"--cpus-per-node must be >= 1, got {cpus_per_node}")
    nproc = nproc_per_node if nproc_per_node is not None else gpus_per_node or 2
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc}")
    if gpus_per_node and nproc > gpus_per_node:
        raise ValueError(f"--nproc-per-node={nproc} is more than --gpus-per-node={gpus_per_node}: "
                         "one rank per GPU; lower --nproc-per-node or ask for more GPUs")
    return nproc


def _activate(activate: str | None) -> str | None:
    return current_venv_activate() if activate == "auto" else activate


def _check_time(time_limit: str) -> None:
    if not _TIME.match(time_limit):
        raise ValueError(f"time limit {time_limit!r} must look like HH:MM:SS (or D-HH:MM:SS)")


def _pbs_walltime(time_limit: str) -> str:
    """``--time``, read as sbatch reads it (sbatch(1), --time: minutes, minutes:seconds,
    hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds), as PBS's
    walltime hours:minutes:seconds (PBS Professional Reference Guide, "Duration":
    [[hours:]minutes:]seconds). qsub refuses a day count, and reads a bare 30 as seconds."""
    days, _, clock = time_limit.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    if days:
        hours, minutes, seconds = (*parts, 0, 0)[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:
        hours, minutes, seconds = 0, parts[0], (parts[1] if len(parts) == 2 else 0)
    total = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    return f"{total // 3600:02d}:{total // 60 % 60:02d}:{total % 60:02d}"


def slurm_script(nodes: int, gpus_per_node: int, train_args: Sequence[str] = (), *,
                 target: Sequence[str] = ("-m", DEFAULT_MODULE), job_name: str = "course-train",
                 time_limit: str = "01:00:00", partition: str | None = None,
                 account: str | None = None, cpus_per_node: int | None = None,
                 nproc_per_node: int | None = None, port: int | None = None,
                 join_timeout: int = 300, nccl_debug: str | None = None,
                 activate: str | None = "auto", launcher: str = "torchrun") -> str:
    """An sbatch script: one srun task per node, each running torchrun with G workers; or, with
    ``launcher="srun"``, one srun task per rank, which finds its rank in SLURM's variables
    (Lightning's SLURMEnvironment: the labs' ``srun python train.py``)."""
    nproc = _validate(nodes, gpus_per_node, nproc_per_node, job_name=job_name,
                      partition=partition, account=account, port=port,
                      cpus_per_node=cpus_per_node)
    _check_time(time_limit)
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    tasks = nproc if launcher == "srun" else 1
    d = [f"--job-name={job_name}", f"--nodes={nodes}", f"--ntasks-per-node={tasks}",
         f"--time={time_limit}", "--output=%x-%j.out"]
    if gpus_per_node:
        d.insert(3, f"--gpus-per-node={gpus_per_node}")
    if cpus_per_node:
        d.append(f"--cpus-per-task={cpus_per_node // tasks or 1}")
    d += [f"--partition={partition}"] if partition else []
    d += [f"--account={account}"] if account else []
    lines = ["#!/bin/bash", *(f"#SBATCH {x}" for x in d),
             *_env_lines(nproc, cpus_per_node, nccl_debug, _activate(activate)),
             "set -euo pipefail", ""]
    if launcher == "srun":  # every task a rank; the framework reads SLURM_PROCID, SLURM_NTASKS, ...
        lines += ([f"export MASTER_PORT={port}"] if port else []) + [
            "srun --kill-on-bad-exit=1 " + (f"--cpus-per-task={cpus_per_node // tasks or 1} "
                                            if cpus_per_node else "")
            + " ".join(["python", *map(shlex.quote, target), *map(shlex.quote, train_args)])]
        return "\n".join(lines) + "\n"
    lines += [
             "# The first node of the allocation hosts the rendezvous store.",
             # sed reads every line: `head -n 1` would close the pipe early, and scontrol's
             # SIGPIPE would fail the script under pipefail
             'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
             *_port_lines(port, "SLURM_JOB_ID"), "",
             # Slurm 22.05 to 23.02: srun does not inherit sbatch's --cpus-per-task (23.11 reads
             # SLURM_CPUS_PER_TASK again); ask again, or every rank of the node may share one core
             # (Slurm's srun man page, --cpus-per-task); harmless where it is inherited
             "srun --kill-on-bad-exit=1 " + (f"--cpus-per-task={cpus_per_node} " if cpus_per_node
                                             else "") + _torchrun_line(
                 nodes, nproc, "$head_node", "$SLURM_JOB_ID", join_timeout, target, train_args)]
    return "\n".join(lines) + "\n"


def pbs_script(nodes: int, gpus_per_node: int, train_args: Sequence[str] = (), *,
               target: Sequence[str] = ("-m", DEFAULT_MODULE), job_name: str = "course-train",
               time_limit: str = "01:00:00", partition: str | None = None,
               account: str | None = None, cpus_per_node: int | None = None,
               nproc_per_node: int | None = None, port: int | None = None,
               join_timeout: int = 300, nccl_debug: str | None = None,
               activate: str | None = "auto") -> str:
    """A qsub script: mpiexec starts one torchrun per node (-ppn 1, Open MPI: --map-by ppr:1:node),
    each with G workers."""
    nproc = _validate(nodes, gpus_per_node, nproc_per_node, job_name=job_name,
                      queue=partition, account=account, port=port,
                      cpus_per_node=cpus_per_node)
    _check_time(time_limit)
    ncpus = cpus_per_node or max(1, nproc) * 4
    select = f"select={nodes}:ncpus={ncpus}:mpiprocs=1"
    if gpus_per_node:
        select += f":ngpus={gpus_per_node}"
    # place=scatter: each chunk on a host of its own (PBS Professional Reference Guide, "place"):
    # under the default "free" two chunks could share a host, two torchruns its GPUs
    d = [f"-N {job_name}", f"-l {select}", "-l place=scatter", f"-l walltime={_pbs_walltime(time_limit)}",
         "-j oe"]
    d += [f"-q {partition}"] if partition else []
    d += [f"-A {account}"] if account else []
    lines = ["#!/bin/bash", *(f"#PBS {x}" for x in d),
             "# The system's MPI, found before the venv's mpich wheel could shadow it.",
             ('mpiexec_bin=$(command -v mpiexec) || { echo "mpiexec not found: load your MPI '
              '(module load ...)" >&2; exit 1; }'),
             # always: PBS sets OMP_NUM_THREADS to the chunk's ncpus, which torchrun keeps for each rank
             *_env_lines(nproc, ncpus, nccl_debug, _activate(activate)),
             *(f"export {name}={shlex.quote(os.environ[name])}" for name in _PBS_CARRIED_ENV
               if os.environ.get(name)),
             "set -euo pipefail", 'cd "$PBS_O_WORKDIR"', "",
             "# The first node of the allocation hosts the rendezvous store.",
             'head_node=$(head -n 1 "$PBS_NODEFILE")', 'job_number=${PBS_JOBID%%[!0-9]*}',
             *_port_lines(port, "job_number"), "",
             "# One torchrun per node: -ppn 1 for MPICH, Cray PALS and Intel MPI; Open MPI has no -ppn.",
             'per_node=(-ppn 1)',
             'case "$("$mpiexec_bin" --version 2>&1 || true)" in',
             '  *"Open MPI"* | *OpenRTE*) per_node=(--map-by ppr:1:node) ;;',
             'esac',
             f'"$mpiexec_bin" -n {nodes} "${{per_node[@]}}" ' + _torchrun_line(
                 nodes, nproc, "$head_node", "$PBS_JOBID", join_timeout, target, train_args)]
    return "\n".join(lines) + "\n"


def _check_train_args(train_args: Sequence[str], data: bool, world_size: int) -> None:
    """The trainer's arguments are checked here, not after the job waited in the queue: every field
    and value (``course train``'s own parsing) and, when submitting from this machine (``data``),
    that the dataset is prepared where the job will look: the same path, since the job starts in
    this folder with this environment on a file system the nodes share."""
    # imported here: `course submit --help` and PBS/--script runs need neither
    from course_lib.gpt.data import DataError, load_meta
    from course_lib.registry import ConfigError
    from course_lib.trainer.config import arg_parser, config_from_args

    try:  # parsed as the worker (python -m course_lib.trainer.loop) will parse them
        cfg, _ = config_from_args(arg_parser("python -m course_lib.trainer.loop", ""), list(train_args))
        cfg.check_layout(world_size)  # tp * pp * cp divides the job's ranks
        if data:
            load_meta(cfg.data_dir or None, cfg.dataset)
    except (ConfigError, DataError) as e:
        raise ValueError(str(e)) from None


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="course submit", description=__doc__.split("\n\n")[1])
    p.add_argument("--scheduler", choices=SCHEDULERS, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True, help="0 for CPU-only nodes")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node (default: the GPUs, or 2)")
    p.add_argument("--cpus-per-node", type=int)
    p.add_argument("--time", default="01:00:00", help="wall-clock limit, HH:MM:SS")
    p.add_argument("--job-name", default="course-train")
    p.add_argument("--partition", help="SLURM partition / PBS queue")
    p.add_argument("--account")
    p.add_argument("--port", type=int, help="rendezvous port on the first node (default: 29500 + job id %% 10000)")
    p.add_argument("--nccl-debug", choices=["VERSION", "WARN", "INFO", "TRACE"])
    p.add_argument("--script", help="run this Python file instead of -m course_lib.trainer.loop")
    p.add_argument("--module", help="run python -m MODULE instead (e.g. course_lib.experiments.frameworks_job)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="torchrun",
                   help="SLURM: srun starts torchrun per node (default), or every rank itself (srun)")
    p.add_argument("--output", help="where to write the batch script (default runs/submit/)")
    p.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the trainer's arguments")
    a = p.parse_args(argv)
    train_args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    target = [a.script] if a.script else ["-m", a.module or DEFAULT_MODULE]
    make = slurm_script if a.scheduler == "slurm" else pbs_script
    try:
        if a.script and a.module:
            raise ValueError("give --script or --module, not both")
        if a.launcher == "srun" and a.scheduler != "slurm":
            raise ValueError("--launcher srun is SLURM's; PBS jobs start torchrun with mpiexec")
        if a.launcher == "srun" and not (a.script or a.module):
            raise ValueError("--launcher srun starts every rank itself: name what each runs with --module "
                             "or --script (the course trainer expects torchrun)")
        if a.script and not Path(a.script).is_file():
            raise ValueError(f"--script {a.script!r} does not exist")
        submit = "sbatch" if a.scheduler == "slurm" else "qsub"
        exe = None if a.dry_run else shutil.which(submit)
        if not (a.script or a.module):
            world = a.nodes * (a.nproc_per_node or a.gpus_per_node or 2)  # _validate's default ranks per node
            _check_train_args(train_args, data=exe is not None, world_size=world)
        text = make(a.nodes, a.gpus_per_node, train_args, target=target, job_name=a.job_name,
                    time_limit=a.time, partition=a.partition, account=a.account,
                    cpus_per_node=a.cpus_per_node, nproc_per_node=a.nproc_per_node,
                    port=a.port, nccl_debug=a.nccl_debug,
                    **({"launcher": a.launcher} if a.scheduler == "slurm" else {}))
    except ValueError as e:
        print(f"course submit: {e}", file=sys.stderr)
        return 2
    if a.dry_run:
        print(text, end="")
        return 0
    ext = "sbatch" if a.scheduler == "slurm" else "pbs"
    path = Path(a.output or f"runs/submit/{a.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.{ext}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if exe is None:
        print(f"wrote {path}\n{submit} was not found: this machine has no {a.scheduler.upper()}. "
              f"Copy the script to your cluster's login node and run: {submit} {path.name}",
              file=sys.stderr)
        return 1
    done = subprocess.run([exe, str(path)], check=False, capture_output=True, text=True)
    print(f"wrote {path}")
    print((done.stdout + done.stderr).strip())
    return done.returncode
