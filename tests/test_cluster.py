"""SLURM and PBS: allocations read from the environment, batch scripts as text, and the scripts
executed by bash with stand-ins for srun/scontrol/mpiexec/sbatch that record the arguments they
get (so quoting is checked the way the shell really does it)."""

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from course_lib.gpt.data import prepare
from course_lib.launch import cluster
from course_lib.launch.placement import Allocation, check_allocation, detect_allocation, expand_nodelist

TRAIN_ARGS = ["--max_iters=100", "--run_name=a b;c", "$HOME", "--strategy=zero2"]


def _recorder(folder, name, stdout=""):
    """An executable ``name`` that appends its argv as a JSON line to $RECORD and prints stdout."""
    path = folder / name
    path.write_text(textwrap.dedent(f'''\
        #!{sys.executable}
        import json, os, sys
        with open(os.environ["RECORD"], "a") as f:
            f.write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\\n")
        print({stdout!r})
    '''))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _scontrol(folder, hosts):
    path = folder / "scontrol"
    path.write_text("#!/bin/bash\n" + "".join(f"echo {h}\n" for h in hosts))
    path.chmod(0o755)


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("a[8-10]") == ["a8", "a9", "a10"]
    assert expand_nodelist("node5") == ["node5"]


def test_detect_slurm_and_pbs(tmp_path):
    slurm = detect_allocation({"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2",
                               "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_ON_NODE": "32",
                               "SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert slurm == Allocation("slurm", "77", 2, 4, 32, ("gpu07", "gpu08"))
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn1\ncn1\ncn2\ncn2\n")  # PBS lists a host once per MPI process
    pbs = detect_allocation({"PBS_JOBID": "9.pbs", "PBS_NODEFILE": str(nodefile), "NCPUS": "16"})
    assert pbs == Allocation("pbs", "9.pbs", 2, None, 16, ("cn1", "cn2"))
    assert detect_allocation({}) is None


def test_allocation_mismatch_says_what_to_change():
    alloc = Allocation("slurm", "77", 2, 4, 32, ("a", "b"))
    check_allocation(2, 4, True, alloc)
    check_allocation(1, 8, False, alloc)  # CPU ranks: the GPU count does not limit them
    with pytest.raises(ValueError, match=r"nnodes=3 but this SLURM job \(77\) has 2 node\(s\).*--nodes 3"):
        check_allocation(3, 4, True, alloc)
    with pytest.raises(ValueError, match=r"8 GPU ranks per node but this job has 4 GPU\(s\).*nproc=4"):
        check_allocation(2, 8, True, alloc)
    check_allocation(5, 5, True, None)  # outside a batch job nothing is checked


def test_slurm_script_text():
    text = cluster.slurm_script(2, 4, TRAIN_ARGS, cpus_per_node=32, partition="gpu", account="course",
                                time_limit="00:30:00", activate=None)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=32", "#SBATCH --time=00:30:00", "#SBATCH --partition=gpu",
                 "#SBATCH --account=course", "export OMP_NUM_THREADS=8"):
        assert line in text.splitlines()
    run = text.splitlines()[-1]
    # srun asks for the CPUs again: since Slurm 22.05 it does not inherit sbatch's --cpus-per-task
    assert run.startswith("srun --kill-on-bad-exit=1 --cpus-per-task=32 torchrun --nnodes=2 --nproc-per-node=4 "
                          "--rdzv-backend=c10d --rdzv-endpoint=\"$head_node:$rdzv_port\" "
                          "--rdzv-id=\"$SLURM_JOB_ID\" --rdzv-conf=join_timeout=300")
    # the batch log is a file: the trainer prints its step lines without a progress bar
    assert run.endswith("-m course_lib.trainer.loop --no-progress --max_iters=100 '--run_name=a b;c' '$HOME' "
                        "--strategy=zero2")
    assert "rdzv_port=$((29500 + SLURM_JOB_ID % 10000))" in text.splitlines()  # one port per job
    assert "rdzv_port=29511" in cluster.slurm_script(1, 1, port=29511, activate=None).splitlines()
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid bash


def test_pbs_script_text():
    text = cluster.pbs_script(3, 2, ["--max_iters=5"], cpus_per_node=24, partition="workq",
                              activate=None)
    lines = text.splitlines()
    assert "#PBS -l select=3:ncpus=24:mpiprocs=1:ngpus=2" in lines and "#PBS -q workq" in lines
    assert "#PBS -l place=scatter" in lines  # one chunk per host: two torchruns would share its GPUs
    assert "export OMP_NUM_THREADS=12" in lines  # 24 cpus, 2 ranks: not PBS's 24 threads for each
    assert "export OMP_NUM_THREADS=4" in cluster.pbs_script(1, 2, activate=None).splitlines()  # 4 per rank asked
    assert lines[-1].startswith('"$mpiexec_bin" -n 3 "${per_node[@]}" torchrun --nnodes=3 --nproc-per-node=2 ')
    assert "per_node=(-ppn 1)" in lines  # MPICH's spelling unless mpiexec --version says Open MPI
    assert '--rdzv-id="$PBS_JOBID"' in lines[-1]
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_cpu_nodes_and_bad_requests():
    text = cluster.slurm_script(2, 0, [], nproc_per_node=3, activate=None)
    assert "--gpus-per-node" not in text and "--nproc-per-node=3" in text
    for kwargs, msg in [({"nodes": 0, "gpus_per_node": 1}, "--nodes must be >= 1"),
                        ({"nodes": 1, "gpus_per_node": -1}, "--gpus-per-node must be >= 0"),
                        ({"nodes": 1, "gpus_per_node": 2, "nproc_per_node": 4}, "one rank per GPU"),
                        ({"nodes": 1, "gpus_per_node": 2, "job_name": "x; rm"}, "must be a name of letters"),
                        ({"nodes": 1, "gpus_per_node": 2, "partition": "gpu,"}, "names separated by commas"),
                        ({"nodes": 1, "gpus_per_node": 2, "time_limit": "soon"}, "HH:MM:SS")]:
        with pytest.raises(ValueError, match=msg):
            cluster.slurm_script(**kwargs)
    # what the schedulers take beyond one name: sbatch's list of partitions, qsub's queue@server
    assert "#SBATCH --partition=gpu,gpu2" in cluster.slurm_script(1, 1, partition="gpu,gpu2", activate=None)
    for queue in ("workq@pbs01", "@pbs01"):
        assert f"#PBS -q {queue}" in cluster.pbs_script(1, 1, partition=queue, activate=None).splitlines()
    with pytest.raises(ValueError, match="queue@server"):
        cluster.pbs_script(1, 1, partition="a@b@c", activate=None)


def test_slurm_script_runs_with_arguments_intact(tmp_path):
    """bash runs the script; srun (a recorder) must get torchrun's arguments exactly."""
    fake = tmp_path / "bin"
    fake.mkdir()
    _recorder(fake, "srun")
    _scontrol(fake, ["gpu07", "gpu08"])
    activate = tmp_path / "activate"
    activate.write_text("export ACTIVATED=1\n")
    script = tmp_path / "job.sbatch"
    script.write_text(cluster.slurm_script(2, 4, TRAIN_ARGS, activate=str(activate)))
    record = tmp_path / "calls.jsonl"
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", RECORD=str(record),
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu[07-08]", HOME="/home/student")
    subprocess.run(["bash", str(script)], env=env, check=True, cwd=tmp_path)
    (call,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert call == ["srun", "--kill-on-bad-exit=1", "torchrun", "--nnodes=2", "--nproc-per-node=4",
                    "--rdzv-backend=c10d", "--rdzv-endpoint=gpu07:33742", "--rdzv-id=4242",  # 29500 + 4242
                    "--rdzv-conf=join_timeout=300", "--max-restarts=0", "-m", "course_lib.trainer.loop",
                    "--no-progress", *TRAIN_ARGS]


def test_pbs_script_runs_with_arguments_intact(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    _recorder(fake, "mpiexec")
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn3\ncn3\ncn4\n")
    script = tmp_path / "job.pbs"
    script.write_text(cluster.pbs_script(2, 1, TRAIN_ARGS, activate=None))
    record = tmp_path / "calls.jsonl"
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", RECORD=str(record), PBS_JOBID="99.pbs",
               PBS_NODEFILE=str(nodefile), PBS_O_WORKDIR=str(tmp_path))
    subprocess.run(["bash", str(script)], env=env, check=True)
    version, call = [json.loads(line) for line in record.read_text().splitlines()]  # the stand-in: no Open MPI
    assert version == ["mpiexec", "--version"]
    assert call[:5] == ["mpiexec", "-n", "2", "-ppn", "1"] and call[5:7] == ["torchrun", "--nnodes=2"]
    assert "--rdzv-endpoint=cn3:29599" in call and "--rdzv-id=99.pbs" in call  # 29500 + 99
    assert call[-len(TRAIN_ARGS):] == TRAIN_ARGS


def test_submit_cli(tmp_path, monkeypatch, capsys):
    base = ["--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "4"]
    monkeypatch.setenv("COURSE_DATA_DIR", str(tmp_path / "data"))  # not prepared: fine for a script to copy
    assert cluster.cli([*base, "--dry-run", "--", "--max_iters=1", "--run_name=a b;c"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n#SBATCH --job-name=course-train\n")
    assert cluster.cli([*base, "--dry-run", "--", "--strategy=zero4"]) == 2
    assert "strategy must be one of" in capsys.readouterr().err
    assert cluster.cli([*base, "--dry-run", "--", "--max_iter=5"]) == 2  # every field is checked
    assert "max_iter" in capsys.readouterr().err
    assert cluster.cli([*base[:2], "--nodes", "0", "--gpus-per-node", "1", "--dry-run"]) == 2
    assert "--nodes must be >= 1" in capsys.readouterr().err

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no sbatch here
    out = tmp_path / "job.sbatch"
    assert cluster.cli([*base, "--output", str(out), "--", "--max_iters=1"]) == 1
    assert "sbatch was not found: this machine has no SLURM" in capsys.readouterr().err
    assert out.read_text().startswith("#!/bin/bash")

    fake = tmp_path / "bin"
    fake.mkdir()
    _recorder(fake, "sbatch", stdout="Submitted batch job 42")
    monkeypatch.setenv("PATH", str(fake))
    monkeypatch.setenv("RECORD", str(tmp_path / "calls.jsonl"))
    # submitting from here: the job would find no data, so nothing is submitted
    assert cluster.cli([*base, "--output", str(out), "--", "--max_iters=1"]) == 2
    assert "dataset 'shakespeare_char' is not prepared" in capsys.readouterr().err
    assert not (tmp_path / "calls.jsonl").exists()
    prepare("shakespeare_char", tmp_path / "data", quiet=True)
    assert cluster.cli([*base, "--output", str(out), "--", "--max_iters=1"]) == 0
    assert "Submitted batch job 42" in capsys.readouterr().out
    assert json.loads((tmp_path / "calls.jsonl").read_text()) == ["sbatch", str(out)]


def test_course_submit_is_registered():
    done = subprocess.run([sys.executable, "-m", "course_lib.cli", "submit", "--scheduler", "pbs",
                           "--nodes", "2", "--gpus-per-node", "1", "--dry-run"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.startswith("#!/bin/bash\n#PBS -N course-train\n")


def test_srun_launcher_starts_every_rank_itself(capsys):
    """--launcher srun (the labs' Fabric jobs): one task per rank, no torchrun, no rendezvous of ours."""
    text = cluster.slurm_script(2, 4, ["--out_dir=x"], target=["-m", "course_lib.experiments.frameworks_job"],
                                cpus_per_node=32, port=29501, launcher="srun", activate=None)
    assert "#SBATCH --ntasks-per-node=4" in text and "#SBATCH --cpus-per-task=8" in text
    assert "torchrun" not in text and "head_node" not in text and "export MASTER_PORT=29501" in text
    assert text.rstrip().splitlines()[-1] == ("srun --kill-on-bad-exit=1 --cpus-per-task=8 python -m "
                                              "course_lib.experiments.frameworks_job --out_dir=x")
    with pytest.raises(ValueError, match="launcher must be one of"):
        cluster.slurm_script(1, 1, launcher="mpirun", activate=None)
    base = ["--scheduler", "slurm", "--nodes", "1", "--gpus-per-node", "0", "--dry-run", "--launcher", "srun"]
    assert cluster.cli(base) == 2 and "--module" in capsys.readouterr().err  # the trainer expects torchrun
    assert cluster.cli(["--scheduler", "pbs", *base[2:], "--module", "m"]) == 2
    assert "SLURM's" in capsys.readouterr().err
    assert cluster.cli([*base, "--module", "course_lib.experiments.frameworks_job", "--", "--out_dir=y"]) == 0
    assert "python -m course_lib.experiments.frameworks_job --out_dir=y" in capsys.readouterr().out
