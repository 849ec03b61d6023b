"""Mixture of experts: the MLP of a GPT block replaced by routed experts (model code: no strategy).

With ``n_expert > 0`` (:class:`course_lib.registry.MoEConfig`, fields of ``GPTConfig``) EVERY
block's MLP is a :class:`MoE` layer. For each token x (a row of the (B*T, C) residual stream):

    p = softmax(x W_r)                      router probabilities over the E experts  (N, E)
    top-k experts e_1..e_k of p, gates g_j = p_{e_j}   (k > 1: renormalised to sum to 1, as GShard
                                            and Mixtral do; k = 1: g = p_e, as Switch Transformer)
    y = sum_j g_j * MLP_{e_j}(x)  [+ MLP_shared(x)]

Token-choice top-k routing: Shazeer et al. 2017, "Outrageously Large Neural Networks: The
Sparsely-Gated Mixture-of-Experts Layer", Sec. 2.1; k = 1: Fedus et al. 2021 (JMLR 2022), "Switch
Transformers", Sec. 2.1; k = 2 and renormalised gates: Lepikhin et al. 2020, "GShard", Sec. 2.2,
and Jiang et al. 2024, "Mixtral of Experts", Sec. 2.1. The shared expert every token also goes
through: Dai et al. 2024, "DeepSeekMoE", Sec. 3.2. Each expert is a GPT-2 MLP (C -> 4C -> C,
tanh GELU); the E experts' weights are stacked, (E, 4C, C) and (E, C, 4C), so expert parallelism
shards them along their first dimension.

The load-balancing loss, Switch Transformers eq. 4 (GShard's l_aux, Sec. 2.2 and Algorithm 1,
has the same form: the fraction of tokens whose first choice is expert e, which has no gradient,
times the mean gate of e, which stands in for it in the differentiable term; summed and divided by
E where Switch multiplies by it):

    aux = E * sum_i f_i * P_i,   f_i = share of the N*k assignments routed to expert i (no gradient),
                                 P_i = mean router probability of expert i over the N tokens

It is 1 when the router is uniform; ``GPT.forward`` adds ``aux_loss_coef * sum over blocks of aux``
to the cross-entropy in training (Switch: alpha = 0.01), so the training loss includes it; in
evaluation (``model.eval()``) the loss is the cross-entropy alone, comparable with a dense model's.
f counts the tokens of ALL data-parallel ranks (the router's ``token_counts`` hook gives the global
counts); P is this rank's mean, so the data-parallel average of the ranks' losses is the global
batch's loss (aux is linear in P once f is fixed).

Capacity (Switch Transformers, eq. 3; GShard, Sec. 2.2): with ``capacity_factor`` c > 0 each expert
takes at most

    capacity = ceil(c * k * N / E)      N = the tokens of the micro-batch over all data-parallel ranks

assignments; the others are dropped (the token keeps its residual; for that choice the expert
adds nothing, the other choices' gates are not renormalised). Which ones: first-choice assignments
before second-choice ones, then in the order of the tokens in the global micro-batch (the samples
in data-parallel rank order, then positions). Neither the capacity nor the dropped set depends on
the layout: a rank learns how many tokens the ranks before it sent to each expert from the
``token_counts`` hook. Two layouts would break that, and are refused before a run or a
``parallelize`` starts (``registry.moe_grid_error``): a capacity with cp > 1 (the cp ranks split
positions, so the order would follow cp) and experts with sequence parallelism.
``capacity_factor = 0`` is dropless (every assignment is computed; the experts' loads vary).

Both the aux loss and the capacity are per micro-batch: a layout equals one process when its
micro-batches hold the same sequences. The trainer's do, with gradient accumulation too: gpt/data.py
lays a global batch out (micro, rank, row), so the dp ranks' micro-batches a together are micro-batch
a of one process with dp times the rows.

After each forward the layer keeps its statistics (:attr:`MoE.stats`: tokens routed to each expert
on this rank, dropped ones, the aux loss), summed over forwards until :func:`moe_stats` reads and
resets them; :func:`router_imbalance` turns counts into the imbalance per expert and per
expert-parallel rank.

    model = GPT(GPTConfig(n_expert=4, top_k=2, ...)); logits, loss = model(x, y)
    moe_stats(model)   # {"tokens_per_expert": (n_moe_layers, E), "dropped": ..., "aux_loss": float}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn


def capacity(n_tokens: int, n_expert: int, top_k: int, capacity_factor: float) -> int | None:
    """Assignments one expert takes from a micro-batch of ``n_tokens`` tokens (all ranks'):
    ceil(capacity_factor * top_k * n_tokens / n_expert) (Switch Transformers, eq. 3, times k as in
    GShard); None when dropless (``capacity_factor == 0``)."""
    if not capacity_factor:
        return None
    # exact arithmetic on the factor as written (its shortest decimal, repr): in floats
    # 1.1 * 100 / 2 = 55.00000000000001, which ceil would round up to one slot more than the rule
    return math.ceil(Fraction(repr(float(capacity_factor))) * top_k * n_tokens / n_expert)


class Experts(nn.Module):
    """``n_expert`` GPT-2 MLPs with their weights stacked (nn.Linear's (out, in) layout per expert):
    w_fc (E, 4C, C), b_fc (E, 4C), w_proj (E, C, 4C), b_proj (E, C). Expert parallelism keeps a
    slice of E on each rank (``n_expert`` is then the local number)."""

    def __init__(self, n_expert: int, n_embd: int, bias: bool):
        super().__init__()
        H = 4 * n_embd
        self.w_fc = nn.Parameter(torch.empty(n_expert, H, n_embd))
        self.w_proj = nn.Parameter(torch.empty(n_expert, n_embd, H))
        self.b_fc = nn.Parameter(torch.zeros(n_expert, H)) if bias else None
        self.b_proj = nn.Parameter(torch.zeros(n_expert, n_embd)) if bias else None
        for b in (self.b_fc, self.b_proj):
            if b is not None:
                b.is_bias = True  # no weight decay (model.adamw_param_groups), though 2-D

    @torch.no_grad()
    def reset_parameters(self, std: float, proj_std: float) -> None:
        """GPT-2's initialisation of each expert's MLP (the output projection scaled for depth)."""
        nn.init.normal_(self.w_fc, mean=0.0, std=std)
        nn.init.normal_(self.w_proj, mean=0.0, std=proj_std)
        for b in (self.b_fc, self.b_proj):
            if b is not None:
                nn.init.zeros_(b)

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """x (M, C): rows sorted by expert, ``counts[e]`` rows for expert e -> (M, C)."""
        out = []
        for e, xe in enumerate(x.split(list(counts))):
            h = F.gelu(F.linear(xe, self.w_fc[e], None if self.b_fc is None else self.b_fc[e]), approximate="tanh")
            out.append(F.linear(h, self.w_proj[e], None if self.b_proj is None else self.b_proj[e]))
        return torch.cat(out) if out else x[:0]


class MoE(nn.Module):
    """Router, routed experts and the optional shared expert; ``forward(x (B, T, C)) -> (B, T, C)``.

    Two hooks, which expert parallelism overrides (:mod:`course_lib.parallel.expert.layer`):
    :meth:`token_counts` (how many assignments of each choice went to each expert on the ranks
    before this one, and in all) and :meth:`run_experts` (the sorted assignments through their
    experts). Alone, this process is the whole micro-batch and holds every expert."""

    def __init__(self, cfg, mlp_factory=None, n_local_expert: int | None = None):
        """``mlp_factory(cfg)`` builds the shared expert; ``n_local_expert``: how many of the
        experts this module holds (expert parallelism; default all)."""
        super().__init__()
        self.n_expert, self.top_k = cfg.n_expert, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)  # W_r
        self.experts = Experts(n_local_expert or cfg.n_expert, cfg.n_embd, cfg.bias)
        self.shared = mlp_factory(cfg) if cfg.n_shared_expert else None
        self.aux_loss: torch.Tensor | None = None  # the last forward's, with its graph
        self.stats = _empty_stats(cfg.n_expert)

    # --- the hooks ------------------------------------------------------------------------------
    def token_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """counts (k, E): this rank's assignments per choice and expert -> (before, total), both
        (k, E): those of the ranks before this one in the global micro-batch, and of all ranks."""
        return torch.zeros_like(counts), counts

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, C) sorted by expert, counts (E,) -> each row through its expert, (M, C)."""
        return self.experts(x, counts.tolist())

    # --- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        E, k = self.n_expert, self.top_k
        h = x.reshape(B * T, C)  # (N, C)
        N = h.shape[0]
        logits = self.router(h)  # (N, E)
        # the router's softmax in at least fp32 (Switch Transformers, Sec. 2.4: selective precision)
        probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        gate, choice = probs.topk(k, dim=-1)  # (N, k) each
        if k > 1:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        onehot = F.one_hot(choice, E)  # (N, k, E)
        counts = onehot.sum(0)  # (k, E) assignments per choice and expert, this rank
        before, total = self.token_counts(counts)
        n_global = int(total[0].sum())  # every token makes one first choice
        # load-balancing loss (Switch eq. 4): f from every rank's counts, P from this rank's tokens
        f = total.sum(0).to(probs.dtype) / (k * n_global)
        self.aux_loss = E * (f * probs.mean(0)).sum()
        keep = torch.ones(N, k, dtype=torch.bool, device=h.device)
        cap = capacity(n_global, E, k, self.capacity_factor)
        if cap is not None:
            # position of each assignment in its expert's queue: earlier choices first (all ranks),
            # then the ranks before this one, then this rank's earlier tokens
            earlier_choices = total.cumsum(0) - total  # (k, E)
            rank_in_local = (onehot.cumsum(0) - onehot).gather(2, choice.unsqueeze(-1)).squeeze(-1)  # (N, k)
            offset = (earlier_choices + before).gather(1, choice.T).T  # (N, k)
            keep = rank_in_local + offset < cap
        # dispatch: this rank's kept assignments, sorted by expert (stable: token order within one)
        flat_expert = choice.reshape(-1)[keep.reshape(-1)]
        token = torch.arange(N, device=h.device).repeat_interleave(k)[keep.reshape(-1)]
        flat_gate = gate.reshape(-1)[keep.reshape(-1)]
        order = torch.argsort(flat_expert, stable=True)
        token, flat_gate = token[order], flat_gate[order]
        per_expert = torch.bincount(flat_expert, minlength=E)  # (E,) kept assignments
        y = self.run_experts(h[token], per_expert)  # (M, C)
        # combine: gate-weighted sum of each token's experts (a dropped choice adds nothing)
        out = h.new_zeros(N, C, dtype=y.dtype).index_add(0, token, y * flat_gate.unsqueeze(-1).to(y.dtype))
        if self.shared is not None:
            out = out + self.shared(x).reshape(N, C)
        routed = counts.sum(0).detach()
        s = self.stats
        s["tokens_per_expert"] += routed.to(s["tokens_per_expert"].device)
        s["dropped"] += (routed - per_expert).to(s["dropped"].device)
        s["aux_loss"] += self.aux_loss.item()
        s["forwards"] += 1
        return out.view(B, T, C)


def _empty_stats(n_expert: int) -> dict:
    return {"tokens_per_expert": torch.zeros(n_expert, dtype=torch.long),
            "dropped": torch.zeros(n_expert, dtype=torch.long), "aux_loss": 0.0, "forwards": 0}


def moe_layers(module: nn.Module) -> list[MoE]:
    """The MoE layers of a model (a GPT or a stage of one), in block order."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def aux_loss(module: nn.Module) -> torch.Tensor | float:
    """Sum of the load-balancing losses of the last forward over the MoE blocks (0.0 without)."""
    losses = [m.aux_loss for m in moe_layers(module) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else 0.0


def moe_stats(module: nn.Module, reset: bool = True) -> dict | None:
    """The router statistics on this rank since the last reset, None for a dense model:
    ``tokens_per_expert`` and ``dropped`` (n_moe_layers, E) counts of assignments (this rank's
    tokens, every forward: training and evaluation), ``aux_loss`` the mean per forward of the
    load-balancing loss summed over the layers, ``forwards`` per layer."""
    layers = moe_layers(module)
    if not layers:
        return None
    out = {"tokens_per_expert": torch.stack([m.stats["tokens_per_expert"] for m in layers]),
           "dropped": torch.stack([m.stats["dropped"] for m in layers]),
           "forwards": layers[0].stats["forwards"]}
    out["aux_loss"] = sum(m.stats["aux_loss"] / max(m.stats["forwards"], 1) for m in layers)
    if reset:
        for m in layers:
            m.stats = _empty_stats(m.n_expert)
    return out


def router_imbalance(tokens_per_expert, ep: int = 1) -> dict:
    """How unevenly the router loads the experts, from assignment counts per expert (E,) (or
    (layers, E), summed over layers first). Per expert: load_e / mean load; per expert-parallel
    rank (rank r holds experts [r E/ep, (r+1) E/ep)): its tokens / mean over ranks. The maxima are
    the slowdown of the busiest expert / rank against a perfectly balanced router (the step waits
    for the slowest: the "max violation" of Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing
    Strategy for Mixture-of-Experts", Sec. 4.1, is max - 1). 1.0 = balanced."""
    t = torch.as_tensor(tokens_per_expert, dtype=torch.float64)
    if t.dim() == 2:
        t = t.sum(0)
    E = t.numel()
    if E % ep:
        raise ValueError(f"ep ({ep}) must divide the number of experts ({E})")
    mean = t.mean()
    per_expert = (t / mean) if mean > 0 else torch.ones_like(t)
    per_rank_tokens = t.view(ep, E // ep).sum(1)
    per_rank = per_rank_tokens / per_rank_tokens.mean() if mean > 0 else torch.ones(ep, dtype=torch.float64)
    return {"per_expert": per_expert.tolist(), "per_rank": per_rank.tolist(),
            "expert_max_over_mean": per_expert.max().item(), "rank_max_over_mean": per_rank.max().item(),
            "tokens_per_rank": per_rank_tokens.tolist()}


def upcycle_state_dict(dense: dict[str, torch.Tensor], n_expert: int) -> dict[str, torch.Tensor]:
    """A dense GPT's state dict as an MoE GPT's with ``n_expert`` copies of each block's MLP and
    a zero router (uniform routing): Komatsuzaki et al. 2023, "Sparse Upcycling: Training
    Mixture-of-Experts from Dense Checkpoints", Sec. 3. With one expert and k = 1 the MoE model
    computes exactly the dense one (its gate is softmax of one logit = 1)."""
    out = {}
    for name, t in dense.items():
        prefix, _, leaf = name.rpartition(".mlp.")
        if not _:
            out[name] = t
            continue
        which = {"c_fc.weight": "w_fc", "c_fc.bias": "b_fc", "c_proj.weight": "w_proj", "c_proj.bias": "b_proj"}[leaf]
        out[f"{prefix}.mlp.experts.{which}"] = t.unsqueeze(0).repeat(n_expert, *[1] * t.dim()).clone()
        if leaf == "c_fc.weight":
            out[f"{prefix}.mlp.router.weight"] = t.new_zeros(n_expert, t.shape[1])
    return out
