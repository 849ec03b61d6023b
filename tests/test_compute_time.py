"""compute_ms and comm_ms on a GPU, on a simulated one: the trainer's own timing code (RunMeter,
SpanTimer, timed_train_step, Comms.timed, TorchDDP's finish_grads) runs
against a fake CUDA stream and host clock, so the arithmetic of CUDA-event spans less host-timed
communication can be checked on a CPU.

The model: the host enqueues work and runs on; the one stream runs it in order; an event is
stamped when the stream reaches it (``cudaEventRecord``); a synchronise moves the host to when
the stream is done. NCCL kernels are on the stream too: a blocking collective, and DDP's
all-reduces at the end of backward (its Reducer waits on every bucket's future, which makes the
current stream wait on the NCCL stream: ``c10::ivalue::Future::wait`` ->
``synchronizeWithCurrentStreams``), hold the compute stream until they are done.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib.hardware import PROFILES
from course_lib.parallel import strategy as strategy_mod
from course_lib.parallel.comms import Comms
from course_lib.parallel.step import Precision
from course_lib.parallel.strategy import CommsStrategy, Strategy, TorchDDP
from course_lib.trainer import metrics
from course_lib.trainer.config import make_config
from course_lib.trainer.loop import Runtime, timed_train_step
from course_lib.trainer.metrics import RunMeter, read_metrics

MS = 1e-3


class FakeGPU:
    """One CUDA stream and the host on one clock (seconds)."""

    def __init__(self):
        self.host = 0.0  # what time.perf_counter reads
        self.done = 0.0  # when the stream finishes what was enqueued so far
        self.syncs = 0  # host waits for the stream (what stalls a GPU's pipeline)

    def launch(self, gpu_s: float, host_s: float = 0.0) -> None:
        """Enqueue ``gpu_s`` of device work, spending ``host_s`` on the host doing it."""
        self.done = max(self.done, self.host) + gpu_s
        self.host += host_s

    def synchronize(self) -> None:
        self.syncs += 1
        self.host = max(self.host, self.done)


class FakeEvent:
    def __init__(self, gpu: FakeGPU):
        self.gpu, self.t = gpu, None

    def record(self) -> None:
        self.t = max(self.gpu.host, self.gpu.done)  # reached once the work before it is done

    def synchronize(self) -> None:
        self.gpu.host = max(self.gpu.host, self.t)

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1e3 * (end.t - self.t)  # ms, as torch.cuda.Event.elapsed_time


class DeviceLoss:
    """The step's loss, a device tensor: ``.item()`` is the host's wait for the stream."""

    def __init__(self, gpu: FakeGPU):
        self.gpu = gpu

    def __itruediv__(self, n):
        return self

    def item(self) -> float:
        self.gpu.synchronize()
        return 1.0


@pytest.fixture
def gpu(monkeypatch):
    gpu = FakeGPU()
    monkeypatch.setattr(time, "perf_counter", lambda: gpu.host)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(gpu))
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: gpu)
    monkeypatch.setattr(strategy_mod, "model_device", lambda model: torch.device("cuda", 0))
    monkeypatch.setattr(metrics, "detect", lambda device: PROFILES["h100"])
    monkeypatch.setattr(dist, "all_reduce", lambda tensor: None)  # the loss's, at the log step
    return gpu


def one_logged_step(gpu: FakeGPU, strategy: Strategy, world_size: int, tmp_path) -> dict:
    """RunMeter + timed_train_step for one step on ``cuda:0``, logged: its metrics.csv row;
    ``syncs``: the host's waits for the stream inside the step."""
    cfg = make_config("shakespeare_char_cpu", {"out_dir": str(tmp_path), "log_interval": 1, "grad_clip": 0.0,
                                                "device": "cuda"})
    rt = Runtime(0, world_size, world_size, "cuda:0", "bfloat16", 1, world_size > 1, devices=world_size)
    meter = RunMeter(cfg, rt, strategy, strategy.name, 1000, 6e3, 0, progress=False)
    syncs = gpu.syncs
    loss, grad_norm, _ = timed_train_step(strategy, None, None, cfg, Precision(), meter)
    syncs = gpu.syncs - syncs
    meter.log(0, loss, 1e-3, grad_norm)
    return {**read_metrics(tmp_path)[0], "syncs": syncs}


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


