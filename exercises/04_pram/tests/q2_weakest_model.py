from otter.test_files import test_case

OK_FORMAT = False

name = "q2_weakest_model"
points = [1]

@test_case(points=None, hidden=False)
def test_elementwise_kernel(weakest_model_of, weakest_model):
    import importlib.util as _iu
    _spec = _iu.find_spec('course_lib.exercises.grading')
    grading = _iu.module_from_spec(_spec)
    _spec.loader.exec_module(grading)
    names = {'gelu_forward', 'matmul_forward', 'layernorm_forward', 'grad_accumulate', 'grad_accumulate_tree'}
    assert isinstance(weakest_model, dict) and set(weakest_model) == names, f'expected weakest_model with one entry per kernel of KERNELS, found {weakest_model!r}'
    candidates = {'EREW', 'CREW', 'CRCW-common', 'CRCW-arbitrary', 'CRCW-priority', 'CRCW-sum'}
    assert set(weakest_model.values()) <= candidates, 'expected the model names of CANDIDATES'

    def check():
        from course_lib.pram import kernels
        got = weakest_model_of(kernels.gelu_forward(16))
        assert got == 'EREW', f"gelu_forward: expected 'EREW' (it touches only its own element), found {got!r}"
    grading.isolated(check)

