"""Point-to-point only, with a byte count: what the collectives exercises forbid and measure.

    from course_lib.exercises.grading import p2p_only
    with p2p_only() as sent:      # dist.all_reduce & co. raise; dist.send/isend are counted
        my_ring_all_reduce(x)
    sent.bytes, sent.messages

Tests reach it through a fresh copy of :mod:`course_lib.exercises.grading`, which loads a fresh
copy of this module too, so a notebook cell that patches the kernel's copy changes nothing.
"""

from __future__ import annotations

import contextlib

COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_to_all", "all_to_all_single", "all_gather_object", "broadcast_object_list",
               "gather", "scatter")


def _refuse_own_ring(*args, **kwargs):
    # Only literals and builtins: this code object runs with the globals of the function it replaces.
    raise RuntimeError("the course's own ring all-reduce (course_lib.parallel.data.ring) is not allowed "
                       "here: write the ring yourself")


class Sent:
    """What this rank sent point-to-point inside :func:`p2p_only`. (A plain class: tests execute
    this module outside ``sys.modules``, where ``@dataclass`` cannot find it.)"""

    def __init__(self) -> None:
        self.bytes = 0
        self.messages = 0


@contextlib.contextmanager
def p2p_only(*functions):
    """Inside, this rank may only use point-to-point sends and receives: the library collectives
    raise, and ``send``/``isend`` (also through ``batch_isend_irecv``) are counted in the
    yielded :class:`Sent`. The course's own ring (lesson 02's :mod:`course_lib.parallel.data.ring`)
    raises too, however it was imported (its code is swapped). ``functions``: the code under test,
    whose globals may hold torch's functions imported by name (``from torch.distributed import
    isend``): those names are rebound too, so that their sends count and their collectives raise
    (the notebook's other functions share those globals). Restores everything on exit."""
    # torch when the block runs: exercises.grading loads this module on import, torch-free
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from course_lib.parallel.data import ring

    own = [(f, f.__code__) for f in (ring.ring_all_reduce, ring.ring_step)]

    sent = Sent()
    # dist re-exports c10d's functions; P2POp and batch_isend_irecv look them up in c10d
    saved = [(mod, name, getattr(mod, name)) for mod in (dist, c10d)
             for name in COLLECTIVES + ("send", "isend") if hasattr(mod, name)]

    def forbidden(name):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"dist.{name} is not allowed here: use point-to-point "
                               "dist.send/dist.isend and dist.recv/dist.irecv only")
        return refuse

    depth = [0]  # send() may be built on isend(): count the outermost call only

    def counted(original):
        def send(tensor, *args, **kwargs):
            if depth[0] == 0:
                sent.bytes += tensor.numel() * tensor.element_size()
                sent.messages += 1
            depth[0] += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                depth[0] -= 1
        return send

    replacements = {name: forbidden(name) for name in COLLECTIVES}
    replacements["send"], replacements["isend"] = counted(c10d.send), counted(c10d.isend)
    originals = {id(fn): replacements[name] for _, name, fn in saved}
    imported = [(g, key, value) for g in {id(f.__globals__): f.__globals__ for f in functions}.values()
                for key, value in list(g.items()) if id(value) in originals]
    try:
        for mod, name, _ in saved:
            setattr(mod, name, replacements[name])
        for g, key, value in imported:
            g[key] = originals[id(value)]
        for f, _ in own:
            f.__code__ = _refuse_own_ring.__code__
        yield sent
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
        for g, key, value in imported:
            g[key] = value
        for f, code in own:
            f.__code__ = code
