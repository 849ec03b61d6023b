"""launch(): run a script or module on N ranks through torchrun, from Python or a notebook.

    from course_lib.launch import launch
    result = launch("train.py", ["--lr", "3e-4"], nproc=2, timeout=600)  # or launch(target, args, LaunchSpec(...))
    result.returncode, result.failed_rank, result.traceback, result.metrics

The call blocks, streams output live (rank 0's in full, every rank's stderr), and returns a
:class:`LaunchResult`; ``check=True`` raises :class:`LaunchError` on failure instead. Every
launch gets its own port (bound by its agent as it starts) and its own rendezvous id, so several
can run at once on one host.
Interrupting (the notebook's stop button, Ctrl-C) stops every process of the run before the
KeyboardInterrupt propagates; :func:`launch_training` runs the course trainer with a progress bar.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import course_lib.launch.checks as checks
import course_lib.launch.torchrun as torchrun
from course_lib.hardware import threads_per_rank
from course_lib.launch.supervise import Agent, RankFailure, supervise


class LaunchError(RuntimeError):
    """A launch that failed, timed out or was refused; ``.result`` holds the details."""

    def __init__(self, message: str, result: LaunchResult | None = None):
        super().__init__(message)
        self.result = result

    def _render_traceback_(self):  # IPython: show the summary, not the launcher's own stack
        return [f"LaunchError: {self}"]


@dataclass
class LaunchResult:
    """What a launch did. ``stdout[k]``/``stderr[k]`` are rank k's full output."""

    returncode: int
    run_dir: Path
    nproc: int
    nnodes: int
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    failure: RankFailure | None = None
    timed_out: bool = False
    error: str | None = None  # one paragraph: what went wrong and where
    duration_s: float = 0.0
    command: list[str] = field(default_factory=list)
    metrics: object = None  # pandas.DataFrame of RUN_DIR/metrics.csv for training runs

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def failed_rank(self) -> int | None:
        return self.failure.rank if self.failure else None

    @property
    def traceback(self) -> str | None:
        return self.failure.traceback if self.failure else None

    def output(self, rank: int = 0) -> str:
        return self.stdout.get(rank, "") + self.stderr.get(rank, "")

    def raise_for_status(self) -> LaunchResult:
        if not self.ok:
            raise LaunchError(self.error or f"launch failed with exit code {self.returncode}", self)
        return self

    def __repr__(self) -> str:
        state = "ok" if self.ok else (self.error or f"exit code {self.returncode}").split("\n")[0]
        return (f"LaunchResult({state}, nproc={self.nproc}, nnodes={self.nnodes}, "
                f"{self.duration_s:.1f} s, run_dir='{self.run_dir}')")


def default_run_dir(kind: str = "launch") -> Path:
    return Path("runs") / kind / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _prepare_run_dir(run_dir) -> Path:
    run_dir = Path(run_dir).resolve()
    logs = run_dir / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file, read-only or mistyped: one line, before anything starts
        raise checks.LaunchConfigError(f"cannot write the run directory {run_dir} ({e.strerror or e}); "
                                       "choose another run_dir") from None
    for old in logs.glob("rank*"):  # a previous launch's rank files would confuse this one
        old.unlink()
    return run_dir


def base_env(env: Mapping[str, str] | None, nproc_per_node: int, run_id: str, *, local: bool,
             nccl_debug: str | None = None, nccl_debug_subsys: str | None = None,
             nccl_debug_file=None) -> dict[str, str]:
    """Environment for the agent and its workers (a copy of ours, plus the launch's settings)."""
    out = dict(os.environ)
    out.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc_per_node)))
    out.update(PYTHONUNBUFFERED="1", COURSE_LAUNCH_ID=run_id, COURSE_PDEATHSIG="1")
    if local:
        out["COURSE_LOOPBACK_STORE"] = "1"
        for k, v in torchrun.local_network_env().items():
            out.setdefault(k, v)
    out.update(torchrun.nccl_debug_env(nccl_debug, nccl_debug_subsys, nccl_debug_file))
    out.update({k: str(v) for k, v in (env or {}).items()})
    return out


