"""Where the ranks run: one decision (course_lib.launch.placement) for every entry point.

The machine's GPU count is an input, so a 1-GPU Colab and a 2-GPU node are tested here on CPU by
passing it (or by faking ``gpu_count`` where an entry point asks the machine); a refused launch
must start no process and create no run directory. The real launches at the end run on CPU.
"""

import io
import json

import pytest

from course_lib.hardware import BACKEND_ENV, RANK_DEVICES_ENV, gpu_count, planned_device, planned_gpu_share
from course_lib.launch import checks, placement, training
from course_lib.launch.api import launch
from course_lib.launch.placement import PlanError, plan_ranks
from course_lib.notebook import demo


def test_one_gpu_two_ranks_share_it_over_gloo():
    plan = plan_ranks(1, 2, recipe="shakespeare_char")
    assert plan.devices == ("cuda:0", "cuda:0") and plan.backend == "gloo" and plan.ranks_per_device == 2
    assert plan.line() == "plan: 2 ranks · cuda:0, cuda:0 (ranks share a GPU) · gloo · recipe shakespeare_char"
    assert plan.env() == {RANK_DEVICES_ENV: "cuda:0,cuda:0", BACKEND_ENV: "gloo"}
    assert plan.gpus_per_node == 1  # what a SLURM job must give: 1 GPU, not 2
    assert plan_ranks(1, "3", device="cuda").devices == ("cuda:0",) * 3  # explicit cuda: shared too
    with pytest.raises(PlanError, match=r"2 ranks on 1 GPU\(s\) here with NCCL: NCCL allows one rank per GPU. "
                                        r"Run one rank per GPU \(--nproc=1, NCCL\), or .*--backend=gloo.*--device=cpu"):
        plan_ranks(1, 2, backend="nccl")


def test_one_rank_per_gpu_is_nccl_and_cpu_is_gloo():
    plan = plan_ranks(2, "auto")
    assert plan.devices == ("cuda:0", "cuda:1") and plan.backend == "nccl"
    assert plan_ranks(4, 2, backend="gloo").backend == "gloo"  # asked for: kept
    assert plan_ranks(4, 3).devices == ("cuda:0", "cuda:1", "cuda:2")
    cpu = plan_ranks(0, "auto")
    assert cpu.devices == ("cpu", "cpu") and cpu.backend == "gloo"
    assert plan_ranks(8, 2, device="cpu").line() == "plan: 2 ranks · cpu, cpu · gloo"  # CPU ranks: only when asked
    assert plan_ranks(1, 1).line() == "plan: 1 rank · cuda:0 · nccl"
    assert (plan.gpus_per_node, cpu.gpus_per_node) == (2, 0)


def test_nodes_on_one_host_share_its_gpus():
    """Two torchrun agents on one GPU: NCCL would see the GPU twice ('NCCL invalid usage')."""
    plan = plan_ranks(1, 1, nnodes=2, same_host=True)
    assert plan.devices == ("cuda:0", "cuda:0") and plan.backend == "gloo" and plan.nproc == 1
    assert plan.line() == "plan: 2 ranks (2 nodes) · cuda:0, cuda:0 (ranks share a GPU) · gloo"
    assert plan_ranks(2, 1, nnodes=2, same_host=True).devices == ("cuda:0", "cuda:1")
    assert plan_ranks(2, 1, nnodes=2, same_host=True).backend == "nccl"
    with pytest.raises(PlanError, match=r"--nnodes=1 --nproc=1"):
        plan_ranks(1, 1, nnodes=2, same_host=True, backend="nccl")
    assert plan_ranks(1, 1, nnodes=2).devices == ("cuda:0",)  # real nodes: each has its own GPU


def test_bad_input_is_refused():
    for bad, match in [({"nproc": 0}, "nproc must be"), ({"nproc": "two"}, "nproc must be"),
                       ({"nproc": True}, "nproc must be"), ({"device": "tpu"}, "device must be"),
                       ({"backend": "mpi"}, "backend must be"), ({"device": "cpu", "backend": "nccl"}, "GPUs only")]:
        with pytest.raises(PlanError, match=match):
            plan_ranks(1, **{"nproc": 2, **bad})
    with pytest.raises(PlanError, match="has no GPU"):
        plan_ranks(0, 1, device="cuda")


