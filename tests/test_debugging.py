"""Seeded distributed bugs, caught and named, through a real Jupyter kernel as a student meets them.

One kernel, one pool of 2 gloo ranks with a 3 s cell limit (``%ranks``), then ``%%torchrun``
cells in the same kernel. Each bug is set up on purpose; the test asserts that it is named (the
rank and the operation, or the tensor that differs) within the cell limit plus 5 s, that the pool
is usable afterwards with any lost state stated, and, at the end, that no process is left.
Hangs: a skipped all-reduce, a barrier on one rank, both ranks receiving first, a rank raising
before a collective. Crashes: a rank's process exits; mismatched shapes with teaching mode off
(gloo aborts the process). Caught before the crash by teaching mode: shapes, dtypes, all-reduce
against broadcast, each rank its own root, an all-gather list and a reduce-scatter of the wrong
size, a send to a rank that does not exist. Silent (check_replicas): replicas that drift apart,
unsharded data, summed gradients, a parameter missing from the sync. A rank that ignores the
interrupt is killed and replaced. Through ``%%torchrun``: a shape mismatch (``--check``), what
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` names and what it does not (a broadcast's root), unsharded data.
Last, the trainer's ``check_collectives`` and ``check_replicas_every`` on real gloo ranks.
"""

from __future__ import annotations

import time
import uuid

import psutil
import pytest
from kernel_cells import left_behind, run, start_kernel

from course_lib.parallel.collective_check import CollectiveMismatchError
from course_lib.utils import without_hidden_tail

LIMIT = 3  # seconds a cell may run; the collective timeout is 2 s more (rank_pool.PG_MARGIN_S)
NAMED_WITHIN = LIMIT + 5  # the promise: named within the cell limit plus 5 s


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    km, kc = start_kernel(tmp_path_factory.mktemp("kernel"))
    run(kc, "%load_ext course_lib")
    start = run(kc, f"%ranks start 2 --timeout {LIMIT}", timeout=180)
    assert start.error is None, start.error
    # the variable usable() finds after each bug: made here, so that any test runs alone (pytest -k)
    assert run(kc, "%%ranks\nkeep = [1.0, 2.0]").error is None
    yield km, kc
    kc.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=True)


def bug(kc, code: str, ename: str, start_s: float = 0.0):
    """Run a buggy cell; it must fail with ``ename`` within NAMED_WITHIN seconds (plus ``start_s``,
    what starting the cell's processes takes on this machine); (message, cell)."""
    t0 = time.monotonic()
    cell = run(kc, code)
    took = time.monotonic() - t0
    assert cell.error is not None and cell.error["ename"] == ename, (cell.error, cell.stdout, cell.display_text)
    assert took < NAMED_WITHIN + start_s, f"named after {took:.1f} s (starting the ranks takes {start_s:.1f} s)"
    return cell.error["evalue"], cell


def usable(kc) -> None:
    """The pool still works: a collective on both ranks, and the variable made before the bugs."""
    cell = run(kc, "%%ranks\nok = torch.ones(1) * (RANK + 1)\ndist.all_reduce(ok)\nprint('usable', ok.item(), keep)")
    assert cell.error is None, (cell.error, cell.display_text)
    assert cell.display_text.count("usable 3.0 [1.0, 2.0]") == 2, cell.display_text


@pytest.mark.timeout(120)
def test_crashes_are_named_the_rank_restarted_and_lost_variables_stated(kernel):
    _, kc = kernel
    made = run(kc, "%%ranks\nkeep = [1.0, 2.0]\nmine = RANK")
    assert made.error is None and made.execution_count is not None
    msg, cell = bug(kc, "%%ranks\nimport os\nif RANK == 1:\n    os._exit(3)\nprint('alive', RANK)", "RankDiedError")
    assert "rank 1 DIED (exit code 3) while running the cell" in msg
    assert "rank 0: done (finished the cell)" in msg
    # the cell that made them, by the prompt the notebook shows (not IPython's count, one ahead while a cell runs)
    assert f"rank 1 LOST its variables keep (In [{made.execution_count}])" in msg, msg
    assert f"mine (In [{made.execution_count}])" in msg, msg
    assert "rank 1 · stopped (DIED, exit code 3)" in cell.display_text
    # the notebook shows the message alone, not a traceback through the magic and the pool
    assert cell.error["traceback"] == [f"RankDiedError: {msg}"], cell.error["traceback"]
    status = run(kc, "%ranks status").stdout
    assert "rank 0: pid" in status and "rank 1: pid" in status and "DEAD" not in status, status
    assert run(kc, "%%ranks 1\nkeep = [1.0, 2.0]").error is None  # what the message says to do
    usable(kc)


