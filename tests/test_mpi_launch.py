"""mpirun() with the mpiexec that matches mpi4py's MPI library: MPICH (the PyPI wheel) and Open MPI.

An mpiexec of another MPI than the one mpi4py loads starts N processes that each are rank 0 of
1; the launcher must take the matching mpiexec, or refuse before anything starts. Open MPI is
Debian's ``openmpi-bin`` (``make test`` installs it when run as root); mpi4py's wheel loads it
when ``MPI4PY_LIBMPI`` names its library. As root, Open MPI refuses to start without its two
documented environment switches, which the launcher sets.
"""

import ctypes.util
import io
import os
import shutil
import stat

import pytest

from course_lib.launch import checks, mpi
from course_lib.launch.mpi import MPICH, OPEN_MPI, family, mpirun

OPEN_MPI_BANNER = "mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
CELL = "print(RANK, WORLD_SIZE, comm.allreduce(RANK + 1), flush=True)\ncomm.Barrier()\n"


def test_families_from_banners_and_library_versions():
    assert family("HYDRA build details:\n    Version: 5.0.2\n") == MPICH
    assert family("MPICH Version:      5.0.2\nMPICH Release date: ...") == MPICH
    assert family(OPEN_MPI_BANNER) == OPEN_MPI
    assert family("mpiexec (Open MPI) 5.0.3\n") == OPEN_MPI and family("prterun (PRRTE) 3.0.5 prte") == OPEN_MPI
    assert family("Open MPI v4.1.4, package: Debian OpenMPI") == OPEN_MPI
    assert family("Intel(R) MPI Library 2021.10 for Linux* OS") == MPICH
    assert family("something else") is None


def _fake_open_mpi(folder):
    """An ``mpiexec`` that says it is Open MPI (and would start copies of rank 0)."""
    folder.mkdir()
    fake = folder / "mpiexec"
    fake.write_text(f"#!/bin/sh\nprintf '{OPEN_MPI_BANNER}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


def test_a_foreign_mpiexec_first_on_path_is_passed_over(tmp_path, monkeypatch):
    fake = _fake_open_mpi(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    assert mpi.library_family()[0] == MPICH  # the mpich wheel, from the dev extras
    assert str(fake) in mpi.candidates()  # seen, and passed over
    mpiexec, fam = mpi.find_mpiexec()
    assert fam == MPICH and mpiexec != str(fake)


def test_only_a_foreign_mpiexec_is_refused_before_anything_starts(tmp_path, monkeypatch):
    fake = _fake_open_mpi(tmp_path / "bin")
    monkeypatch.setattr(mpi, "candidates", lambda: [str(fake)])
    script = tmp_path / "cell.py"
    script.write_text(CELL)
    with pytest.raises(checks.LaunchConfigError,
                       match=r"mpi4py loads MPICH \('MPICH Version.*'\) but no mpiexec of it was found, only: "
                             rf"{fake} \(Open MPI\)\. An mpiexec of another MPI would start copies of rank 0"):
        mpirun(script, n=2, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_mpich_wheel_ranks_are_distinct(tmp_path):
    script = tmp_path / "cell.py"
    script.write_text(CELL)
    r = mpirun(script, n=3, run_dir=tmp_path / "run", show_ranks="all", out=io.StringIO(), err=io.StringIO())
    assert r.ok, r.error
    assert r.stdout == {k: f"{k} 3 6\n" for k in range(3)}
    assert r.command[1:5] == ["-n", "3", "-launcher", "fork"]


def _open_mpi_library():
    if shutil.which("ompi_info") is None:
        return None
    name = ctypes.util.find_library("mpi")  # the system's libmpi (ldconfig), not the wheel's
    env = {**os.environ, "MPI4PY_LIBMPI": name or ""}
    return name if name and mpi.library_family(env)[0] == OPEN_MPI else None


OPEN_MPI_LIB = _open_mpi_library()
needs_open_mpi = pytest.mark.skipif(OPEN_MPI_LIB is None, reason=(
    "no Open MPI here (Debian's openmpi-bin: `make test` installs it when run as root; "
    "else sudo apt-get install openmpi-bin)"))


@needs_open_mpi
@pytest.mark.timeout(120)
def test_open_mpi_ranks_are_distinct_even_as_root(tmp_path):
    """mpi4py loads Open MPI's library: the launcher takes Open MPI's mpiexec (not the wheel's
    MPICH one, which comes first), lets it run as root, and ranks 0 and 1 meet."""
    script = tmp_path / "cell.py"
    script.write_text(CELL)
    r = mpirun(script, n=2, env={"MPI4PY_LIBMPI": OPEN_MPI_LIB}, run_dir=tmp_path / "run", show_ranks="all",
               out=io.StringIO(), err=io.StringIO())
    assert r.ok, r.error
    assert r.stdout == {0: "0 2 3\n", 1: "1 2 3\n"}  # not two copies of "0 1 1"
    assert mpi.launcher_family(r.command[0]) == OPEN_MPI and "--oversubscribe" in r.command


@needs_open_mpi
def test_open_mpi_library_with_only_the_mpich_mpiexec_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # only the venv's mpiexec (MPICH) is in reach
    with pytest.raises(checks.LaunchConfigError, match=r"mpi4py loads Open MPI .* install or load that MPI's mpiexec"):
        mpi.find_mpiexec({**os.environ, "MPI4PY_LIBMPI": OPEN_MPI_LIB})


def test_comm_bench_uses_the_matching_mpiexec_too(tmp_path, monkeypatch):
    from course_lib.experiments.comm_bench import run_benchmark

    fake = _fake_open_mpi(tmp_path / "bin")
    monkeypatch.setattr(mpi, "candidates", lambda: [str(fake)])
    with pytest.raises(ValueError, match="would start copies of rank 0"):
        run_benchmark("mpi", 2)
