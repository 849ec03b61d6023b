"""Teaching mode: every collective compared across the ranks before it runs, and a flight recorder.

    from course_lib.parallel.collective_check import install_collective_check
    install_collective_check()          # every rank, after init_process_group
    dist.all_reduce(torch.ones(4 + RANK))
    # CollectiveMismatchError on every rank, before gloo sees the call:
    #   collective #1 does not match across ranks: rank 0: all_reduce float32[4]; rank 1: all_reduce float32[5]

Each wrapped ``torch.distributed`` call (``dist.all_reduce(...)`` called by name, as the course's
cells and modules do) first exchanges a small descriptor: the operation, the tensors' dtype and
shape, the root (``src``/``dst``) and the reduce op; what may differ from rank to rank is left out
of the comparison (an ``all_to_all_single`` with split sizes: each rank sends and receives its own
number of rows, so only the dtype and the dims after the first are compared; the list of a
``scatter`` or ``gather``, which only the root passes). An ``all_to_all_single``'s split sizes
travel in the same descriptor and are checked pair by pair instead: what rank i sends rank j (its
``input_split_sizes[j]`` rows) must be what rank j expects from rank i (its
``output_split_sizes[i]``), in elements. The exchange is one ``all_gather`` of an int64 tensor
(its size set by the world size) on a separate gloo group, so mismatched shapes cannot corrupt it.
If the descriptors differ, every rank raises :class:`CollectiveMismatchError` naming each rank's call,
and the real collective is never called: gloo does not abort the process, the group stays usable.
A send or recv whose peer is not a rank (``send(t, dst=5)`` on 2 ranks), or is the rank itself,
is refused at once, without an exchange (there may be no peer to exchange with). What else one
call shows wrong by itself (an ``all_gather`` list or ``reduce_scatter`` input of the wrong length
or size, a ``scatter`` or ``gather`` list on a rank that is not the root or of the wrong length on
the root, :func:`problem`) is named after the exchange, on every rank, so that no rank is left
waiting in it. A point-to-point pair is checked only by its peer: its descriptors are not
exchanged, since a ``recv`` cannot know whether its sender used ``send`` or an unchecked ``isend``.

Not caught: a collective that one rank never calls (there is nothing to compare: the exchange
waits, the pool's time limit names the waiting rank), calls on a sub-group (only the default group
is checked), calls made inside PyTorch (DDP's buckets call c10d directly, not ``dist.X``), and
point-to-point pairs (``send``/``recv``, ``isend``/``irecv``) beyond the peer-range check. PyTorch's own
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (in the environment before torch is imported: torch.distributed
reads it on import) wraps the process group and checks op type, shapes and dtypes of collectives,
internal ones included (so it does catch DDP's), but not the root of a broadcast, nor send/recv.
Like this module, it checks before the collective runs, with an exchange of its own on a gloo group.

The flight recorder keeps each rank's last :data:`RECORD` calls (checked or not) with their state
(``started``, ``done``, ``failed``), :func:`flight_record`; a notebook shows all ranks side by side.
"""

from __future__ import annotations

import collections
import functools
import math
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from course_lib.utils import traceback_to_caller

RECORD = 16  # calls kept by the flight recorder
_WIDTH = 16  # int64 slots of a descriptor's fixed head (all_to_all_single's split sizes follow: _width)
_MAX_NDIM = 6  # shape slots 6..11
_SPLITS = 12  # slot of all_to_all_single's split sizes: 1 if given (row counts may then differ per rank)
_RED = 14  # slot of the reduce op
_OUT = 13  # slot of the output tensor's size (all_gather_into_tensor, reduce_scatter_tensor)
# After the _WIDTH slots, all_to_all_single's split sizes (-1 elsewhere): the number of input and
# output split sizes given (-1: none, an even split), the input's and the output's rows and
# elements per row, then the rows sent to each rank and the rows expected from each rank.
_A2A = 6  # slots before the two split vectors
CHECKED_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
       "reduce_scatter_tensor", "all_to_all_single", "barrier", "scatter", "gather", "send", "recv")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)
