"""What autograd keeps for backward, counted while a forward runs: the activations a rank holds.

    with SavedTensorMeter(model) as meter:
        loss = model(x, y)[1]
    meter.bytes    # bytes of the distinct storages saved for backward, parameters excluded

This is Korthikanti et al. 2022's quantity (the activation memory of training, their Sec. 4),
measured rather than modelled: every tensor an operation saves for its backward passes through a
``saved_tensors_hooks`` pack hook, and each storage is counted once (q, k and v are views of one
matmul output; a tensor saved by two operations is one allocation). With activation
recomputation (``torch.utils.checkpoint``) the recomputed region saves only its inputs, so the
count shows the saving. The trainer measures one micro-batch per logged step and writes it to
``metrics.csv`` next to :func:`modelled_bytes` (``act_mb``, ``act_model_mb``).
"""

from __future__ import annotations

from typing import Self

import torch
from torch import nn

from course_lib.analysis.precision import trainer_activation_bytes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor holds only its shard


class SavedTensorMeter:
    """Count the bytes saved for backward inside the ``with`` (parameters are not activations)."""

    def __init__(self, model: nn.Module):
        self.params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.saved: dict[int, tuple[int, str]] = {}  # storage address -> (bytes, dtype name)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = _local(t).untyped_storage()
        if st.data_ptr() not in self.params:
            self.saved[st.data_ptr()] = (st.nbytes(), str(t.dtype).removeprefix("torch."))
        return t

    @property
    def bytes(self) -> int:
        return sum(n for n, _ in self.saved.values())

    def by_dtype(self) -> dict[str, int]:
        """Bytes per dtype: under autocast, what stayed fp32 and what is 16-bit."""
        out: dict[str, int] = {}
        for n, dtype in self.saved.values():
            out[dtype] = out.get(dtype, 0) + n
        return out

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def modelled_bytes(cfg, vocab_size: int, dtype: str, device_type: str = "cpu") -> float:
    """The activation model for one micro-batch of a trainer run (``cfg`` a TrainConfig):
    :func:`course_lib.analysis.precision.trainer_activation_bytes`."""
    return trainer_activation_bytes(cfg.n_layer, cfg.block_size, cfg.batch_size, cfg.n_embd, cfg.n_head,
                                    vocab_size, dtype, cfg.recompute, cfg.dropout, cfg.bias, device_type)
