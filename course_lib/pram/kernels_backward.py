"""The backward kernels and the AdamW update of a GPT-2 step as PRAM programs.

Names follow llm.c (``train_gpt2.c``). The interesting ones accumulate into a shared weight
gradient: ``dweight[o, i]`` receives one contribution from every batch position (b, t), and
``dwpe[t, c]`` one from every b. Written in one step, that is a concurrent write that needs the
CRCW sum rule (the gradient buffers start at zero, as after ``zero_grad``); the EREW/CREW way
is to write the contributions apart and add them with a log-depth tree
(``matmul_backward_tree``, ``grad_accumulate(..., tree=True)``). The same choice appears
between ranks in data parallelism: all-reduce is the sum rule implemented by messages.
"""

from __future__ import annotations

import math
import random

from .kernels import GELU_SCALE, _program, randn, to_torch, tokens
from .program import Program, coords, phases
from .shared_memory import Array, filled

__all__ = ["crossentropy_backward", "matmul_backward", "matmul_backward_tree",
           "grad_accumulate", "gelu_backward", "encoder_backward", "adamw_update"]


def _power_of_two(name: str, what: str, n: int) -> None:
    if n < 2 or n & (n - 1):
        raise ValueError(f"{name} needs {what} to be a power of two >= 2, got {n}")


def crossentropy_backward(B: int, T: int, V: int, seed: int = 0) -> Program:
    """dlogits = (probs - onehot(targets)) / (B*T) for the mean loss. 1 step, CREW."""
    rng = random.Random(seed)
    logits, targets = randn(rng, B, T, V), tokens(rng, V, B, T)
    probs = []
    for r in range(B * T):
        row = logits.data[r * V:(r + 1) * V]
        m = max(row)
        e = [math.exp(x - m) for x in row]
        probs += [x / sum(e) for x in e]

    def step(pid, _, mem):          # targets[b,t] is read by the V processors of its row
        b, t, v = coords(pid, (B, T, V))
        hit = 1.0 if v == mem["targets"][b, t] else 0.0
        mem["dlogits"][b, t, v] = (mem["probs"][b, t, v] - hit) / (B * T)
        mem.op("sub")

    def expected():
        import torch.nn.functional as F  # torch only for the reference result
        x = to_torch(logits).requires_grad_()
        F.cross_entropy(x.view(-1, V), to_torch(targets).view(-1)).backward()
        return {"dlogits": x.grad}

    memory = {"probs": Array((B, T, V), probs), "targets": targets,
              "dlogits": filled((B, T, V), 0.0)}
    return _program("crossentropy_backward", step, B * T * V, memory, "CREW", expected,
                    "targets[b,t] is read by the V processors of its row", 1)


def _matmul_backward_data(B, T, C, OC, seed):
    rng = random.Random(seed)
    inp, weight, dout = randn(rng, B, T, C), randn(rng, OC, C), randn(rng, B, T, OC)

    def expected():
        x, w = to_torch(inp).requires_grad_(), to_torch(weight).requires_grad_()
        bias = to_torch(Array((OC,), [0.0] * OC)).requires_grad_()
        (x @ w.T + bias).backward(to_torch(dout))
        return {"dinp": x.grad, "dweight": w.grad, "dbias": bias.grad}

    def dinp(pid, o, mem):          # processor (b,t,i), step o: dinp += dout[b,t,o] w[o,i]
        b, t, i = coords(pid, (B, T, C))
        acc = 0.0 if o == 0 else mem["dinp"][b, t, i]
        mem["dinp"][b, t, i] = acc + mem["dout"][b, t, o] * mem["weight"][o, i]
        mem.op("fma")

    memory = {"inp": inp, "weight": weight, "dout": dout, "dinp": filled((B, T, C), 0.0),
              "dweight": filled((OC, C), 0.0), "dbias": filled(OC, 0.0)}
    return memory, expected, dinp


