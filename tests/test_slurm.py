"""``course submit --scheduler slurm`` on a real SLURM: munged, slurmctld and two slurmd on this
host (:mod:`course_lib.launch.slurm_local`), Debian's slurm-wlm 22.05 and munge (``make slurm-deps``).

Two jobs run side by side, 1 node x 2 ranks and 2 nodes x 1 rank; each must train under srun +
torchrun with the c10d rendezvous and log the same losses as ``course train --nproc=2`` of the same
config on this host (one thread per rank, so the arithmetic is the same). ``sbatch --test-only``
checks the #SBATCH lines against the cluster without running anything.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from course_lib.gpt.data import prepare
from course_lib.launch import cluster, slurm_local
from course_lib.launch.procs import pid_alive
from course_lib.trainer.metrics import read_metrics
from course_lib.utils import free_port

pytestmark = [
    pytest.mark.slow,  # a cluster and three training runs: ~30 s
    pytest.mark.skipif(bool(slurm_local.missing_programs()),
                       reason=f"SLURM not installed ({', '.join(slurm_local.missing_programs())} missing): "
                              "make slurm-deps (as root) installs Debian's slurm-wlm and munge"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the local SLURM runs its daemons as root (SlurmUser=root)"),
]

TINY = ["--config=shakespeare_char_cpu", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32",
        "--max_iters=4", "--lr_decay_iters=4", "--warmup_iters=1", "--eval_interval=2", "--eval_iters=2",
        "--log_interval=1", "--threads=1"]
LAYOUTS = {"1x2": (1, 2), "2x1": (2, 1)}  # nodes x ranks per node


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running 2-node cluster; every daemon is stopped by pid afterwards."""
    c = slurm_local.start(tmp_path_factory.mktemp("slurm"))
    yield c
    pids = list(c.pids.values())
    c.stop()
    assert not any(pid_alive(pid) for pid in pids)


