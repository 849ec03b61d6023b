from otter.test_files import test_case

OK_FORMAT = False

name = "q3_evidence"
points = 2

@test_case(points=None, hidden=False)
def test_evidence_shape(evidence):
    names = {'gelu_forward', 'matmul_forward', 'layernorm_forward', 'grad_accumulate', 'grad_accumulate_tree'}
    assert isinstance(evidence, dict) and set(evidence) == names, 'evidence needs one entry per kernel of KERNELS'
    assert evidence['gelu_forward'] is None, 'gelu_forward runs on EREW: its evidence is None'

@test_case(points=None, hidden=True)
def test_evidence_is_the_right_violation(evidence):
    from course_lib import pram
    from course_lib.pram import kernels, kernels_backward
    from course_lib.pram.classify import classify
    candidates = ['EREW', 'CREW', 'CRCW-common', 'CRCW-arbitrary', 'CRCW-priority', 'CRCW-sum']
    programs = {'gelu_forward': kernels.gelu_forward(16), 'matmul_forward': kernels.matmul_forward(B=2, T=2, C=4, OC=3), 'layernorm_forward': kernels.layernorm_forward(B=2, T=2, C=4), 'grad_accumulate': kernels_backward.grad_accumulate(R=4, N=3), 'grad_accumulate_tree': kernels_backward.grad_accumulate(R=4, N=3, tree=True)}
    for name, prog in programs.items():
        model = classify(prog, candidates).model
        e = evidence[name]
        if model == 'EREW':
            assert e is None, f'{name} runs on EREW'
            continue
        want_model, want_kind = ('EREW', 'read') if model == 'CREW' else ('CREW', 'write')
        assert isinstance(e, pram.AccessViolation), f'evidence[{name!r}] must be an AccessViolation'
        assert (e.model, e.kind) == (want_model, want_kind), f'evidence[{name!r}] is a {e.kind} violation under {e.model}, expected a {want_kind} under {want_model}'

