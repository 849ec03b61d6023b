"""The forward kernels of a GPT-2 training step as PRAM programs, checked against PyTorch.

The kernels and their names follow the C/CUDA GPT-2 trainer llm.c (Karpathy, 2024:
``train_gpt2.c``): one processor per output element wherever the C loop nest has an
independent output, and a processor per row looping over the reduction (C, T or V steps)
where the C code accumulates. Every kernel is a :class:`Program` whose ``expected()`` runs the
PyTorch operation in float64, so ``prog.verify(run(prog)) == []`` checks the numerics.

Shapes: B batch, T sequence length, C width (n_embd), NH heads, hs = C / NH, V vocabulary,
OC output channels of a matmul. Counts (steps, work, processors) are given per kernel; they
are checked against the simulator in the tests and used by :mod:`.gpt_step` for scaling.
"""

from __future__ import annotations

import math
import random

from .program import Program, coords, phases
from .shared_memory import Array, filled

__all__ = ["encoder_forward", "matmul_forward", "layernorm_forward", "attention_forward",
           "residual_forward", "gelu_forward", "softmax_crossentropy_forward", "randn",
           "tokens", "to_torch", "gelu_tanh"]

GELU_SCALE = math.sqrt(2.0 / math.pi)  # the tanh approximation (Hendrycks & Gimpel, 2016)


def randn(rng: random.Random, *shape: int) -> Array:
    """A standard-normal array of ``shape``."""
    return Array(shape, [rng.gauss(0.0, 1.0) for _ in range(math.prod(shape))])


def tokens(rng: random.Random, V: int, *shape: int) -> Array:
    """Random token ids in ``[0, V)``."""
    return Array(shape, [rng.randrange(V) for _ in range(math.prod(shape))])


def to_torch(a: Array):
    """A float64 tensor (int64 for token ids) of the array's shape."""
    import torch  # torch only for the reference results: the package imports without it
    dtype = torch.int64 if all(isinstance(x, int) for x in a.data) else torch.float64
    return torch.tensor(a.data, dtype=dtype).view(a.shape)


def gelu_tanh(x: float) -> float:
    """GELU, tanh approximation, as GPT-2 uses it."""
    return 0.5 * x * (1.0 + math.tanh(GELU_SCALE * (x + 0.044715 * x ** 3)))


def _program(name, step, processors, memory, model, expected, note, steps=None) -> Program:
    return Program(name, step, processors, memory, steps if steps is not None else step.steps,
                   model, expected, note, rtol=1e-9, atol=1e-12)


def encoder_forward(B: int, T: int, C: int, V: int, seed: int = 0) -> Program:
    """out[b,t,:] = wte[inp[b,t], :] + wpe[t, :]. 1 step, B*T*C processors, CREW."""
    rng = random.Random(seed)
    inp, wte, wpe = tokens(rng, V, B, T), randn(rng, V, C), randn(rng, T, C)

    def step(pid, step, mem):
        b, t, c = coords(pid, (B, T, C))
        mem["out"][b, t, c] = mem["wte"][mem["inp"][b, t], c] + mem["wpe"][t, c]
        mem.op("add")

    def expected():
        return {"out": to_torch(wte)[to_torch(inp)] + to_torch(wpe)}

    memory = {"inp": inp, "wte": wte, "wpe": wpe, "out": filled((B, T, C), 0.0)}
    return _program("encoder_forward", step, B * T * C, memory, "CREW", expected,
                    "inp[b,t] is read by the C processors of its row, wpe[t,c] by all B", 1)


def matmul_forward(B: int, T: int, C: int, OC: int, seed: int = 0) -> Program:
    """out = inp @ weight^T + bias: one processor per output, C steps of multiply-add, CREW."""
    rng = random.Random(seed)
    inp, weight, bias = randn(rng, B, T, C), randn(rng, OC, C), randn(rng, OC)

    def step(pid, i, mem):          # step i adds inp[b,t,i] * weight[o,i]
        b, t, o = coords(pid, (B, T, OC))
        acc = mem["bias"][o] if i == 0 else mem["out"][b, t, o]
        mem["out"][b, t, o] = acc + mem["inp"][b, t, i] * mem["weight"][o, i]
        mem.op("fma")

    def expected():
        return {"out": to_torch(inp) @ to_torch(weight).T + to_torch(bias)}

    memory = {"inp": inp, "weight": weight, "bias": bias, "out": filled((B, T, OC), 0.0)}
    return _program("matmul_forward", step, B * T * OC, memory, "CREW", expected,
                    "each output has one writer; a weight row is read by all B*T positions", C)


