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

