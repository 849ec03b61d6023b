from otter.test_files import test_case

OK_FORMAT = False

name = "q3_evidence"
points = 2

@test_case(points=None, hidden=False)
def test_evidence_shape(evidence):
    names = {'gelu_forward', 'matmul_forward', 'layernorm_forward', 'grad_accumulate', 'grad_accumulate_tree'}
    assert isinstance(evidence, dict) and set(evidence) == names, 'evidence needs one entry per kernel of KERNELS'
    assert evidence['gelu_forward'] is None, 'gelu_forward runs on EREW: its evidence is None'

