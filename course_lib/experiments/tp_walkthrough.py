"""One tensor-parallel MLP taken apart across notebook cells (lesson 10, on the ranks of ``%ranks``).

    %%ranks
    from course_lib.experiments.tp_walkthrough import TPLayer
    layer = TPLayer(n_embd=8)                 # the same dense MLP on every rank, then its shards
    shards = layer.shards()                   # this rank's pieces of c_fc and c_proj
    parts = layer.forward_parts(x)            # x A_i, the partial product, the all-reduced output

    shard_shapes(ranks.pull("shards"))        # in the notebook: what each rank holds
    compare_with_dense(ranks.pull("shards"), ranks.pull("parts"), n_embd=8, x=x)

Megatron-LM's MLP split (Shoeybi et al. 2019, Sec. 3, Figure 3a): c_fc, A (C -> 4C), is split by
columns, so rank i computes GELU(x A_i) with no communication; c_proj, B (4C -> C), by rows, so
rank i's product GELU(x A_i) B_i is only a part of the output, and one all-reduce (g) sums the
parts. The layer is :class:`course_lib.parallel.tensor.layers.TensorParallelMLP`, the one the
course's tensor-parallel GPT uses.
"""

from __future__ import annotations

import torch
from torch import nn

from course_lib.gpt.model import MLP, GPTConfig
from course_lib.parallel.comms import Comms
from course_lib.parallel.tensor.layers import TensorParallelMLP


def dense_mlp(n_embd: int, seed: int = 0) -> MLP:
    """The unsplit MLP every rank starts from (the same seed gives the same weights)."""
    torch.manual_seed(seed)
    return MLP(GPTConfig(n_embd=n_embd, n_head=1, bias=True, dropout=0.0))


class TPLayer:
    """This rank's half (third, ...) of one MLP, and what it computes."""

    def __init__(self, n_embd: int = 8, seed: int = 0, group=None):
        self.comms = Comms(group)
        self.tp_rank, self.tp_world_size = self.comms.rank, self.comms.world_size
        dense = dense_mlp(n_embd, seed)
        self.layer = TensorParallelMLP(dense.c_fc, dense.c_proj, self.comms)

    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's parameters: c_fc by output rows (4C/tp, C), c_proj by input columns (C, 4C/tp);
        c_proj's bias is whole on every rank (added once, after the sum)."""
        return {name: p.detach().clone() for name, p in self.layer.named_parameters()}

    @torch.no_grad()
    def forward_parts(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, T, C) in; this rank's hidden GELU(x A_i) (B, T, 4C/tp), its partial product
        h_i B_i (B, T, C), and the output after the all-reduce (B, T, C, equal on every rank)."""
        hidden = self.layer.gelu(self.layer.c_fc(x))
        partial = nn.functional.linear(hidden, self.layer.c_proj.weight)
        return {"hidden": hidden, "partial": partial, "output": self.layer(x)}


def shard_shapes(pulled: list[dict[str, torch.Tensor]]):
    """What each rank holds: a row per rank and parameter, its shape and number of values."""
    # pandas only for the notebook's table: every %ranks engine imports this module
    import pandas as pd

    rows = [{"rank": r, "parameter": name, "shape": tuple(t.shape), "values": t.numel()}
            for r, shards in enumerate(pulled) for name, t in shards.items()]
    return pd.DataFrame(rows).set_index(["parameter", "rank"]).sort_index()


def reassemble(pulled: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The dense MLP's parameters put back together from the ranks' shards."""
    cat = {"c_fc.weight": 0, "c_fc.bias": 0, "c_proj.weight": 1}  # the split dimension of each
    return {name: torch.cat([s[name] for s in pulled], dim=cat[name]) if name in cat else pulled[0][name]
            for name in pulled[0]}


def compare_with_dense(shards: list[dict], parts: list[dict], n_embd: int, x: torch.Tensor, seed: int = 0):
    """Largest differences from the dense MLP: the shards put back together, the sum of the
    partial products, and each rank's all-reduced output."""
    # pandas only for the notebook's table: every %ranks engine imports this module
    import pandas as pd

    dense = dense_mlp(n_embd, seed)
    full = reassemble(shards)
    with torch.no_grad():
        want = dense(x)
    gaps = {f"reassembled {k}": (full[k] - v).abs().max().item() for k, v in dense.state_dict().items()}
    gaps["sum of the partial products + bias"] = (sum(p["partial"] for p in parts) + dense.c_proj.bias
                                                 - want).abs().max().item()
    gaps.update({f"rank {r} output": (p["output"] - want).abs().max().item() for r, p in enumerate(parts)})
    gaps["one rank's partial alone"] = (parts[0]["partial"] + dense.c_proj.bias - want).abs().max().item()
    return pd.Series(gaps, name="max |difference from the dense MLP|")
