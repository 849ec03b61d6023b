"""Parameters and training memory of a mixture-of-experts transformer: total against active, per rank.

A mixture-of-experts (MoE) layer replaces a transformer block's feed-forward network by E experts
(each a feed-forward network of its own) and a router that sends every token to k of them
(Shazeer et al. 2017; Switch Transformer, Fedus et al. 2022; GShard, Lepikhin et al. 2020). The
model *holds* every expert, but each token *uses* only k: its total parameters set the memory, its
active parameters the FLOPs per token.

    from course_lib.analysis.moe_memory import PUBLISHED, rank_states
    shape = PUBLISHED["deepseek-v3"]
    shape.total_params(), shape.active_params()                # 671e9, 37e9 (the paper's abstract)
    rank_states(shape, dp=128, ep=64, pp=16, stage=1).total     # bytes per GPU, mixed precision

Per rank, with ranks = dp x tp x pp and expert parallelism carved out of data parallelism (ep
divides dp: DeepSpeed-MoE's, Megatron-LM's and DeepSeek-V3's layout, and the course's
``ParallelConfig``): the dp ranks read different data, and the ep ranks of one group hold different
experts:

* the experts: E / ep of every MoE layer's routed experts on each rank; each of those is held by
  dp / ep ranks (the "expert data parallel" group), so ZeRO shards the experts' states over dp / ep;
* everything else (embeddings, attention, dense feed-forward networks, shared experts, routers,
  norms) is replicated over all dp ranks, so ZeRO shards it over dp;
* tp divides every matrix (the small norm vectors ignored, as :func:`model_state_bytes` does),
  the experts' too as Megatron-LM may split them; but not the course GPT's routers and routed
  experts (``MoEShape.experts_split_by_tp`` False, :meth:`MoEShape.of_gpt`), which every tp rank
  holds whole (:mod:`course_lib.parallel.expert.layer`); pp divides the layers evenly (the first
  and last stages' embeddings ignored). With context parallelism, count dp x cp as dp (the ranks
  that hold other tokens of the batch).

Bytes per parameter are those of :mod:`course_lib.analysis.memory` (the ZeRO paper's 2 + 2 + 12
in mixed precision, 4 + 4 + 8 in fp32); ``expert_stage`` lets the experts use another ZeRO stage
than the rest (a strategy that shards only the non-expert parameters).

Parameter counts follow each architecture's layers: attention with grouped-query heads
(:func:`gqa_attention_params`) or DeepSeek's multi-head latent attention (:func:`mla_attention_params`),
feed-forward networks of 2 matrices (GPT's GELU MLP) or 3 (SwiGLU). :data:`PUBLISHED` holds the
shapes of DeepSeek-V3 and Mixtral 8x7B with the source of each number; tests/test_moe_models.py
checks their totals against the papers.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.analysis.memory import ModelStates, model_state_bytes
from course_lib.hardware import GB
from course_lib.utils import check_count


def gqa_attention_params(n_embd: int, n_head: int, n_kv_head: int | None = None,
                         head_dim: int | None = None, bias: bool = False) -> int:
    """One layer's attention: Q (n_head heads), K and V (n_kv_head heads each: grouped-query
    attention, Ainslie et al. 2023; n_kv_head = n_head is multi-head attention) and the output
    projection, each head of ``head_dim`` (default n_embd / n_head)."""
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    head_dim = n_embd // n_head if head_dim is None else head_dim
    q, kv = n_head * head_dim, n_kv_head * head_dim
    weights = n_embd * (q + 2 * kv) + q * n_embd
    return weights + ((q + 2 * kv + n_embd) if bias else 0)


def mla_attention_params(n_embd: int, n_head: int, q_lora_rank: int, kv_lora_rank: int,
                         qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int) -> int:
    """One layer's multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, Sec. 2.1; DeepSeek-V3,
    arXiv:2412.19437, Sec. 2.1.1): the query through a rank-``q_lora_rank`` bottleneck (down,
    RMSNorm, up to n_head x (nope + rope) dims), keys and values through one compressed latent of
    ``kv_lora_rank`` (down, with the shared rope key beside it, RMSNorm, up to n_head x (nope + v)),
    and the output projection from n_head x v_head_dim. No biases."""
    q = n_embd * q_lora_rank + q_lora_rank + q_lora_rank * n_head * (qk_nope_head_dim + qk_rope_head_dim)
    kv = (n_embd * (kv_lora_rank + qk_rope_head_dim) + kv_lora_rank
          + kv_lora_rank * n_head * (qk_nope_head_dim + v_head_dim))
    return q + kv + n_head * v_head_dim * n_embd


@dataclass(frozen=True)
class MoEShape:
    """A transformer whose feed-forward networks are (from layer ``n_dense_layers`` on) MoE layers."""

    name: str
    n_layer: int  # transformer blocks
    n_embd: int  # hidden size h
    vocab_size: int
    attention_params: int  # one block's attention (gqa_attention_params / mla_attention_params)
    n_experts: int  # routed experts per MoE layer, E
    top_k: int  # routed experts per token, k
    expert_hidden: int  # intermediate size of one expert
    n_shared: int = 0  # shared experts, used by every token (DeepSeekMoE)
    n_dense_layers: int = 0  # the first blocks keep a dense feed-forward network
    dense_hidden: int = 0  # its intermediate size
    ffn_matrices: int = 3  # 3: SwiGLU (gate, up, down); 2: GPT's GELU MLP (c_fc, c_proj)
    ffn_bias: bool = False  # biases in the feed-forward networks and experts
    norm_bias: bool = False  # LayerNorm with a bias (GPT); False: RMSNorm or a bias-free LayerNorm
    router_bias: bool = False  # a bias per expert in the router (DeepSeek-V3's balancing bias)
    tied_embeddings: bool = False  # the output head shares the token embedding's weight
    # False: every tp rank holds the routers and the routed experts whole (the course GPT's
    # ExpertParallelMoE: tp splits the shared expert only); True: tp splits them as every matrix
    experts_split_by_tp: bool = True
    positions: int = 0  # rows of a learned position embedding (GPT: block_size; RoPE: 0)
    source: str = ""  # where each number comes from

    def __post_init__(self):
        for f in ("n_layer", "n_embd", "vocab_size", "n_experts", "top_k", "expert_hidden"):
            check_count(f, getattr(self, f))
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) cannot exceed n_experts ({self.n_experts})")
        if not 0 <= self.n_dense_layers <= self.n_layer:
            raise ValueError(f"n_dense_layers must be in [0, n_layer={self.n_layer}], got {self.n_dense_layers}")
        if self.n_dense_layers and self.dense_hidden < 1:
            raise ValueError("dense layers need dense_hidden (their feed-forward width)")
        if self.ffn_matrices not in (2, 3):
            raise ValueError(f"ffn_matrices must be 2 (GELU MLP) or 3 (SwiGLU), got {self.ffn_matrices}")

    @classmethod
    def of_gpt(cls, cfg, name: str = "course-gpt") -> MoEShape:
        """The course GPT with ``cfg.n_expert`` experts in every block (:mod:`course_lib.gpt.moe`):
        GPT-2 attention and LayerNorms (biases as ``cfg.bias``), each expert and the optional shared
        expert a GPT-2 MLP (C -> 4C -> C), a router without bias, the token embedding tied to the
        output head, learned positions. ``cfg``: anything with GPTConfig's fields (no import of gpt/)."""
        h = cfg.n_embd
        return cls(name, n_layer=cfg.n_layer, n_embd=h, vocab_size=cfg.vocab_size,
                   attention_params=gqa_attention_params(h, cfg.n_head, bias=cfg.bias),
                   n_experts=cfg.n_expert, top_k=cfg.top_k, expert_hidden=4 * h,
                   n_shared=getattr(cfg, "n_shared_expert", 0), ffn_matrices=2, ffn_bias=cfg.bias,
                   norm_bias=cfg.bias, tied_embeddings=True, positions=cfg.block_size,
                   experts_split_by_tp=False,
                   source="course_lib.gpt.model and gpt.moe: the module's own parameters")

    @property
    def n_moe_layers(self) -> int:
        return self.n_layer - self.n_dense_layers

    def ffn_params(self, hidden: int) -> int:
        """One feed-forward network (or expert) of intermediate size ``hidden``."""
        bias = (self.ffn_matrices - 1) * hidden + self.n_embd if self.ffn_bias else 0
        return self.ffn_matrices * self.n_embd * hidden + bias

    def params(self) -> dict[str, int]:
        """Parameters by part: ``experts`` (the routed experts, the part expert parallelism
        splits) and the rest, held by every rank of a dp x ep grid."""
        h, L, moe = self.n_embd, self.n_layer, self.n_moe_layers
        norm = h * (2 if self.norm_bias else 1)
        return {
            "embeddings": self.vocab_size * h * (1 if self.tied_embeddings else 2) + self.positions * h,
            "attention": L * self.attention_params,
            "dense_ffn": self.n_dense_layers * self.ffn_params(self.dense_hidden) if self.n_dense_layers else 0,
            "shared_experts": moe * self.n_shared * self.ffn_params(self.expert_hidden),
            "routers": moe * (h * self.n_experts + (self.n_experts if self.router_bias else 0)),
            "norms": (2 * L + 1) * norm,
            "experts": moe * self.n_experts * self.ffn_params(self.expert_hidden),
        }

    def total_params(self) -> int:
        return sum(self.params().values())

    def expert_params(self) -> int:
        return self.params()["experts"]

    def extra_activation_bytes(self, s: int, b: int, bytes_per_value: int) -> float:
        """What a step of the course's mixture of experts (:mod:`course_lib.gpt.moe`) keeps for
        backward beyond a dense GPT's one MLP per layer, for b sequences of s tokens: the MLP inputs
        of the other top_k + n_shared - 1 experts a token passes (h + 2 hidden values each: the
        first matmul's input, GELU's input, the second matmul's input) and every routed expert's
        output, kept for its gate's product (top_k h values). Met within 2 % on a CPU
        (tests/test_step_peak.py). GELU experts only (``ffn_matrices == 2``)."""
        if self.ffn_matrices != 2:
            raise ValueError("extra_activation_bytes models GELU experts (ffn_matrices=2) only")
        h, k = self.n_embd, self.top_k
        per_token = (k + self.n_shared - 1) * (h + 2 * self.expert_hidden) + k * h
        return float(self.n_moe_layers * s * b * per_token * bytes_per_value)

    def active_params(self, embeddings: bool = True) -> float:
        """Parameters one token uses: everything but the routed experts, plus k of the E in every
        MoE layer. ``embeddings=False`` leaves out the token (and position) embedding, a look-up
        of one row (the output head is a matrix product and stays)."""
        p = self.params()
        active = self.total_params() - p["experts"] * (1 - self.top_k / self.n_experts)
        if not embeddings:
            active -= (self.vocab_size + self.positions) * self.n_embd
        return active