def matmul_backward(B: int, T: int, C: int, OC: int, seed: int = 0) -> Program:
    """Gradients of out = inp @ weight^T + bias. Step 0: processor (b,t,o,i) writes its
    contribution dout[b,t,o] * inp[b,t,i] to dweight[o,i] (i == C: dout[b,t,o] to dbias[o]),
    all B*T writers of a cell in the same step: CRCW-sum. Then OC steps for dinp."""
    memory, expected, dinp = _matmul_backward_data(B, T, C, OC, seed)

    def accumulate(pid, _, mem):
        b, t, o, i = coords(pid, (B, T, OC, C + 1))
        if i < C:
            mem["dweight"][o, i] = mem["dout"][b, t, o] * mem["inp"][b, t, i]
            mem.op("fma")
        else:
            mem["dbias"][o] = mem["dout"][b, t, o]
            mem.op("add")

    return _program("matmul_backward", phases((accumulate, 1), (dinp, OC, B * T * C)),
                    B * T * OC * (C + 1), memory, "CRCW-sum", expected,
                    "dweight[o,i] gets B*T concurrent contributions; or EREW-style with a "
                    "log2(B*T)-step tree: see matmul_backward_tree")


def matmul_backward_tree(B: int, T: int, C: int, OC: int, seed: int = 0) -> Program:
    """``matmul_backward`` without concurrent writes: contributions go to P[bt, o, i] (1 step),
    a tree adds them over bt (log2(B*T) steps), then dinp (OC steps). CREW (reads only)."""
    BT = B * T
    _power_of_two("matmul_backward_tree", "B*T", BT)
    memory, expected, dinp = _matmul_backward_data(B, T, C, OC, seed)
    memory["P"] = filled((BT, OC, C + 1), 0.0)
    levels = BT.bit_length() - 1

    def contribute(pid, _, mem):
        r, o, i = coords(pid, (BT, OC, C + 1))
        x = mem["inp"][r // T, r % T, i] if i < C else 1.0
        mem["P"][r, o, i] = mem["dout"][r // T, r % T, o] * x
        mem.op("fma" if i < C else "add")

    def tree(pid, s, mem):
        r, o, i = coords(pid, (BT, OC, C + 1))
        stride = 2 ** s
        if r % (2 * stride) == 0:
            total = mem["P"][r, o, i] + mem["P"][r + stride, o, i]
            mem.op("add")
            if s < levels - 1:
                mem["P"][r, o, i] = total
            elif i < C:
                mem["dweight"][o, i] = total
            else:
                mem["dbias"][o] = total

    step = phases((contribute, 1), (tree, levels), (dinp, OC, BT * C))
    return _program("matmul_backward_tree", step,
                    BT * OC * (C + 1), memory, "CREW", expected,
                    "exclusive writes: the sum over batch positions is a log-depth tree")


def grad_accumulate(R: int, N: int, tree: bool = False, seed: int = 0) -> Program:
    """g[j] = sum over r of G[r, j]: R contributions (batch positions, or ranks) to each of N
    shared gradient cells. ``tree=False``: 1 step, R*N processors, CRCW-sum.
    ``tree=True``: log2 R steps of pairwise adds, EREW."""
    G = randn(random.Random(seed), R, N)

    def combine(pid, _, mem):
        r, j = coords(pid, (R, N))
        mem["g"][j] = mem["G"][r, j]
        mem.op("add")

    def pairwise(pid, s, mem):
        r, j = coords(pid, (R, N))
        stride = 2 ** s
        if r % (2 * stride) == 0:
            total = mem["G"][r, j] + mem["G"][r + stride, j]
            mem.op("add")
            if 2 * stride < R:
                mem["G"][r, j] = total
            else:
                mem["g"][j] = total

    if tree:
        _power_of_two("grad_accumulate(tree=True)", "R", R)
    name = "grad_accumulate_tree" if tree else "grad_accumulate"
    step = phases((pairwise, R.bit_length() - 1)) if tree else phases((combine, 1))
    return _program(name, step, R * N, {"G": G, "g": filled(N, 0.0)},
                    "EREW" if tree else "CRCW-sum", lambda: {"g": to_torch(G).sum(0)},
                    "log2 R steps of exclusive pairwise adds" if tree else
                    "R processors write each g[j] in the same step; the sum rule adds them")


def gelu_backward(N: int, seed: int = 0) -> Program:
    """dinp = dout * GELU'(inp) (tanh approximation), 1 step, EREW."""
    rng = random.Random(seed)
    inp, dout = randn(rng, N), randn(rng, N)

    def step(pid, _, mem):
        x = mem["inp"][pid]
        u = GELU_SCALE * (x + 0.044715 * x ** 3)
        du = GELU_SCALE * (1.0 + 3 * 0.044715 * x * x)
        grad = 0.5 * (1.0 + math.tanh(u)) + 0.5 * x * du / math.cosh(u) ** 2
        mem["dinp"][pid] = mem["dout"][pid] * grad
        mem.op("gelu'")

    def expected():
        import torch.nn.functional as F  # torch only for the reference result
        x = to_torch(inp).requires_grad_()
        F.gelu(x, approximate="tanh").backward(to_torch(dout))
        return {"dinp": x.grad}

    return _program("gelu_backward", step, N, {"inp": inp, "dout": dout,
                                               "dinp": filled(N, 0.0)},
                    "EREW", expected, "each processor reads and writes only its own element", 1)


def encoder_backward(B: int, T: int, C: int, V: int, seed: int = 0) -> Program:
    """dwte[inp[b,t], c] and dwpe[t, c] receive dout[b,t,c]: 1 step, B*T*C processors,
    CRCW-sum (dwpe[t,c] has B writers; a dwte row has one per occurrence of its token)."""
    rng = random.Random(seed)
    inp, dout = tokens(rng, V, B, T), randn(rng, B, T, C)

    def step(pid, _, mem):
        b, t, c = coords(pid, (B, T, C))
        d = mem["dout"][b, t, c]
        mem["dwte"][mem["inp"][b, t], c] = d
        mem["dwpe"][t, c] = d
        mem.op("add", 2)

    def expected():
        import torch  # torch only for the reference result
        wte = torch.zeros(V, C, dtype=torch.float64, requires_grad=True)
        wpe = torch.zeros(T, C, dtype=torch.float64, requires_grad=True)
        (wte[to_torch(inp)] + wpe).backward(to_torch(dout))
        return {"dwte": wte.grad, "dwpe": wpe.grad}

    memory = {"inp": inp, "dout": dout, "dwte": filled((V, C), 0.0), "dwpe": filled((T, C), 0.0)}
    return _program("encoder_backward", step, B * T * C, memory, "CRCW-sum", expected,
                    "positions with the same t (all b) or the same token add into one cell", 1)


def adamw_update(N: int, t: int = 3, lr: float = 1e-3, beta1: float = 0.9,
                 beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.1,
                 seed: int = 0) -> Program:
    """One AdamW step (Loshchilov & Hutter, 2019) at step ``t``, one processor per parameter,
    1 step, EREW: m, v moments, bias correction, decoupled weight decay."""
    rng = random.Random(seed)
    param, grad, m = randn(rng, N), randn(rng, N), randn(rng, N)
    v = Array((N,), [rng.random() for _ in range(N)])

    def step(pid, _, mem):
        g, p = mem["grad"][pid], mem["param"][pid]
        m1 = beta1 * mem["m"][pid] + (1 - beta1) * g
        v1 = beta2 * mem["v"][pid] + (1 - beta2) * g * g
        m_hat, v_hat = m1 / (1 - beta1 ** t), v1 / (1 - beta2 ** t)
        mem["param"][pid] = p - lr * (m_hat / (math.sqrt(v_hat) + eps) + weight_decay * p)
        mem["m"][pid], mem["v"][pid] = m1, v1
        mem.op("adamw")

    def expected():
        import torch  # torch only for the reference result
        p = torch.nn.Parameter(to_torch(param))
        opt = torch.optim.AdamW([p], lr=lr, betas=(beta1, beta2), eps=eps,
                                weight_decay=weight_decay, foreach=False)
        opt.state[p] = {"step": torch.tensor(float(t - 1)), "exp_avg": to_torch(m),
                        "exp_avg_sq": to_torch(v)}
        p.grad = to_torch(grad)
        opt.step()
        s = opt.state[p]
        return {"param": p.detach(), "m": s["exp_avg"], "v": s["exp_avg_sq"]}

    memory = {"param": param, "grad": grad, "m": m, "v": v}
    return _program("adamw_update", step, N, memory, "EREW", expected,
                    "each processor updates only its own parameter and moments", 1)
