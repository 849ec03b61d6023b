"""Amdahl, Gustafson and Karp-Flatt against their sources; the measured workload and its table.

Sources:
- Amdahl, AFIPS 1967: S = 1 / (s + (1 - s)/p), bounded by 1/s.
- Gustafson, "Reevaluating Amdahl's law", CACM 31(5), 1988: on a 1024-processor hypercube at
  Sandia, serial fractions s' = 0.4-0.8 percent gave scaled speedups of 1016, 1020 and 1021;
  "very few problems will experience even a 100-fold speedup" under Amdahl's fixed-size view.
- Karp and Flatt, CACM 33(5), 1990: e = (1/S - 1/p) / (1 - 1/p).
- Kaplan et al. 2020 (arXiv:2001.08361), Sec. 2.1: C = 6 N D training FLOPs.
"""

import math

import pytest

from course_lib.analysis import scaling_laws as sl


def test_amdahl_bounds_and_values():
    assert sl.amdahl_speedup(0.0, 64) == pytest.approx(64)
    assert sl.amdahl_speedup(1.0, 64) == pytest.approx(1)
    assert sl.amdahl_speedup(0.1, 10) == pytest.approx(1 / 0.19)
    assert sl.amdahl_speedup(0.05, 1e9) == pytest.approx(20, rel=1e-6)  # the ceiling 1/s
    with pytest.raises(ValueError, match="between 0 and 1"):
        sl.amdahl_speedup(1.5, 2)
    with pytest.raises(ValueError, match="p must be >= 1"):
        sl.amdahl_speedup(0.1, 0)


def test_gustafson_reproduces_the_sandia_numbers():
    # s' = 0.4-0.8 % on 1024 processors: scaled speedups 1016-1021 (Gustafson 1988)
    for s in (0.004, 0.008):
        assert 1015 <= sl.gustafson_speedup(s, 1024) <= 1021
    # ... while Amdahl's law with the same fractions stays far below: about 201 and 112
    assert sl.amdahl_speedup(0.004, 1024) == pytest.approx(201, abs=1)
    assert sl.amdahl_speedup(0.008, 1024) == pytest.approx(112, abs=1)


def test_karp_flatt_recovers_amdahls_fraction_and_the_fit():
    for s in (0.0, 0.03, 0.2):
        for p in (2, 4, 16):
            assert sl.karp_flatt(sl.amdahl_speedup(s, p), p) == pytest.approx(s, abs=1e-12)
    ps = [1, 2, 4, 8]
    assert sl.fit_serial_fraction(ps, [sl.amdahl_speedup(0.07, p) for p in ps]) == pytest.approx(0.07)
    assert sl.fit_serial_fraction([1, 2], [1.0, 0.5]) == 1.0  # slower in parallel: clipped to 1
    with pytest.raises(ValueError, match="p > 1"):
        sl.karp_flatt(1.0, 1)
    with pytest.raises(ValueError, match="p > 1"):
        sl.fit_serial_fraction([1], [1.0])


def test_training_time_is_six_n_d_over_throughput():
    assert sl.training_flops(124e6, 9e9) == pytest.approx(6 * 124e6 * 9e9)
    t = sl.training_time_s(124e6, 9e9, peak_flops=312e12, mfu=0.5, n_devices=8)
    assert t == pytest.approx(6 * 124e6 * 9e9 / (312e12 * 0.5 * 8))
    with pytest.raises(ValueError):
        sl.training_time_s(1, 1, peak_flops=1, mfu=0)


def test_work_is_split_evenly():
    assert sl._split(10, 3) == [4, 3, 3] and sum(sl._split(7, 7)) == 7
    assert sl.burn(1) == sl.burn(1)  # deterministic work, not a sleep


@pytest.mark.timeout(120)
def test_measurements_are_consistent():
    strong = sl.measure_strong([2, 1], serial_units=1, parallel_units=4, repeats=1)
    assert [r["p"] for r in strong] == [1, 2]
    assert strong[0]["speedup"] == 1.0 and strong[0]["karp_flatt"] is None
    r = strong[1]
    assert r["efficiency"] == pytest.approx(r["speedup"] / 2)
    assert r["karp_flatt"] == pytest.approx(sl.karp_flatt(r["speedup"], 2))
    weak = sl.measure_weak([1, 2], serial_units=1, parallel_units_per_proc=2, repeats=1)
    assert weak[0]["scaled_speedup"] == 1.0
    for w in weak:
        assert 0 < w["serial_share"] <= 1
        assert w["gustafson"] == pytest.approx(w["serial_share"] + (1 - w["serial_share"]) * w["p"])
        assert w["scaled_speedup"] == pytest.approx(w["seconds_1"] / w["seconds"])
    fig = sl.plot_scaling(strong, 0.05, weak, s_written=1 / 5, p_max=64)
    assert len(fig.axes) == 2 and len(fig.axes[1].get_lines()) == 5  # ideal, 2 x Amdahl, Gustafson, measured
    with pytest.raises(ValueError, match="procs"):
        sl.measure_strong([0, 1])


def test_speedup_table():
    runs = [{"ranks": 1, "ms_per_iter": 100.0, "tokens_per_iter": 1000},
            {"ranks": 2, "ms_per_iter": 125.0, "tokens_per_iter": 2000, "strategy": "ddp"}]
    one, two = sl.speedup_table(runs)
    assert one["tokens_per_s"] == pytest.approx(10_000) and one["speedup"] == 1.0
    assert two["speedup"] == pytest.approx(1.6) and two["efficiency"] == pytest.approx(0.8)
    assert two["strategy"] == "ddp"
    with pytest.raises(ValueError, match="ms_per_iter > 0"):
        sl.speedup_table([{"ranks": 1, "ms_per_iter": math.nan, "tokens_per_iter": 1}])


@pytest.mark.timeout(120)
def test_command_line(capsys):
    assert sl.main(["--procs", "1,2", "--serial-units", "1", "--parallel-units", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "serial part written in: s = 0.333" in out and "Karp-Flatt e =" in out and "fitted Amdahl" in out
    with pytest.raises(SystemExit):
        sl.main(["--procs", "one,two"])
    assert "--procs takes whole numbers" in capsys.readouterr().err
