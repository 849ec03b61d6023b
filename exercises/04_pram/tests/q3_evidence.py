from otter.test_files import test_case

OK_FORMAT = False

name = "q3_evidence"
points = [0.5]

@test_case(points=None, hidden=False)
def test_evidence_shape(evidence):
    names = {'gelu_forward', 'matmul_forward', 'layernorm_forward', 'grad_accumulate', 'grad_accumulate_tree'}
    assert isinstance(evidence, dict) and set(evidence) == names, f'expected evidence with one entry per kernel of KERNELS, found keys {(sorted(evidence) if isinstance(evidence, dict) else evidence)!r}'
    gelu = evidence['gelu_forward']
    assert gelu is None, f'gelu_forward runs on EREW: expected None, found {gelu!r}'

