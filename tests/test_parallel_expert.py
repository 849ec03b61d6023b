"""Expert parallelism of the course GPT's mixture of experts equals one process on real gloo ranks.

A tiny MoE GPT (n_layer 2, n_embd 32, block 16, 4 experts, top-2, a bias) trains 10 steps in
float64 under several dp x ep layouts (ep carved out of dp: ``dp`` below is the data-parallel
degree, dp/ep the experts' replicas), one with tp, one with a capacity factor and one with the
padded all-to-all; its per-step losses must be within 1e-5 relative of one process on the same
global batch (within ~1e-12 in float64; ZeRO-1/2/3 on the non-expert parameters run in float32),
its full state dict equal, and with a capacity factor the
dropped assignments (summed over the ranks) equal one process's: the capacity rule does not
depend on the layout. The all-to-all's counted bytes equal the arithmetic of
``parallel.expert.comms`` (written out below).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist

from course_lib.gpt.model import GPT, GPTConfig
from course_lib.gpt.moe import moe_stats
from course_lib.launch.spawn import run_ranks
from course_lib.parallel.comms import Comms
from course_lib.parallel.expert.comms import combine, dispatch
from course_lib.parallel.parallelize import parallelize
from course_lib.parallel.step import train_step
from course_lib.trainer.config import TrainConfig
from course_lib.trainer.loop import optimizer_factory

CFG = GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_embd=32, bias=True, n_expert=4, top_k=2,
                n_shared_expert=1)
TRAIN = TrainConfig(learning_rate=1e-2)
B, STEPS = 2, 10
PAD = 8  # rows per peer in the padded all-to-all test (the same on every rank; at most 4 are real)


def batch(step: int, dp: int):
    """The global batch of a step: (1, B * dp, T) inputs and targets."""
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, CFG.vocab_size, (1, B * dp, CFG.block_size + 1), generator=g)
    return idx[..., :-1].contiguous(), idx[..., 1:].contiguous()


@functools.cache  # several layouts share a global batch
def reference(cfg: GPTConfig, dp: int, dtype=torch.float64):
    """One process, the same global batches: losses, the full state, dropped assignments per step."""
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    opt = optimizer_factory(TRAIN)(model)
    losses, dropped = [], []
    for s in range(STEPS):
        x, y = batch(s, dp)
        loss = model(x[0], y[0])[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        dropped.append(moe_stats(model)["dropped"])
    return losses, model.state_dict(), dropped


def layout(tp=1, ep=1, cp=1, pp=1, capacity_factor=0.0, padded=False, strategy="ddp"):
    """ZeRO keeps fp32 master shards: its layouts train in float32, the others in float64."""
    dtype = torch.float32 if strategy.startswith("zero") else torch.float64
    return {"tp": tp, "ep": ep, "cp": cp, "pp": pp, "capacity_factor": capacity_factor, "padded": padded,
            "strategy": strategy, "dtype": dtype}


LAYOUTS_4 = {  # dp = 4 / tp; the experts' replicas dp / ep
    "dp4-ep1": layout(),
    "dp4-ep2": layout(ep=2),
    "dp4-ep4": layout(ep=4),
    "tp2-dp2-ep2": layout(tp=2, ep=2),
    "cp2-dp2-ep2": layout(cp=2, ep=2),
    "pp2-dp2-ep2": layout(pp=2, ep=2),  # the first stage's load-balancing loss through the pipeline
    "dp4-ep2-capacity": layout(ep=2, capacity_factor=1.0),
    "dp4-ep4-padded": layout(ep=4, padded=True),
    "dp4-ep2-zero1": layout(ep=2, strategy="zero1"),  # ZeRO on the other parameters, experts apart
    "tp2-dp2-ep2-zero2": layout(tp=2, ep=2, strategy="zero2"),
    "tp2-dp2-ep2-zero3": layout(tp=2, ep=2, strategy="zero3"),  # ZeRO-3 shards the rest, the experts whole
    "pp2-dp2-ep2-zero3": layout(pp=2, ep=2, strategy="zero3"),
}
LAYOUTS_8 = {"dp8-ep4": layout(ep=4)}


def train_layout(lay: dict):
    """Every rank: the strategy on its place of the grid, STEPS steps; losses, state, dropped, bytes."""
    cfg = dataclasses.replace(CFG, capacity_factor=lay["capacity_factor"])
    torch.manual_seed(0)
    strategy = parallelize(GPT(cfg).to(lay["dtype"]), optimizer_factory(TRAIN), lay["strategy"], tp=lay["tp"],
                           cp=lay["cp"], pp=lay["pp"], ep=lay["ep"], ep_padded=lay["padded"])
    g = strategy.grid
    losses, dropped = [], []
    for s in range(STEPS):
        x, y = batch(s, g.dp_world_size)
        mine = slice(B * g.dp_rank, B * (g.dp_rank + 1))
        loss = train_step(strategy, x[:, mine], y[:, mine], grad_clip=1.0).loss.reshape(1)
        dist.all_reduce(loss)  # tp ranks hold equal losses, dp ranks their part
        losses.append(loss.item() / g.world_size)
        d = moe_stats(strategy.module)["dropped"] * (g.tp_rank == 0)  # one copy per tp group
        if g.pp_world_size > 1:  # stage r holds blocks [r L/pp, (r+1) L/pp): its rows of (L, E)
            per = CFG.n_layer // g.pp_world_size
            d = torch.cat([torch.zeros(g.pp_rank * per, CFG.n_expert, dtype=d.dtype), d,
                           torch.zeros(CFG.n_layer - (g.pp_rank + 1) * per, CFG.n_expert, dtype=d.dtype)])
        dist.all_reduce(d)
        dropped.append(d)
    figures = strategy.figures()
    state = strategy.state_dict()
    return losses, state, dropped, figures


def reload(state: dict, lay: dict) -> bool:
    """A full state dict loaded into another layout (its ep shards) gives back the same full state."""
    torch.manual_seed(1)  # other initial weights: everything must come from ``state``
    strategy = parallelize(GPT(CFG).double(), optimizer_factory(TRAIN), "ddp", tp=lay["tp"], ep=lay["ep"])
    strategy.load_state_dict(state)
    again = strategy.state_dict()
    same_model = all(torch.equal(again["model"][k], v) for k, v in state["model"].items())
    same_opt = all(torch.equal(torch.as_tensor(again["optimizer"]["state"][i][k]), torch.as_tensor(v))
                   for i, st in state["optimizer"]["state"].items() for k, v in st.items())
    return same_model and same_opt and again["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]


def layouts_worker(rank: int, world_size: int, layouts: dict) -> dict:
    out = {name: train_layout(lay) for name, lay in layouts.items()}
    if world_size == 4:
        out["a2a"] = a2a_bytes(rank, world_size)
        out["reload"] = reload(out["dp4-ep2"][1], layout(ep=4)) and reload(out["dp4-ep4"][1], layout(tp=2, ep=2))
    return {k: v if rank == 0 or k in ("a2a", "reload") else (v[0], None, v[2], v[3]) for k, v in out.items()}


def a2a_bytes(rank: int, world_size: int) -> dict:
    """dispatch -> (experts: x 2) -> combine -> backward, on known counts, exact and padded."""
    ep, n_local, C = world_size, 2, 3
    comms = Comms()
    counts = torch.tensor([(rank + e) % 3 for e in range(ep * n_local)])  # (E,) rows to each expert
    x = torch.randn(int(counts.sum()), C, dtype=torch.float64, requires_grad=True)
    out = {}
    for padded in (False, True):
        comms.reset()
        send = counts.view(ep, n_local)
        recv, recv_counts = dispatch(x, send, comms, padded, pad_rows=PAD)
        y = combine(recv * 2, send, recv_counts, comms, padded, pad_rows=PAD)
        y.sum().backward()
        out[padded] = {"sent": comms.sent["all_to_all"], "volume": comms.volume["all_to_all"],
                       "calls": comms.calls["all_to_all"], "y_is_2x": torch.equal(y, 2 * x.detach()),
                       "grad_is_2": torch.equal(x.grad, torch.full_like(x, 2.0)),
                       "recv_counts": recv_counts.tolist()}
        x.grad = None
    return out


@pytest.fixture(scope="module")
def results_4():
    return run_ranks(layouts_worker, 4, LAYOUTS_4, timeout=240)


def assert_equal_to_one_process(name: str, lay: dict, results: list, world_size: int):
    dp = world_size // (lay["tp"] * lay["cp"] * lay["pp"])
    cfg = dataclasses.replace(CFG, capacity_factor=lay["capacity_factor"])
    ref_losses, ref_state, ref_dropped = reference(cfg, dp, lay["dtype"])
    losses, state, dropped, _ = results[0][name]
    assert max(abs(a - b) / a for a, b in zip(losses, ref_losses)) < 1e-5, (name, losses, ref_losses)
    exact = lay["dtype"] == torch.float64
    if exact:
        assert max(abs(a - b) / a for a, b in zip(losses, ref_losses)) < 1e-10, name  # in fact float64-exact
    assert all(r[name][0] == losses for r in results), name  # every rank reports the same losses
    assert list(state["model"]) == list(ref_state), name  # the one full format
    for k, v in ref_state.items():
        assert torch.allclose(state["model"][k], v, atol=1e-9 if exact else 2e-4, rtol=0), (name, k)
    for got, want in zip(dropped, ref_dropped):
        assert torch.equal(got, want), (name, got, want)
    return ref_dropped


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", LAYOUTS_4)
def test_dp_x_ep_layouts_on_4_ranks_equal_one_process(results_4, name):
    ref_dropped = assert_equal_to_one_process(name, LAYOUTS_4[name], results_4, 4)
    dropped = sum(int(d.sum()) for d in ref_dropped)
    if LAYOUTS_4[name]["capacity_factor"]:
        assert dropped > 0  # the capacity bites, and the layout drops the same assignments
    else:
        assert dropped == 0  # dropless
    figures = results_4[0][name][3]
    if LAYOUTS_4[name]["ep"] > 1:  # the all-to-all is counted on its own group
        assert figures["sent_bytes_ep"] > 0 and figures["sent_bytes_router"] > 0
    else:
        assert figures["sent_bytes_ep"] == 0


def test_all_to_all_bytes_equal_their_arithmetic(results_4):
    """Per exchange (forward counts, dispatch, combine; backward: combine, dispatch), what leaves
    rank r: counts (ep-1) * E/ep * 8 bytes; rows: exact (M - own) and (R - own_recv) rows of C
    float64 each way, twice (forward and backward); padded: (ep - 1) * pad rows for each of the 4."""
    ep, n_local, C, e = 4, 2, 3, 8
    for rank, res in enumerate(r["a2a"] for r in results_4):
        counts = [(rank + x) % 3 for x in range(ep * n_local)]
        send = [sum(counts[j * n_local:(j + 1) * n_local]) for j in range(ep)]
        recv = [sum((j + x) % 3 for x in range(rank * n_local, (rank + 1) * n_local)) for j in range(ep)]
        M, R = sum(send), sum(recv)
        counts_sent = (ep - 1) * n_local * 8
        for padded, got in res.items():
            assert got["y_is_2x"] and got["grad_is_2"], (rank, padded)
            assert [sum(row) for row in got["recv_counts"]] == recv
            assert got["calls"] == 5  # counts, dispatch, combine, and the two in backward
            if padded:
                want_sent = counts_sent + 4 * (ep - 1) * PAD * C * e
                want_volume = ep * n_local * 8 + 4 * ep * PAD * C * e
            else:
                want_sent = counts_sent + 2 * ((M - send[rank]) + (R - recv[rank])) * C * e
                want_volume = ep * n_local * 8 + 2 * (M + R) * C * e
            assert got["sent"] == want_sent, (rank, padded)
            assert got["volume"] == want_volume, (rank, padded)


def test_a_full_state_moves_between_ep_layouts(results_4):
    """dp4-ep2's full state into dp4-ep4, dp4-ep4's into tp2-dp2-ep2: the same full state back."""
    assert all(r["reload"] for r in results_4)


@pytest.mark.timeout(300)
def test_dp8_ep4_on_8_ranks_equals_one_process():
    results = run_ranks(layouts_worker, 8, LAYOUTS_8, timeout=240)
    assert_equal_to_one_process("dp8-ep4", LAYOUTS_8["dp8-ep4"], results, 8)


# parallelize refuses the MoE layouts the run's configuration refuses (registry.moe_grid_error),
# before any collective: experts with sequence parallelism, and a capacity factor with cp > 1
def _refused_worker(rank: int, world_size: int) -> dict:
    out = {}
    cases = {"sp": (CFG, {"tp": 2, "sequence_parallel": True}),
             "capacity-cp": (dataclasses.replace(CFG, capacity_factor=0.5), {"cp": 2})}
    for name, (cfg, kw) in cases.items():
        torch.manual_seed(0)
        try:
            parallelize(GPT(cfg).double(), optimizer_factory(TRAIN), "ddp", **kw)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    torch.manual_seed(0)  # the same ranks still build a grid: tp=2 without sp equals one process
    strategy = parallelize(GPT(CFG).double(), optimizer_factory(TRAIN), "ddp", tp=2)
    x, y = batch(0, 1)
    out["tp2"] = float(train_step(strategy, x, y, grad_clip=1.0).loss)
    return out


@pytest.mark.timeout(120)
def test_parallelize_refuses_moe_layouts_that_do_not_equal_one_process():
    results = run_ranks(_refused_worker, 2, timeout=90)
    torch.manual_seed(0)
    x, y = batch(0, 1)
    want = GPT(CFG).double()(x[0], y[0])[1].item()
    for r in results:
        assert r["sp"] is not None and "n_expert with sequence_parallel is not supported" in r["sp"], r
        assert r["capacity-cp"] is not None and "capacity_factor with cp > 1 is not supported" in r["capacity-cp"], r
        assert r["tp2"] == pytest.approx(want, rel=1e-12)
