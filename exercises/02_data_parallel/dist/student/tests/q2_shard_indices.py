from otter.test_files import test_case

OK_FORMAT = False

name = "q2_shard_indices"
points = 3

@test_case(points=None, hidden=False)
def test_ten_examples(shard_indices):
    for world in (2, 3):
        shards = [shard_indices(10, r, world) for r in range(world)]
        assert sorted((i for s in shards for i in s)) == list(range(10)), f'{world} ranks: {shards}'