@pytest.mark.timeout(120)
def test_hangs_name_each_ranks_real_state(kernel):
    _, kc = kernel
    msg, _ = bug(kc, "%%ranks\nif RANK == 0:\n    dist.all_reduce(torch.ones(2))", "RankHangError")
    assert msg.startswith(f"the cell ran past {LIMIT} s and was stopped"), msg
    assert "rank 0: waiting in all_reduce" in msg and "rank 1: done (finished the cell)" in msg
    flight = run(kc, "%ranks flight").stdout  # the stopped call, as the flight recorder kept it
    assert "all_reduce float32[2] · interrupted (cell limit or Ctrl-C)" in flight, flight
    usable(kc)
    msg, _ = bug(kc, "%%ranks\nif RANK == 1:\n    dist.barrier()", "RankHangError")
    assert "rank 1: waiting in barrier" in msg and "rank 0: done" in msg
    usable(kc)
    msg, _ = bug(kc, "%%ranks\nt = torch.zeros(2)\ndist.recv(t, src=1 - RANK)\ndist.send(t, dst=1 - RANK)",
                 "RankHangError")
    assert "rank 0: waiting in recv (peer 1)" in msg and "rank 1: waiting in recv (peer 0)" in msg
    usable(kc)
    msg, _ = bug(kc, "%%ranks\nif RANK == 0:\n    raise ValueError('bad batch')\ndist.all_reduce(torch.ones(2))",
                 "RankHangError")
    assert "rank 0: error: ValueError: bad batch" in msg and "rank 1: waiting in all_reduce" in msg
    assert "finished" not in msg  # the old summary said the failing rank had finished the cell
    usable(kc)


