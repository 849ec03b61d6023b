"""Cluster launching as a real cluster would run it: MPI ranks under the rank variables a batch
system leaves in a notebook's environment, and PBS jobs run with the environment PBS gives them."""

import io
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
from test_mpi_launch import OPEN_MPI_LIB, needs_open_mpi

from course_lib.launch import cluster
from course_lib.launch.mpi import mpirun


@needs_open_mpi  # the one rule: `make test` installs Open MPI as root (Makefile: mpi-deps)
@pytest.mark.timeout(120)
def test_open_mpi_ranks_are_distinct_under_srun_pmi2(tmp_path, monkeypatch):
    """A Jupyter server started by ``srun`` (batchspawner) on a cluster whose MpiDefault is pmi2 has
    PMI_RANK=0 and PMI_SIZE=1 (Slurm's mpi/pmi2 plugin sets them for every task). Open MPI's ranks do
    not overwrite them (they get OMPI_COMM_WORLD_*), and the bootstrap reads PMI_RANK first."""
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "1")
    monkeypatch.setenv("MPI_LOCALRANKID", "0")  # Hydra's local rank, left by an MPICH-started kernel
    script = tmp_path / "cell.py"
    script.write_text("print(RANK, WORLD_SIZE, LOCAL_RANK, comm.allreduce(RANK + 1), flush=True)\n"
                      "comm.Barrier()\n")
    r = mpirun(script, n=2, env={"MPI4PY_LIBMPI": OPEN_MPI_LIB}, run_dir=tmp_path / "run", timeout=90,
               show_ranks="all", out=io.StringIO(), err=io.StringIO())
    assert r.ok, r.error
    assert r.stdout == {0: "0 2 0 3\n", 1: "1 2 1 3\n"}  # not rank 0 of 1, twice, in one log file


@pytest.mark.timeout(60)
def test_pbs_job_sees_the_data_dir_the_submit_checked(tmp_path, monkeypatch):
    """qsub gives the job only PBS_O_HOME, PBS_O_PATH, ... and PBS_O_WORKDIR of its own environment
    (POSIX qsub, https://pubs.opengroup.org/onlinepubs/9699919799/utilities/qsub.html; everything
    else needs -V or -v). ``course submit`` checked the dataset under COURSE_DATA_DIR: the job must
    look there too, not in the repository's data/."""
    data = tmp_path / "scratch data"
    monkeypatch.setenv("COURSE_DATA_DIR", str(data))
    fake = tmp_path / "bin"
    fake.mkdir()
    mpiexec = fake / "mpiexec"  # records what the ranks would see
    mpiexec.write_text(textwrap.dedent(f'''\
        #!{sys.executable}
        import json, os
        with open({str(tmp_path / "seen.json")!r}, "w") as f:
            json.dump(os.environ.get("COURSE_DATA_DIR"), f)
    '''))
    mpiexec.chmod(mpiexec.stat().st_mode | stat.S_IEXEC)
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn1\ncn2\n")
    script = tmp_path / "job.pbs"
    script.write_text(cluster.pbs_script(2, 1, ["--max_iters=5"], activate=None))
    # what PBS starts the script with: its own variables, none of the submitter's
    job_env = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path), "PBS_JOBID": "7.pbs",
               "PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(tmp_path)}
    subprocess.run(["bash", str(script)], env=job_env, check=True, timeout=30)
    assert json.loads((tmp_path / "seen.json").read_text()) == str(data)


@pytest.mark.timeout(30)
def test_pbs_walltime_means_what_sbatch_reads_in_the_same_time():
    """``--time`` is checked in SLURM's forms (sbatch(1) --time: minutes, minutes:seconds,
    hours:minutes:seconds, days-hours[:minutes[:seconds]]). PBS's walltime is
    [[hours:]minutes:]seconds (PBS Professional Reference Guide, "Duration"): qsub refuses a day
    count, and a bare 30 is 30 seconds there, not sbatch's 30 minutes."""
    def walltime(time_limit):
        text = cluster.pbs_script(1, 1, time_limit=time_limit, activate=None)
        (line,) = [x for x in text.splitlines() if x.startswith("#PBS -l walltime=")]
        return line.removeprefix("#PBS -l walltime=")

    assert walltime("01:00:00") == "01:00:00"
    assert walltime("1-12:00:00") == "36:00:00" and walltime("2-6") == "54:00:00"
    assert walltime("30") == "00:30:00" and walltime("90:30") == "01:30:30"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", [pytest.param("Open MPI", marks=needs_open_mpi), "MPICH"])
def test_pbs_job_starts_one_torchrun_per_node_with_open_mpi_and_mpich(tmp_path, family):
    """The PBS script said ``mpiexec -n N -ppn 1``: Open MPI's mpiexec has no -ppn ("unknown option"),
    so the job died at once on a site whose MPI is Open MPI. Run with each real mpiexec on one node
    (this host), a stand-in torchrun recording its rank and arguments."""
    fake = tmp_path / "bin"
    fake.mkdir()
    venv_bin = os.path.dirname(sys.executable)  # the mpich wheel's Hydra
    real = shutil.which("mpiexec.openmpi") if family == "Open MPI" else os.path.join(venv_bin, "mpiexec")
    (fake / "mpiexec").symlink_to(real)
    if family == "MPICH":  # Hydra starts its proxy from beside the path it was called by
        (fake / "hydra_pmi_proxy").symlink_to(os.path.join(os.path.dirname(real), "hydra_pmi_proxy"))
    record = tmp_path / "calls.jsonl"
    torchrun = fake / "torchrun"
    torchrun.write_text(textwrap.dedent(f'''\
        #!{sys.executable}
        import json, os, sys
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK"))
        with open({str(record)!r}, "a") as f:
            f.write(json.dumps([rank] + sys.argv[1:]) + "\\n")
    '''))
    torchrun.chmod(torchrun.stat().st_mode | stat.S_IEXEC)
    nodefile = tmp_path / "nodes"
    nodefile.write_text(f"{os.uname().nodename}\n")
    script = tmp_path / "job.pbs"
    script.write_text(cluster.pbs_script(1, 1, ["--max_iters=5"], activate=None))
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", PBS_JOBID="99.pbs", PBS_NODEFILE=str(nodefile),
               PBS_O_WORKDIR=str(tmp_path), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK"):
        env.pop(name, None)
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (call,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert call[0] == "0" and call[1:3] == ["--nnodes=1", "--nproc-per-node=1"], call
    assert call[-1] == "--max_iters=5"
