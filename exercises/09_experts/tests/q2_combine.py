from otter.test_files import test_case

OK_FORMAT = False

name = "q2_combine"
points = [1]

@test_case(points=None, hidden=False)
def test_two_ranks_against_one_process(combine):
    import torch
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)
    g = torch.Generator().manual_seed(5)
    E, h = (4, 3)
    W = torch.randn(E, h, h, generator=g)
    idx = [torch.tensor([[0, 3], [2, 1], [3, 2]]), torch.tensor([[1, 0], [1, 3]])]
    xs = [torch.randn(len(i), h, generator=g) for i in idx]
    ws = [torch.rand(len(i), 2, generator=g) for i in idx]
    from collections import namedtuple
    p, per = (len(idx), E // len(idx))
    Plan = namedtuple('Plan', 'order send_counts recv_counts')
    plans, sent = ([], [])
    for r in range(p):
        flat = idx[r].reshape(-1)
        order = torch.argsort(flat, stable=True)
        owner = flat[order] // per
        sent.append([(xs[r][int(i) // idx[r].shape[1]], int(flat[i])) for i in order])
        send = [int((owner == s).sum()) for s in range(p)]
        recv = [int((idx[s].reshape(-1) // per == r).sum()) for s in range(p)]
        plans.append(Plan(order, send, recv))
    ys = []
    for r in range(p):
        rows = [row @ W[e] for s in range(p) for row, e in sent[s] if e // per == r]
        ys.append(torch.stack(rows) if rows else torch.zeros(0, W.shape[1]))

    def worker(rank, world_size):
        return combine(ys[rank], ws[rank], plans[rank])
    results = grading.run_ranks(worker, 2, timeout=20)
    for r, out in enumerate(results):
        choices = [[xs[r][t] @ W[int(e)] for e in idx[r][t]] for t in range(len(idx[r]))]
        ref = torch.stack([sum((w * c for w, c in zip(ws[r][t], cs))) for t, cs in enumerate(choices)])
        plain = torch.stack([sum(cs) for cs in choices])
        if isinstance(out, torch.Tensor) and out.shape == ref.shape and (not torch.allclose(ref, plain)) and torch.allclose(out, plain, atol=1e-05):
            raise AssertionError(f"{p} ranks, rank {r}: the {idx[r].shape[1]} outputs of each token were added without the router's weights (each must be multiplied by weights[t, j])")
        grading.assert_close(out, ref, f"{p} ranks, rank {r}'s combined output against one process", atol=1e-05)

