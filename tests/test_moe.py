"""The mixture-of-experts GPT (course_lib.gpt.moe) in one process, its configuration's refusals, and
the trainer with experts (one process and ep=2 on 2 gloo ranks, its router columns in metrics.csv).

One expert with top-1 routing is the dense model: its gate is softmax of one logit = 1, so with
the dense MLP's weights in the expert (``upcycle_state_dict``) logits and gradients are the dense
model's, and the loss is the dense loss plus aux_loss_coef per block (the aux loss of one expert is
E * f * P = 1). The capacity rule is checked against a plain-Python queue per expert, and the
router's imbalance against hand arithmetic. With frozen parameters, accumulation and bf16, ep=2
under DDP and ZeRO-3 trains like one process.
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_parallel_trainer import TINY, losses, numbers, run

from course_lib.gpt.data import prepare
from course_lib.gpt.model import GPT, GPTConfig, adamw_param_groups
from course_lib.gpt.moe import MoE, capacity, moe_stats, router_imbalance, upcycle_state_dict
from course_lib.launch.checks import check_request
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.parallelize import parallelize
from course_lib.parallel.step import Precision, train_step
from course_lib.registry import ConfigError
from course_lib.trainer.config import TrainConfig, make_config
from course_lib.trainer.loop import optimizer_factory
from course_lib.trainer.metrics import announce_run

SMALL = dict(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_embd=32, bias=True)


def test_one_expert_with_top1_is_the_dense_model():
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**SMALL)).double()
    moe = GPT(GPTConfig(**SMALL, n_expert=1, top_k=1)).double()
    moe.load_state_dict(upcycle_state_dict(dense.state_dict(), 1))
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 65, (3, 16), generator=g) for _ in range(2))
    logits_d, loss_d = dense(x, y)
    logits_m, loss_m = moe(x, y)
    assert torch.equal(logits_d, logits_m)
    assert loss_m.item() == pytest.approx(loss_d.item() + 0.01 * SMALL["n_layer"], abs=1e-14)
    loss_d.backward()
    loss_m.backward()
    got = upcycle_state_dict({n: p.grad for n, p in dense.named_parameters()}, 1)
    grads = dict(moe.named_parameters())
    for name, p in grads.items():
        if name.endswith("router.weight"):
            assert p.grad.abs().max() < 1e-14  # one expert: the gate is 1 whatever the router says
        else:
            assert torch.allclose(p.grad, got[name], atol=1e-14, rtol=0), name
    assert moe.num_params() == dense.num_params() + SMALL["n_layer"] * SMALL["n_embd"]  # + the routers


def test_expert_biases_get_no_weight_decay_though_they_are_2d():
    model = GPT(GPTConfig(**SMALL, n_expert=2))
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = ([names[id(p)] for p in g["params"]] for g in adamw_param_groups(model, 0.1))
    assert "transformer.h.0.mlp.experts.w_fc" in decay and "transformer.h.0.mlp.router.weight" in decay
    assert {"transformer.h.0.mlp.experts.b_fc", "transformer.h.0.mlp.experts.b_proj"} <= set(no_decay)


def test_capacity_drops_what_the_rule_says():
    """capacity = ceil(c k N / E); first choices queue before second ones, tokens in order."""
    assert capacity(32, 4, 2, 1.0) == 16 and capacity(30, 4, 1, 1.25) == 10 and capacity(30, 4, 1, 0.0) is None
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, n_expert=4, top_k=2, capacity_factor=1.0))
    logits = []
    for m in model.modules():
        if isinstance(m, MoE):
            m.router.register_forward_hook(lambda mod, inp, out: logits.append(out.detach()))
    x = torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(2))
    model(x, x)
    stats = moe_stats(model)
    cap = math.ceil(1.0 * 2 * 64 / 4)
    for layer, lg in enumerate(logits):
        choice = F.softmax(lg, dim=-1).topk(2, dim=-1).indices.tolist()
        load, dropped, routed = [0] * 4, [0] * 4, [0] * 4
        for j in range(2):
            for token in range(64):
                e = choice[token][j]
                routed[e] += 1
                if load[e] < cap:
                    load[e] += 1
                else:
                    dropped[e] += 1
        assert stats["tokens_per_expert"][layer].tolist() == routed
        assert stats["dropped"][layer].tolist() == dropped
    assert stats["dropped"].sum() > 0  # this router is uneven enough for the capacity to bite
    # dropless: nothing dropped, the first block routes the same (the later ones see other inputs)
    model2 = GPT(GPTConfig(**SMALL, n_expert=4, top_k=2))
    model2.load_state_dict(model.state_dict())
    model2(x, x)
    s2 = moe_stats(model2)
    assert s2["dropped"].sum() == 0 and torch.equal(s2["tokens_per_expert"][0], stats["tokens_per_expert"][0])


def test_router_imbalance_per_expert_and_per_rank():
    r = router_imbalance([10, 30, 20, 20], ep=2)
    assert r["per_expert"] == [0.5, 1.5, 1.0, 1.0] and r["expert_max_over_mean"] == 1.5
    assert r["tokens_per_rank"] == [40.0, 40.0] and r["per_rank"] == [1.0, 1.0] and r["rank_max_over_mean"] == 1.0
    r = router_imbalance(torch.tensor([[10, 0, 5, 5], [20, 0, 0, 0]]), ep=2)  # (layers, E): summed first
    assert r["per_expert"] == [3.0, 0.0, 0.5, 0.5] and r["per_rank"] == [1.5, 0.5]
    with pytest.raises(ValueError, match="ep \\(3\\) must divide"):
        router_imbalance([1, 2, 3, 4], ep=3)


# one micro-batch per step: the load-balancing loss is per micro-batch (its f over the micro-batch's
# tokens), so the micro-batches must hold the same sequences in both runs
BASE = {**TINY, "max_iters": 10, "lr_decay_iters": 10, "eval_interval": 5, "n_expert": 4, "top_k": 2,
        "gradient_accumulation_steps": 1}


def cfg(tmp_path, name: str, **overrides):
    return make_config("shakespeare_char_moe_cpu", {**BASE, "out_dir": str(tmp_path / name), **overrides})


@pytest.mark.parametrize("overrides, message", [
    ({"nproc": 4, "ep": 2, "n_expert": 0}, r"ep=2 shards experts, but the model has none"),
    ({"nproc": 4, "ep": 4, "n_expert": 6}, r"n_expert \(6\) must be divisible by ep \(4\)"),
    ({"nproc": 6, "ep": 4, "n_expert": 4}, r"ep \(4\) must divide dp = ranks / \(tp\*pp\*cp\) = 6"),
    ({"nproc": 4, "ep": 4, "tp": 2}, r"ep \(4\) must divide dp = ranks / \(tp\*pp\*cp\) = 2"),
    ({"nproc": 4, "ep": 2, "sequence_parallel": True, "tp": 2}, r"n_expert with sequence_parallel is not supported"),
    ({"nproc": 2, "ep": 2, "strategy": "fsdp_full"}, r"strategy 'fsdp_full' with n_expert on several ranks: use one of"),
    ({"nproc": 2, "top_k": 5}, r"top_k must be in \[1, n_expert=4\], got 5"),
    ({"nproc": 2, "cp": 2, "capacity_factor": 1.25}, r"capacity_factor with cp > 1 is not supported"),
    ({"nproc": 2, "ep": 2, "dropout": 0.1}, r"dropout=0.1 with tp/pp/cp is not supported"),
    ({"nproc": 2, "ep_dispatch": "padded"}, r"ep_dispatch=padded chooses the all-to-all of expert parallelism"),
])
def test_bad_expert_layouts_are_refused_before_spawning(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        check_request(cfg(tmp_path, "bad", **overrides))
    assert "\n" not in str(e.value)


@pytest.mark.timeout(300)
def test_trainer_with_experts_ep2_equals_one_process_and_logs_the_router(tmp_path, capsys):
    """The recipe, tiny: one process (batch 16) and ep=2 on 2 ranks (batch 8 each), dropless; a
    one-process checkpoint continued under ep=2 (its experts cut out of the full state)."""
    prepare("shakespeare_char", quiet=True)
    run([cfg(tmp_path, "single", batch_size=16), cfg(tmp_path, "single-to-ep2", batch_size=16, max_iters=5),
         cfg(tmp_path, "single-acc2", batch_size=8, gradient_accumulation_steps=2)], 1)
    run([cfg(tmp_path, "ep2", nproc=2, ep=2, batch_size=8),  # and the half run continued under ep=2
         cfg(tmp_path, "single-to-ep2", nproc=2, ep=2, batch_size=8, init_from="resume"),
         cfg(tmp_path, "pp2", nproc=2, pp=2, batch_size=16),  # the aux loss of both stages
         cfg(tmp_path, "ep2-padded", nproc=2, ep=2, batch_size=8, ep_dispatch="padded"),
         cfg(tmp_path, "ep2-zero3-acc2", nproc=2, ep=2, strategy="zero3", batch_size=4, gradient_accumulation_steps=2)], 2)
    want = losses(tmp_path / "single")
    for name in ("ep2", "single-to-ep2", "pp2", "ep2-padded"):
        got = losses(tmp_path / name)
        assert sorted(got) == list(range(11)), name
        for it in range(10):
            assert float(got[it][0]) == pytest.approx(float(want[it][0]), rel=1e-5), (name, it)
    # eval: the same rows for every layout of one global batch, dropless (the aux loss is not in it)
    evals = {name: losses(tmp_path / name) for name in ("single", "ep2", "single-to-ep2", "pp2", "ep2-padded",
                                                        "single-acc2", "ep2-zero3-acc2")}
    for name, ref, its in [(n, "single", (0, 5, 10)) for n in ("ep2", "single-to-ep2", "pp2", "ep2-padded")] + [
            ("single-acc2", "single", (0,)), ("ep2-zero3-acc2", "single-acc2", (0, 5, 10))]:
        for it in its:
            assert numbers(evals[name][it][1:]) == pytest.approx(numbers(evals[ref][it][1:]), rel=1e-5), (name, it)
    # with accumulation: each rank's micro-batch a is its share of one process's micro-batch a
    # (gpt/data.py), so the router's counts and the aux loss are those of one process too
    # (and under ZeRO-3: the other parameters sharded over dp, the experts whole on their rank)
    want, got = losses(tmp_path / "single-acc2"), losses(tmp_path / "ep2-zero3-acc2")
    for it in range(10):
        assert float(got[it][0]) == pytest.approx(float(want[it][0]), rel=1e-5), ("ep2-zero3-acc2", it)
    aux = {name: [float(r["moe_aux_loss"]) for r in _rows(tmp_path / name)] for name in ("single", "ep2", "pp2")}
    assert aux["ep2"] == pytest.approx(aux["single"], rel=1e-4) and aux["pp2"] == pytest.approx(aux["single"], rel=1e-4)
    for name in ("single", "ep2", "pp2"):
        rows = _rows(tmp_path / name)
        assert len(rows) == 10
        for r in rows:  # every step: 16 sequences x 32 tokens x top-2 x 2 blocks, dropless
            assert sum(float(r[f"moe_tokens_e{i}"]) for i in range(4)) == 16 * 32 * 2 * 2
            assert float(r["moe_dropped"]) == 0 and 1.0 <= float(r["moe_aux_loss"]) / 2 < 4.0
    exact, padded = ([float(r["sent_bytes_ep"]) for r in _rows(tmp_path / n)] for n in ("ep2", "ep2-padded"))
    assert all(0 < e < p for e, p in zip(exact, padded))  # the naive all-to-all sends its padding too
    info = json.loads((tmp_path / "ep2" / "run.json").read_text())
    assert info["layout"]["ep"] == 2 and info["layout"]["dp"] == 2
    capsys.readouterr()
    announce_run(cfg(tmp_path, "ep2", nproc=2, ep=2, batch_size=8), info)
    out = capsys.readouterr().out
    assert "ep 2 (of dp): 2 of 4 experts per rank, experts data-parallel over dp/ep = 1" in out


def _rows(out_dir) -> list[dict]:
    """metrics.csv's step rows (those with the router's columns)."""
    with open(out_dir / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r["moe_tokens_e0"]]


# Frozen parameters among the experts and the router, accumulation and bf16 autocast, under ep=2
# with DDP and with ZeRO-3 (the two ends: nothing sharded, everything sharded): one process's run.
# fp32: summation order only (measured 2.2e-5 after 3 AdamW steps at lr 1e-2); bf16 rounds every
# matmul to 8 bits, differently for other batch sizes, as for the dense model
# (tests/test_parallel_data.py's CORNER_TOL; measured 3.2e-2 here).
MOE_CORNER = dict(SMALL, n_expert=4, top_k=2, dropout=0.0)
MOE_FROZEN = ("transformer.h.0.mlp.router.weight", "transformer.h.0.mlp.experts.w_fc",
              "transformer.h.1.mlp.experts.b_proj")
MOE_CORNER_TOL = {"float32": 1e-4, "bfloat16": 5e-2}


def _moe_corner_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MOE_CORNER))
    for name, p in model.named_parameters():
        p.requires_grad_(name not in MOE_FROZEN)
    return model


def _moe_corner_batch(step: int, n: int):
    idx = torch.randint(0, MOE_CORNER["vocab_size"], (2, n, MOE_CORNER["block_size"] + 1),
                        generator=torch.Generator().manual_seed(step))  # (accum, rows, T + 1)
    return idx[..., :-1].contiguous(), idx[..., 1:].contiguous()


def _moe_corner_run(strategy_name: str, dtype: str, rank: int = 0, world_size: int = 1):
    strategy = parallelize(_moe_corner_model(), optimizer_factory(TrainConfig(learning_rate=1e-2)), strategy_name,
                           ep=world_size, model_parallel=world_size > 1)
    rows = 4 // world_size  # the global batch: 2 micro-batches of 4 rows
    mine = slice(rows * rank, rows * (rank + 1))
    for step in range(3):
        x, y = _moe_corner_batch(step, 4)
        train_step(strategy, x[:, mine], y[:, mine], grad_clip=1.0, precision=Precision.for_dtype("cpu", dtype))
    return strategy.state_dict()["model"]


def _moe_corner_worker(rank: int, world_size: int) -> dict:
    return {(s, dtype): _moe_corner_run(s, dtype, rank, world_size)
            for s in ("ddp", "zero3") for dtype in MOE_CORNER_TOL}


@pytest.mark.timeout(240)
def test_experts_with_frozen_parameters_and_bf16_equal_one_process():
    got = run_ranks(_moe_corner_worker, 2)[0]
    start = _moe_corner_model().state_dict()
    for dtype, tol in MOE_CORNER_TOL.items():
        want = _moe_corner_run("single", dtype)
        for (name, d), state in got.items():
            if d != dtype:
                continue
            diff = max((state[k].float() - want[k].float()).abs().max().item() for k in want)
            assert diff <= tol, (name, dtype, diff)
            assert all(torch.equal(state[k], start[k]) for k in MOE_FROZEN), (name, dtype)  # frozen: untouched
            assert not torch.equal(state["transformer.h.1.mlp.router.weight"], start["transformer.h.1.mlp.router.weight"])
