from otter.test_files import test_case

OK_FORMAT = False

name = "q2_shard_indices"
points = 3

@test_case(points=None, hidden=False)
def test_ten_examples(shard_indices):
    for world in (2, 3):
        shards = [shard_indices(10, r, world) for r in range(world)]
        assert sorted((i for s in shards for i in s)) == list(range(10)), f'{world} ranks: {shards}'

@test_case(points=None, hidden=True)
def test_many_sizes_on_ranks(shard_indices):
    from course_lib.exercises.grading import run_ranks
    for n in (0, 1, 2, 7, 64, 1001):
        for world in (1, 2, 3, 4, 8):
            shards = [shard_indices(n, r, world) for r in range(world)]
            flat = [i for s in shards for i in s]
            assert sorted(flat) == list(range(n)), f'n={n}, {world} ranks: shards do not cover range(n) exactly once'
            assert max(map(len, shards)) - min(map(len, shards)) <= 1, f'n={n}, {world} ranks: unbalanced'
            assert all((s == sorted(s) for s in shards)), f'n={n}, {world} ranks: not increasing'

    def worker(rank, world_size):
        return shard_indices(50, rank, world_size)
    seen = [i for shard in run_ranks(worker, 4) for i in shard]
    assert sorted(seen) == list(range(50)), 'on 4 ranks, the shards do not partition range(50)'

