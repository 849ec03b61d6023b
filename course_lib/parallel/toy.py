"""A toy model for the parallelism notebooks and tests: small, fast, with the GPT interface.

``ToyMLP(x, targets) -> (logits, loss)``: a stack of Linear + GELU layers (an ``nn.ModuleList``,
so ZeRO-3 and FSDP treat each layer as a unit) and a classification head. The default widths are
odd so that sharding needs padding, as with real models.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.gpt.model import make_adamw


class ToyMLP(nn.Module):
    def __init__(self, d_in: int = 12, width: int = 37, n_classes: int = 5, n_layers: int = 3):
        super().__init__()
        dims = [d_in] + [width] * n_layers
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.head = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        """x (B, d_in), targets (B,) class ids -> logits (B, n_classes), mean cross-entropy."""
        for layer in self.layers:
            x = F.gelu(layer(x))
        logits = self.head(x)
        return logits, None if targets is None else F.cross_entropy(logits, targets)


def toy_batch(n: int, seed: int, d_in: int = 12, n_classes: int = 5):
    """A reproducible random batch: x (n, d_in), targets (n,)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randint(0, n_classes, (n,), generator=g)


def adamw(model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """The trainer's AdamW (a decayed group of matrices, a non-decayed one of biases): the shape
    of optimizer every strategy must handle."""
    return make_adamw(model, lr, weight_decay, betas=(0.9, 0.95))
