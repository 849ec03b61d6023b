from otter.test_files import test_case

OK_FORMAT = False

name = "q2_shard_indices"
points = [0.5]

@test_case(points=None, hidden=False)
def test_ten_examples(shard_indices):
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)

    def check():
        for world in (2, 3):
            shards = [list(grading.returned(shard_indices(10, r, world), f'shard_indices(10, {r}, {world})')) for r in range(world)]
            assert sorted((i for s in shards for i in s)) == list(range(10)), f'{world} ranks: expected shards that cover range(10) once, found {shards}'
            sizes = [len(s) for s in shards]
            assert max(sizes) - min(sizes) <= 1, f'{world} ranks: expected sizes that differ by at most one, found {sizes}'
            assert all((s == sorted(s) for s in shards)), f'{world} ranks: expected each shard in increasing order, found {shards}'
    grading.isolated(check)