def test_each_rank_reads_its_own_device():
    env = {RANK_DEVICES_ENV: "cuda:0,cuda:1,cuda:0,cuda:1", BACKEND_ENV: "nccl", "LOCAL_WORLD_SIZE": "2"}
    got = [planned_device({**env, "GROUP_RANK": str(g), "LOCAL_RANK": str(k)}) for g in (0, 1) for k in (0, 1)]
    assert got == [("cuda:0", "nccl"), ("cuda:1", "nccl"), ("cuda:0", "nccl"), ("cuda:1", "nccl")]
    one_node = {RANK_DEVICES_ENV: "cuda:0,cuda:0", BACKEND_ENV: "gloo", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "3"}
    assert planned_device({**one_node, "LOCAL_RANK": "1"}) == ("cuda:0", "gloo")
    assert planned_device({"LOCAL_RANK": "0"}) is None  # not started by the course's launcher
    # MFU's peak: the GPUs the run has (2 ranks on 1 GPU: half a GPU each), not one per rank
    assert planned_gpu_share(one_node) == 0.5 and planned_gpu_share(env) == 0.5
    assert planned_gpu_share({RANK_DEVICES_ENV: "cuda:0,cuda:1", BACKEND_ENV: "nccl"}) == 1.0
    assert planned_gpu_share({RANK_DEVICES_ENV: "cpu,cpu", BACKEND_ENV: "gloo"}) == planned_gpu_share({}) == 1.0


# ------------------------------------------------------------ the entry points, on a faked 1-GPU machine

@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(placement, "gpu_count", lambda: 1)


