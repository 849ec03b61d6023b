"""The GPT-step kernels as PRAM programs: numerics against PyTorch (float64), the classifier's
verdicts with their reasons, the whole-step table and the scaling formulas.

Kernel definitions follow llm.c's train_gpt2.c; the expected CREW verdict for matmul_forward
and layernorm_forward and CRCW (sum rule) for gradient accumulation are those of the course
report on llm.c (Balcázar, Barrantes & Coa, "Entrenamiento distribuido de un LLM").
"""

from dataclasses import replace

import pytest

from course_lib import pram
from course_lib.pram import kernels as K
from course_lib.pram import kernels_backward as KB
from course_lib.pram.classify import classify
from course_lib.pram.gpt_step import (
    STEP_KERNELS,
    GPTShape,
    cost,
    growth,
    scaling,
    step_kernel,
    step_table,
)

SMALL = GPTShape(B=2, T=4, C=8, NH=2, V=16)
ODD = GPTShape(B=1, T=3, C=6, NH=3, V=5)

KERNELS = {
    "encoder_forward": (lambda: K.encoder_forward(2, 4, 8, 16), "CREW"),
    "matmul_forward": (lambda: K.matmul_forward(2, 4, 8, 24), "CREW"),
    "layernorm_forward": (lambda: K.layernorm_forward(2, 4, 8), "CREW"),
    "attention_forward": (lambda: K.attention_forward(2, 4, 8, 2), "CREW"),
    "residual_forward": (lambda: K.residual_forward(32), "EREW"),
    "gelu_forward": (lambda: K.gelu_forward(32), "EREW"),
    "softmax_crossentropy_forward": (lambda: K.softmax_crossentropy_forward(2, 4, 16), "CREW"),
    "crossentropy_backward": (lambda: KB.crossentropy_backward(2, 4, 16), "CREW"),
    "matmul_backward": (lambda: KB.matmul_backward(2, 4, 8, 12), "CRCW-sum"),
    "matmul_backward_tree": (lambda: KB.matmul_backward_tree(2, 4, 8, 12), "CREW"),
    "grad_accumulate": (lambda: KB.grad_accumulate(8, 6), "CRCW-sum"),
    "grad_accumulate_tree": (lambda: KB.grad_accumulate(8, 6, tree=True), "EREW"),
    "gelu_backward": (lambda: KB.gelu_backward(32), "EREW"),
    "encoder_backward": (lambda: KB.encoder_backward(2, 4, 8, 16), "CRCW-sum"),
    "adamw_update": (lambda: KB.adamw_update(32), "EREW"),
}


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_numerics_match_pytorch(name):
    prog = KERNELS[name][0]()
    assert prog.name == name
    r = pram.run(prog)              # under the model the kernel is written for
    assert prog.verify(r) == []
    assert prog.reference()         # there is a PyTorch reference to compare with


def test_verify_catches_a_wrong_cell():
    prog = K.layernorm_forward(1, 2, 4)
    r = pram.run(prog)
    r.memory.cells[r.memory.bases["out"] + 3] += 1e-6
    got, want = r["out"][0][0][3], prog.reference()["out"][3]
    assert prog.verify(r) == [f"out[0, 0, 3] is {got:.6g}, expected {want:.6g}"]  # 6 digits show the difference
    r.memory.cells[r.memory.bases["out"] + 3] = want * (1 + 1e-7)  # beyond the tolerance, not 6 digits
    assert prog.verify(r) == [f"out[0, 0, 3] is {want * (1 + 1e-7)!r}, expected {want!r}"]


@pytest.mark.parametrize("name", KERNELS)
def test_classifier_verdicts(name):
    build, model = KERNELS[name]
    v = classify(build())
    assert v.model == model, v.reason
    assert v.attempts[-1].model == model and v.attempts[-1].ok
    assert all(not a.ok for a in v.attempts[:-1])
    assert v.reason.endswith(".") and str(v).startswith(f"{name}: {model}.")


def test_crew_reasons_name_the_concurrent_reads_and_the_erew_failure():
    for build in (lambda: K.matmul_forward(2, 4, 8, 24), lambda: K.layernorm_forward(2, 4, 8)):
        v = classify(build())
        assert "Every address has at most one writer per step, while up to" in v.reason
        assert "Weaker models fail: EREW: processors" in v.reason
        assert "read address" in v.attempts[0].why
    v = classify(K.matmul_forward(2, 4, 8, 24))
    assert "up to 24 processors read one address" in v.reason  # inp[b,t,i] read by all OC


def test_gradient_accumulation_needs_the_sum_rule_or_a_tree():
    v = classify(KB.matmul_backward(2, 4, 8, 12))
    whys = {a.model: a.why for a in v.attempts}
    assert whys["CREW"].startswith("CREW: processors 0, 108, 216")
    assert "wrote address" in whys["CREW"] and "(dweight[0, 0])" in whys["CREW"]
    assert "wrote different values to address" in whys["CRCW-common"]
    assert whys["CRCW-arbitrary"].startswith("CRCW-arbitrary: runs, but gives a wrong result")
    assert whys["CRCW-priority"].startswith("CRCW-priority: runs, but gives a wrong result")
    assert "Up to 8 processors write one address in the same step" in v.reason
    assert "the values must be combined (sum)" in v.reason
    # the tree version: no concurrent write, log2(B*T) more steps
    tree = pram.run(KB.matmul_backward_tree(2, 4, 8, 12), "CREW")
    assert tree.max_writers.count == 0 and tree.steps == 1 + 3 + 12
    acc, acc_tree = classify(KB.grad_accumulate(8, 6)), classify(KB.grad_accumulate(8, 6, True))
    assert (acc.result.steps, acc.result.work) == (1, 8 * 6)
    assert (acc_tree.result.steps, acc_tree.result.work) == (3, 7 * 6)