@dataclass(frozen=True)
class LaunchSpec:
    """How to run a target on N ranks: what :func:`launch` takes besides the target and its args.

    Build one (``LaunchSpec(nproc=2, timeout=60)``) or pass its fields to ``launch`` as keywords;
    an unknown field is an error. Every field is checked by
    :func:`course_lib.launch.checks.check_launch` before anything is spawned.
    """

    nproc: int | str = "auto"
    """Ranks per node: an int, or "auto" (one rank per GPU, else 2 CPU ranks, threads split between them)."""
    nnodes: int = 1
    """Nodes. >1 without ``rdzv_endpoint`` starts that many torchrun agents on this host, meeting in a c10d
    rendezvous on 127.0.0.1 (the course's stand-in for a cluster)."""
    module: bool | None = None
    """The target is a module name (True), a .py path (False), or None: guess from the target."""
    device: str = "auto"
    """'auto', 'cpu' or 'cuda': with more ranks than GPUs the ranks share the GPUs over gloo."""
    backend: str = "auto"
    """'auto', 'gloo' or 'nccl' (NCCL is refused when ranks share a GPU); the decision
    (:mod:`course_lib.launch.placement`) is printed once, as one line, before the ranks start."""
    recipe: str = ""
    """What the plan line calls the run (default: the target's name)."""
    timeout: float | None = None
    """Wall-clock limit for the whole run in seconds (None: none). On expiry the ranks still running
    print where they are, then everything is stopped."""
    collective_timeout: float = 60.0
    """Seconds a collective may wait: the process group of ``init_process_group=True`` uses it, and the
    trainer reads it from ``COURSE_COLLECTIVE_TIMEOUT``."""
    env: Mapping[str, str] | None = None
    """Extra environment variables for every rank."""
    run_dir: object = None
    """Where the logs go (RUN_DIR/logs); None: a new runs/launch/TIMESTAMP-ID."""
    init_process_group: bool = False
    """Each rank joins the default process group before the target runs (as ``%%torchrun`` does)."""
    show_ranks: Sequence[int] | str = (0,)
    """Whose stdout is streamed (every rank's stderr always is): (0,), [0, 1], "all"."""
    rdzv: str = "c10d"
    """torchrun's rendezvous backend (one of ``torchrun.RDZV_BACKENDS``; several nodes need c10d)."""
    rdzv_endpoint: str | None = None
    """"HOST:PORT" of a real multi-node job this host joins (with ``rdzv_id``); None: this host only."""
    rdzv_id: str | None = None
    """The rendezvous id, the same on every node (needed with ``rdzv_endpoint``)."""
    nccl_debug: str | None = None
    """NCCL_DEBUG for the ranks (checked: one of NCCL's levels)."""
    nccl_debug_subsys: str | None = None
    """NCCL_DEBUG_SUBSYS for the ranks."""
    nccl_debug_file: object = None
    """NCCL_DEBUG_FILE for the ranks."""
    grace: float = 5.0
    """Seconds between SIGTERM and SIGKILL when the ranks are stopped."""
    progress: Callable | None = None
    """A callable(run_dir) -> object with poll() and close(): the training progress bar."""
    before_start: Callable[[], None] | None = None
    """Called once every check has passed and before anything is made or started (launch_training
    writes the run's directory and config.json here: a refused launch leaves the old run as it was)."""
    output: str = "ranks"
    """"ranks" (each line prefixed ``[rankK]``) or "raw" (rank 0's stdout and stderr byte for byte, as a
    terminal would show that process, its progress bar included; other ranks' stderr still prefixed)."""
    check: bool = False
    """Raise :class:`LaunchError` on failure instead of returning the failed LaunchResult."""
    out: object = None
    """Where streamed stdout goes (None: sys.stdout)."""
    err: object = None
    """Where streamed stderr and the launcher's messages go (None: sys.stderr). The plan line goes
    here too when given; else, with the "ranks" output of a notebook, to ``out`` with the ranks'
    lines (it is news, not an error: stderr is drawn red), and with "raw" to sys.stderr."""

    def replace(self, **changes) -> LaunchSpec:
        return dataclasses.replace(self, **changes)


LAUNCH_FIELDS = tuple(f.name for f in dataclasses.fields(LaunchSpec))


def check_fields(fields: Mapping, caller: str, taken: Sequence[str] = (), hint: str = "") -> None:
    """Keyword fields of a LaunchSpec: each one known, and none that ``caller`` sets itself (``taken``;
    ``hint`` says where they come from instead)."""
    unknown = sorted(set(fields) - set(LAUNCH_FIELDS))
    if unknown:
        raise TypeError(f"{caller} got unknown field(s) {', '.join(unknown)}; a LaunchSpec has "
                        f"{', '.join(LAUNCH_FIELDS)}")
    own = sorted(set(fields) & set(taken))
    if own:
        raise TypeError(f"{caller} sets {', '.join(own)} itself; leave {'it' if len(own) == 1 else 'them'} out"
                        + (f" ({hint})" if hint else ""))