def layernorm_forward(B: int, T: int, C: int, seed: int = 0, eps: float = 1e-5) -> Program:
    """LayerNorm over C: a processor per row computes mean and variance (C steps each), then
    rstd (1 step), then one processor per element normalises (1 step). 2C + 2 steps, CREW."""
    rng = random.Random(seed)
    inp, weight, bias = randn(rng, B, T, C), randn(rng, C), randn(rng, C)

    def mean(pid, i, mem):          # processor (b,t) owns row (b,t); step i adds inp[b,t,i]
        b, t = coords(pid, (B, T))
        acc = 0.0 if i == 0 else mem["mean"][b, t]
        mem["mean"][b, t] = acc + mem["inp"][b, t, i] / C
        mem.op("add")

    def var(pid, i, mem):           # rstd holds the variance until the next phase
        b, t = coords(pid, (B, T))
        acc = 0.0 if i == 0 else mem["rstd"][b, t]
        mem["rstd"][b, t] = acc + (mem["inp"][b, t, i] - mem["mean"][b, t]) ** 2 / C
        mem.op("fma")

    def rstd(pid, _, mem):
        b, t = coords(pid, (B, T))
        mem["rstd"][b, t] = 1.0 / math.sqrt(mem["rstd"][b, t] + eps)
        mem.op("rsqrt")

    def norm(pid, _, mem):          # mean, rstd of a row read by its C processors at once
        b, t, c = coords(pid, (B, T, C))
        x = (mem["inp"][b, t, c] - mem["mean"][b, t]) * mem["rstd"][b, t]
        mem["out"][b, t, c] = x * mem["weight"][c] + mem["bias"][c]
        mem.op("norm")

    def expected():
        import torch.nn.functional as F  # torch only for the reference result
        x = to_torch(inp)
        return {"out": F.layer_norm(x, (C,), to_torch(weight), to_torch(bias), eps),
                "mean": x.mean(-1), "rstd": (x.var(-1, unbiased=False) + eps).rsqrt()}

    memory = {"inp": inp, "weight": weight, "bias": bias, "mean": filled((B, T), 0.0),
              "rstd": filled((B, T), 0.0), "out": filled((B, T, C), 0.0)}
    rows = B * T                    # the row phases use B*T of the B*T*C processors
    step = phases((mean, C, rows), (var, C, rows), (rstd, 1, rows), (norm, 1))
    return _program("layernorm_forward", step, B * T * C, memory, "CREW", expected,
                    "each output has one writer; a row's mean and rstd are read by C processors")


