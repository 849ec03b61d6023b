"""The bridge to the frameworks (notebook 11): Lightning Fabric's strategies and a Hugging Face BERT
on real gloo ranks, each against one process; what the frameworks do inside; what they refuse.

    .venv/bin/python -m pytest -q tests/test_frameworks.py
"""

from __future__ import annotations

import ast
import math

import pytest
from test_architecture import ROOT

from course_lib.launch.spawn import run_ranks

pytest.importorskip("lightning", reason="the frameworks extra: pip install 'course-lib[frameworks]'")
pytest.importorskip("transformers", reason="the frameworks extra: pip install 'course-lib[frameworks]'")

from course_lib.experiments.frameworks_fabric import refusals
from course_lib.experiments.frameworks_gpt import RUNS, compare_runs, rows
from course_lib.experiments.frameworks_inside import ddp_inside, fsdp2_inside
from course_lib.experiments.frameworks_qa import (
    BERT_TINY,
    qa_examples,
    speech_openings,
    strategy_table,
    train_qa,
)
from course_lib.gpt.data import prepare


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    data = prepare("shakespeare_char", tmp_path_factory.mktemp("data"), quiet=True).parent
    return run_ranks(compare_runs, 2, data, tuple(RUNS), None, 3, timeout=120)  # 3 steps


def test_every_run_equals_one_process_step_by_step(gpt_runs):
    for rank_result in gpt_runs:
        ref = rank_result["reference"]
        assert len(ref) == 3 and ref[0] > ref[-1]  # it trains
        for label in RUNS:
            assert rank_result[label]["losses"] == pytest.approx(ref, rel=1e-5, abs=1e-6), label


def test_bytes_held_and_moved_match_the_models(gpt_runs):
    r = gpt_runs[0]
    psi = r["num_params"]
    for label in ("course ddp", "torch ddp", "fabric ddp"):
        # parameters and Adam's two states, replicated (+ Adam's step counters, a few bytes each)
        assert r[label]["held"] == pytest.approx(r[label]["held_model"], rel=2e-3), label
        assert r[label]["held_model"] == 12 * psi
        # one all-reduce of every gradient: 2 Psi x 4 bytes in the paper's accounting
        assert r[label]["comm"] == pytest.approx(8 * psi, rel=2e-3), label
    for label in ("course zero3", "fabric fsdp2"):
        assert r[label]["held"] == pytest.approx(12 * psi / 2, rel=5e-3), label  # sharded over 2 ranks
        # all-gather forward and backward, reduce-scatter: at most 3 Psi, the root's parameters
        # stay gathered from forward to backward in both, so a little less
        assert 0.9 * r[label]["comm_model"] < r[label]["comm"] <= r[label]["comm_model"], label
    table = rows(r)
    assert [row["run"] for row in table] == list(RUNS)
    assert all(row["max |loss - one process|"] < 1e-4 for row in table)


@pytest.fixture(scope="module")
def inside():
    """DDP and FSDP2 taken apart, and Fabric's answers, in one start of 2 ranks (Lightning imports once)."""
    def three(rank, world):
        return ddp_inside(rank, world, 0.05), fsdp2_inside(rank, world), refusals(rank, world)
    return run_ranks(three, 2, timeout=180)[0]


def test_ddp_buckets_are_the_course_rule_after_the_rebuild(inside):
    r = inside[0]
    first, second = r["buckets_by_step"]
    # the first step: one bucket (without find_unused_parameters DDP waits for the real order)
    assert len(first) == 1 and first[0]["bytes"] == sum(b["bytes"] for b in second)
    # then DDP rebuilds its buckets in the order the gradients arrived: the course's rule
    assert [(b["params"], b["bytes"]) for b in second] == [(b["params"], b["bytes"]) for b in r["course_buckets"]]
    assert len(second) >= 2 and [b["index"] for b in second] == list(range(len(second)))
    assert "_autograd_hook" in r["reducer_hook_methods"]
    assert r["bucket_cap_bytes"] == int(0.05 * 2**20)


def test_fsdp2_shards_every_parameter_and_gathers_around_each_unit(inside):
    r = inside[1]
    for s in r["shards"]:
        assert s["placement"] == "(Shard(dim=0),)"
        assert s["local shape"][0] == math.ceil(s["full shape"][0] / 2)
    assert r["fsdp_units"] == ["root", "transformer.h.0", "transformer.h.1"]
    events = [(kind, what) for kind, what, _ in r["events"]]
    for unit in ("transformer.h.0", "transformer.h.1"):  # gathered just before its forward
        i = events.index(("forward", unit))
        assert events[i - 1] == ("collective", "all_gather")
    assert r["calls"] == {"all_gather": 5, "reduce_scatter": 3}  # root once, each block twice; one RS each