def test_launch_refuses_nccl_ranks_sharing_a_gpu(one_gpu, nothing_spawned, tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("print('hi')\n")
    with pytest.raises(placement.LaunchConfigError, match=r"Run one rank per GPU \(--nproc=1, NCCL\)"):
        launch(script, nproc=2, backend="nccl", run_dir=nothing_spawned)
    with pytest.raises(placement.LaunchConfigError, match="backend must be"):
        launch(script, nproc=2, backend="mpi", run_dir=nothing_spawned)


def test_course_train_on_one_gpu_keeps_the_gpu_recipe_on_the_gpu(one_gpu, monkeypatch, tmp_path):
    """``course train --config=shakespeare_char --nproc=2`` on one GPU: both ranks on cuda:0, gloo
    (before: 2 CPU ranks, silently). What reaches launch() is the plan check_request made."""
    from course_lib.gpt.data import prepare
    from course_lib.trainer.config import TrainConfig

    cpu = checks.detect("cpu")
    monkeypatch.setattr(checks, "detect", lambda device=None: cpu)  # no CUDA here to ask
    launched = {}

    def launch(target, args, spec):  # launch() after its checks: the spec's before_start writes the run directory
        spec.before_start()
        launched.update(vars(spec))
        return _Ok()

    monkeypatch.setattr(training, "launch", launch)
    prepare("shakespeare_char", data_dir=tmp_path / "data", quiet=True)
    code = training.cli(["--config=shakespeare_char", "--nproc=2", "--max_iters=2", "--dtype=float32",
                          f"--out_dir={tmp_path / 'run'}", f"--data_dir={tmp_path / 'data'}"])
    assert code == 0
    assert (launched["nproc"], launched["device"], launched["backend"]) == (2, "cuda", "gloo")
    assert launched["recipe"] == "shakespeare_char"
    assert TrainConfig.load(tmp_path / "run" / "config.json").device == "auto"  # the ranks follow the plan
    assert placement.plan(2, "cuda", "gloo", "shakespeare_char", same_host=True).devices == ("cuda:0", "cuda:0")


def test_pipeline_ranks_sharing_a_gpu_are_refused(one_gpu, monkeypatch, tmp_path):
    """pp and cp send activations point to point; gloo cannot send CUDA tensors."""
    from course_lib.trainer.config import make_config

    cpu = checks.detect("cpu")
    monkeypatch.setattr(checks, "detect", lambda device=None: cpu)
    cfg = make_config("shakespeare_char", {"nproc": 2, "pp": 2, "n_layer": 2, "dtype": "float32", "dropout": 0.0,
                                           "out_dir": str(tmp_path / "run")})
    with pytest.raises(placement.LaunchConfigError, match=r"gloo cannot do with CUDA tensors \(plan: 2 ranks · cuda:0, "
                                                       r"cuda:0 .*\); use one rank per GPU \(NCCL\) or --device=cpu"):
        checks.check_request(cfg)


def test_demo_on_one_gpu_picks_the_gpu_recipe_for_shared_ranks(one_gpu, monkeypatch, tmp_path):
    ran = {}

    def run_training(cfg, **kw):
        ran.update(cfg=cfg, **kw)
        raise demo.LaunchError("stop here")  # what matters is what the demo asked for

    monkeypatch.setattr(demo, "prepare", lambda *a, **k: None)
    monkeypatch.setattr(demo, "run_training", run_training)
    assert demo.main(["--nproc=2", f"--out_dir={tmp_path}"]) == 1
    assert ran["recipe"] == "shakespeare_char" and ran["cfg"].nproc == 2 and ran["cfg"].block_size == 256
    assert demo.main(["--nproc=2", f"--out_dir={tmp_path}", "--device=cpu"]) == 1
    assert ran["recipe"] == "shakespeare_char_cpu" and ran["cfg"].device == "cpu"


class _Ok:
    ok = True


# ------------------------------------------------------------ real launches on CPU: the line, the ranks' view

@pytest.mark.timeout(120)
def test_launch_prints_the_plan_once_and_ranks_see_it(tmp_path):
    script = tmp_path / "where.py"
    script.write_text("import json, os\n"
                      "print(json.dumps([str(DEVICE), dist.get_backend(), os.environ['COURSE_RANK_DEVICES']]))\n")
    err = io.StringIO()
    r = launch(script, nproc=2, device="cpu", init_process_group=True, run_dir=tmp_path / "run",
               show_ranks="all", out=io.StringIO(), err=err)
    assert r.ok, r.error
    assert err.getvalue().count("plan: ") == 1
    assert "[launch] plan: 2 ranks · cpu, cpu · gloo · recipe where.py\n" in err.getvalue()
    assert [json.loads(r.stdout[k]) for k in (0, 1)] == [["cpu", "gloo", "cpu,cpu"]] * 2


# ------------------------------------------------------------ on a GPU machine (skipped on CPU)


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_more_ranks_than_gpus_share_them_over_gloo(tmp_path):
    """One rank more than the GPUs: every rank on a GPU (the last one sharing), gloo all-reduces
    CUDA tensors, and the sum is what one process gets."""
    n = gpu_count() + 1
    script = tmp_path / "share.py"
    script.write_text("import json\nt = torch.full((4,), RANK + 1.0, device=DEVICE)\ndist.all_reduce(t)\n"
                      "print(json.dumps([str(DEVICE), str(t.device), dist.get_backend(), t[0].item()]))\n")
    err = io.StringIO()
    r = launch(script, nproc=n, init_process_group=True, run_dir=tmp_path / "run", show_ranks="all",
               out=io.StringIO(), err=err)
    assert r.ok, r.error
    total = n * (n + 1) / 2
    assert [json.loads(r.stdout[k]) for k in range(n)] == [
        [f"cuda:{k % (n - 1)}", f"cuda:{k % (n - 1)}", "gloo", total] for k in range(n)]
    assert "(ranks share a GPU) · gloo" in err.getvalue()


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_training_with_more_ranks_than_gpus_runs_on_the_gpu(tmp_path):
    from course_lib.gpt.data import prepare
    from course_lib.launch import launch_training
    from course_lib.trainer.config import make_config

    prepare("shakespeare_char", data_dir=tmp_path / "data", quiet=True)
    cfg = make_config("shakespeare_char", {"max_iters": 4, "log_interval": 1, "eval_interval": 4, "eval_iters": 1,
                                           "warmup_iters": 1, "lr_decay_iters": 4, "batch_size": 4, "block_size": 64,
                                           "n_layer": 2, "nproc": gpu_count() + 1, "out_dir": str(tmp_path / "run"),
                                           "data_dir": str(tmp_path / "data")})
    r = launch_training(cfg, progress=False, out=io.StringIO(), err=io.StringIO())
    assert r.ok, r.error
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["device"].startswith("cuda") and run["backend"] == "gloo" and run["world_size"] == gpu_count() + 1
    assert run["devices"] == pytest.approx(gpu_count())  # MFU over the GPUs' peak, not one per rank
