from otter.test_files import test_case

OK_FORMAT = False

name = "q2_fix_the_deadlock"
points = [1]

@test_case(points=None, hidden=False)
def test_two_ranks_swap(exchange):
    import torch
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)

    def worker(rank, world_size):
        return grading.returned(exchange(torch.full((3,), float(rank + 1)), peer=1 - rank), f'exchange(tensor, peer={1 - rank})').tolist()
    got = grading.run_ranks(worker, 2, timeout=5)
    assert got == [[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]], f'2 ranks swapping: expected [[2, 2, 2], [1, 1, 1]], found {got}'

