"""The numbers the lessons take from their sources, computed by the library the lessons call (issue 23).

Sources, one per test:

- ZeRO-Offload: Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX
  ATC, Sec. 3-4: only the 16-bit parameters stay on the GPU (gradients, fp32 master weights and
  Adam's moments go to CPU memory, 8x less GPU memory than 16 bytes per parameter), which trains
  13B parameters on one 32 GB V100 (abstract, Sec. 6). Plain mixed-precision Adam holds 2 + 2 + 12
  = 16 bytes per parameter (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1). Notebook 2: a 7B model
  does not fit one 80 GB GPU with the second and does with the first.
- Tensor parallelism: Megatron-LM (Shoeybi et al. 2019, Sec. 3: each rank owns whole heads) asserts
  in its code that the head count divides by the tensor-parallel size (``divide`` ->
  ``ensure_divisibility`` in megatron/core/transformer/attention.py) and pads only the vocabulary
  (``--make-vocab-size-divisible-by``). Notebook 10: GPT-2 XL's 25 heads rule tp in {2, 4, 8} out.
- Ring attention: Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for
  Near-Infinite Context", Sec. 3: with the sequence on cp hosts each one passes its K/V block on
  cp - 1 times per layer (and, in backward, the gradients cp - 1 times the other way).
- Pipeline bubble: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC21, Sec. 2.2.1: bubble time over ideal time is (p - 1) / m; as a
  share of the whole step that is b / (1 + b) = (p - 1) / (m + p - 1) (notebook 5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from course_lib.analysis.layout_plan import plan_layouts
from course_lib.analysis.memory import ModelShape, breakdown, model_state_bytes
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.hardware import PROFILES
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.comms import Comms
from course_lib.parallel.context.ring_attention import cp_split, ring_attention
from course_lib.parallel.gpt_parallel import GPTStage
from course_lib.parallel.pipeline.schedules import Pipeline, mlp_stage
from course_lib.parallel.tensor.layers import tensor_parallel_gpt
from course_lib.parallel.toy import ToyMLP, toy_batch
from course_lib.registry import ConfigError
from course_lib.trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]

# A 7B-class GPT (Llama-2-7B's depth and width, GPT-2's vocabulary): 6.7e9 parameters
SEVEN_B = ModelShape("7b", n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304,
                     batch_size=1, bias=False)


# --- ZeRO-Offload: 7B on one 80 GB GPU ------------------------------------------------------------

def test_zero_offload_keeps_only_the_16_bit_weights_on_the_gpu():
    plain, off = model_state_bytes(7e9), model_state_bytes(7e9, offload=True)
    assert plain.total == 16 * 7e9  # 2 + 2 + 12 (ZeRO, Sec. 3.1): 112 GB
    assert (off.params, off.grads, off.optimizer) == (2 * 7e9, 0.0, 0.0)
    assert plain.total / off.total == 8  # ZeRO-Offload's 8x
    # Ren et al.: 13B parameters train on one 32 GB V100, impossible without offload
    v100 = PROFILES["v100"].memory_bytes
    assert model_state_bytes(13e9, offload=True).total < v100 < model_state_bytes(13e9).total
    # stage 3 shards the weights that stay; offload composes with the other stages' sharding
    assert model_state_bytes(7e9, dp=4, stage=3, offload=True).params == 2 * 7e9 / 4


@pytest.mark.parametrize("gpu", ["a100-80gb", "h100"])
def test_a_7b_model_trains_on_one_80gb_gpu_with_zero_offload_only(gpu):
    assert 6.5e9 < SEVEN_B.num_params() < 7.5e9
    plain = breakdown(preset=SEVEN_B, flash_attention=True)  # one 2048-token sequence, no recompute
    off = breakdown(preset=SEVEN_B, flash_attention=True, offload=True)
    assert plain.activations == off.activations > 0  # offload moves model states, not activations
    assert plain.model_states > PROFILES[gpu].memory_bytes and not plain.fits(gpu)
    assert off.fits(gpu) and off.total < 0.5 * PROFILES[gpu].memory_bytes


# --- tensor parallelism: heads divide by tp, only the vocabulary is padded ------------------------

class _FakeComms:  # the layers' constructors need only the group's size and this rank
    def __init__(self, world_size: int, rank: int = 0):
        self.world_size, self.rank = world_size, rank


CFG = GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_embd=32, bias=False)


@pytest.mark.parametrize("tp", [3, 8])
def test_tensor_parallelism_refuses_heads_that_tp_does_not_divide(tp):
    with pytest.raises(ValueError, match=rf"n_head \(4\) must be divisible by the tensor-parallel size "
                                         rf"tp_world_size \({tp}\)"):
        tensor_parallel_gpt(GPT(CFG), _FakeComms(tp))
    comms = {"tp": _FakeComms(tp), "sp": _FakeComms(tp), "cp": _FakeComms(1)}
    with pytest.raises(ValueError, match=r"n_head \(4\) must be divisible"):
        GPTStage(CFG, 0, 1, comms)
    # the trainer refuses the layout before any process starts
    with pytest.raises(ConfigError, match=rf"n_head \(4\) must be divisible by tp \({tp}\)"):
        TrainConfig(n_layer=2, n_head=4, n_embd=32, tp=tp)


def test_tensor_parallelism_pads_the_vocabulary_and_nothing_else():
    tp = 2
    comms = {"tp": _FakeComms(tp, rank=1), "sp": _FakeComms(tp, rank=1), "cp": _FakeComms(1)}
    stage = GPTStage(CFG, 0, 1, comms)
    full = dict(GPT(CFG).named_parameters())
    padded = []
    for name, p in stage.named_parameters():
        whole = full[name].numel()
        assert p.numel() * tp >= whole and p.numel() <= whole, name  # split by tp, or replicated
        if p.numel() * tp > whole and p.numel() < whole:
            padded.append(name)
    assert padded == ["transformer.wte.weight"]  # 65 tokens padded to 66: 33 rows per rank
    assert stage.transformer.wte.weight.shape == (33, CFG.n_embd)
    assert stage.transformer.h["0"].attn.n_head_local * tp == CFG.n_head  # heads split, never padded


def test_gpt2_xl_has_no_tensor_parallel_layout():
    """Notebook 10: GPT-2 XL's 25 heads divide by no tp in {2, 4, 8}; gpt2-large's 20 by 2 and 4."""
    assert {r["tp"] for r in plan_layouts("gpt2-xl")} == {1}
    assert {r["tp"] for r in plan_layouts("gpt2-large")} >= {1, 2, 4}
    with pytest.raises(ConfigError, match=r"n_head \(25\) must be divisible by tp \(8\)"):
        TrainConfig(n_layer=48, n_head=25, n_embd=1600, tp=8)


# --- context parallelism: cp - 1 ring hops each way per layer -------------------------------------

class _PeerComms(Comms):
    """Comms that also records where each point-to-point message goes and comes from."""

    def reset(self) -> None:
        super().reset()
        self.peers: list[tuple[str, int]] = []

    def isend(self, tensor, dst):
        self.peers.append(("send", dst))
        return super().isend(tensor, dst)

    def recv(self, tensor, src):
        self.peers.append(("recv", src))
        return super().recv(tensor, src)


def ring_worker(rank: int, cp: int) -> dict:  # cp = world_size
    comms = _PeerComms()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8 * cp, 4, generator=g) for _ in range(3))  # (B, nh, T, hs)
    q, k, v = (cp_split(t.transpose(1, 2), rank, cp).transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, comms)  # one layer's attention
    forward = {"calls": dict(comms.calls), "peers": list(comms.peers), "sent": comms.sent_bytes}
    comms.reset()
    out.sum().backward()
    backward = {"calls": dict(comms.calls), "peers": list(comms.peers), "sent": comms.sent_bytes}
    return {"forward": forward, "backward": backward, "kv_bytes": 2 * k.numel() * k.element_size()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp", [2, 3])
def test_ring_attention_passes_keys_and_values_cp_minus_1_hops_each_way(cp):
    for rank, r in enumerate(run_ranks(ring_worker, cp)):
        fwd, bwd = r["forward"], r["backward"]
        assert fwd["calls"] == {"send": cp - 1, "recv": cp - 1}, (rank, fwd)
        assert bwd["calls"] == {"send": cp - 1, "recv": cp - 1}, (rank, bwd)
        nxt, prev = (rank + 1) % cp, (rank - 1) % cp
        assert fwd["peers"] == [("send", nxt), ("recv", prev)] * (cp - 1)  # K/V go one way round
        assert bwd["peers"] == [("send", prev), ("recv", nxt)] * (cp - 1)  # their gradients the other
        assert fwd["sent"] == bwd["sent"] == (cp - 1) * r["kv_bytes"]  # K and V in one message per hop


# --- the pipeline bubble: Narayanan's (p - 1)/m and the share of the step (p - 1)/(m + p - 1) ------

def bubble_worker(rank: int, world_size: int, n_micros: tuple[int, ...]) -> dict:
    comms = Comms()
    torch.manual_seed(0)
    pipe = Pipeline(mlp_stage(ToyMLP(n_layers=4), rank, world_size), comms, "1f1b")
    out = {}
    for m in n_micros:
        _, stats = pipe.train_step(*toy_batch(8, seed=0), m)
        out[m] = (stats.busy_ticks, stats.total_ticks, stats.bubble)
    return out


@pytest.mark.timeout(120)
def test_bubble_over_ideal_time_is_narayanans_p_minus_1_over_m():
    p, n_micros = 2, (1, 2, 4, 8)
    for per_rank in run_ranks(bubble_worker, p, n_micros):
        for m in n_micros:
            busy, total, share = per_rank[m]
            b = (total - busy) / busy  # idle time over ideal (busy) time, on the schedule's clock
            assert b == pytest.approx((p - 1) / m, abs=1e-12)  # Narayanan et al. 2021, Sec. 2.2.1
            assert share == pytest.approx(b / (1 + b), abs=1e-12) == pytest.approx((p - 1) / (m + p - 1))
    # the planner of notebook 10 uses the same share of the step
    for row in plan_layouts("gpt2-xl"):
        b = (row["pp"] - 1) / row["micro_batches"]
        assert row["bubble"] == pytest.approx(b / (1 + b), abs=1e-12)


# --- show_source: one definition, in the library ----------------------------------------------------

def test_notebooks_take_show_source_from_the_library(monkeypatch):
    import IPython.display

    from course_lib.notebook.source import show_source

    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    show_source(ring_attention)
    (code,) = shown
    assert code.data.startswith("def ring_attention(") and "ring_shift(kv, comms)" in code.data
    users = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            text = "".join(cell["source"])
            assert "def show_source" not in text, f"{path.name} defines show_source again"
            if "show_source(" in text and path.name not in users:
                users.append(path.name)
    assert len(users) >= 3, users


def test_show_doc_shows_a_docstring_as_text_without_its_markup(monkeypatch):
    import IPython.display

    from course_lib.analysis.comm_cost import zero_comm_volume
    from course_lib.notebook.source import doc_markdown, show_doc

    text = '''First line.

        See :func:`~course_lib.parallel.step.train_step` and :mod:`course_lib.parallel.comms`, and
        ``exact=True`` (:data:`GB`). An example::

            train_step(strategy, x, y)

        Last paragraph.
        '''
    assert doc_markdown(text) == ("First line.\n\nSee `train_step` and `course_lib.parallel.comms`, and\n"
                                  "`exact=True` (`GB`). An example:\n\n    train_step(strategy, x, y)\n\nLast paragraph.")
    assert doc_markdown(text, slice(2, 4)) == "    train_step(strategy, x, y)\n\nLast paragraph."
    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    show_doc(zero_comm_volume)
    (md,) = shown
    assert md.data.startswith("Bytes each data-parallel rank sends") and "`exact` keeps" in md.data
    assert "``" not in md.data and not md.data.endswith("\n")