def launch(target, args: Sequence[str] = (), spec: LaunchSpec | None = None, **fields) -> LaunchResult:
    """Run ``target`` (a .py path or a module name) with ``args`` on ``spec.nproc`` ranks per node via torchrun.

    ``spec`` is a :class:`LaunchSpec`; keyword ``fields`` build one (or change the given one):
    ``launch("train.py", nproc=2, timeout=600)``. An unknown keyword is an error.
    """
    check_fields(fields, "launch()")
    if isinstance(args, (str, bytes)):
        raise TypeError(f"args is a list of strings, such as ['--lr=0.1'], got the string {args!r}")
    spec = (spec or LaunchSpec()).replace(**fields)
    plan, target, is_module, timeout, collective_timeout = checks.check_launch(target, spec)
    if spec.before_start is not None:
        spec.before_start()
    nproc, nnodes = plan.nproc, spec.nnodes
    rdzv, rdzv_endpoint, rdzv_id, grace = spec.rdzv, spec.rdzv_endpoint, spec.rdzv_id, spec.grace
    nccl_debug, nccl_debug_subsys, nccl_debug_file = spec.nccl_debug, spec.nccl_debug_subsys, spec.nccl_debug_file
    run_dir, env, init_process_group, err, progress = spec.run_dir, spec.env, spec.init_process_group, spec.err, spec.progress

    run_dir = _prepare_run_dir(run_dir or default_run_dir())
    log_dir = str(run_dir / "logs")
    run_id = rdzv_id or torchrun.new_run_id()
    local = rdzv_endpoint is None
    full_env = base_env(env, nproc, run_id, local=local, nccl_debug=nccl_debug,
                        nccl_debug_subsys=nccl_debug_subsys, nccl_debug_file=nccl_debug_file)
    if "COURSE_COLLECTIVE_TIMEOUT" not in (env or {}):  # the launch's own, not one this process inherited
        full_env["COURSE_COLLECTIVE_TIMEOUT"] = f"{collective_timeout:g}"
    full_env.update(plan.env())  # each rank's device and the backend (course_lib.hardware.planned_device)
    init_pg = plan.backend if init_process_group else "none"
    worker = torchrun.bootstrap_args(str(run_dir), target, args, module=is_module, init_pg=init_pg,
                                     pg_timeout=collective_timeout)
    join = max(30.0, collective_timeout)
    accepted = torchrun.accepted_options()  # the installed torchrun's own parser, read once per launch

    def fit(flags):
        return torchrun.fit_to_torchrun(flags, accepted)

    agents = []
    if local and nnodes == 1:
        flags = torchrun.single_node_flags(nproc, rdzv=rdzv, run_id=run_id, join_timeout=join,
                                           shutdown_timeout=grace, log_dir=f"{log_dir}/torchelastic")
        agents.append(Agent(torchrun.agent_argv(fit(flags)) + worker, f"{log_dir}/agent0"))
    elif local:
        endpoint = f"{torchrun.LOOPBACK}:{torchrun.free_port(torchrun.LOOPBACK)}"
        for i in range(nnodes):
            flags = torchrun.multi_node_flags(
                nnodes, nproc, endpoint, run_id, join_timeout=join, is_host=(i == 0),
                local_addr=torchrun.LOOPBACK, shutdown_timeout=grace,
                log_dir=f"{log_dir}/torchelastic{i}")
            agents.append(Agent(torchrun.agent_argv(fit(flags)) + worker, f"{log_dir}/agent{i}"))
    else:
        flags = torchrun.multi_node_flags(nnodes, nproc, rdzv_endpoint, run_id,
                                          join_timeout=max(join, 300.0), shutdown_timeout=grace,
                                          log_dir=f"{log_dir}/torchelastic")
        agents.append(Agent(torchrun.agent_argv(fit(flags), loopback=False) + worker, f"{log_dir}/agent0"))
        print(f"[launch] on every other node run:\n  {' '.join(agents[0].argv)}", file=err or sys.stderr)

    news = err or (sys.stderr if spec.output == "raw" else spec.out or sys.stdout)
    print(f"[launch] {plan.line()}", file=news)
    outcome = supervise(agents, full_env, log_dir, show=spec.show_ranks, timeout=timeout, grace=grace,
                        collective_timeout=collective_timeout, progress=progress(run_dir) if progress else None,
                        raw=spec.output == "raw", out=spec.out, err=err)
    result = LaunchResult(
        returncode=outcome.returncode, run_dir=run_dir, nproc=nproc, nnodes=nnodes,
        stdout=outcome.stdout, stderr=outcome.stderr, failure=outcome.failure,
        timed_out=outcome.timed_out, error=outcome.error,
        duration_s=outcome.duration_s, command=agents[0].argv, metrics=_read_metrics(run_dir))
    if spec.check:
        result.raise_for_status()
    return result


def _read_metrics(run_dir: Path):
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return None
    import pandas as pd  # a second of import: only once a run has written metrics

    try:
        return pd.read_csv(path)
    except (ValueError, OSError):  # empty or half-written: the run died before its first row
        return None