def test_the_qa_answer_is_the_speakers_name():
    d = qa_examples(20, max_len=96)
    inv = d["vocab"]
    names = {" ".join(n.lower().split()) for n, _ in speech_openings()}
    for row, s, e in zip(d["input_ids"], d["start_positions"], d["end_positions"]):
        answer = " ".join(inv[int(t)] for t in row[s:e + 1])
        assert answer in names or "[UNK]" in answer
    assert d["example"]["answer"] in d["example"]["context"]


def test_bert_on_two_ranks_is_the_one_rank_program():
    def both(rank, world):  # one start of 2 ranks for both strategies
        return train_qa(rank, world, "ddp", BERT_TINY, 3), train_qa(rank, world, "fsdp2", BERT_TINY, 3)

    one = run_ranks(train_qa, 1, "single", BERT_TINY, 3, timeout=200)
    two, fsdp = map(list, zip(*run_ranks(both, 2, timeout=200)))
    for run in (two, fsdp):
        assert run[0]["losses"] == pytest.approx(one[0]["losses"], rel=1e-5)
    assert fsdp[0]["model_state_bytes"] == pytest.approx(one[0]["model_state_bytes"] / 2, rel=0.01)
    table = strategy_table({"single": one, "ddp": two, "fsdp2": fsdp}, {"fsdp": "refused: ..."})
    assert table[0]["speedup vs 1 rank"] == 1.0
    assert table[0]["peak MB / rank"] == one[0]["peak_bytes"] / 1e6  # MB as labelled, not MiB
    assert table[1]["model states MB / rank"] == max(r["model_state_bytes"] for r in two) / 1e6
    assert table[1]["speedup vs 1 rank"] == pytest.approx(one[0]["seconds"] / max(r["seconds"] for r in two))
    assert table[-1]["strategy"] == "fsdp" and table[-1]["seconds"] is None


def test_a_step_on_one_loss_per_replica_trains_on_their_mean():
    """Under "dp" (a GPU machine) DataParallel hands back a Hugging Face model's loss once per GPU,
    as a vector; fabric_step steps on their mean, the loss of the whole batch."""
    import types

    import torch

    from course_lib.experiments.frameworks_fabric import fabric_step

    class Replicas(torch.nn.Module):  # what DataParallel's gather returns for 2 replicas' losses
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, x):  # each replica's scalar loss on its half of the batch
            halves = (self.w * x[:2]).pow(2).mean(), (self.w * x[2:]).pow(2).mean()
            return types.SimpleNamespace(loss=torch.stack(halves))

    x, model = torch.tensor([1.0, 2.0, 3.0, 4.0]), Replicas()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fabric = types.SimpleNamespace(backward=lambda loss: loss.backward())
    loss = fabric_step(fabric, model, optimizer, x)
    assert loss.dim() == 0 and loss.item() == pytest.approx((2.0 * x).pow(2).mean().item())
    assert model.w.item() == pytest.approx(2.0 - 0.1 * (2 * 2.0 * x.pow(2).mean()).item())  # d/dw of the mean


def test_what_fabric_refuses_on_a_cpu(inside):
    said = inside[2]
    assert said["dp"].startswith("replaced: 'dp' is not supported on CPUs") and "DDPStrategy" in said["dp"]
    assert said["fsdp"].startswith("refused:") and "only available on GPU" in said["fsdp"]
    # without DeepSpeed: Fabric's ImportError; with it (CPU accelerator): only supported on CUDA GPUs
    assert said["deepspeed"].startswith("refused:")


def test_only_the_framework_modules_import_the_frameworks():
    allowed = {f"course_lib/experiments/frameworks_{m}.py" for m in ("fabric", "qa")}
    found = []
    for path in sorted((ROOT / "course_lib").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in ("lightning", "transformers", "deepspeed") for n in names):
                found.append(path.relative_to(ROOT).as_posix())
    assert found and set(found) <= allowed, found


def test_the_numbers_the_lesson_takes_from_its_sources():
    from course_lib.experiments.frameworks_qa import BERT_BASE, LAB_DEVICES, bert_qa, lab_speedups

    # the lab's table: ddp 5.1x and deepspeed 4.8x over its baseline on 2 devices; dp slower than it
    s = lab_speedups()
    assert round(s["ddp"], 1) == 5.1 and round(s["fsdp"], 1) == 4.9 and round(s["deepspeed"], 1) == 4.8
    assert s["dp"] < 1 and all(v > LAB_DEVICES for k, v in s.items() if k != "dp")
    # Devlin et al. 2019, Sec. 3: BERT-base has 110M parameters (30,522 WordPiece tokens, 512 positions)
    n = sum(p.numel() for p in bert_qa(BERT_BASE, 30522, 512).parameters())
    assert n == pytest.approx(110e6, rel=0.02)
