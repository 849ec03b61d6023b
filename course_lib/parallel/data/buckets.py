"""The one bucket-closing rule of data parallelism and ZeRO (Li et al. 2020, "PyTorch Distributed",
Sec. 3.2, gradient reduction: DDP's buckets and ``bucket_cap_mb``).

Tensors are taken in backward order (the reverse of definition order, since backward visits the
last layers first) and added to the current bucket; a bucket closes as soon as it holds
``cap_bytes`` or more. The first bucket is therefore complete early in backward and its
collective can start while the rest of backward runs; with its default ``bucket_cap_mb`` PyTorch's
DDP closes its first bucket even earlier, at 1 MiB (``first_cap_bytes``), so that communication
starts sooner.

    groups = bucket_indices([4096, 4096, 512], cap_bytes=8192)     # [[0, 1], [2]]
    buckets = bucket_params(params, bucket_cap_mb=25)               # lists of Parameters

A bucket may mix dtypes (an fp32 norm beside bf16 weights): its flat buffer then takes
:func:`common_dtype`, the widest of them, so no parameter is rounded to a narrower one.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from course_lib.hardware import MiB  # bucket_cap_mb is in MiB, as in torch's DistributedDataParallel


def bucket_indices(sizes: Iterable[int], cap_bytes: float,
                   first_cap_bytes: float | None = None) -> list[list[int]]:
    """Indices of ``sizes`` (bytes, already in backward order) grouped by the closing rule; the
    first bucket closes at ``min(first_cap_bytes, cap_bytes)`` when that is given."""
    if not cap_bytes > 0 or not (first_cap_bytes is None or first_cap_bytes > 0):
        raise ValueError(f"cap_bytes must be > 0, got {cap_bytes!r} (first: {first_cap_bytes!r})")
    buckets, current, filled = [], [], 0
    for i, nbytes in enumerate(sizes):
        current.append(i)
        filled += nbytes
        if filled >= (cap_bytes if buckets or first_cap_bytes is None else min(cap_bytes, first_cap_bytes)):
            buckets.append(current)
            current, filled = [], 0
    return buckets + [current] if current else buckets


def bucket_params(params: list[nn.Parameter], bucket_cap_mb: float,
                  first_bucket_cap_mb: float | None = None) -> list[list[nn.Parameter]]:
    """Parameters (in definition order) -> buckets in backward order (the last parameter first)."""
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    backward = list(reversed(params))
    first = None if first_bucket_cap_mb is None else first_bucket_cap_mb * MiB
    groups = bucket_indices((p.numel() * p.element_size() for p in backward), bucket_cap_mb * MiB, first)
    return [[backward[i] for i in g] for g in groups]


def common_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype a flat buffer for ``tensors`` needs to hold each of them exactly: the widest
    (``torch.promote_types`` over them: fp32 + bf16 -> fp32, bf16 + fp16 -> fp32); one dtype -> itself."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))