def test_verdicts_depend_on_the_data():
    """encoder_backward with one sequence of distinct tokens has no concurrent write."""
    prog = KB.encoder_backward(1, 4, 8, 1000, seed=0)
    toks = pram.Memory(prog.memory).flat("inp")
    assert len(set(toks)) == 4
    assert classify(prog).model == "CREW"


def test_classifier_on_algorithms_and_on_programs_without_a_reference():
    assert classify(pram.tree_sum(16)).model == "EREW"
    assert classify(pram.prefix_hillis_steele(16)).model == "CREW"
    assert classify(pram.max_crcw(8)).model == "CRCW-common"
    assert classify(pram.or_crcw(8, bits=[1, 0, 1, 1, 0, 0, 0, 1])).model == "CRCW-common"
    assert classify(pram.matmul(4)).model == "CREW"

    def any_witness(pid, step, mem):   # every processor writes its own id: arbitrary suffices
        if step == 0:
            mem["R"][0] = pid

    prog = pram.Program("any_witness", any_witness, 4, {"R": [None]}, steps=1)
    v = classify(prog)
    assert v.model == "CRCW-arbitrary" and "any one writer's value" in v.reason

    broken = pram.Program("broken", any_witness, 4, {"R": [None]}, steps=1,
                          expected=lambda: {"R": [99]})
    with pytest.raises(pram.PRAMError, match="broken runs correctly under none of: EREW, CREW"):
        classify(broken)


def test_step_table_small_configuration():
    rows = step_table(SMALL)
    by_kernel = {r["kernel"]: r for r in rows}
    want = {"encoder_forward": "CREW", "layernorm_forward": "CREW",
            "matmul_forward (qkv)": "CREW", "attention_forward": "CREW",
            "residual_forward": "EREW", "gelu_forward": "EREW",
            "softmax_crossentropy_forward": "CREW", "crossentropy_backward": "CREW",
            "matmul_backward (fc)": "CRCW-sum", "gelu_backward": "EREW",
            "encoder_backward": "CRCW-sum", "adamw_update": "EREW"}
    for kernel, model in want.items():
        assert by_kernel[kernel]["model"] == model
    for r in rows[:-1]:             # the simulator's counts are the formulas' counts
        assert {k: r[k] for k in ("steps", "work", "processors")} == cost(r["kernel"], SMALL)
    total = rows[-1]
    assert total["kernel"] == "total (distinct kernels)"
    assert total["steps"] == sum(r["steps"] for r in rows[:-1])
    assert len(step_table(SMALL, distinct=False)) == len(STEP_KERNELS) + 1


def test_cost_formulas_match_the_simulator_at_another_shape():
    for label in dict.fromkeys(k.label for k in STEP_KERNELS):
        r = pram.run(step_kernel(label).build(ODD), "CRCW-sum", trace=False)
        assert {"steps": r.steps, "work": r.work, "processors": r.processors} == cost(label, ODD)


def test_scaling_with_batch_sequence_and_width():
    gpt2 = GPTShape(B=8, T=1024, C=768, NH=12, V=50257)
    # batch is embarrassingly parallel: no kernel takes more steps, every one does more work
    for row in growth("B", 1, 16, gpt2):
        assert row["steps_exponent"] == 0
        assert row["work_exponent"] == (0 if row["kernel"] == "adamw_update" else 1)
    by_c = {r["kernel"]: r for r in growth("C", 192, 1536, replace(gpt2, NH=3))}
    assert (by_c["matmul_forward (qkv)"]["steps_exponent"],
            by_c["matmul_forward (qkv)"]["work_exponent"]) == (1, 2)
    assert by_c["gelu_forward"]["steps_exponent"] == 0
    by_t = {r["kernel"]: r for r in growth("T", 128, 1024, gpt2)}
    assert by_t["attention_forward"]["work_exponent"] == 2     # T^2 pairs
    assert by_t["matmul_forward (fc)"]["steps_exponent"] == 0
    rows = scaling("T", [4, 8], SMALL, kernels=["attention_forward"])
    assert rows == [{"kernel": "attention_forward", "T": 4, **cost("attention_forward", SMALL)},
                    {"kernel": "attention_forward", "T": 8,
                     **cost("attention_forward", GPTShape(2, 8, 8, 2, 16))}]


def test_bad_shapes_and_names():
    with pytest.raises(ValueError, match="C=10 must be divisible by NH=4"):
        GPTShape(C=10, NH=4)
    with pytest.raises(ValueError, match="GPTShape.B must be a positive int"):
        GPTShape(B=0)
    with pytest.raises(ValueError, match="dim must be one of B, T, C, NH, V"):
        scaling("L", [1, 2])
    with pytest.raises(ValueError, match="unknown kernel 'conv2d'; choose one of: encoder_forward"):
        cost("conv2d")
    with pytest.raises(ValueError, match="needs B\\*T to be a power of two >= 2, got 6"):
        KB.matmul_backward_tree(2, 3, 4, 4)
