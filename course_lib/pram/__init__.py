"""A PRAM simulator for reasoning about the parallelism of a training step.

    from course_lib import pram

    def tree_sum(pid, step, mem):            # a program: one function of (pid, step, mem)
        stride, i = 2 ** step, 2 * pid
        if pid % stride == 0 and i + stride < len(mem["A"]):
            mem["A"][i] = mem["A"][i] + mem["A"][i + stride]
            mem.op("add")

    r = pram.run(tree_sum, "EREW", processors=4, memory={"A": [3, 1, 4, 1, 5, 9, 2, 6]})
    r.steps, r.work, r["A"][0]              # (3, 7, 31)
    pram.step_slider(r)                      # a notebook slider over the steps

Modules: :mod:`.models` (EREW, CREW, CRCW rules, errors), :mod:`.machine` (``run``),
:mod:`.algorithms` (tree sum, scans, max, OR, matmul, broadcast), :mod:`.kernels` and
:mod:`.kernels_backward` (the kernels of a GPT training step as PRAM programs),
:mod:`.classify` (weakest model), :mod:`.gpt_step` (whole-step table, scaling with B, T, C),
:mod:`.lost_updates` (what the
combining rule protects against, on real threads and processes), :mod:`.trace` (tables and
the step slider), :mod:`.cli` (``course pram``).

Importing this package imports neither torch nor ipywidgets; the functions that need them
import them when called.
"""

from .algorithms import (
    ALGORITHMS,
    Algorithm,
    broadcast_crew,
    broadcast_erew,
    get_algorithm,
    matmul,
    max_crcw,
    or_crcw,
    or_tree,
    prefix_blelloch,
    prefix_hillis_steele,
    tree_max,
    tree_sum,
)
from .classify import Attempt, Verdict, classify
from .gpt_step import STEP_KERNELS, GPTShape, StepKernel, cost, growth, scaling, step_table
from .kernels import (
    attention_forward,
    encoder_forward,
    gelu_forward,
    layernorm_forward,
    matmul_forward,
    residual_forward,
    softmax_crossentropy_forward,
)
from .kernels_backward import (
    adamw_update,
    crossentropy_backward,
    encoder_backward,
    gelu_backward,
    grad_accumulate,
    matmul_backward,
    matmul_backward_tree,
)
from .machine import MAX_PROCESSORS, ArrayView, View, run
from .shared_memory import Array, Memory, filled
from .models import (
    MODEL_ORDER,
    MODELS,
    AccessViolation,
    Model,
    PRAMError,
    ProcessorLimitError,
    combining,
    get_model,
)
from .program import Program, Result, StepStats, StepTrace, coords, phases
from .trace import format_table, render_step, step_slider, work_time_table

__all__ = [
    # simulator
    "run", "Program", "Result", "StepStats", "StepTrace", "View", "ArrayView", "Memory",
    "Array", "filled", "coords", "phases", "MAX_PROCESSORS",
    # models and errors
    "Model", "MODELS", "MODEL_ORDER", "get_model", "combining", "PRAMError", "AccessViolation",
    "ProcessorLimitError",
    # classic algorithms
    "ALGORITHMS", "Algorithm", "get_algorithm", "tree_sum", "tree_max", "or_tree",
    "prefix_hillis_steele", "prefix_blelloch", "max_crcw", "or_crcw", "matmul",
    "broadcast_crew", "broadcast_erew",
    # GPT-step kernels, classifier, whole-step table
    "encoder_forward", "layernorm_forward", "matmul_forward", "attention_forward",
    "residual_forward", "gelu_forward", "softmax_crossentropy_forward", "crossentropy_backward",
    "matmul_backward", "matmul_backward_tree", "grad_accumulate", "gelu_backward",
    "encoder_backward", "adamw_update", "classify", "Verdict", "Attempt", "GPTShape",
    "StepKernel", "STEP_KERNELS", "step_table", "cost", "scaling", "growth",
    # display
    "format_table", "render_step", "step_slider", "work_time_table",
]