_REDUCE = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")


class CollectiveMismatchError(RuntimeError):
    """The ranks called different collectives, or the same with different tensors; raised on every
    rank. ``calls`` maps a rank to its call, as text."""

    def __init__(self, message: str, calls: dict[int, str] | None = None):
        super().__init__(message)
        self.calls = calls or {}

    # IPython leaves out each frame marked ``__tracebackhide__`` except the last one, where the error
    # was raised: here the check's own. The traceback shown ends at the student's call instead.
    _render_traceback_ = traceback_to_caller


class _STATE:
    """The wrapped functions' switch, their side group and the recorder: one per process, so the
    class itself holds them (no instance is made on import)."""

    enabled = False
    side = None  # the gloo group the descriptors travel on
    seq = 0
    generation = 0  # which process group the calls were numbered in
    record: collections.deque = collections.deque(maxlen=RECORD)


def install_collective_check(enabled: bool = True, timeout_s: float | None = None, generation: int = 0) -> None:
    """Wrap the collectives of ``torch.distributed`` (once per process) and (re)make the side
    group; call it on every rank after each ``init_process_group`` (it is itself collective).
    ``timeout_s``: how long an exchange may wait (give the default group's timeout: a rank that
    never calls the collective leaves the others waiting in the exchange). ``generation``: the
    number of this process group (the same on every rank); calls are numbered from 1 within it."""
    for name in CHECKED_OPS:
        fn = getattr(dist, name, None)
        if fn is not None and not hasattr(fn, "__course_checked__"):
            wrapped = _checked(fn, name)
            wrapped.__course_checked__ = fn
            setattr(dist, name, wrapped)
    _STATE.side = dist.new_group(backend="gloo", timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
    if generation != _STATE.generation:
        _STATE.generation, _STATE.seq = generation, 0
    _STATE.enabled = enabled


def side_group():
    """The gloo group the descriptors are exchanged on (None before :func:`install_collective_check`):
    a rank pool sets its timeout with the default group's."""
    return _STATE.side


def forget_side_group() -> None:
    """Before the default group is destroyed (a new one follows): calls pass unchecked until
    :func:`install_collective_check` makes the next side group."""
    _STATE.side = None


def set_collective_check(enabled: bool) -> bool:
    """Turn the comparison on or off (the recorder stays on); returns the previous setting."""
    before, _STATE.enabled = _STATE.enabled, enabled
    return before


def flight_record() -> list[dict]:
    """This rank's last calls, oldest first: group (its generation), seq, op, what (dtype[shape] and
    root), state, seconds ago."""
    now = time.time()
    return [dict(entry, ago_s=round(now - entry.pop("t"), 2)) for entry in map(dict, _STATE.record)]


def describe(code: list[int]) -> str:
    """A descriptor as text: 'all_reduce float32[4]', 'broadcast float32[2, 3] from 1'."""
    op, dtype, ndim = CHECKED_OPS[code[1]], code[2], code[5]
    text = CHECKED_OPS[code[1]]
    if op != "barrier":
        shape = ", ".join(str(d) for d in code[6:6 + ndim])
        text += f" {str(_DTYPES[dtype]).removeprefix('torch.') if 0 <= dtype < len(_DTYPES) else 'other'}[{shape}]"
    if code[4] >= 0:
        text += f" list of {code[4]}"
    if code[3] >= 0:
        text += {"send": " to ", "recv": " from "}.get(op, " from " if op in ("broadcast", "scatter") else " to ") \
            + str(code[3])
    if code[_RED] > 0 and op in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"):
        text += f" op={_REDUCE[code[_RED]]}"
    return text


def _arg(args, kwargs, index: int, *names):
    for name in names:
        if kwargs.get(name) is not None:  # src=None, group_src=1: the root is 1
            return kwargs[name]
    return args[index] if len(args) > index else None


def _width(world: int) -> int:
    """int64 slots of one descriptor on ``world`` ranks (the split sizes need two per rank)."""
    return _WIDTH + _A2A + 2 * world


def _split_sizes(tensor, given, world: int) -> list[int]:
    """[count given, rows, elements per row, rows for each rank...] of one side of an
    all_to_all_single; no split sizes: the even split torch makes (-1s where there is none)."""
    shape = list(tensor.shape) if isinstance(tensor, torch.Tensor) and tensor.dim() else [0]
    rows, row = shape[0], math.prod(shape[1:])
    if given is None or len(given) == 0:
        return [-1, rows, row] + ([rows // world] * world if rows % world == 0 else [-1] * world)
    sizes = [int(s) for s in given][:world]
    return [len(given), rows, row] + sizes + [-1] * (world - len(sizes))


def _descriptor(name: str, args, kwargs, world: int = 1) -> list[int]:
    """The int64 descriptor of one call: seq, op, dtype, root, list length, ndim, shape..., then
    all_to_all_single's split sizes (:func:`_width`)."""
    tensor, root, count, red, out_numel, splits, a2a = None, None, -1, None, -1, -1, None
    if name in ("all_reduce", "broadcast", "reduce", "send", "recv", "scatter", "gather"):
        tensor = _arg(args, kwargs, 0, "tensor")
        # the root's position: scatter(tensor, scatter_list, src), gather(tensor, gather_list, dst)
        at = 2 if name in ("scatter", "gather") else 1
        if name in ("broadcast", "scatter", "recv"):
            root = _arg(args, kwargs, at, "src", "group_src")
        elif name in ("reduce", "send", "gather"):
            root = _arg(args, kwargs, at, "dst", "group_dst")
        if name in ("scatter", "gather"):
            root = 0 if root is None else root  # torch's default root
            tensors = _arg(args, kwargs, 1, f"{name}_list")
            count = len(tensors) if tensors else -1  # torch takes an empty list for none
        if name in ("all_reduce", "reduce"):
            red = _arg(args, kwargs, 2 if name == "reduce" else 1, "op") or dist.ReduceOp.SUM
    elif name == "all_gather":
        tensor, count = _arg(args, kwargs, 1, "tensor"), len(_arg(args, kwargs, 0, "tensor_list"))
    elif name in ("reduce_scatter", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single"):
        tensor = _arg(args, kwargs, 1, "input", "input_list", "input_tensor")
        if isinstance(tensor, list | tuple):
            count, tensor = len(tensor), (tensor[0] if tensor else None)
        if name.startswith("reduce_scatter"):
            red = _arg(args, kwargs, 2, "op") or dist.ReduceOp.SUM
        output = _arg(args, kwargs, 0, "output", "output_tensor")
        out_numel = output.numel() if isinstance(output, torch.Tensor) else -1
        if name == "all_to_all_single":
            given = [_arg(args, kwargs, i, s) for i, s in ((2, "output_split_sizes"), (3, "input_split_sizes"))]
            splits = int(any(s is not None and len(s) > 0 for s in given))
            ins, outs = _split_sizes(tensor, given[1], world), _split_sizes(output, given[0], world)
            a2a = [ins[0], outs[0], ins[1], outs[1], ins[2], outs[2]] + ins[3:] + outs[3:]
    code = [_STATE.seq, CHECKED_OPS.index(name), -1, -1 if root is None else int(root), count, 0] \
        + [-1] * (_width(world) - 6)
    if isinstance(tensor, torch.Tensor):
        code[2] = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
        code[5] = min(tensor.dim(), _MAX_NDIM)
        code[6:6 + code[5]] = list(tensor.shape)[:code[5]]
    code[_OUT] = out_numel
    code[_SPLITS] = splits
    if a2a is not None:
        code[_WIDTH:] = a2a
    if red is not None:
        code[_RED] = _REDUCE.index(str(red).rsplit(".", 1)[-1].upper()) \
            if str(red).rsplit(".", 1)[-1].upper() in _REDUCE else -1
    return code


def problem(code: list[int], world: int, me: int) -> str | None:
    """What is wrong with one call whatever the other ranks do (a peer that is no rank, a list of
    the wrong length, sizes that do not divide among the ranks); None if nothing."""
    name, root = CHECKED_OPS[code[1]], code[3]
    if name in ("send", "recv", "broadcast", "reduce", "scatter", "gather") and root != -1:
        if not 0 <= root < world:
            return f"{describe(code)}: there is no rank {root} (ranks are 0..{world - 1})"
        if name in ("send", "recv") and root == me:
            return f"{describe(code)}: a rank cannot {name} to itself"
        if name in ("scatter", "gather") and root == me and code[4] != world:
            return (f"{describe(code)}: the root's list has {max(code[4], 0)} tensors, "
                    f"{world} ranks need {world}")
        if name in ("scatter", "gather") and root != me and code[4] >= 0:
            return f"{describe(code)}: only the root (rank {root}) passes a list"
    if name in ("all_gather", "reduce_scatter") and code[4] != world:
        return f"{describe(code)}: the list has {code[4]} tensors, {world} ranks need {world}"
    if name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
        numel = 1
        for d in code[6:6 + code[5]]:
            numel *= d
        out = code[_OUT]
        ok = numel == out * world if name == "reduce_scatter_tensor" else out == numel * world
        if not ok:
            return (f"{describe(code)}: input of {numel} and output of {out} elements do not fit "
                    f"{world} ranks")
    if name == "all_to_all_single":
        for side, at in (("input", 0), ("output", 1)):
            given, rows = code[_WIDTH + at], code[_WIDTH + 2 + at]
            sizes = code[_WIDTH + _A2A + at * world:_WIDTH + _A2A + (at + 1) * world]
            if given >= 0 and given != world:
                return f"{describe(code)}: {given} {side}_split_sizes, {world} ranks need {world}"
            if given < 0 and rows % world:
                return (f"{describe(code)}: no {side}_split_sizes and the {side}'s {rows} rows do not "
                        f"divide among {world} ranks")
            if given >= 0 and (min(sizes) < 0 or sum(sizes) != rows):
                return (f"{describe(code)}: {side}_split_sizes {sizes} add up to {sum(sizes)}, "
                        f"the {side} has {rows} rows")
    return None


def _must_agree(code: list[int], uneven: bool) -> list[int]:
    """The part of a descriptor that must be the same on every rank (all but the seq, each rank's
    own count, the split sizes: :func:`_split_mismatch`). ``uneven``: some rank gave
    all_to_all_single split sizes."""
    same = list(code)
    if CHECKED_OPS[code[1]] == "all_to_all_single" and uneven:
        same[6] = same[_OUT] = same[_SPLITS] = -1  # each rank's own row counts in and out
    if CHECKED_OPS[code[1]] in ("scatter", "gather"):
        same[4] = -1  # only the root passes a list (problem() checks it)
    return same[1:_WIDTH]


def _split_mismatch(rows: list[list[int]]) -> list[str]:
    """The pairs of ranks whose all_to_all_single split sizes disagree: rank i sends rank j other
    than rank j expects from rank i (elements: the rows times each tensor's row size)."""
    world, said = len(rows), []

    def where(r: int, at: int, peer: int) -> str:
        side = ("input", "output")[at]
        return f"{side}_split_sizes[{peer}]" if rows[r][_WIDTH + at] >= 0 else f"{side} split evenly"

    for i, src in enumerate(rows):
        for j, dst in enumerate(rows):
            sent, got = src[_WIDTH + _A2A + j], dst[_WIDTH + _A2A + world + i]
            row_in, row_out = src[_WIDTH + 4], dst[_WIDTH + 5]
            if sent * row_in == got * row_out:
                continue
            n_in = f"{sent} row{'s' * (sent != 1)}" + ("" if row_in == row_out else f" of {row_in} elements")
            n_out = str(got) if row_in == row_out else f"{got} row{'s' * (got != 1)} of {row_out} elements"
            to, frm, who = ("itself", "", "") if i == j else (f"rank {j}", f" from rank {i}", f"rank {j} ")
            said.append(f"rank {i} sends {n_in} to {to} ({where(i, 0, j)}) but {who}expects {n_out}{frm} "
                        f"({where(j, 1, i)})")
    return said


def _compare(code: list[int]) -> None:
    """Exchange a collective's descriptors on the side group; raise on every rank if they differ."""
    __tracebackhide__ = True  # read by IPython: the error, not this frame, is the news
    mine = torch.tensor(code, dtype=torch.int64)
    gathered = [torch.zeros(len(code), dtype=torch.int64) for _ in range(dist.get_world_size())]
    c10d.all_gather(gathered, mine, group=_STATE.side)
    rows = [g.tolist() for g in gathered]
    wrong = {r: problem(row, len(rows), r) for r, row in enumerate(rows)}
    wrong = {r: text for r, text in wrong.items() if text}
    if wrong:
        raise CollectiveMismatchError(f"collective #{code[0]}: " + "; ".join(
            f"rank {r}: {text}" for r, text in wrong.items()), wrong)
    uneven = any(r[_SPLITS] == 1 for r in rows)  # some rank gave all_to_all_single split sizes
    agreed = [_must_agree(r, uneven) for r in rows]
    codes = {} if all(a == agreed[0] for a in agreed) else dict(enumerate(rows))
    if codes:
        calls = {r: describe(c) for r, c in sorted(codes.items())}
        raise CollectiveMismatchError(f"collective #{code[0]} does not match across ranks: "
                                      + "; ".join(f"rank {r}: {c}" for r, c in calls.items()), calls)
    pairs = _split_mismatch(rows) if CHECKED_OPS[code[1]] == "all_to_all_single" else []
    if pairs:
        w = len(rows)
        calls = {r: f"{describe(c)} input_split_sizes {c[_WIDTH + _A2A:_WIDTH + _A2A + w]} "
                    f"output_split_sizes {c[_WIDTH + _A2A + w:]}" for r, c in enumerate(rows)}
        more = f"; and {len(pairs) - 4} more pairs" if len(pairs) > 5 else ""
        raise CollectiveMismatchError(f"collective #{code[0]}: the split sizes do not match across ranks: "
                                      + "; ".join(pairs[:4] if more else pairs) + more, calls)


def _checked(fn, name: str):
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        __tracebackhide__ = True  # IPython leaves this frame out of a rank's traceback
        group = kwargs.get("group")
        if not dist.is_initialized() or (group is not None and group is not dist.group.WORLD):
            return fn(*args, **kwargs)  # sub-groups are not compared (see the module docstring)
        _STATE.seq += 1
        code = _descriptor(name, args, kwargs, dist.get_world_size())
        entry = {"group": _STATE.generation, "seq": code[0], "op": name, "what": describe(code), "state": "started", "t": time.time()}
        _STATE.record.append(entry)
        try:
            if _STATE.enabled:
                me = dist.get_rank()
                alone = problem(code, dist.get_world_size(), me) if name in ("send", "recv") else None
                if alone:  # no exchange: the peer may not exist
                    raise CollectiveMismatchError(f"rank {me}: {alone}", {me: alone})
                # A point-to-point pair is not exchanged: a receiver cannot tell a blocking send
                # from an isend (unchecked), and waiting for a descriptor that an isend never
                # posts would turn a working ring (isend, then recv: lesson 02) into a deadlock.
                if _STATE.side is not None and name not in ("send", "recv"):
                    _compare(code)
            result = fn(*args, **kwargs)
        except BaseException as e:  # KeyboardInterrupt: the pool's cell limit (SIGINT) or the student's Ctrl-C
            entry["state"] = ("interrupted (cell limit or Ctrl-C)" if isinstance(e, KeyboardInterrupt)
                              else f"failed: {type(e).__name__}")
            raise
        entry["state"] = "done"
        return result
    return checked