def attention_forward(B: int, T: int, C: int, NH: int, seed: int = 0) -> Program:
    """Causal self-attention from qkv (B, T, 3C) to out (B, T, C), in five phases:
    scores (hs steps), row max (T), exp and row sum (T), normalise (1), att @ v (T). CREW."""
    if C % NH:
        raise ValueError(f"C={C} must be divisible by NH={NH}")
    hs, rng = C // NH, random.Random(seed)
    qkv, scale = randn(rng, B, T, 3 * C), 1.0 / math.sqrt(C // NH)
    n_pair, n_row = B * NH * T * T, B * NH * T

    def scores(pid, i, mem):        # processor (b,h,t,t2) with t2 <= t: q . k, term i
        b, h, t, t2 = coords(pid, (B, NH, T, T))
        if t2 <= t:
            acc = 0.0 if i == 0 else mem["preatt"][b, h, t, t2]
            q, k = mem["qkv"][b, t, h * hs + i], mem["qkv"][b, t2, C + h * hs + i]
            mem["preatt"][b, h, t, t2] = acc + q * k * scale
            mem.op("fma")

    def row_max(pid, s, mem):       # processor (b,h,t) scans its row
        b, h, t = coords(pid, (B, NH, T))
        if s <= t:
            x = mem["preatt"][b, h, t, s]
            mem["rowmax"][b, h, t] = x if s == 0 else max(x, mem["rowmax"][b, h, t])
            mem.op("max")

    def exp_sum(pid, s, mem):
        b, h, t = coords(pid, (B, NH, T))
        if s <= t:
            e = math.exp(mem["preatt"][b, h, t, s] - mem["rowmax"][b, h, t])
            mem["att"][b, h, t, s] = e
            mem["rowsum"][b, h, t] = e + (0.0 if s == 0 else mem["rowsum"][b, h, t])
            mem.op("exp")

    def normalise(pid, _, mem):     # rowsum read by the t+1 processors of the row
        b, h, t, t2 = coords(pid, (B, NH, T, T))
        if t2 <= t:
            mem["att"][b, h, t, t2] = mem["att"][b, h, t, t2] / mem["rowsum"][b, h, t]
            mem.op("div")

    def weighted(pid, s, mem):      # processor (b,t,c): out += att[b,h,t,s] * v[b,s,c]
        b, t, c = coords(pid, (B, T, C))
        if s <= t:
            acc = 0.0 if s == 0 else mem["out"][b, t, c]
            a = mem["att"][b, c // hs, t, s]
            mem["out"][b, t, c] = acc + a * mem["qkv"][b, s, 2 * C + c]
            mem.op("fma")

    def expected():
        import torch  # torch only for the reference result
        import torch.nn.functional as F
        q, k, v = (x.view(B, T, NH, hs).transpose(1, 2) for x in to_torch(qkv).split(C, -1))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = (q @ k.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return {"att": att, "out": out.transpose(1, 2).reshape(B, T, C)}

    memory = {"qkv": qkv, "preatt": filled((B, NH, T, T), 0.0), "att": filled((B, NH, T, T), 0.0),
              "rowmax": filled((B, NH, T), 0.0), "rowsum": filled((B, NH, T), 0.0),
              "out": filled((B, T, C), 0.0)}
    step = phases((scores, hs, n_pair), (row_max, T, n_row), (exp_sum, T, n_row),
                  (normalise, 1, n_pair), (weighted, T, B * T * C))
    return _program("attention_forward", step, max(n_pair, B * T * C), memory, "CREW",
                    expected, "q[b,t] is read by every key position, v[b,s] by every later query")


def residual_forward(N: int, seed: int = 0) -> Program:
    """out = inp1 + inp2, one processor per element, 1 step, EREW."""
    rng = random.Random(seed)
    a, b = randn(rng, N), randn(rng, N)

    def step(pid, _, mem):
        mem["out"][pid] = mem["inp1"][pid] + mem["inp2"][pid]
        mem.op("add")

    return _program("residual_forward", step, N, {"inp1": a, "inp2": b, "out": filled(N, 0.0)},
                    "EREW", lambda: {"out": to_torch(a) + to_torch(b)},
                    "each processor reads and writes only its own element", 1)


def gelu_forward(N: int, seed: int = 0) -> Program:
    """out = GELU(inp) (tanh approximation), one processor per element, 1 step, EREW."""
    inp = randn(random.Random(seed), N)

    def step(pid, _, mem):
        mem["out"][pid] = gelu_tanh(mem["inp"][pid])
        mem.op("gelu")

    def expected():
        import torch.nn.functional as F  # torch only for the reference result
        return {"out": F.gelu(to_torch(inp), approximate="tanh")}

    return _program("gelu_forward", step, N, {"inp": inp, "out": filled(N, 0.0)}, "EREW",
                    expected, "each processor reads and writes only its own element", 1)


def softmax_crossentropy_forward(B: int, T: int, V: int, seed: int = 0) -> Program:
    """probs = softmax(logits) and losses[b,t] = -log probs[b,t,targets[b,t]]: a processor per
    row finds the max (V steps) and the sum of exponentials (V steps); one per element
    normalises (1 step); the row processor takes the loss (1 step). 2V + 2 steps, CREW."""
    rng = random.Random(seed)
    logits, targets = randn(rng, B, T, V), tokens(rng, V, B, T)

    def row_max(pid, s, mem):       # processor (b,t) scans row (b,t)
        b, t = coords(pid, (B, T))
        x = mem["logits"][b, t, s]
        mem["rowmax"][b, t] = x if s == 0 else max(x, mem["rowmax"][b, t])
        mem.op("max")

    def exp_sum(pid, s, mem):
        b, t = coords(pid, (B, T))
        e = math.exp(mem["logits"][b, t, s] - mem["rowmax"][b, t])
        mem["probs"][b, t, s] = e
        mem["rowsum"][b, t] = e + (0.0 if s == 0 else mem["rowsum"][b, t])
        mem.op("exp")

    def normalise(pid, _, mem):
        b, t, v = coords(pid, (B, T, V))
        mem["probs"][b, t, v] = mem["probs"][b, t, v] / mem["rowsum"][b, t]
        mem.op("div")

    def loss(pid, _, mem):
        b, t = coords(pid, (B, T))
        mem["losses"][b, t] = -math.log(mem["probs"][b, t, mem["targets"][b, t]])
        mem.op("log")

    def expected():
        import torch.nn.functional as F  # torch only for the reference result
        x, y = to_torch(logits), to_torch(targets)
        return {"probs": x.softmax(-1),
                "losses": F.cross_entropy(x.view(-1, V), y.view(-1), reduction="none")}

    memory = {"logits": logits, "targets": targets, "rowmax": filled((B, T), 0.0),
              "rowsum": filled((B, T), 0.0), "probs": filled((B, T, V), 0.0),
              "losses": filled((B, T), 0.0)}
    rows = B * T                    # the row phases use B*T of the B*T*V processors
    step = phases((row_max, V, rows), (exp_sum, V, rows), (normalise, 1), (loss, 1, rows))
    return _program("softmax_crossentropy_forward", step, B * T * V, memory, "CREW", expected,
                    "a row's sum of exponentials is read by its V processors at once")
