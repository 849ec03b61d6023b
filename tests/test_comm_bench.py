"""The collectives benchmark on real processes: 2 gloo ranks and 3 mpiexec ranks, tiny sizes.

Bandwidth definitions from nccl-tests, doc/PERFORMANCE.md: algbw = S / t; busbw = algbw x
2(n-1)/n (all_reduce), (n-1)/n (reduce_scatter, all_gather), 1 (broadcast, reduce); S is the
whole array for reduce_scatter and all_gather ("recvcount*sizeof(datatype)*n").
"""

import csv
import json

import pytest

from course_lib.analysis.comm_cost import OPS, busbw_factor, bytes_per_rank
from course_lib.experiments import comm_bench
from course_lib.experiments.comm_bench import parse_size, parse_sizes, run_benchmark
from course_lib.experiments.comm_bench_workers import bench_plan, expected, make_row
from course_lib.hardware import gpu_count


def test_sizes():
    assert parse_size("1K") == 1024 and parse_size("256M") == 256 * 2**20 and parse_size(64) == 64
    assert parse_size("1.5KiB") == 1536 and parse_size("2 mib") == 2 * 2**20
    with pytest.raises(ValueError, match="the course's MB is 1e6 bytes; write 1M or 1MiB"):
        parse_size("1MB")  # binary or decimal? neither guessed
    full = parse_sizes("1K:256M")  # the default range, factor 2: 2^10 ... 2^28
    assert full[0] == 2**10 and full[-1] == 2**28 and len(full) == 19
    assert parse_sizes("1K:256M", factor=4) == [2**k for k in range(10, 29, 2)]
    assert parse_sizes("1K, 1M") == [1024, 2**20]
    for bad in ("lots", "0", "-1K"):
        with pytest.raises(ValueError, match="bad size"):
            parse_size(bad)
    with pytest.raises(ValueError, match="goes down"):
        parse_sizes("1M:1K")


def test_sizes_are_rounded_to_whole_elements_per_rank():
    assert bench_plan(["all_reduce"], [1023, 1024], 3) == [("all_reduce", 1020), ("all_reduce", 1024)]
    assert bench_plan(["all_gather", "reduce_scatter"], [1024], 3) == [("all_gather", 1020),
                                                                       ("reduce_scatter", 1020)]
    assert bench_plan(["broadcast", "all_gather"], [1], 3) == [("broadcast", 4), ("all_gather", 12)]


def test_expected_results_and_row_arithmetic():
    assert expected("all_reduce", 2, 3) == 6 and expected("reduce_scatter", 0, 4) == 10
    assert expected("broadcast", 1, 3) == 1 and expected("reduce", 1, 3) is None
    assert expected("all_gather", 0, 3) == [1.0, 2.0, 3.0]
    row = make_row("gloo", "all_reduce", 4, 2**20, 1e-3, 10, 2**20, 2**20, True)
    assert row["algbw_GBps"] == pytest.approx(2**20 / 1e-3 / 1e9)
    assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * 3 / 4)
    assert row["time_us"] == pytest.approx(1000) and row["count"] == 2**18
    assert row["model_bytes_per_rank"] == pytest.approx(2 * 3 / 4 * 2**20)


def test_bad_configurations_fail_before_starting_processes(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        run_benchmark("ucc", 2)
    with pytest.raises(ValueError, match="nproc"):
        run_benchmark("gloo", 0)
    with pytest.raises(ValueError, match="unknown collective"):
        run_benchmark("gloo", 2, ops=["all_to_all"])
    with pytest.raises(ValueError, match="iters"):
        run_benchmark("gloo", 2, iters=0)
    with pytest.raises(ValueError, match="GiB"):
        run_benchmark("gloo", 2, sizes=["64G"])
    import torch

    with pytest.raises(ValueError, match="NCCL needs one GPU per rank"):
        run_benchmark("nccl", torch.cuda.device_count() + 1)
    monkeypatch.setattr(comm_bench.sys, "executable", "/nonexistent/bin/python")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="mpiexec not found: `pip install mpich`"):
        run_benchmark("mpi", 2)


