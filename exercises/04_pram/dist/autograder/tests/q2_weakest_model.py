from otter.test_files import test_case

OK_FORMAT = False

name = "q2_weakest_model"
points = 4

@test_case(points=None, hidden=False)
def test_elementwise_kernel(weakest_model_of, weakest_model):
    from course_lib.pram import kernels
    names = {'gelu_forward', 'matmul_forward', 'layernorm_forward', 'grad_accumulate', 'grad_accumulate_tree'}
    assert weakest_model_of(kernels.gelu_forward(16)) == 'EREW', 'gelu touches only its own element'
    assert isinstance(weakest_model, dict) and set(weakest_model) == names, 'weakest_model needs one entry per kernel of KERNELS'
    candidates = {'EREW', 'CREW', 'CRCW-common', 'CRCW-arbitrary', 'CRCW-priority', 'CRCW-sum'}
    assert set(weakest_model.values()) <= candidates, 'use the model names of CANDIDATES'

@test_case(points=None, hidden=True)
def test_verdicts_match_classifier(weakest_model):
    from course_lib.pram import kernels, kernels_backward
    from course_lib.pram.classify import classify
    candidates = ['EREW', 'CREW', 'CRCW-common', 'CRCW-arbitrary', 'CRCW-priority', 'CRCW-sum']
    programs = {'gelu_forward': kernels.gelu_forward(16), 'matmul_forward': kernels.matmul_forward(B=2, T=2, C=4, OC=3), 'layernorm_forward': kernels.layernorm_forward(B=2, T=2, C=4), 'grad_accumulate': kernels_backward.grad_accumulate(R=4, N=3), 'grad_accumulate_tree': kernels_backward.grad_accumulate(R=4, N=3, tree=True)}
    for name, prog in programs.items():
        assert weakest_model[name] == classify(prog, candidates).model, f'weakest_model[{name!r}]'

@test_case(points=None, hidden=True)
def test_other_kernels(weakest_model_of):
    from course_lib import pram
    from course_lib.pram import kernels, kernels_backward
    from course_lib.pram.classify import classify
    candidates = ['EREW', 'CREW', 'CRCW-common', 'CRCW-arbitrary', 'CRCW-priority', 'CRCW-sum']
    others = [kernels.encoder_forward(2, 2, 3, 5, seed=3), kernels.residual_forward(6, seed=3), kernels_backward.matmul_backward(1, 2, 3, 2, seed=3), kernels_backward.grad_accumulate(R=8, N=2, seed=5), pram.or_crcw(8, seed=1)]
    for prog in others:
        assert weakest_model_of(prog) == classify(prog, candidates).model, prog.name

