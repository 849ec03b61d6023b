from otter.test_files import test_case

OK_FORMAT = False

name = "q1_dispatch"
points = [1]

@test_case(points=None, hidden=False)
def test_two_ranks_four_experts(dispatch):
    import torch
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)
    E = 4
    idx = [torch.tensor([[0, 3], [2, 1], [3, 2]]), torch.tensor([[1, 0], [1, 3]])]
    xs = [torch.tensor([[10.0 * r + t, r + 0.5, -t] for t in range(len(idx[r]))]) for r in range(2)]

    def worker(rank, world_size):
        received, local_expert, plan = grading.returned(dispatch(xs[rank], idx[rank], E), 'dispatch(x, idx, n_experts)')
        return (received, local_expert, plan.order, list(plan.send_counts), list(plan.recv_counts))

    def check(results, xs, idx, n_experts, what):
        p = len(idx)
        per = n_experts // p
        where = f'experts {per} r to {per} r + {per - 1} live on rank r'
        for r, (received, local, order, send, recv) in enumerate(results):
            flat = idx[r].reshape(-1)
            expected = [int((flat // per == s).sum()) for s in range(p)]
            assert send == expected, f'{what}: rank {r} sent {send} rows to ranks 0..{p - 1}, expected {expected} ({where})'
            assert sorted(order.tolist()) == list(range(len(flat))), f"{what}: rank {r}'s plan.order {order.tolist()} is not an order of its {len(flat)} (token, choice) rows"
            owners = (flat[order] // per).tolist()
            assert owners == sorted(owners), f"{what}: rank {r}'s plan.order does not group the rows by the rank they go to ({where})"
        for r, (received, local, order, send, recv) in enumerate(results):
            expected = [int((idx[s].reshape(-1) // per == r).sum()) for s in range(p)]
            assert recv == expected, f'{what}: rank {r} expects {recv} rows from ranks 0..{p - 1}, they send {expected}'
            assert local.dtype == torch.long, f"{what}: rank {r}'s local_expert: expected a long tensor, found {local.dtype}"
            start = 0
            for s in range(p):
                flat, k = (idx[s].reshape(-1), idx[s].shape[1])
                sent = results[s][2][flat[results[s][2]] // per == r]
                rows, end = (xs[s][sent // k], start + len(sent))
                grading.assert_close(received[start:end], rows, f'{what}: rank {r}, the rows from rank {s}')
                found, local_expected = (local[start:end].tolist(), (flat[sent] - r * per).tolist())
                assert found == local_expected, f'{what}: rank {r}, the rows from rank {s} go to its experts {local_expected} (0 to {per - 1}), found {found}'
                start = end
            assert start == len(received), f'{what}: rank {r} received {len(received)} rows, expected {start}'
    check(grading.run_ranks(worker, 2, timeout=20), xs, idx, E, '2 ranks, 4 experts, top-2')