def _submit(slurm, cwd, argv):
    # torchrun logs its rendezvous (LOGLEVEL); the job's TMPDIR is the test's, so the folder torchrun
    # makes there for its agent's logs (torchelastic_*, no --log-dir in the script) goes with the test
    tmp = cwd / "job_tmp"
    tmp.mkdir(exist_ok=True)
    env = slurm.env({**os.environ, "LOGLEVEL": "INFO", "TMPDIR": str(tmp)})
    return subprocess.run([sys.executable, "-m", "course_lib.cli", "submit", "--scheduler", "slurm", *argv],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def runs(slurm, tmp_path_factory):
    """Both SLURM jobs submitted, the local reference trained while they run, then both awaited."""
    root = tmp_path_factory.mktemp("runs")
    data = root / "data"
    prepare("shakespeare_char", data, quiet=True)
    jobs = {}
    for name, (nodes, nproc) in LAYOUTS.items():
        done = _submit(slurm, root, ["--nodes", str(nodes), "--gpus-per-node", "0", "--nproc-per-node", str(nproc),
                                     "--port", str(free_port()), "--time", "00:05:00", "--job-name", f"job{name}",
                                     "--output", str(root / f"{name}.sbatch"), "--",
                                     *TINY, f"--data_dir={data}", f"--out_dir={root / name}"])
        assert done.returncode == 0, done.stderr
        jobs[name] = re.search(r"Submitted batch job (\d+)", done.stdout).group(1)
    local = subprocess.run([sys.executable, "-m", "course_lib.cli", "train", *TINY, "--nproc=2", "--no-progress",
                            f"--data_dir={data}", f"--out_dir={root / 'local'}"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert local.returncode == 0, local.stderr
    states = {name: slurm.wait_job(job, timeout=120) for name, job in jobs.items()}
    return root, jobs, states


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_submitted_job_trains_like_a_local_run(runs, layout):
    root, jobs, states = runs
    nodes, nproc = LAYOUTS[layout]
    job = jobs[layout]
    log = (root / f"job{layout}-{job}.out").read_text()  # the script's --output=%x-%j.out, in the submit folder
    assert states[layout] == ("COMPLETED", "0:0"), log[-3000:]

    # srun started one torchrun per node, which met in a c10d rendezvous named after the job
    script = (root / f"{layout}.sbatch").read_text()
    assert re.search(rf"^srun .*torchrun --nnodes={nodes} --nproc-per-node={nproc} --rdzv-backend=c10d",
                     script, re.MULTILINE)
    assert len(re.findall(r"rdzv_backend\s*:\s*c10d", log)) == nodes
    assert len(re.findall(rf"run_id\s*:\s*{job}\b", log)) == nodes
    launcher = json.loads((root / layout / "run.json").read_text())["launcher"]
    assert launcher["slurm_job_id"] == launcher["torchrun_run_id"] == job
    assert "slurm_step_id" in launcher  # inside an srun step, not the batch script itself
    assert launcher["torchrun_agents"] == str(nodes)
    assert len(launcher["slurm_step_nodes"].split(",")) == nodes

    # the same losses as `course train --nproc=2` on this host
    got, ref = (read_metrics(root / d / "metrics.csv") for d in (layout, "local"))
    assert [r["iter"] for r in got] == [r["iter"] for r in ref] == list(range(5))
    for key in ("train_loss", "val_loss", "eval_train_loss", "grad_norm"):
        assert [r[key] for r in got] == [r[key] for r in ref], key


def test_sbatch_test_only_checks_the_directives(slurm, tmp_path):
    """``sbatch --test-only`` validates a script's #SBATCH lines against the cluster, running nothing."""
    def test_only(text):
        path = tmp_path / "job.sbatch"
        path.write_text(text)
        done = subprocess.run(["sbatch", "--test-only", str(path)], env=slurm.env(), cwd=tmp_path,
                              capture_output=True, text=True, timeout=30, check=False)
        return done.returncode, done.stdout + done.stderr

    rc, out = test_only(cluster.slurm_script(2, 0, ["--max_iters=1"], nproc_per_node=2, cpus_per_node=2,
                                             partition="debug", time_limit="00:10:00", activate=None))
    assert rc == 0 and re.search(r"Job \d+ to start at", out), out
    rc, out = test_only(cluster.slurm_script(3, 0, [], activate=None))  # the cluster has 2 nodes
    assert rc != 0 and "node configuration is not available" in out, out
    rc, out = test_only(cluster.slurm_script(1, 0, [], partition="gpu", activate=None))
    assert rc != 0 and "invalid partition" in out.lower(), out
    rc, out = test_only(cluster.slurm_script(1, 1, [], activate=None))  # no GPUs (gres) on these nodes
    assert rc != 0 and "Invalid generic resource (gres) specification" in out, out


def test_daemons_left_by_a_killed_starter_are_stopped(tmp_path):
    """The starter exits without stopping its cluster; ``--stop`` finds the daemons by their pids."""
    root = tmp_path / "cluster"
    subprocess.run([sys.executable, "-c", f"from course_lib.launch import slurm_local; slurm_local.start({str(root)!r})"],
                   check=True, timeout=60)
    pids = [int(line.split()[1]) for line in (root / "pids").read_text().splitlines()]
    assert len(pids) == 4 and all(pid_alive(pid) for pid in pids)  # munged, slurmctld, 2 slurmd
    done = subprocess.run([sys.executable, "-m", "course_lib.launch.slurm_local", "--stop", "--dir", str(root)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and f"stopped pids {sorted(pids)}" in done.stdout, done.stderr
    assert not any(pid_alive(pid) for pid in pids)
    (root / "pids").write_text(f"pytest {os.getpid()}\n")  # a pid that is no longer a daemon of this cluster
    assert slurm_local.stop_leftovers(root) == []


@pytest.fixture(scope="module")
def fabric_runs(slurm, tmp_path_factory):
    """The labs' job: `course submit --launcher srun` runs Lightning Fabric, one srun task per rank."""
    pytest.importorskip("lightning", reason="the frameworks extra: pip install 'course-lib[frameworks]'")
    root = tmp_path_factory.mktemp("fabric")
    data = prepare("shakespeare_char", root / "data", quiet=True).parent
    jobs = {}
    for name, (nodes, nproc) in LAYOUTS.items():
        done = _submit(slurm, root, ["--nodes", str(nodes), "--gpus-per-node", "0", "--nproc-per-node", str(nproc),
                                     "--launcher", "srun", "--module", "course_lib.experiments.frameworks_job",
                                     "--port", str(free_port()), "--time", "00:05:00", "--job-name", f"fabric{name}",
                                     "--output", str(root / f"{name}.sbatch"), "--",
                                     f"--data_dir={data}", f"--out_dir={root / name}", "--max_iters=4"])
        assert done.returncode == 0, done.stderr
        jobs[name] = re.search(r"Submitted batch job (\d+)", done.stdout).group(1)
    states = {name: slurm.wait_job(job, timeout=180) for name, job in jobs.items()}
    return root, data, jobs, states


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fabric_job_under_srun_finds_its_ranks_and_trains_like_one_process(fabric_runs, layout):
    from course_lib.experiments.frameworks_gpt import SMALL, one_process

    root, data, jobs, states = fabric_runs
    nodes, nproc = LAYOUTS[layout]
    job = jobs[layout]
    log = (root / f"fabric{layout}-{job}.out").read_text()
    assert states[layout] == ("COMPLETED", "0:0"), log[-3000:]
    script = (root / f"{layout}.sbatch").read_text()
    assert f"#SBATCH --ntasks-per-node={nproc}" in script and "torchrun" not in script
    assert re.search(r"^srun .*python -m course_lib.experiments.frameworks_job", script, re.MULTILINE)
    report = json.loads((root / layout / "fabric_run.json").read_text())
    assert report["cluster_environment"] == "SLURMEnvironment"  # Fabric read SLURM's variables
    assert report["slurm_job_id"] == job and report["world_size"] == 2 and report["num_nodes"] == nodes
    assert [r["slurm_procid"] for r in report["ranks"]] == ["0", "1"]
    assert sorted({r["slurm_nodeid"] for r in report["ranks"]}) == [str(n) for n in range(nodes)]
    ref = one_process(data, SMALL, 4, 4, 2, 1e-3, 0)  # 4 steps, 4 rows per rank, 2 ranks
    assert report["losses"] == pytest.approx(ref, rel=1e-5)
