"""One ZeRO step taken apart across notebook cells (lesson 04, on the ranks of ``%ranks``).

    %%ranks                                   # on every rank
    from course_lib.experiments.zero_walkthrough import ZeroWalk
    walk = ZeroWalk(["zero1", "zero2", "zero3"], gpt=dict(...), batch_size=4)
    walk.forward_backward(); report = walk.report()     # one cell per phase
    walk.step(); report = walk.report()

    shard_table(ranks.pull("report"))          # in the notebook: a row per strategy and rank

Each strategy starts from the same weights and sees the same data (rank r takes rows r, r + N, ...
of the global batch), as :func:`course_lib.experiments.memory_measure.measure_strategies` does,
but the trainer's step (:mod:`course_lib.parallel.step`) is run in its two halves,
``forward_backward`` and ``optimizer_step``, so that each rank's bytes of parameters, gradients
and optimizer states can be looked at between them, next to the ZeRO paper's model of them
(:func:`course_lib.analysis.memory.model_state_bytes`, fp32 AdamW: 4 + 4 + 8 bytes per
parameter, divided by N from stage 1, 2 or 3 on). :func:`single_process_step` is the reference: the
same AdamW step on the whole batch in one process, which every stage must reproduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.analysis.memory import model_state_bytes
from course_lib.experiments.memory_measure import PeakTracker
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.parallel.footprint import measure_model_states
from course_lib.parallel.step import forward_backward, optimizer_step, train_step
from course_lib.parallel.strategy import build_strategy

STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
ZERO_PHASES = ("built", "after backward", "after step")


def global_batch(cfg: GPTConfig, batch_size: int, world_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch, (batch_size * world_size, block_size) inputs and targets."""
    gen = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, cfg.vocab_size, (batch_size * world_size, cfg.block_size + 1), generator=gen)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _adamw(lr: float):
    return lambda m: torch.optim.AdamW(m.parameters(), lr=lr, foreach=True)


class ZeroWalk:
    """The strategies ``names`` side by side on this rank, stepped phase by phase."""

    def __init__(self, names, gpt: dict, batch_size: int, lr: float = 1e-3, seed: int = 0,
                 bucket_cap_mb: float = 25.0):
        unknown = [n for n in names if n not in STAGE]
        if unknown:
            raise ValueError(f"ZeroWalk takes {sorted(STAGE)}, got {unknown}")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.cfg = GPTConfig(**gpt)
        x, y = global_batch(self.cfg, batch_size, self.world_size, seed)
        # this rank's rows: r, r + N, ... (the same slices measure_strategies takes)
        self.x, self.y = x[self.rank::self.world_size].contiguous(), y[self.rank::self.world_size].contiguous()
        self.runs, self.models, self.grad_peaks = {}, {}, {}
        for name in names:
            torch.manual_seed(seed)  # the same initial weights for every strategy, on every rank
            self.models[name] = GPT(self.cfg)
            extra = {"bucket_cap_mb": bucket_cap_mb} if name != "zero3" else {}  # ZeRO-1/2 reduce by buckets
            self.runs[name] = build_strategy(name, self.models[name], _adamw(lr), **extra)
        self.num_params = GPT(self.cfg).num_params()
        self.phase, self.losses = ZERO_PHASES[0], {}

    def forward_backward(self) -> dict[str, float]:
        """Forward and backward on this rank's micro-batch, gradients communicated (ZeRO: the
        reduce-scatter, which leaves each rank the averaged gradient of its shard). The gradient
        bytes reported are the peak during backward: ZeRO-1 builds every full gradient first."""
        for name, strategy in self.runs.items():
            tracker = PeakTracker(self.models[name], strategy)
            # the first half of the trainer's step, one micro-batch: (1, B, T)
            loss = forward_backward(strategy, self.x[None], self.y[None])
            tracker.sample()
            tracker.remove()
            self.grad_peaks[name] = tracker.peak["grads"]
            self.losses[name] = loss.item()
        self.phase = ZERO_PHASES[1]
        return self.losses

    def step(self) -> None:
        """The optimizer step on this rank's shard (ZeRO-1/2: then the all-gather of parameters),
        and zero_grad, as the trainer does."""
        for strategy in self.runs.values():
            optimizer_step(strategy)  # the second half of the trainer's step (no clipping here)
        self.phase = ZERO_PHASES[2]

    def report(self) -> list[dict]:
        """Bytes this rank holds now, per strategy, next to the model's figure for the phase."""
        rows = []
        for name, strategy in self.runs.items():
            held = measure_model_states(strategy)
            model = model_state_bytes(self.num_params, dp=self.world_size, stage=STAGE[name], dtype="fp32")
            adam = self.phase == ZERO_PHASES[2]  # AdamW creates its moments at the first step
            grads = self.phase == ZERO_PHASES[1]  # zero_grad frees them after the step
            rows.append({"phase": self.phase, "strategy": name, "rank": self.rank,
                         "params B": held.params, "model params B": round(model.params),
                         "grads B": self.grad_peaks[name] if grads else held.grads,
                         "model grads B": round(model.grads) if grads else 0,
                         "optimizer B": held.optimizer, "model optimizer B": round(model.optimizer) if adam else 0})
        return rows

    def full_parameters(self, name: str) -> dict[str, torch.Tensor]:
        """Every parameter of strategy ``name``, whole (a collective for the sharded ones: call it
        on every rank)."""
        return {k: v.clone() for k, v in self.runs[name].state_dict()["model"].items()}


