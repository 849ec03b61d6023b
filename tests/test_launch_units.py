"""The launcher's parts without torchrun: process trees, command lines, checks, diagnosis.

Processes here are plain Python (no torch import), so these tests take a few seconds.
"""

import faulthandler
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from course_lib.launch import checks, procs, supervise, torchrun
from course_lib.launch.api import LaunchSpec, launch
from course_lib.launch.bootstrap import diagnose
from course_lib.launch.supervise import pick_failure

PY = sys.executable


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


# ---------------------------------------------------------------- processes


@pytest.mark.timeout(30)
def test_arguments_arrive_literally_without_a_shell(tmp_path):
    weird = ["a b", ";echo pwned", "$HOME", "*", "'q'", 'd"q', "--flag=x y"]
    p = procs.spawn([PY, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", *weird],
                    stdout=subprocess.PIPE, cwd=str(tmp_path))
    out, _ = p.communicate(timeout=20)
    assert json.loads(out) == weird
    with pytest.raises(TypeError, match="not a string"):
        procs.spawn("echo hi")


@pytest.mark.timeout(30)
def test_child_runs_in_own_session_and_dies_with_its_parent():
    """SIGKILL the process that spawned the child: the parent-death signal stops the child."""
    code = ("import sys, time\n"
            "from course_lib.launch.procs import spawn\n"
            f"p = spawn([{PY!r}, '-c', 'import time; time.sleep(60)'])\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert os.getsid(child) == child  # its own session: the kernel's Ctrl-C does not reach it
        assert psutil.Process(child).is_running()
        parent.kill()
        parent.wait()
        assert _gone(child), "child outlived its parent"
    finally:
        for pid in (child, parent.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(30)
def test_terminate_kills_a_tree_that_ignores_sigterm():
    """Like torchrun: the grandchild is in a session of its own; both ignore SIGTERM."""
    grandchild = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print('ready', flush=True); time.sleep(60)")
    child = ("import signal, subprocess, sys, time\n"
             "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             f"g = subprocess.Popen([sys.executable, '-c', {grandchild!r}], start_new_session=True, stdout=subprocess.PIPE)\n"
             "g.stdout.readline()\n"
             "print(g.pid, flush=True)\n"
             "time.sleep(60)\n")
    p = procs.spawn([PY, "-c", child], stdout=subprocess.PIPE)
    gpid = int(p.stdout.readline())
    tree = procs.ProcessTree(p)
    assert gpid in tree.known
    killed = tree.terminate(grace=0.5)
    assert sorted(killed) == sorted([p.pid, gpid])
    assert _gone(gpid) and _gone(p.pid)
    assert tree.alive() == []


# ---------------------------------------------------------------- command lines


def test_single_node_rendezvous_is_loopback_with_fresh_port_and_id():
    a = torchrun.single_node_flags(2, join_timeout=45)
    b = torchrun.single_node_flags(2)
    endpoint = next(f for f in a if f.startswith("--rdzv-endpoint="))
    assert endpoint.startswith("--rdzv-endpoint=127.0.0.1:")
    assert "--local-addr=127.0.0.1" in a and "--rdzv-backend=c10d" in a
    assert "--rdzv-conf=join_timeout=45,is_host=1" in a
    ids = {f for f in a + b if f.startswith("--rdzv-id=")}
    assert len(ids) == 2  # a unique rendezvous id per launch
    static = torchrun.single_node_flags(3, rdzv="static", port=12345)
    assert {"--rdzv-backend=static", "--master-addr=127.0.0.1", "--master-port=12345",
            "--nproc-per-node=3"} <= set(static)
    with pytest.raises(ValueError, match="rdzv must be one of"):
        torchrun.single_node_flags(2, rdzv="etcd")


def test_multi_node_flags():
    f = torchrun.multi_node_flags(4, 8, "node01:29400", "job-17", join_timeout=120)
    assert {"--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d",
            "--rdzv-endpoint=node01:29400", "--rdzv-id=job-17", "--rdzv-conf=join_timeout=120"} <= set(f)
    assert "--rdzv-conf=join_timeout=30,is_host=0" in torchrun.multi_node_flags(
        2, 1, "h:1", "x", join_timeout=30, is_host=False)
    with pytest.raises(ValueError, match="HOST:PORT"):
        torchrun.multi_node_flags(2, 1, "node01", "x")
    with pytest.raises(ValueError, match="run id"):
        torchrun.multi_node_flags(2, 1, "node01:1", "")


def test_bootstrap_args_keep_target_and_args_apart():
    argv = torchrun.bootstrap_args("/r", "-weird.py", ["-m", "a b"], module=False, init_pg="gloo",
                                   pg_timeout=7)
    assert argv[:2] == ["-m", "course_lib.launch.bootstrap"]
    assert "--init-pg=gloo" in argv and "--pg-timeout=7" in argv
    assert argv[argv.index("--") + 1:] == ["-weird.py", "-m", "a b"]


def test_nccl_debug_switches():
    assert torchrun.nccl_debug_env("info", "INIT,COLL", "/tmp/nccl.%h.%p") == {
        "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,COLL", "NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p"}
    assert torchrun.nccl_debug_env(subsys="ALL")["NCCL_DEBUG"] == "INFO"
    assert torchrun.nccl_debug_env() == {}
    with pytest.raises(ValueError, match="NCCL debug level"):
        torchrun.nccl_debug_env("LOUD")


# ---------------------------------------------------------------- refused before spawning


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "ok.py"
    path.write_text("print('hi')\n")
    return path


def test_refuses_bad_nproc(nothing_spawned, script):
    for bad in (0, -1, 1.5, "two", True):
        with pytest.raises(checks.LaunchConfigError, match="nproc must be"):
            launch(script, nproc=bad, run_dir=nothing_spawned)


def test_refuses_more_gpu_ranks_than_gpus(nothing_spawned, script):
    from course_lib.hardware import gpu_count

    n = gpu_count()
    with pytest.raises(checks.LaunchConfigError, match=r"no GPU|NCCL allows one rank per GPU"):
        launch(script, nproc=n + 1, device="cuda", backend="nccl", run_dir=nothing_spawned)


def test_refuses_missing_script_and_module(nothing_spawned):
    with pytest.raises(checks.LaunchConfigError, match="does not exist"):
        launch("no_such_script.py", nproc=2, run_dir=nothing_spawned)
    with pytest.raises(checks.LaunchConfigError, match="neither a file nor an importable module"):
        launch("no_such_pkg.train", nproc=2, run_dir=nothing_spawned)


def test_refuses_bad_options(nothing_spawned, script):
    with pytest.raises(checks.LaunchConfigError, match="timeout must be"):
        launch(script, nproc=2, timeout=0, run_dir=nothing_spawned)
    for endless in (math.inf, math.nan):  # a rank's timedelta(seconds=inf) overflows; nan <= 0 is False
        with pytest.raises(checks.LaunchConfigError, match="collective_timeout must be"):
            launch(script, nproc=2, collective_timeout=endless, run_dir=nothing_spawned)
    with pytest.raises(checks.LaunchConfigError, match="rdzv must be"):
        launch(script, nproc=2, rdzv="etcd", run_dir=nothing_spawned)
    nothing_spawned.parent.joinpath("a_file").write_text("")  # as %%torchrun --run-dir a_file: was a FileExistsError
    with pytest.raises(checks.LaunchConfigError, match=r"cannot write the run directory .*a_file.*choose another"):
        launch(script, nproc=2, run_dir=nothing_spawned.parent / "a_file")
    with pytest.raises(TypeError, match=r"args is a list of strings, such as \['--lr=0.1'\], got the string"):
        launch(script, "--lr=0.1", nproc=2, run_dir=nothing_spawned)  # it once ran with args - - l r = ...
    with pytest.raises(checks.LaunchConfigError,
                       match=r"launch runs a script or a module.*run_ranks.*notebook_launcher\(fn, args, nproc=N\)"):
        launch(print, nproc=2, run_dir=nothing_spawned)
    with pytest.raises(checks.LaunchConfigError, match="nnodes must be"):
        launch(script, nproc=2, nnodes=0, run_dir=nothing_spawned)
    with pytest.raises(ValueError, match="NCCL debug level"):
        launch(script, nproc=2, nccl_debug="LOUD", run_dir=nothing_spawned)


def test_launch_takes_a_typed_spec_and_refuses_unknown_fields(nothing_spawned, script):
    """Issue 30 item 3: launch(target, args, spec, **fields), at most 10 parameters; every field of
    the spec has a docstring; an unknown keyword is an error, before anything is spawned."""
    import dataclasses
    import inspect

    assert len(inspect.signature(launch).parameters) <= 10
    assert list(inspect.signature(launch).parameters) == ["target", "args", "spec", "fields"]
    source = inspect.getsource(LaunchSpec)
    for f in dataclasses.fields(LaunchSpec):  # each field line is followed by its docstring
        assert re.search(rf"\n    {f.name}: [^\n]+\n    \"\"\"", source), f"{f.name} has no docstring"
    with pytest.raises(TypeError, match=r"unknown field\(s\) nprocs"):
        launch(script, nprocs=2, run_dir=nothing_spawned)
    with pytest.raises(checks.LaunchConfigError, match="timeout must be"):  # a spec's fields are checked too
        launch(script, (), LaunchSpec(nproc=2, timeout=-1, run_dir=nothing_spawned))
    with pytest.raises(checks.LaunchConfigError, match="output must be"):  # keywords change a given spec
        launch(script, (), LaunchSpec(nproc=2, run_dir=nothing_spawned), output="loud")


def test_refuses_nodes_beyond_the_slurm_allocation(nothing_spawned, script, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu01")
    with pytest.raises(checks.LaunchConfigError, match=r"nnodes=2 but this SLURM job \(4242\) has 1 node"):
        launch(script, nproc=1, nnodes=2, run_dir=nothing_spawned)


def test_refuses_unknown_strategy():
    with pytest.raises(checks.LaunchConfigError, match="unknown strategy 'zero4'; choose one of"):
        checks.check_strategy("zero4")
    checks.check_strategy("ddp")


def test_refuses_training_config_that_does_not_fit(nothing_spawned):
    from course_lib.launch import launch_training
    from course_lib.trainer.config import make_config

    # GPT-2 XL shape with a large batch: hundreds of GB per rank by the memory model
    cfg = make_config(None, {"n_layer": 48, "n_head": 25, "n_embd": 1600, "block_size": 1024,
                             "batch_size": 64, "device": "cpu", "nproc": 2,
                             "out_dir": str(nothing_spawned)})
    with pytest.raises(checks.LaunchConfigError, match=r"GB per rank \(launch.checks.estimate_bytes"):
        launch_training(cfg)


def test_the_memory_check_meets_the_gpu_measurement():
    """GPT-2 small (no biases, no dropout) at 12 x 1024 tokens in bf16 on a GPU: 11.24 GiB measured by
    max_memory_allocated on an H200 (benchmarks/RESULTS.md, issue 28). The check may count a little
    more (every gradient, which the peak's moment does not hold yet), never less."""
    from course_lib.trainer.config import make_config

    cfg = make_config(None, {"dataset": "shakespeare", "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024,
                             "batch_size": 12, "dropout": 0.0, "bias": False, "device": "cuda", "nproc": 1})
    assert 11.24 <= checks.estimate_bytes(cfg, 1, "bfloat16", "cuda") / 2**30 <= 1.1 * 11.24


def test_recomputation_is_named_and_counted_by_the_memory_check():
    """A run refused for memory fits with --recompute=full, which the refusal names: the check
    counts the config's recomputation (nothing spawned: check_memory is arithmetic)."""
    import psutil

    from course_lib.trainer.config import make_config

    shape = {"n_layer": 2, "n_head": 4, "n_embd": 256, "block_size": 512, "device": "cpu", "nproc": 1,
             "dataset": "shakespeare_char"}
    have = psutil.virtual_memory().total
    one, two = (checks.estimate_bytes(make_config(None, {**shape, "batch_size": b}), 1, "float32") for b in (1, 2))
    batch = int(1.5 * have / (two - one)) + 1  # activations grow with the batch: about 1.5x this machine's RAM
    big = make_config(None, {**shape, "batch_size": batch})
    with pytest.raises(checks.LaunchConfigError, match=r"recompute activations \(--recompute=full\)"):
        checks.check_memory(checks.TrainRequest(big, nnodes=1, device="cpu"))
    checks.check_memory(checks.TrainRequest(big.replace(recompute="full"), nnodes=1, device="cpu"))  # fits


def test_the_memory_estimate_follows_the_layout():
    """check_memory's estimate divides what tp, pp, cp and ep divide, counts the experts and the
    config's recomputation, and for a plain run is ZeRO's states + the trainer's step model's
    activations and loss gradients (analysis.memory.step_peak)."""
    from course_lib.analysis.memory import ModelShape, stage_states, step_peak
    from course_lib.analysis.moe_memory import MoEShape
    from course_lib.trainer.config import make_config

    base = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 8, "dataset": "shakespeare_char",
            "device": "cpu"}

    def need(world, dtype="float32", device="cpu", **fields):
        return checks.estimate_bytes(make_config(None, {**base, "nproc": world, **fields}), world, dtype, device)

    cfg = make_config(None, {**base, "nproc": 1})
    shape = ModelShape("c", 4, 4, 128, 64, 65, 8, bias=cfg.bias, dropout=cfg.dropout)

    def plain(dp=1, stage=0, dtype="float32", device="cpu", recompute="none", dropout=0.0):
        peak = step_peak(4, 4, 128, 64, 65, 8, dtype, device_type=device, dropout=dropout, bias=cfg.bias,
                         recompute=recompute)
        precision = "fp32" if dtype == "float32" else "mixed"
        return stage_states(shape, dp=dp, stage=stage, dtype=precision).total + peak.activations + peak.loss_grads

    assert need(1) == pytest.approx(plain())
    assert need(2, strategy="zero3") == pytest.approx(plain(dp=2, stage=3))
    assert need(1, "bfloat16", "cuda") == pytest.approx(plain(dtype="bfloat16", device="cuda"))
    for recompute in ("selective", "full"):  # Korthikanti et al. 2022, Table 2's rows
        assert need(1, recompute=recompute, dropout=0.1) == pytest.approx(plain(recompute=recompute, dropout=0.1))
    # with dropout a CPU's attention keeps its s x s scores; a GPU's fused attention never does
    assert need(1, recompute="full", dropout=0.1) < need(1, recompute="selective", dropout=0.1) < need(1, dropout=0.1)
    assert need(1, device="cuda", dropout=0.1) < need(1, dropout=0.1)
    ddp = need(2, strategy="ddp")
    assert need(2, tp=2) < 0.6 * ddp  # every matrix split in two, and the activations mostly
    assert need(2, tp=2, sequence_parallel=True) < need(2, tp=2)  # and the rest of the activations
    tp2 = step_peak(4, 4, 128, 64, 65, 8, "float32", device_type="cpu", bias=cfg.bias, tp=2)
    assert need(2, tp=2) == pytest.approx(  # with tp: the step model of one tp rank (Korthikanti's count over tp)
        stage_states(shape, dp=1, tp=2, dtype="fp32").total + tp2.activations + tp2.loss_grads)
    assert tp2.loss_grads == 8 * 64 * 8 * 65 / 2  # the vocabulary-parallel loss: 8 s b v / tp
    assert need(2, cp=2, strategy="ddp") < ddp  # half of every sequence
    assert need(2, pp=2, gradient_accumulation_steps=8) < ddp  # half of the layers
    assert need(2, pp=2, gradient_accumulation_steps=8, pp_schedule="afab") > need(2, pp=2, gradient_accumulation_steps=8)
    moe = {"n_expert": 8, "top_k": 2}
    import torch  # here: the rest of this file's tests run without torch or the model

    from course_lib.gpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, bias=cfg.bias, n_expert=8, top_k=2))
    params = sum(p.numel() for p in gpt.parameters())  # the tied head counted once
    kept = MoEShape.of_gpt(gpt.config).extra_activation_bytes(64, 8, 4)  # the second expert's MLP, the outputs
    assert kept > 0
    # fp32 Adam: 4 + 4 + 8 B per parameter more, and the experts' extra activations
    assert need(1, **moe) - need(1) == pytest.approx(16 * (params - shape.num_params()) + kept)
    assert need(2, ep=2, strategy="ddp", **moe) < need(2, strategy="ddp", **moe)  # four experts per rank
    assert need(2, strategy="zero3", **moe) > need(2, strategy="zero3") + 0.5 * (need(2, strategy="ddp", **moe) - ddp)


# ---------------------------------------------------------------- a machine with one GPU (Colab's T4)
# (where the ranks run on it: tests/test_placement.py)

# ---------------------------------------------------------------- diagnosis


def test_diagnose_error_texts():
    kind, hint = diagnose("RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                          "5000ms for recv operation to complete", "run", 5)
    assert kind == "collective_timeout" and "never joined" in hint and "5 s" in hint
    assert diagnose("DistStoreError: timed out", "init", 5)[1].startswith("init_process_group timed out")
    assert diagnose("RuntimeError: Connection closed by peer [127.0.0.1]:1", "run", 5)[0] == "peer_exited"
    assert diagnose("ValueError: bad", "run", 5) == ("error", "")


def _where_am_i(tmp_path):
    path = tmp_path / "dump.txt"
    with open(path, "w") as f:
        faulthandler.dump_traceback(f, all_threads=True)  # this line is what where() must find
    return path.read_text()


def test_where_reads_tracebacks_and_stack_dumps(tmp_path):
    try:
        json.loads("{")  # raises inside the json module (a library frame, not the user's)
    except ValueError:
        import traceback

        tb = traceback.format_exc()
    at = supervise.where(tb)
    assert at.startswith("test_launch_units.py:") and "json.loads" in at
    dump = _where_am_i(tmp_path)
    assert "most recent call first" in dump
    assert "faulthandler.dump_traceback" in supervise.where(dump)
    assert supervise.last_dump("noise\n" + dump) is not None and supervise.last_dump("noise") is None


def test_root_cause_beats_ranks_that_only_saw_it():
    killed = pick_failure({0: {"state": "failed", "exitcode": 1}, 1: {"state": "running"}},
                          {0: {"rank": 0, "type": "RuntimeError", "message": "Connection closed by peer",
                               "kind": "peer_exited", "time": 1.0}},
                          {0: 1, 1: -9})
    assert (killed.rank, killed.kind, killed.signal) == (1, "killed", "SIGKILL")
    timeout = pick_failure({0: {"state": "failed", "exitcode": 1}, 1: {"state": "running"}},
                           {0: {"rank": 0, "type": "RuntimeError", "message": "Timed out",
                                "kind": "collective_timeout", "time": 1.0}},
                           {0: 1, 1: -15})  # rank 1 was stopped by torchrun afterwards
    assert (timeout.rank, timeout.kind) == (0, "collective_timeout")
    assert pick_failure({0: {"state": "done", "exitcode": 0}}, {}, {}) is None


def test_parse_torchrun_failure_summary():
    text = ("Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-22_04:01:50\n"
            "  host      : localhost\n  rank      : 1 (local_rank: 1)\n"
            "  exitcode  : -9 (pid: 8100)\n  error_file: <N/A>\n")
    assert supervise.launcher_exit_codes(text, {}) == {1: -9}
    hydra = ("=   PID 77 RUNNING AT vm\n=   EXIT CODE: 9\n")
    assert supervise.launcher_exit_codes(hydra, {3: {"pid": 77}}) == {3: -9}


def test_find_by_env_sees_only_marked_processes():
    marker = uuid.uuid4().hex
    p = procs.spawn([PY, "-c", "import time; time.sleep(30)"], env={**os.environ, "COURSE_TEST_MARKER": marker})
    try:
        assert [q.pid for q in procs.find_by_env("COURSE_TEST_MARKER", marker)] == [p.pid]
    finally:
        procs.ProcessTree(p).terminate(grace=1)
    assert procs.find_by_env("COURSE_TEST_MARKER", marker) == []


@pytest.mark.timeout(30)
def test_terminate_reaches_workers_whose_parent_died():
    """The agent crashed and left a worker (own session, re-parented to init): still stopped."""
    child = ("import subprocess, sys\n"
             "g = subprocess.Popen([sys.executable, '-c', 'import time; print(1, flush=True); time.sleep(60)'],"
             " start_new_session=True, stdout=subprocess.PIPE)\n"
             "g.stdout.readline()\n"
             "print(g.pid, flush=True)\n"
             "import time; time.sleep(60)\n")  # until the test kills it
    p = procs.spawn([PY, "-c", child], stdout=subprocess.PIPE)
    gpid = int(p.stdout.readline())
    tree = procs.ProcessTree(p)  # sees the worker while its parent is alive
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert psutil.Process(gpid).is_running()
    assert tree.terminate(grace=10) == []  # SIGTERM sufficed: nobody needed SIGKILL
    assert _gone(gpid, 1.0)


def test_refuses_a_bad_grace_env_name_or_endpoint(nothing_spawned, script):
    """Each once got past the checks: the run directory was made (launch_training had cleared the
    old run), then a TypeError (grace), execve's "illegal environment variable name" or the
    rendezvous flags' ValueError came out of the launcher."""
    for bad in (None, "5", -1, math.inf):
        with pytest.raises(checks.LaunchConfigError, match="grace must be a number of seconds >= 0"):
            launch(script, nproc=1, grace=bad, run_dir=nothing_spawned)
    for env in ({"A=B": "1"}, {"": "1"}):
        with pytest.raises(checks.LaunchConfigError, match="env must be a dict of variable names"):
            launch(script, nproc=1, env=env, run_dir=nothing_spawned)
    for endpoint in ("node01", "node01:", "node01:99999", ""):
        with pytest.raises(checks.LaunchConfigError, match="rdzv_endpoint must be HOST:PORT"):
            launch(script, nproc=1, rdzv_endpoint=endpoint, rdzv_id="job-1", run_dir=nothing_spawned)


def test_mpirun_refuses_bad_options_before_anything_starts(nothing_spawned, script):
    """show_ranks, env and grace: checked as launch() checks them (a TypeError or AttributeError
    once came out of the launcher, after the run directory was made)."""
    from course_lib.launch.mpi import mpirun

    for kw, match in (({"show_ranks": 5}, "show_ranks must be"), ({"env": ["A=1"]}, "env must be a dict"),
                      ({"grace": None}, "grace must be")):
        with pytest.raises(checks.LaunchConfigError, match=match):
            mpirun(script, n=2, run_dir=nothing_spawned, **kw)


@pytest.mark.parametrize("flags,match", [(["--port", "99999"], "--port must be a port from 1 to 65535"),
                                         (["--port", "0"], "--port must be a port from 1 to 65535"),
                                         (["--cpus-per-node", "-3"], "--cpus-per-node must be >= 1"),
                                         (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1")])
def test_submit_refuses_numbers_the_job_would_fail_on(flags, match, capsys):
    """Written into the script as they were (--nproc-per-node 0 silently became the default), they
    failed only on the nodes, after the job had waited in the queue."""
    from course_lib.launch import cluster

    for scheduler in cluster.SCHEDULERS:
        assert cluster.cli(["--scheduler", scheduler, "--nodes", "1", "--gpus-per-node", "2", *flags,
                            "--dry-run"]) == 2
        assert f"course submit: {match}" in capsys.readouterr().err