@dataclass(frozen=True)
class RankStates:
    """Model states one rank holds: its experts' and the rest's (ModelStates each)."""

    experts: ModelStates
    non_experts: ModelStates

    @property
    def total(self) -> ModelStates:
        return ModelStates(self.experts.params + self.non_experts.params,
                           self.experts.grads + self.non_experts.grads,
                           self.experts.optimizer + self.non_experts.optimizer)


def rank_states(shape: MoEShape | dict, *, dp: int = 1, ep: int = 1, tp: int = 1, pp: int = 1,
                stage: int = 0, expert_stage: int | None = None, dtype: str = "mixed",
                k: float | None = None) -> RankStates:
    """Bytes of parameters, gradients and optimizer states per rank (module docstring's layout).

    ``shape``: an :class:`MoEShape`, or a dict of parameter counts by part with an ``experts``
    entry (the whole model's, e.g. counted from its modules). ``stage``: the ZeRO stage of the
    non-expert states, sharded over the dp ranks; ``expert_stage`` (default: ``stage``) that of the
    experts' states, sharded over the dp / ep ranks that hold the same experts.
    """
    dp = check_count("dp (data-parallel degree)", dp)
    ep = check_count("ep (expert-parallel degree)", ep)
    pp = check_count("pp (pipeline-parallel degree)", pp)
    if dp % ep:
        raise ValueError(f"ep ({ep}) must divide dp ({dp}): expert parallelism is carved out of the data ranks")
    parts = shape.params() if isinstance(shape, MoEShape) else dict(shape)
    if isinstance(shape, MoEShape) and shape.n_experts % ep:
        raise ValueError(f"{shape.n_experts} experts cannot be split evenly over ep={ep} ranks")
    experts = float(parts.pop("experts"))
    # the course GPT's routers and routed experts are whole on every tp rank (experts_split_by_tp)
    whole_on_tp = isinstance(shape, MoEShape) and not shape.experts_split_by_tp
    routers = float(parts.pop("routers")) if whole_on_tp else 0.0
    rest = float(sum(parts.values()))
    expert_stage = stage if expert_stage is None else expert_stage
    non_experts = model_state_bytes(rest / pp, dp, stage, k, dtype, tp)
    if routers:
        r = model_state_bytes(routers / pp, dp, stage, k, dtype)
        non_experts = ModelStates(non_experts.params + r.params, non_experts.grads + r.grads,
                                  non_experts.optimizer + r.optimizer)
    return RankStates(
        experts=model_state_bytes(experts / (ep * pp), dp // ep, expert_stage, k, dtype, 1 if whole_on_tp else tp),
        non_experts=non_experts,
    )


def layout_rows(shape: MoEShape, layouts: list[dict], dtype: str = "mixed", unit: float = GB) -> list[dict]:
    """One row per layout (``rank_states``' keyword arguments, e.g. ``{"dp": 128, "ep": 64, "pp": 16,
    "stage": 1}``): the GPUs it takes and what one of them holds, in GB (1e9 bytes)."""
    rows = []
    for layout in layouts:
        r = rank_states(shape, dtype=dtype, **layout)
        gpus = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
        rows.append({"model": shape.name, "layout": " ".join(f"{k}={v}" for k, v in layout.items()),
                     "GPUs": gpus, "experts GB": r.experts.total / unit,
                     "rest GB": r.non_experts.total / unit, **{f"{k} GB": v for k, v in r.total.to_gb(unit).items()}})
    return rows


# The published configurations. Each field's source is in `source`; tests/test_moe_models.py checks
# the totals against the papers' own 671B/37B and 46.7B/12.9B.
PUBLISHED: dict[str, MoEShape] = {s.name: s for s in (
    MoEShape(
        "deepseek-v3", n_layer=61, n_embd=7168, vocab_size=129280,
        attention_params=mla_attention_params(7168, 128, q_lora_rank=1536, kv_lora_rank=512,
                                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        n_experts=256, top_k=8, expert_hidden=2048, n_shared=1, n_dense_layers=3, dense_hidden=18432,
        router_bias=True,
        source=("DeepSeek-AI, 'DeepSeek-V3 Technical Report', arXiv:2412.19437 (2024), Sec. 4.2 "
                "(hyper-parameters): 61 layers, hidden 7168, 128 heads of 128, KV compression 512, "
                "query compression 1536, decoupled RoPE 64 per head, MoE in all but the first 3 "
                "layers, 1 shared + 256 routed experts of intermediate 2048, 8 routed per token; "
                "671B total, 37B active (abstract, Sec. 4.2; README_WEIGHTS.md of the released weights: "
                "36.7B active with the embedding and the output head, 2.3 % below this count). "
                "SwiGLU experts and RMSNorm (Sec. 2.1, "
                "after DeepSeek-V2); the balancing bias per expert (Sec. 2.1.2). Not in the paper, "
                "from the released config.json (huggingface.co/deepseek-ai/DeepSeek-V3): the dense "
                "layers' intermediate size 18432, vocabulary 129280 (the paper: 128K), untied "
                "output head. The multi-token-prediction module (Sec. 2.2, 14B more in the release) "
                "is not counted, as the paper's 671B does not count it.")),
    MoEShape(
        "mixtral-8x7b", n_layer=32, n_embd=4096, vocab_size=32000,
        attention_params=gqa_attention_params(4096, 32, n_kv_head=8, head_dim=128),
        n_experts=8, top_k=2, expert_hidden=14336,
        source=("Jiang et al., 'Mixtral of Experts', arXiv:2401.04088 (2024), Table 1: dim 4096, "
                "32 layers, head_dim 128, hidden_dim 14336, 32 heads, 8 KV heads, vocabulary "
                "32000, 8 experts, top-2; Sec. 2: SwiGLU experts, the Mistral 7B architecture "
                "(RMSNorm, RoPE, an untied output head); 'each token has access to 47B parameters, "
                "but only uses 13B active parameters' (abstract); 46.7B and 12.9B: Mistral AI's "
                "release post 'Mixtral of experts' (December 2023)")),
)}