def single_process_step(gpt: dict, batch_size: int, world_size: int, lr: float = 1e-3,
                        seed: int = 0) -> dict[str, torch.Tensor]:
    """The reference: one AdamW step of one process on the whole global batch; its parameters."""
    cfg = GPTConfig(**gpt)
    torch.manual_seed(seed)
    model = GPT(cfg)
    x, y = global_batch(cfg, batch_size, world_size, seed)
    # The ranks' averaged gradient is the gradient of the mean loss over their equal micro-batches:
    # in one process, rank r's rows are micro-batch r of gradient accumulation, (world_size, B, T).
    micro_x, micro_y = (torch.stack([t[r::world_size] for r in range(world_size)]) for t in (x, y))
    train_step(build_strategy("single", model, _adamw(lr)), micro_x, micro_y)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def shard_table(reports: list[list[dict]]):
    """The reports pulled from the ranks as one table: a row per strategy, rank and phase, each byte
    count next to the model's (``measured/model``: 1 up to padding and Adam's step counters, but
    above 1 for ZeRO-2's gradients during backward, whose buckets in flight are still whole)."""
    # pandas only for the notebook's table: every %ranks engine imports this module
    import pandas as pd

    frame = pd.DataFrame([row for rows in reports for row in rows]).set_index(["phase", "strategy", "rank"])
    held = frame[["params B", "grads B", "optimizer B"]].sum(axis=1)
    model = frame[["model params B", "model grads B", "model optimizer B"]].sum(axis=1)
    frame = frame.assign(**{"measured/model": (held / model).round(3)}).reset_index()
    frame["phase"] = pd.Categorical(frame["phase"], ZERO_PHASES, ordered=True)  # in the order they happen
    return frame.sort_values(["strategy", "rank", "phase"]).set_index(["strategy", "rank", "phase"])


def differences(pulled: list[dict[str, dict[str, torch.Tensor]]], reference: dict[str, torch.Tensor]):
    """Largest |parameter - reference| of each strategy on each rank (``pulled``: one dict per rank,
    strategy -> full parameters, as :meth:`ZeroWalk.full_parameters` gives them)."""
    # pandas only for the notebook's table: every %ranks engine imports this module
    import pandas as pd

    return pd.Series({(name, rank): max((params[k] - reference[k]).abs().max().item() for k in reference)
                      for rank, per_rank in enumerate(pulled) for name, params in per_rank.items()},
                     name="max |parameter - one process|").rename_axis(["strategy", "rank"])
