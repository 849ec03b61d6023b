"""Amdahl, Gustafson and Karp-Flatt against their sources; training cost; the speedup table.

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


def test_speedup_table():
    runs = [{"ranks": 1, "ms_per_iter": 100.0, "tokens_per_iter": 1000},
            {"ranks": 2, "ms_per_iter": 125.0, "tokens_per_iter": 2000, "strategy": "ddp"}]
    one, two = sl.speedup_table(runs)
    assert one["tokens_per_s"] == pytest.approx(10_000) and one["speedup"] == 1.0
    assert two["speedup"] == pytest.approx(1.6) and two["efficiency"] == pytest.approx(0.8)
    assert two["strategy"] == "ddp"
    with pytest.raises(ValueError, match="ms_per_iter > 0"):
        sl.speedup_table([{"ranks": 1, "ms_per_iter": math.nan, "tokens_per_iter": 1}])
