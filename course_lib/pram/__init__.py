"""A PRAM simulator for reasoning about the parallelism of a training step.

    from course_lib import pram

    def tree_sum(pid, step, mem):            # a program: one function of (pid, step, mem)
        stride, i = 2 ** step, 2 * pid
        if pid % stride == 0 and i + stride < len(mem["A"]):
            mem["A"][i] = mem["A"][i] + mem["A"][i + stride]
            mem.op("add")

    r = pram.run(tree_sum, "EREW", processors=4, memory={"A": [3, 1, 4, 1, 5, 9, 2, 6]})
    r.steps, r.work, r["A"][0]              # (3, 7, 31)
    step_slider(r)       # from course_lib.notebook.pram_slider: a notebook slider over the steps

Modules:

    models            the EREW, CREW and CRCW access rules; the errors a run can raise
    shared_memory     the shared memory: named arrays in one address space
    program           a Program (step function, processors, memory) and the Result of a run
    machine           ``run``: executes a Program step by step under a model
    algorithms        tree sum, scans, max, OR, matmul, broadcast as PRAM programs
    catalog           the named algorithms ``course pram`` and the plots choose from
    kernels           the forward kernels of a GPT training step as PRAM programs
    kernels_backward  their backward kernels and the AdamW update
    allreduce         the ring all-reduce of data parallelism, EREW only
    classify          the weakest model a program runs on
    gpt_step          the whole step as a table; how it scales with B, T, C
    lost_updates      what the combining rule protects against, on real threads and processes
    trace             tables, and the steps of a traced run as HTML
    trace_plots       steps and work against n, kernel scaling, lost updates (matplotlib)
    cli               ``course pram``

Importing this package imports neither torch nor ipywidgets; the functions that need them
import them when called.
"""

from .algorithms import (
    broadcast_crew,
    broadcast_erew,
    matmul,
    max_crcw,
    or_crcw,
    or_tree,
    prefix_blelloch,
    prefix_hillis_steele,
    tree_max,
    tree_sum,
)
from .catalog import ALGORITHMS, Algorithm, get_algorithm
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
from .shared_memory import Array, Memory, filled
from .trace import format_table, render_step, work_time_table

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
    "format_table", "render_step", "work_time_table",
]
