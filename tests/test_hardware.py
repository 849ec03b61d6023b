"""Hardware profiles against the vendors' data sheets, GPU name matching, dtype choice, nproc.

Data sheets (dense tensor-core figures; NVIDIA prints the sparse ones, twice as large, beside):
T4: "NVIDIA T4 Tensor Core GPU" data sheet - 65 TFLOPS mixed fp16, 8.1 fp32, 16 GB GDDR6.
V100: "NVIDIA Tesla V100 GPU Accelerator" data sheet, SXM2 - 125 TFLOPS tensor, 15.7 fp32, 32 GB;
    PCIe - 112 TFLOPS tensor, 14 fp32.
A100: "NVIDIA A100 Tensor Core GPU" data sheet - bf16/fp16 312, tf32 156, fp32 19.5; 40 / 80 GB.
L4: "NVIDIA L4 Tensor Core GPU" data sheet - fp16/bf16 242 sparse (121 dense), tf32 120 sparse
    (60 dense), fp32 30.3; 24 GB.
H100: "NVIDIA H100 Tensor Core GPU" data sheet - SXM bf16/fp16 1979 sparse (989.5 dense), tf32
    989 sparse (494.5 dense), fp32 67, 80 GB; PCIe 1513 / 756 sparse (756 / 378 dense), fp32 51.
    NVL (the same data sheet's second column): 1671 / 835 sparse (835.5 / 417.5 dense), fp32 60, 94 GB.
H200: "NVIDIA H200 Tensor Core GPU" data sheet - 141 GB, compute as H100 SXM; H200 NVL 141 GB,
    compute as H100 NVL (1671 / 835 sparse, fp32 60).
Mixed-precision choice: bf16 needs Ampere or newer; Turing/Volta train in fp16 with loss scaling
(Micikevicius et al. 2018, "Mixed Precision Training").
"""

import os

import pytest

from course_lib import hardware
from course_lib.hardware import GB, PROFILES, TFLOP, _match_gpu, cpu_autocast_dtypes, pick_dtype

DATA_SHEETS = {  # profile: (memory GB, {dtype: dense TFLOP/s})
    "t4": (16, {"float16": 65, "float32": 8.1}),
    "v100": (32, {"float16": 125, "float32": 15.7}),
    "v100-pcie": (32, {"float16": 112, "float32": 14}),
    "a100-40gb": (40, {"bfloat16": 312, "float16": 312, "tf32": 156, "float32": 19.5}),
    "a100-80gb": (80, {"bfloat16": 312, "float16": 312, "tf32": 156, "float32": 19.5}),
    "l4": (24, {"bfloat16": 242 / 2, "float16": 242 / 2, "tf32": 120 / 2, "float32": 30.3}),
    "h100": (80, {"bfloat16": 1979 / 2, "float16": 1979 / 2, "tf32": 989 / 2, "float32": 67}),
    "h100-pcie": (80, {"bfloat16": 1513 / 2, "float16": 1513 / 2, "tf32": 756 / 2, "float32": 51}),
    "h100-nvl": (94, {"bfloat16": 1671 / 2, "float16": 1671 / 2, "tf32": 835 / 2, "float32": 60}),
    "h200": (141, {"bfloat16": 1979 / 2, "tf32": 989 / 2, "float32": 67}),
    "h200-nvl": (141, {"bfloat16": 1671 / 2, "float16": 1671 / 2, "tf32": 835 / 2, "float32": 60}),
}


@pytest.mark.parametrize("key", sorted(DATA_SHEETS))
def test_profile_matches_data_sheet(key):
    mem_gb, peaks = DATA_SHEETS[key]
    p = PROFILES[key]
    assert p.kind == "cuda"
    assert p.memory_bytes == pytest.approx(mem_gb * GB)
    for dtype, tflops in peaks.items():
        # within 0.2 %: the profiles round 989.5 to 989 and 494.5 to 495
        assert p.peak(dtype) / TFLOP == pytest.approx(tflops, rel=2e-3), (key, dtype)


def test_turing_and_volta_have_no_bf16_or_tf32():
    for key in ("t4", "v100", "v100-pcie"):
        assert PROFILES[key].peak("bfloat16") is None
        assert PROFILES[key].peak("tf32") is None


