"""A GPT-2 style language model, written for reading (Radford et al. 2019).

Shapes in comments: B batch, T time (sequence), C channels (n_embd), nh heads, hs head size.
The architecture is GPT-2's: learned position embeddings, pre-LayerNorm residual blocks of
causal self-attention and a 4x GELU MLP, a final LayerNorm, and an LM head tied to the token
embedding. Initialisation follows GPT-2: N(0, 0.02) everywhere, with the residual output
projections scaled by 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with
depth.

Activation recomputation (``GPT.set_recompute``), after Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models" (arXiv:2205.05198): "full" keeps only each
block's input and recomputes the block in backward (Chen et al. 2016's gradient checkpointing),
"selective" recomputes only the attention core (softmax(QK^T)V with its dropout), whose s x s
activations are large but cheap to recompute. Both use ``torch.utils.checkpoint`` with
``use_reentrant=False``; the forward values are the same operations, so losses do not change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib.analysis.activations import RECOMPUTE  # none, selective, full
from course_lib.gpt.chunked_loss import chunked_linear_cross_entropy
from course_lib.gpt.moe import Experts, MoE, aux_loss
from course_lib.registry import MoEConfig, check_types


@dataclass(frozen=True)
class GPTConfig(MoEConfig):  # n_expert > 0: every block's MLP is a mixture of experts (gpt/moe.py)
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64 for faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, like GPT-2

    def __post_init__(self):
        check_types(self)  # GPTConfig(n_layer="4") is named here, not in a comparison below
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        MoEConfig.check(self)

    @classmethod
    def from_shape(cls, shape) -> GPTConfig:
        """The model of an :class:`course_lib.analysis.memory.ModelShape` (what the memory model prices)."""
        return cls(block_size=shape.block_size, vocab_size=shape.vocab_size, n_layer=shape.n_layer,
                   n_head=shape.n_head, n_embd=shape.n_embd, dropout=shape.dropout, bias=shape.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scale = True
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.recompute_core = False  # selective recomputation (set by GPT.set_recompute)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(hs)) v with causal mask and dropout: (B, nh, T, hs) each."""
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, nh, T, hs): each head attends independently
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.recompute_core and torch.is_grad_enabled():
            # keep q, k, v; the s x s scores, softmax and dropout mask are recomputed in backward
            y = checkpoint(self.core, q, k, v, use_reentrant=False)  # (B, nh, T, hs)
        else:
            y = self.core(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scale = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MoE(cfg, MLP) if cfg.n_expert else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # pre-LN: normalise the branch input, keep the residual clean
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying (one tensor, two uses)
        self.apply(self._init_weights)
        self.recompute = "none"  # how backward gets the blocks' activations (set_recompute)
        self.loss_chunks = 0  # 0: logits, then F.cross_entropy; n: head and loss fused over n chunks

    def set_loss_chunks(self, chunks: int) -> GPT:
        """0 (the default): the LM head makes the (B, T, V) logits and ``F.cross_entropy`` reads them.
        ``chunks`` > 0: in training (gradients on) the head and the loss run fused over ``chunks`` row
        chunks (:mod:`course_lib.gpt.chunked_loss`), never holding the full logits, and forward
        returns ``(None, loss)``. Like recomputation it changes memory and time, not the loss."""
        if chunks < 0:
            raise ValueError(f"loss chunks must be >= 0, got {chunks}")
        self.loss_chunks = chunks
        return self

    def set_recompute(self, mode: str) -> GPT:
        """'none' (keep every activation), 'selective' (recompute the attention core) or 'full'
        (keep each block's input only; recompute the block in backward). Not part of GPTConfig:
        it changes memory and time, never the weights or the loss."""
        if mode not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}; got {mode!r}")
        self.recompute = mode
        for block in self.transformer.h:
            block.attn.recompute_core = mode == "selective"
        return self

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_scale", False):
                std /= math.sqrt(2 * self.config.n_layer)  # two residual adds per block
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, Experts):  # each expert initialised as the dense MLP
            module.reset_parameters(0.02, 0.02 / math.sqrt(2 * self.config.n_layer))

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; tied weights are counted once. ``non_embedding`` drops wpe (as nanoGPT)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) token ids. Returns (logits, loss); logits (B, T, V), or (B, 1, V)
        for the last position only when no targets are given (generation), or None in training
        with ``set_loss_chunks``."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        full = self.recompute == "full" and torch.is_grad_enabled()
        for block in self.transformer.h:
            # full recomputation: autograd keeps x (B, T, C) only and reruns the block in backward
            x = checkpoint(block, x, use_reentrant=False) if full else block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        if self.loss_chunks and torch.is_grad_enabled():  # no (B, T, V) logits at all
            logits = None
            loss = chunked_linear_cross_entropy(x.view(B * T, -1), self.lm_head.weight, targets.view(-1),
                                                self.loss_chunks)
        else:
            logits = self.lm_head(x)  # (B, T, V)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        if self.config.n_expert and self.training:  # + every MoE block's load-balancing loss (gpt/moe.py);
            loss = loss + self.config.aux_loss_coef * aux_loss(self)  # evaluation: the cross-entropy alone
        return logits, loss

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW's two groups for this model (see :func:`adamw_param_groups`)."""
        return adamw_param_groups(self, weight_decay)

    def configure_optimizers(self, weight_decay: float, learning_rate: float,
                             betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
        """nanoGPT's name for :func:`make_adamw` on this model."""
        return make_adamw(self, learning_rate, weight_decay, betas)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the matmuls with the weights (forward 2N, backward 4N)
        plus 12 * n_layer * n_embd * T for attention scores and values (PaLM, Chowdhery et al.
        2022, Appendix B)."""
        c = self.config
        return 6 * self.active_params() + 12 * c.n_layer * c.n_embd * c.block_size

    def active_params(self) -> int:
        """Non-embedding parameters one token computes with: all of them for the dense model; with
        experts, top_k of the n_expert routed experts (DeepSeek-V3's "activated parameters", Sec. 1)."""
        n = self.num_params(non_embedding=True)
        if not self.config.n_expert:
            return n
        routed = sum(p.numel() for m in self.modules() if isinstance(m, Experts) for p in m.parameters())
        return n - routed + routed * self.config.top_k // self.config.n_expert

    def estimate_mfu(self, tokens_per_s: float, peak_flops: float | None) -> float:
        """Model FLOPs utilisation: achieved FLOP/s over the hardware's peak for the dtype in use.
        ``peak_flops`` comes from :mod:`course_lib.hardware` (NaN if unknown)."""
        if not peak_flops:
            return float("nan")
        return self.flops_per_token() * tokens_per_s / peak_flops

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to idx (B, T); returns (B, T + max_new_tokens)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size:]  # crop the context to what the model has seen
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature  # (B, V)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, 1, generator=generator)), dim=1)
        return idx


def adamw_param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """The course's one AdamW grouping: decay matrices (Linear and embedding weights, dim >= 2),
    never biases or LayerNorm gains (dim < 2), as nanoGPT's ``configure_optimizers``; decoupled
    weight decay is Loshchilov & Hutter 2019. The stacked biases of a mixture of experts (E, n) are
    biases too (flagged ``is_bias``). Trainable parameters only: a frozen one gets no
    optimizer state. A tied weight appears once (``parameters()`` skips repeats)."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p.dim() >= 2 and not getattr(p, "is_bias", False) for p in params]  # stacked experts' biases: (E, n)
    return [{"params": [p for p, d in zip(params, decay) if d], "weight_decay": weight_decay},
            {"params": [p for p, d in zip(params, decay) if not d], "weight_decay": 0.0}]


def make_adamw(module: nn.Module, lr: float, weight_decay: float,
               betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW over :func:`adamw_param_groups`, used by the trainer, ``GPT.configure_optimizers`` and
    the parallelism tests' toy model alike. ``fused=True`` on every device: one kernel for all
    parameters on CPU and CUDA, and every update elementwise, so a parameter sharded by ZeRO or
    tensor parallelism steps as the whole one does; one flag everywhere keeps a strategy and its
    single-process reference on the same arithmetic."""
    return torch.optim.AdamW(adamw_param_groups(module, weight_decay), lr=lr, betas=betas, fused=True)