class GPUStrategy(Strategy):
    """A strategy's work as the stream sees it: forward and backward, then the optimizer step."""

    def __init__(self, gpu: FakeGPU):
        super().__init__(nn.Linear(2, 2), make_optimizer)
        self.gpu = gpu

    def forward_backward(self, x, y, precision, phase):
        self.gpu.launch(30 * MS, host_s=2 * MS)  # the host runs ahead of the stream
        return DeviceLoss(self.gpu)

    def step(self):
        self.gpu.launch(3 * MS, host_s=1 * MS)


class FakeTorchDDP(GPUStrategy):
    """PyTorch's DDP on NCCL: the last bucket's all-reduce ends 5 ms after backward's compute and
    the stream waits for it; ``finish_grads`` is TorchDDP's own."""

    name = "torch_ddp"
    finish_grads = TorchDDP.finish_grads

    def forward_backward(self, x, y, precision, phase):
        loss = super().forward_backward(x, y, precision, phase)
        self.gpu.launch(5 * MS)  # exposed all-reduce: the compute stream waits for it
        return loss


class FakeZeRO(CommsStrategy):
    """Our ZeRO on NCCL: a blocking reduce-scatter in finish_grads, an all-gather in the step,
    both through Comms.timed."""

    name = "zero2"

    def __init__(self, gpu: FakeGPU):
        self.comms = Comms.__new__(Comms)  # its timer and counters, without a process group
        self.comms.reset()
        Strategy.__init__(self, nn.Linear(2, 2), make_optimizer)
        self.gpu = gpu

    forward_backward = GPUStrategy.forward_backward

    def finish_grads(self):
        with self.comms.timed(cuda=True):
            self.gpu.launch(4 * MS)  # reduce-scatter

    def step(self):
        self.gpu.launch(2 * MS, host_s=1 * MS)  # update the shard
        with self.comms.timed(cuda=True):
            self.gpu.launch(6 * MS)  # all-gather the parameters
        self.gpu.launch(1 * MS, host_s=0.5 * MS)


def test_torch_ddp_on_a_gpu_counts_no_compute_as_communication(gpu, tmp_path):
    """TorchDDP.finish_grads timed a device synchronise from when the host got there, 2 ms into
    a 35 ms backward: it was 33 ms of comm_ms, all of them inside compute_ms's CUDA-event span
    too (compute 38 + comm 33 > step 38), and a host sync every step. The stream already waits
    for DDP's all-reduce, so its exposed 5 ms are in compute_ms (as on a CPU, where DDP's wait
    blocks inside backward), counted once, and the step stays asynchronous."""
    r = one_logged_step(gpu, FakeTorchDDP(gpu), 2, tmp_path)
    assert r["syncs"] == 0
    assert r["step_ms"] == pytest.approx(38)
    assert r["compute_ms"] == pytest.approx(38)
    assert r["comm_ms"] == pytest.approx(0, abs=1e-9)
    assert r["compute_ms"] + r["comm_ms"] <= r["step_ms"] + 1e-9


def test_host_timed_collectives_subtracted_from_cuda_event_spans(gpu, tmp_path):
    """Comms.timed settles the stream before its timer starts and synchronises before it stops:
    its interval lies inside the span where the stream ran only the collective, so the span
    less it is the compute: 30 + 2 + 1 ms, and 4 + 6 ms of communication, summing to the step."""
    r = one_logged_step(gpu, FakeZeRO(gpu), 2, tmp_path)
    assert r["compute_ms"] == pytest.approx(33)
    assert r["comm_ms"] == pytest.approx(10)
    assert r["step_ms"] == pytest.approx(43)


def test_one_gpu_steps_without_a_host_sync(gpu, tmp_path):
    """One rank has no communication to wait for: the step stays asynchronous (no host sync
    until the log step's loss.item())."""
    r = one_logged_step(gpu, GPUStrategy(gpu), 1, tmp_path)
    assert r["syncs"] == 0
    assert (r["step_ms"], r["compute_ms"], r["comm_ms"]) == pytest.approx((33, 33, 0))