def check_rows(rows, backend, p, sizes):
    assert [(r["op"], r["size_bytes"]) for r in rows] == bench_plan(OPS, sizes, p)
    for r in rows:
        op, size = r["op"], r["size_bytes"]
        assert r["backend"] == backend and r["nproc"] == p and r["correct"], r
        assert r["count"] * 4 == size
        # The buffers each rank really held: S / p in or out for the scattered/gathered ops.
        if op == "all_gather":
            assert (r["in_bytes"] * p, r["out_bytes"]) == (size, size)
        elif op == "reduce_scatter":
            assert (r["in_bytes"], r["out_bytes"] * p) == (size, size)
        else:
            assert r["in_bytes"] == r["out_bytes"] == size
        assert r["time_us"] > 0 and r["algbw_GBps"] > 0
        assert r["algbw_GBps"] == pytest.approx(size / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * busbw_factor(op, p))
        assert r["model_bytes_per_rank"] == pytest.approx(bytes_per_rank(op, size, p))


@pytest.mark.timeout(180)
def test_gloo_two_ranks(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    rows = run_benchmark("gloo", 2, sizes=[64, 4096], iters=3, warmup=1, timeout_s=120,
                         jsonl_path=jsonl)
    check_rows(rows, "gloo", 2, [64, 4096])
    # Rows were appended as they were measured, one JSON line each.
    assert [json.loads(line) for line in jsonl.read_text().splitlines()] == rows


@pytest.mark.timeout(120)
def test_mpiexec_three_ranks():
    rows = run_benchmark("mpi", 3, sizes=["1K", "64K"], iters=3, warmup=1, timeout_s=90)
    check_rows(rows, "mpi", 3, [1024, 65536])
    assert {r["size_bytes"] for r in rows if r["op"] == "all_gather"} == {1020, 65532}


@pytest.mark.timeout(120)
def test_cli_json_csv_and_plot(tmp_path, capsys):
    csv_path, png = tmp_path / "comm.csv", tmp_path / "busbw.png"
    code = comm_bench.cli(["comm", "--backend", "mpi", "--nproc", "2", "--sizes", "1K:16K",
                           "--ops", "all_reduce,all_gather", "--iters", "2", "--warmup", "0",
                           "--json", "--csv", str(csv_path), "--plot", str(png)])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["op"], r["size_bytes"]) for r in rows] == [
        ("all_reduce", 1024), ("all_reduce", 4096), ("all_reduce", 16384),
        ("all_gather", 1024), ("all_gather", 4096), ("all_gather", 16384)]
    with open(csv_path) as f:
        table = list(csv.DictReader(f))
    assert [int(r["size_bytes"]) for r in table] == [r["size_bytes"] for r in rows]
    assert png.stat().st_size > 1000
    assert "busbw GB/s" in comm_bench.format_bench_table(rows)
    with pytest.raises(SystemExit) as e:
        comm_bench.cli(["comm", "--backend", "gloo", "--sizes", "1M:1K"])
    assert e.value.code == 2 and "goes down" in capsys.readouterr().err


def test_plot_comm_bench_lines():
    from course_lib.experiments.comm_bench import plot_comm_bench

    rows = [make_row("gloo", op, 2, s, 1e-4 * s / 1024, 1, s, s, True)
            for op in ("all_reduce", "broadcast") for s in (1024, 2048, 4096)]
    ax = plot_comm_bench(rows).axes[0]
    assert len(ax.get_lines()) == 2
    assert list(ax.get_lines()[0].get_xdata()) == [1024, 2048, 4096]



@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_nccl_ranks_on_gpus():
    p = min(2, gpu_count())
    rows = run_benchmark("nccl", p, sizes=[4096, 2**20], iters=3, warmup=1, timeout_s=120)
    check_rows(rows, "nccl", p, [4096, 2**20])