@pytest.mark.parametrize("name, mem_gb, key", [
    ("Tesla T4", 15.6, "t4"),
    ("Tesla V100-SXM2-32GB", 32, "v100"),
    ("Tesla V100-PCIE-16GB", 16, "v100-pcie"),  # SXM2's peak would read its MFU 10 % low
    ("NVIDIA A100-SXM4-80GB", 79.2 * 1.074, "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", 39.4 * 1.074, "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", 39.4 * 1.074, "a100-40gb"),
    ("NVIDIA L4", 22.5 * 1.074, "l4"),
    ("NVIDIA H100 80GB HBM3", 79.1 * 1.074, "h100"),
    ("NVIDIA H100 PCIe", 79.6 * 1.074, "h100-pcie"),
    ("NVIDIA H100 NVL", 93.1 * 1.074, "h100-nvl"),  # MFU against the SXM5's peak would read 16 % low
    ("NVIDIA H200", 139.8 * 1.074, "h200"),
    ("NVIDIA H200 NVL", 139.8 * 1.074, "h200-nvl"),
    ("NVIDIA L40S", 44.4 * 1.074, None),  # not an L4
    ("Quadro T400", 1.9, None),  # not a T4
    ("NVIDIA GeForce RTX 4090", 23.6, None),
])
def test_match_device_names(name, mem_gb, key):
    assert _match_gpu(name, int(mem_gb * GB)) == key


def test_dtype_choice():
    assert pick_dtype(PROFILES["t4"]) == "float16" and PROFILES["t4"].needs_grad_scaler
    assert pick_dtype(PROFILES["v100"]) == "float16" and PROFILES["v100"].needs_grad_scaler
    for key in ("a100-40gb", "a100-80gb", "l4", "h100", "h100-pcie", "h100-nvl", "h200", "h200-nvl"):
        assert pick_dtype(PROFILES[key]) == "bfloat16", key
        assert not PROFILES[key].needs_grad_scaler
    assert pick_dtype(PROFILES["cpu"]) == "float32"
    assert pick_dtype(PROFILES["a100-80gb"], "float32") == "float32"
    assert pick_dtype(PROFILES["t4"], "auto") == "float16"
    # CPU autocast: bf16, and fp16 where this torch supports it (2.13 does), so the fp16 lesson runs
    assert pick_dtype(PROFILES["cpu"], "bfloat16") == "bfloat16"
    if "float16" in cpu_autocast_dtypes():
        assert pick_dtype(PROFILES["cpu"], "float16") == "float16"
    else:
        with pytest.raises(ValueError, match="float16 autocast is not supported on CPU"):
            pick_dtype(PROFILES["cpu"], "float16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        pick_dtype(PROFILES["h100"], "fp8")


def test_detect_on_this_machine():
    import torch

    p = hardware.detect()
    if torch.cuda.is_available():
        assert p.kind == "cuda" and p.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    else:
        assert p.kind == "cpu" and p.estimated and p.peak("float32") > 0
        assert p.memory_bytes > 0


def test_nproc_auto_and_threads():
    import torch

    n_gpu = torch.cuda.device_count()
    assert hardware.gpu_count() == n_gpu
    assert hardware.default_nproc("cpu") == 2
    assert hardware.default_nproc() == (n_gpu or 2)
    cores = len(os.sched_getaffinity(0))
    assert hardware.threads_per_rank(2) == max(1, cores // 2)
    assert hardware.threads_per_rank(10 * cores) == 1
    with pytest.raises(ValueError, match="device must be"):
        hardware.default_nproc("tpu")


def test_info_and_cli(capsys):
    d = hardware.info()
    assert d["default_nproc"] == hardware.default_nproc()
    assert d["backend"] == ("nccl" if d["gpus"] else "gloo")
    assert hardware.cli([]) == 0
    out = capsys.readouterr().out
    assert f"nproc=auto -> {d['default_nproc']} ranks" in out


@pytest.mark.gpu
def test_detected_gpu_has_a_profile_and_dtype():
    import torch

    p = hardware.detect()
    props = torch.cuda.get_device_properties(0)
    assert p.name == _match_gpu(props.name, props.total_memory) or p.name == props.name
    expected = "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    assert pick_dtype(p) == expected


def test_detect_reads_the_ranks_own_gpu(monkeypatch):
    """A rank that called torch.cuda.set_device(1) gets GPU 1's profile from detect("cuda")."""
    import types

    import torch

    gpus = [types.SimpleNamespace(name="Tesla T4", total_memory=15 * GB),
            types.SimpleNamespace(name="NVIDIA A100-SXM4-80GB", total_memory=80 * GB)]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpus[i])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert hardware.detect("cuda").name == "a100-80gb"
    assert hardware.detect("cuda:0").name == "t4"
    assert hardware.detect("cuda:0").memory_bytes == 15 * GB  # the device's own, not the sheet's


def test_cpu_autocast_dtypes_are_the_ones_autocast_really_uses():
    import torch

    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for name in ("bfloat16", "float16"):
        with torch.autocast("cpu", dtype=getattr(torch, name)):
            out = a @ b
        assert (out.dtype == getattr(torch, name)) == (name in cpu_autocast_dtypes()), name
    assert "bfloat16" in cpu_autocast_dtypes()