@pytest.mark.timeout(120)
def test_a_rank_that_ignores_the_interrupt_is_killed_and_replaced(kernel):
    """Stuck where SIGINT cannot reach it (here: it ignores SIGINT): after the collective's timeout
    and a grace the pool kills it and starts it again, rather than giving up the pool."""
    _, kc = kernel
    t0 = time.monotonic()
    cell = run(kc, "%%ranks\nimport signal, time\nif RANK == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                   "    time.sleep(600)")
    took = time.monotonic() - t0
    assert cell.error is not None and cell.error["ename"] == "RankHangError", cell.error
    msg = cell.error["evalue"]
    assert "rank 1: running, not in a collective" in msg and "rank 0: done" in msg
    assert "rank 1 did not come back from the interrupt and was killed" in msg
    assert "rank(s) 1 started again" in msg and "rank 1 LOST its variables keep (In [" in msg
    assert took < LIMIT + 2 + 5 + 5 + 5, took  # limit, collective timeout, grace, kill and the spare
    run(kc, "%%ranks 1\nkeep = [1.0, 2.0]")
    usable(kc)


MISMATCHES = {  # teaching mode: named on every rank before gloo sees the call
    "dist.all_reduce(torch.ones(4 + RANK))":
        "rank 0: all_reduce float32[4]; rank 1: all_reduce float32[5]",
    "dist.all_reduce(torch.ones(4, dtype=torch.float32 if RANK == 0 else torch.float64))":
        "rank 0: all_reduce float32[4]; rank 1: all_reduce float64[4]",
    "dist.all_reduce(torch.ones(3)) if RANK == 0 else dist.broadcast(torch.ones(3), src=0)":
        "rank 0: all_reduce float32[3]; rank 1: broadcast float32[3] from 0",
    "dist.broadcast(torch.ones(3), src=RANK)":
        "rank 0: broadcast float32[3] from 0; rank 1: broadcast float32[3] from 1",
    "dist.all_gather([torch.zeros(2) for _ in range(3)], torch.ones(2))":
        "all_gather float32[2] list of 3: the list has 3 tensors, 2 ranks need 2",
    "dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(5))":
        "reduce_scatter_tensor float32[5]: input of 5 and output of 2 elements do not fit 2 ranks",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code", list(MISMATCHES))
def test_teaching_mode_names_a_mismatch_before_gloo_aborts(kernel, code):
    _, kc = kernel
    msg, cell = bug(kc, f"%%ranks\n{code}", "RankPoolError")
    assert msg.startswith("ranks 0, 1: CollectiveMismatchError: ") and MISMATCHES[code] in msg, msg  # on both
    # each rank's traceback names the notebook's cell (In [n]) and ends at its own line, not in the check
    assert cell.display_text.count(f"Cell In[{cell.execution_count}], line 1\n----> 1 {code}") == 2, cell.display_text
    assert "collective_check.py" not in cell.display_text, cell.display_text
    assert "DIED" not in msg and "the pool is still usable" in msg
    usable(kc)


@pytest.mark.timeout(60)
def test_a_send_to_a_rank_that_does_not_exist_is_refused_at_once(kernel):
    _, kc = kernel
    t0 = time.monotonic()
    msg, _ = bug(kc, "%%ranks\nif RANK == 0:\n    dist.send(torch.ones(2), dst=2)", "RankPoolError")
    assert "rank 0: CollectiveMismatchError: rank 0: send float32[2] to 2: there is no rank 2 (ranks are 0..1)" in msg
    assert time.monotonic() - t0 < LIMIT  # not waited out
    usable(kc)


@pytest.mark.timeout(120)
def test_without_teaching_mode_gloo_kills_the_rank_and_the_pool_survives(kernel):
    _, kc = kernel
    assert "teaching mode off" in run(kc, "%ranks teaching off").stdout
    try:
        msg, _ = bug(kc, "%%ranks\nkept = RANK\ndist.all_reduce(torch.ones(4 + RANK))", "RankDiedError")
    finally:  # the kernel is shared: a failure here must not leave the later tests without teaching mode
        run(kc, "%ranks teaching on")
        run(kc, "%%ranks\nkeep = [1.0, 2.0]")
    assert "DIED (signal SIGABRT)" in msg and "gloo::EnforceNotMet" in msg, msg  # gloo's abort, its last output
    assert "started again; the process group was made anew" in msg
    assert "LOST its variables" in msg and "keep (In [" in msg
    usable(kc)


SILENT = """%%ranks
import torch.nn as nn
torch.manual_seed({seed})
model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
g = torch.Generator().manual_seed({data_seed})
x = torch.randn(8, 4, generator=g)
model(x).pow(2).mean().backward()
from course_lib.parallel.replicas import local_grads
mine = local_grads(model)
for name, p in model.named_parameters():
    if name != {skip!r}:
        dist.all_reduce(p.grad)
        p.grad /= {divide}
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed, data_seed, skip, divide, named", [
    ("RANK", "RANK", "", "WORLD_SIZE", "parameter '0.weight' differs: rank 0 norm"),  # replicas drifted apart
    ("0", "0", "", "WORLD_SIZE", "batch: ranks 0, 1 read the SAME batch"),  # unsharded data
    ("0", "RANK", "", "1", "gradient '0.weight' (rank 0, 1) is the SUM of the ranks' gradients"),  # summed
    ("0", "RANK", "2.bias", "WORLD_SIZE", ("gradient '2.bias' (rank 0, 1) is this rank's own gradient: "
                                          "the parameter is missing from the gradient sync")),
])
def test_check_replicas_names_the_silent_bugs(kernel, seed, data_seed, skip, divide, named):
    _, kc = kernel
    assert run(kc, SILENT.format(seed=seed, data_seed=data_seed, skip=skip, divide=divide)).error is None
    t0 = time.monotonic()
    out = run(kc, "%ranks check_replicas model --batch x --local mine").stdout
    assert time.monotonic() - t0 < NAMED_WITHIN
    assert "replicas DIFFER" in out and named in out, out


@pytest.mark.timeout(60)
def test_the_flight_recorder_shows_each_ranks_last_collectives(kernel):
    _, kc = kernel
    run(kc, "%%ranks\nfor n in (1, 2):\n    dist.all_reduce(torch.ones(n))\nif RANK == 0:\n    dist.send(ok, dst=5)")
    table = run(kc, "%ranks flight").stdout
    lines = table.splitlines()
    assert lines[0].split() == ["call", "rank", "0", "rank", "1"], table
    assert "all_reduce float32[2] · done" in lines[-2] and lines[-2].count("done") == 2, table
    assert "send float32[1] to 5 · failed: CollectiveMismatchError" in lines[-1], table
    assert lines[-1].rstrip().endswith("-"), table  # rank 1 made no such call


MARK = "COURSE_TEST_DEBUGGING"


@pytest.mark.timeout(120)
def test_torchrun_cells_name_the_same_bugs(kernel):
    _, kc = kernel
    marker = uuid.uuid4().hex
    # a %%torchrun cell starts torchrun and its ranks first (each imports torch: seconds more on a GPU
    # machine, whose torch loads CUDA); the limit + 5 s is counted from there, so a correct cell's
    # whole time on this machine is added to it
    t0 = time.monotonic()
    ok = run(kc, f"%%torchrun -n 2 --check --timeout {LIMIT} --env {MARK}={marker}\ndist.all_reduce(torch.ones(4))\n")
    start_s = time.monotonic() - t0
    assert ok.error is None, ok.error
    msg, cell = bug(kc, f"%%torchrun -n 2 --check --timeout {LIMIT} --env {MARK}={marker}\n"
                        "dist.all_reduce(torch.ones(4 + RANK))\n", "LaunchError", start_s)
    assert "rank 0: all_reduce float32[4]; rank 1: all_reduce float32[5]" in msg + cell.stderr, (msg, cell.stderr)
    # PyTorch's own check (no --check): DETAIL names the shapes, but not a broadcast's root
    detail = run(kc, f"%%torchrun -n 2 --timeout {LIMIT} --env TORCH_DISTRIBUTED_DEBUG=DETAIL --env {MARK}={marker}\n"
                     "try:\n    dist.all_reduce(torch.ones(4 + RANK))\nexcept RuntimeError as e:\n"
                     "    print('DETAIL:', str(e).splitlines()[0][:120])\n"
                     "dist.broadcast(torch.ones(3), src=RANK)\n")
    assert "Detected mismatch between collectives on ranks" in detail.stdout, detail.stdout
    assert detail.error is not None and "CollectiveFingerPrint" not in detail.error["evalue"] + detail.stderr, detail.error
    msg, cell = bug(kc, f"%%torchrun -n 2 --check --timeout {LIMIT} --env {MARK}={marker}\n"
                        + SILENT.format(seed="0", data_seed="0", skip="", divide="WORLD_SIZE").split("\n", 1)[1]
                        + "from course_lib.parallel.replicas import check_replicas\n"
                          "check_replicas(model, batch=x, raise_error=True)\n", "LaunchError", start_s)
    assert "read the SAME batch" in msg + cell.stderr
    assert left_behind(MARK, marker) == []


@pytest.mark.timeout(120)
def test_no_process_is_left_behind(kernel):
    km, kc = kernel
    procs = psutil.Process(km.provisioner.process.pid).children(recursive=True)
    assert len(procs) >= 4  # the controller, two ranks and a spare (each under its parent), at least
    assert run(kc, "%ranks stop").stdout.strip() == "ranks stopped"
    _, alive = psutil.wait_procs(procs, timeout=15)
    assert [p.pid for p in alive] == []


def _hidden_raiser():
    __tracebackhide__ = True
    raise CollectiveMismatchError("collective #1 does not match", {0: "a", 1: "b"})


def _hidden_wrapper():
    __tracebackhide__ = True
    _hidden_raiser()


def _students_cell():
    _hidden_wrapper()  # the line a student wrote


def test_a_mismatchs_traceback_ends_at_the_students_call():
    try:
        _students_cell()
    except CollectiveMismatchError as e:
        err = e
    names = []
    tb = without_hidden_tail(err.__traceback__)
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert names == ["test_a_mismatchs_traceback_ends_at_the_students_call", "_students_cell"]
    text = "".join(err._render_traceback_())  # outside IPython: Python's own format of those frames
    assert "_hidden_wrapper()  # the line a student wrote" in text and "_hidden_raiser" not in text, text
    assert text.rstrip().endswith("CollectiveMismatchError: collective #1 does not match"), text
    assert without_hidden_tail(None) is None


# ------------------------------------------------------------------ the trainer's options

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 4, "max_iters": 4,
        "lr_decay_iters": 4, "warmup_iters": 1, "eval_interval": 4, "eval_iters": 1, "log_interval": 1,
        "dropout": 0.0, "dtype": "float32", "device": "cpu", "threads": 1, "strategy": "ddp"}


def trainer_checks_worker(rank: int, world_size: int, cfg: dict, stores: list[str]) -> tuple:
    import os

    import torch
    import torch.distributed as dist

    from course_lib.parallel.collective_check import CollectiveMismatchError
    from course_lib.parallel.replicas import ReplicaMismatchError
    from course_lib.trainer.config import TrainConfig
    from course_lib.trainer.loop import check_step_replicas, train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    if not dist.is_initialized():  # run_ranks made one; train() ends it
        dist.init_process_group("gloo", init_method=f"file://{stores[0]}", rank=rank, world_size=world_size)
    summary = train(TrainConfig.from_dict(cfg), progress=False)  # checks on: it must run through
    dist.init_process_group("gloo", init_method=f"file://{stores[1]}", rank=rank, world_size=world_size)
    try:
        dist.all_reduce(torch.ones(2 + rank))  # teaching mode is still installed in this process
        mismatch = ""
    except CollectiveMismatchError as e:
        mismatch = str(e)

    class Drifted:  # what check_step_replicas reads of a strategy
        name, group = "ddp", None
        module = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

    torch.manual_seed(rank)  # the seeded bug: every rank initialises its own replica
    Drifted.module.reset_parameters()
    try:
        check_step_replicas(Drifted, torch.arange(4) + 4 * rank, it=7)
        drift = ""
    except ReplicaMismatchError as e:
        drift = str(e)
    dist.destroy_process_group()
    return summary, mismatch, drift


@pytest.mark.timeout(240)
def test_the_trainer_checks_collectives_and_replicas_when_asked(tmp_path):
    from course_lib.gpt.data import prepare
    from course_lib.launch.spawn import run_ranks
    from course_lib.registry import ConfigError
    from course_lib.trainer.config import make_config

    with pytest.raises(ConfigError, match="check_replicas_every must be >= 0"):
        make_config("shakespeare_char_cpu", {"check_replicas_every": -1})
    with pytest.raises(ConfigError, match="shards the parameters"):
        make_config("shakespeare_char_cpu", {"check_replicas_every": 2, "strategy": "zero3", "nproc": 2})
    with pytest.raises(ConfigError, match="expected bool"):
        make_config("shakespeare_char_cpu", {"check_collectives": "yes"})
    prepare("shakespeare_char", tmp_path / "data", quiet=True)
    cfg = make_config("shakespeare_char_cpu", {**TINY, "data_dir": str(tmp_path / "data"), "out_dir": str(tmp_path / "run"),
                                               "check_collectives": True, "check_replicas_every": 2})
    results = run_ranks(trainer_checks_worker, 2, cfg.to_dict(), [str(tmp_path / "s0"), str(tmp_path / "s1")],
                        timeout=120)
    for _, mismatch, drift in results:
        assert "rank 0: all_reduce float32[2]; rank 1: all_reduce float32[3]" in mismatch
        assert drift.startswith("after step 7: replicas DIFFER") and "parameter 'weight' differs" in drift
    assert (tmp_path / "run" / "last.pt").exists()  # 4 steps, replicas compared after steps 2 and 4


def replica_check_worker(rank: int, world_size: int) -> dict:
    """Every data-parallel strategy after one step on this rank's own batch: what the trainer's
    replica check says of it (``ok`` or the error)."""
    import torch

    from course_lib import registry
    from course_lib.parallel.strategy import build_strategy
    from course_lib.parallel.toy import ToyMLP, adamw, toy_batch
    from course_lib.trainer.loop import check_step_replicas

    out = {}
    for name in registry.STRATEGIES:
        if name == "single":
            continue
        torch.manual_seed(0)
        strategy = build_strategy(name, ToyMLP(d_in=16, width=64, n_layers=2), adamw)
        x, y = toy_batch(8, seed=rank, d_in=16)
        strategy.model(x, y)[1].backward()
        strategy.finish_grads()
        strategy.step()
        try:
            check_step_replicas(strategy, x, it=0)
            out[name] = "ok"
        except (RuntimeError, TypeError) as e:  # what a run with --check_replicas_every stops on
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.timeout(120)
def test_the_replica_check_is_refused_exactly_where_the_parameters_are_shards():
    """``--check_replicas_every`` is accepted for a strategy only where the check works after a
    correct step (FSDP2's parameters are DTensor shards: before the refusal a run with
    fsdp_grad_op crashed in the check), and refused, before anything starts, where it cannot."""
    from course_lib.launch.spawn import run_ranks
    from course_lib.registry import ConfigError
    from course_lib.trainer.config import make_config

    checked = run_ranks(replica_check_worker, 2, timeout=100)
    for name, said in checked[0].items():
        try:
            make_config("shakespeare_char_cpu", {"check_replicas_every": 1, "strategy": name, "nproc": 2})
            accepted = True
        except ConfigError as e:
            assert "shards the parameters" in str(e)
            accepted = False
        assert accepted == (said == "ok") == (checked[1][name] == "ok"), (name, said)
    assert {n for n, said in checked[0].items() if said != "ok"} == {"zero3", "fsdp_grad_op", "fsdp_full"}
    assert checked[0]["fsdp_grad_op"].startswith("TypeError: parameter 'layers.0.weight' is a DTensor sharded")


# ------------------------------------------------------------------ what teaching mode and check_replicas allow

def uneven_all_to_all_worker(rank: int, world_size: int) -> dict:
    """Teaching mode on, then a valid all_to_all_single with uneven splits (exercise 09, lesson 13)
    and two that are wrong on one rank: its dtype, its dims after the first."""
    import torch
    import torch.distributed as dist

    from course_lib.parallel.collective_check import CollectiveMismatchError, install_collective_check

    install_collective_check(True, 20)
    sends = [[1, 2], [3, 1]]  # sends[i][j]: rows rank i sends to rank j
    send, recv = sends[rank], [s[rank] for s in sends]
    x = torch.arange(sum(send) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank  # [3, 2] | [4, 2]
    y = torch.empty(sum(recv), 2)  # [4, 2] | [3, 2]
    dist.all_to_all_single(y, x, recv, send)
    out = {"y": y.tolist()}
    for what, (dtype, width) in {"dtype": (torch.float64, 2), "dims": (torch.float32, 3)}.items():
        try:
            dist.all_to_all_single(torch.empty(sum(recv), width, dtype=dtype) if rank else y,
                                   x.to(dtype).repeat(1, 2)[:, :width] if rank else x, recv, send)
            out[what] = "ran"
        except CollectiveMismatchError as e:
            out[what] = str(e)
    return out


def test_teaching_mode_lets_an_uneven_all_to_all_single_through():
    from course_lib.launch.spawn import run_ranks

    results = run_ranks(uneven_all_to_all_worker, 2, timeout=20)
    rows = [[[2.0 * i + 100 * r, 2.0 * i + 1 + 100 * r] for i in range(n)] for r, n in enumerate((3, 4))]
    assert results[0]["y"] == rows[0][:1] + rows[1][:3]  # one row of its own, three of rank 1's
    assert results[1]["y"] == rows[0][1:] + rows[1][3:]
    for said in results:
        assert said["dtype"].endswith("rank 0: all_to_all_single float32[3, 2]; "
                                      "rank 1: all_to_all_single float64[4, 2]"), said
        assert said["dims"].endswith("rank 0: all_to_all_single float32[3, 2]; "
                                     "rank 1: all_to_all_single float32[4, 3]"), said


def scatter_gather_worker(rank: int, world_size: int) -> dict:
    """Teaching mode on: scatter and gather with the root passed by position, then a root's list
    of the wrong length."""
    import torch
    import torch.distributed as dist

    from course_lib.parallel.collective_check import CollectiveMismatchError, install_collective_check

    install_collective_check(True, 10)
    got = torch.empty(2)
    dist.scatter(got, [torch.full((2,), 1.0 + r) for r in range(world_size)] if rank == 0 else None, 0)
    gathered = [torch.empty(2) for _ in range(world_size)] if rank == 1 else None
    dist.gather(got * 10, gathered, 1)
    out = {"scattered": got.tolist(), "gathered": None if gathered is None else [g.tolist() for g in gathered]}
    try:
        dist.scatter(got, [got] if rank == 1 else None, 1)
        out["short"] = "ran"
    except CollectiveMismatchError as e:
        out["short"] = str(e)
    return out


def test_teaching_mode_reads_the_root_of_scatter_and_gather_by_position():
    from course_lib.launch.spawn import run_ranks

    results = run_ranks(scatter_gather_worker, 2, timeout=10)
    assert [r["scattered"] for r in results] == [[1.0, 1.0], [2.0, 2.0]]
    assert results[1]["gathered"] == [[10.0, 10.0], [20.0, 20.0]] and results[0]["gathered"] is None
    for said in results:  # named on both ranks, the root's list checked against the world size
        assert said["short"] == ("collective #3: rank 1: scatter float32[2] list of 1 from 1: "
                                 "the root's list has 1 tensors, 2 ranks need 2"), said


def branch_replicas_worker(rank: int, world_size: int) -> dict[str, str]:
    """A model whose layer ``b`` runs on rank 0 only (a data-dependent branch): check_replicas after
    the course's DDP, after a sum, after a sync that leaves ``c.weight`` out, and after syncs of
    ``b.weight``, the parameter only rank 0 used: left out (None on rank 1, or zeros where the sync
    filled missing gradients first), and averaged on rank 1 while rank 0 keeps its own (then on
    rank 0 its own gradient is also the sum, and nothing on rank 1 tells which: the report says both)."""
    import torch
    from torch import nn

    from course_lib.parallel.data.ddp import DataParallelNaive
    from course_lib.parallel.replicas import check_replicas, local_grads

    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x, use_b):
            h = self.a(x)
            return self.c(self.b(h) if use_b else h).sum()

    def batch(r):
        return torch.randn(3, 4, generator=torch.Generator().manual_seed(r))

    torch.manual_seed(0)
    reference = Branch()  # one process, both ranks' batches: the mean loss's gradients
    sum(reference(batch(r), use_b=r == 0) for r in range(world_size)).div(world_size).backward()
    said = {}
    for sync in ("ddp", "sum", "skip c.weight", "skip b.weight, none elsewhere", "skip b.weight, zeros elsewhere",
                 "rank 0 keeps b.weight"):
        torch.manual_seed(0)
        model = Branch()
        ddp = DataParallelNaive(model)
        ddp(batch(rank), use_b=rank == 0).backward()
        mine = local_grads(model)
        if sync == "ddp":
            ddp.finish_gradient_synchronization()
            for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert torch.allclose(p.grad, q.grad, atol=1e-6), n
        else:
            for n, p in model.named_parameters():
                if p.grad is None and sync.endswith("zeros elsewhere"):
                    p.grad = torch.zeros_like(p)
                if sync.startswith("skip") and n == sync.split()[1].rstrip(","):
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                synced = p.grad.clone()
                torch.distributed.all_reduce(synced)
                if sync == "rank 0 keeps b.weight" and rank == 0 and n == "b.weight":
                    continue  # rank 0 took part in the all-reduce, but kept its own gradient
                p.grad.copy_(synced / (1 if sync == "sum" else world_size))
        said[sync] = str(check_replicas(model, batch=batch(rank), local=mine))
    return said


def test_check_replicas_with_a_branch_taken_on_one_rank():
    """Also: on the rank that used it, a parameter's own gradient *is* the sum of the ranks' local
    gradients (the others' are zero); left out of the sync it was named a sum. The other ranks tell."""
    from course_lib.launch.spawn import run_ranks

    own = "is this rank's own gradient: the parameter is missing from the gradient sync"
    for rank, said in enumerate(run_ranks(branch_replicas_worker, 2, timeout=30)):
        ddp, summed, skipped = said["ddp"], said["sum"], said["skip c.weight"]
        assert ddp == "replicas agree on 2 ranks: 6 parameters, 6 gradients, 1 batch compared", ddp
        assert "gradient 'b.weight' (rank 0, 1) is the SUM of the ranks' gradients" in summed, summed
        assert "gradient 'c.bias' (rank 0, 1) is the SUM" in summed, summed
        assert "missing from the gradient sync" not in summed, summed
        assert "gradient 'c.weight' differs: rank 0 norm" in skipped, skipped
        assert f"gradient 'c.weight' (rank 0, 1) {own}" in skipped, skipped
        # rank 1 holds no gradient of b.weight: the sets differ, and rank 0's is its own, not a sum
        none = said["skip b.weight, none elsewhere"]
        assert "the ranks hold different sets of tensors" in none, (rank, none)
        assert f"gradient 'b.weight' (rank 0) {own}" in none and "SUM" not in none, (rank, none)
        # rank 1 holds zeros (its own): both ranks named, no sum anywhere
        zeros = said["skip b.weight, zeros elsewhere"]
        assert "gradient 'b.weight' differs: rank 0 norm" in zeros, (rank, zeros)
        assert f"gradient 'b.weight' (rank 0, 1) {own}" in zeros and "SUM" not in zeros, (rank, zeros)
        # rank 1 averaged, rank 0 kept its own: both bugs named, neither claimed
        kept = said["rank 0 keeps b.weight"]
        assert ("gradient 'b.weight' (rank 0) is both this rank's own gradient and the SUM of the ranks' "
                "gradients") in kept, (rank, kept)
        assert kept.count("gradient 'b.weight' (rank") == 1, (rank, kept)


# ------------------------------------------------------------------ all_to_all_single's split sizes, pair by pair

A2A_SPLITS = {  # (input_split_sizes, output_split_sizes) of rank 0, rank 1: each rank's own sizes add up
    # the pair 0 <-> 1 disagrees, each rank's own rows agree: gloo::EnforceNotMet aborts rank 1 (SIGABRT)
    "cross": (([1, 3], [1, 3]), ([2, 2], [2, 2])),
    # rank 0 sends itself 1 row and expects 2: gloo's enforce fails on rank 0, rank 1 sees "Connection closed"
    "self": (([1, 3], [2, 2]), ([2, 2], [2, 2])),
}


def a2a_split_mismatch_worker(rank: int, world_size: int) -> dict:
    """Teaching mode on: all_to_all_single calls whose split sizes are valid on each rank but
    disagree between ranks, one of each rank's own sizes that do not add up, then a correct one."""
    import torch
    import torch.distributed as dist

    from course_lib.parallel.collective_check import CollectiveMismatchError, install_collective_check

    install_collective_check(True, 20)
    out = {}
    for name, splits in A2A_SPLITS.items():
        send, recv = splits[rank]
        try:
            dist.all_to_all_single(torch.empty(sum(recv), 2), torch.zeros(sum(send), 2), recv, send)
            out[name] = "ran"
        except CollectiveMismatchError as e:
            out[name] = str(e)
    try:  # rank 1's input_split_sizes add up to 3, its input has 4 rows: torch raises on rank 1 only
        dist.all_to_all_single(torch.empty(3 if rank == 0 else 5, 2), torch.zeros(4, 2),
                               [1, 2] if rank == 0 else [3, 2], [1, 3] if rank == 0 else [2, 1])
        out["sum"] = "ran"
    except CollectiveMismatchError as e:
        out["sum"] = str(e)
    y = torch.empty(3 if rank == 0 else 5, 2)  # the group is still usable: the correct exchange
    dist.all_to_all_single(y, torch.full((4, 2), float(rank)), [1, 2] if rank == 0 else [3, 2],
                           [1, 3] if rank == 0 else [2, 2])
    out["y"] = y[:, 0].tolist()
    return out


def test_teaching_mode_names_all_to_all_split_sizes_that_disagree_between_ranks():
    from course_lib.launch.spawn import run_ranks

    results = run_ranks(a2a_split_mismatch_worker, 2, timeout=20)
    for said in results:  # named on both ranks, the pair and both numbers, before gloo sees the call
        assert said["cross"] == (
            "collective #1: the split sizes do not match across ranks: rank 0 sends 3 rows to rank 1 "
            "(input_split_sizes[1]) but rank 1 expects 2 from rank 0 (output_split_sizes[0]); rank 1 sends "
            "2 rows to rank 0 (input_split_sizes[0]) but rank 0 expects 3 from rank 1 (output_split_sizes[1])"), said
        assert said["self"] == (
            "collective #2: the split sizes do not match across ranks: rank 0 sends 1 row to itself "
            "(input_split_sizes[0]) but expects 2 (output_split_sizes[0]); rank 0 sends 3 rows to rank 1 "
            "(input_split_sizes[1]) but rank 1 expects 2 from rank 0 (output_split_sizes[0])"), said
        assert said["sum"] == ("collective #3: rank 1: all_to_all_single float32[4, 2]: input_split_sizes "
                               "[2, 1] add up to 3, the input has 4 rows"), said
    assert [said["y"] for said in results] == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0, 1.0]]


def expert_exchange_worker(rank: int, world_size: int) -> dict:
    """The course's expert-parallel exchange (parallel/expert: counts, then uneven rows there and
    back, and the backward's reversed splits) with teaching mode on and off, after a named mismatch."""
    import torch
    import torch.distributed as dist

    from course_lib.parallel.collective_check import (CollectiveMismatchError, install_collective_check,
                                                      set_collective_check)
    from course_lib.parallel.comms import Comms
    from course_lib.parallel.expert.comms import combine, dispatch

    install_collective_check(True, 20)
    out = {}
    try:  # the pair 0 <-> 1 disagrees: named, and the real collective is never called
        dist.all_to_all_single(torch.empty(4, 2), torch.zeros(4, 2), [1, 3] if rank == 0 else [2, 2],
                               [1, 3] if rank == 0 else [2, 2])
        out["bad"] = "ran"
    except CollectiveMismatchError as e:
        out["bad"] = str(e)
    comms = Comms()
    send_counts = torch.tensor([[1], [3]] if rank == 0 else [[2], [1]])  # rows for rank 0's, rank 1's expert
    for check in (True, False):
        set_collective_check(check)
        x = (torch.arange(int(send_counts.sum()) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
             ).requires_grad_()
        got, recv_counts = dispatch(x, send_counts, comms)
        back = combine(got * (2 + rank), send_counts, recv_counts, comms)
        back.sum().backward()
        out[check] = (got.tolist(), recv_counts.tolist(), back.tolist(), x.grad.tolist())
    return out


def test_teaching_mode_leaves_a_correct_uneven_expert_exchange_as_it_was():
    from course_lib.launch.spawn import run_ranks

    results = run_ranks(expert_exchange_worker, 2, timeout=20)
    for said in results:
        assert said["bad"].startswith("collective #1: the split sizes do not match across ranks: "), said["bad"]
        assert said[True] == said[False], said  # the same rows, counts, outputs and gradients unchecked
    rows = [[[2.0 * i + 100 * r, 2.0 * i + 1 + 100 * r] for i in range(n)] for r, n in enumerate((4, 3))]
    assert results[0][True][0] == rows[0][:1] + rows[1][:2]  # rank 0's expert: 1 row of its own, 2 of rank 1's
    assert results[1][True][0] == rows[0][1:] + rows[1][2:]
    assert results[0][True][1] == [[1], [2]] and results[1][True][1] == [[3], [1]]
    for r, to_rank0 in enumerate((1, 2)):  # back where they came from, times the factor of the expert's rank
        factor = [2.0] * to_rank0 + [3.0] * (len(rows[r]) - to_rank0)
        assert results[r][True][2] == [[f * v for v in row] for f, row in zip(factor, rows[r], strict=True)]
        assert results[r][True][3] == [[f, f] for f in factor]
