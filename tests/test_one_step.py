"""The training step is written once (course_lib/parallel/step.py): no other module of the library
or the benchmarks runs its own backward or optimizer step, and the trainer does not duck-type
strategies. Also: the step's accumulation equals one large batch, for every strategy's interface.

    .venv/bin/python -m pytest -q tests/test_one_step.py
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from course_lib.gpt.model import GPT, GPTConfig
from course_lib.parallel.step import Precision, forward_backward, optimizer_step, train_step
from course_lib.parallel.strategy import build_strategy

ROOT = Path(__file__).resolve().parent.parent
STEP_HOME = "course_lib/parallel/step.py"

# (file, enclosing function) -> why it may call .backward() / .step() / .finish_grads() itself.
# Strategies implement the interface the step calls; the rest is no training step at all.
ALLOWED = {
    ("course_lib/parallel/strategy.py", "step"): "Strategy.step: the optimizer step the one step calls",
    ("course_lib/parallel/model_parallel.py", "finish_grads"): "ModelParallel delegates to its dp strategy",
    ("course_lib/parallel/model_parallel.py", "step"): "ModelParallel delegates to its dp strategy",
    ("course_lib/parallel/pipeline/schedules.py", "train_step"):
        "the pipeline schedule: backward of each micro-batch on each stage (ModelParallel.forward_backward)",
    ("course_lib/pram/kernels_backward.py", "*"): "PyTorch's autograd as the reference of the PRAM kernels",
    ("benchmarks/gpu_speed.py", "step"): "upstream nanoGPT's train.py step, the baseline the course's step is timed against",
    ("course_lib/experiments/gpu_check.py", "probe"): "one tiny backward to start autograd's threads",
    ("course_lib/experiments/gpu_check.py", "_launcher_rank"): "one tiny backward in a rank, after the kernel's",
    ("course_lib/experiments/gpu_check.py", "_isolated_check"): "one tiny backward in the isolated process",
    ("course_lib/experiments/gpu_check.py", "_library_workspaces"): "one GEMM backward to allocate cuBLAS' workspace",
    ("course_lib/experiments/model_parallel_check.py", "compare_tensor_parallel"):
        "the gradients of one backward, tensor-parallel against dense; no optimizer step",
    ("course_lib/experiments/precision.py", "_grads"): "one backward's gradients at several loss scales; no step",
    ("course_lib/experiments/debugging.py", "step"):
        "lesson 12's hand-written data-parallel step, with the bugs students write, to be found by check_replicas",
    ("course_lib/experiments/frameworks_fabric.py", "fabric_step"):
        "Lightning Fabric's own step (fabric.backward, its optimizer): the framework set beside the course's step",
}


def _is_step_call(node: ast.AST) -> bool:
    """``x.backward(...)``, ``x.finish_grads()`` or ``x.step()`` (an optimizer's or a strategy's)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    attr = node.func.attr
    return attr in ("backward", "finish_grads") or (attr == "step" and not node.args and not node.keywords)


def step_calls(path: Path) -> list[tuple[str, int, str]]:
    """(enclosing function, line, call) of every step-like call in ``path``."""
    out = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if _is_step_call(child):
                out.append((func, child.lineno, ast.unparse(child)))
            visit(child, name)
    visit(ast.parse(path.read_text()), "<module>")
    return out


def test_no_module_runs_its_own_training_step():
    found = []
    for folder in ("course_lib", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == STEP_HOME:
                continue
            for func, line, call in step_calls(path):
                if (rel, func) not in ALLOWED and (rel, "*") not in ALLOWED:
                    found.append(f"{rel}:{line} in {func}: {call}")
    assert not found, ("a copy of the training step; call course_lib.parallel.step.train_step (or its halves "
                       "forward_backward / optimizer_step) instead:\n" + "\n".join(found))


def test_the_scan_sees_a_copy(tmp_path):
    """The rule above can fail: an experiment-like loop with its own backward is found."""
    copy = tmp_path / "copy.py"
    copy.write_text("def run(model, opt, x, y):\n    loss = model(x, y)[1]\n    loss.backward()\n    opt.step()\n")
    assert [(f, c) for f, _, c in step_calls(copy)] == [("run", "loss.backward()"), ("run", "opt.step()")]
    assert all((("course_lib/experiments/copy.py", f) not in ALLOWED) for f, _, _ in step_calls(copy))


def test_the_trainer_does_not_duck_type_strategies():
    """Model parallelism is a Strategy like the others: gpt/ asks no strategy what it has."""
    offenders = []
    for path in sorted((ROOT / "course_lib" / "gpt").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr", "isinstance")
                    and "strategy" in ast.unparse(node.args[0])):
                offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, offenders


CFG = GPTConfig(block_size=8, vocab_size=17, n_layer=1, n_head=2, n_embd=16, bias=False)


def _single(lr: float = 1e-2):
    torch.manual_seed(0)
    model = GPT(CFG)
    return model, build_strategy("single", model, lambda m: torch.optim.AdamW(m.parameters(), lr=lr))


def test_accumulated_micro_batches_equal_one_batch():
    """4 micro-batches of 2 rows, accumulated, step like one batch of 8 rows (the mean loss)."""
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CFG.vocab_size, (8, CFG.block_size + 1), generator=gen)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    model_a, a = _single()
    model_b, b = _single()
    before = [p.detach().clone() for p in model_a.parameters()]
    ra = train_step(a, x.reshape(4, 2, -1), y.reshape(4, 2, -1), grad_clip=1.0)
    rb = train_step(b, x[None], y[None], grad_clip=1.0)
    torch.testing.assert_close(ra.loss, rb.loss)
    torch.testing.assert_close(ra.grad_norm, rb.grad_norm)
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert p.grad is None  # zero_grad ran
    assert all(not torch.equal(p, p0) for p, p0 in zip(model_a.parameters(), before))  # it did step


def test_the_halves_compose_to_the_step_and_phases_come_in_order():
    x = torch.randint(0, CFG.vocab_size, (2, 3, CFG.block_size), generator=torch.Generator().manual_seed(2))
    model_a, a = _single()
    model_b, b = _single()
    seen = []

    def phase(name, micro):
        seen.append((name, micro))
        return torch.autograd.profiler.record_function(name)
    train_step(a, x, x, grad_clip=0.5, phase=phase)
    forward_backward(b, x, x)
    assert all(p.grad is not None for p in model_b.parameters())
    assert optimizer_step(b, grad_clip=0.5) is not None
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
    assert seen == [("forward_backward", None), ("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1),
                    ("finish_grads", None), ("update", None), ("clip_grad_norm", None),
                    ("optimizer_step", None), ("zero_grad", None)]


def test_fp16_loss_scaling_skips_an_overflowing_step():
    """With the scaler on, a step whose gradients overflow leaves the weights and halves the scale."""
    model, single = _single()
    precision = Precision(scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    x = torch.randint(0, CFG.vocab_size, (1, 2, CFG.block_size))
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("inf")  # every gradient becomes inf / nan
    before = [p.detach().clone() for p in model.parameters()]
    result = train_step(single, x, x, precision=precision)
    assert not torch.isfinite(result.grad_norm)
    assert precision.skipped == 1 and precision.scaler.get_scale() == 2.0**15
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # the step was skipped
