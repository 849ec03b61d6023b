"""Activation memory of a transformer layer, after Korthikanti et al. 2022.

Source: Korthikanti, Casper, Lym, McAfee, Andersch, Shoeybi, Catanzaro, "Reducing Activation
Recomputation in Large Transformer Models" (arXiv:2205.05198, MLSys 2023). Variables as in the
paper: s sequence length, b micro-batch size, h hidden size (n_embd), a attention heads, t
tensor-parallel degree, L layers, v vocabulary size. Activations are 16-bit (2 bytes) and dropout
masks 1 byte. Section 4.1 counts, per layer,

    attention  11 sbh + 5 a s^2 b   (QKV input 2, Q and K 4, V 2, projection input 2, mask 1;
                                     softmax output 2, its dropout mask 1, dropout output 2)
    MLP        19 sbh               (inputs of the two linears 2 + 8, GeLU input 8, mask 1)
    LayerNorms  4 sbh

so sbh (34 + 5as/h) bytes (Eq. 1). Table 2 then gives, per layer:

    no parallelism                         sbh (34 + 5as/h)
    tensor parallel                        sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel             sbh/t (34 + 5as/h)
    tensor parallel + selective recompute  sbh (10 + 24/t)
    tensor + sequence + selective          sbh 34/t
    full recomputation                     2 sbh   (only the layer's input is kept)

Section 4.3 adds what lives outside the layers (without pipeline parallelism): the embedding
dropout mask sbh/t, the final LayerNorm and output-layer inputs 4sbh/t and the fp32 logits for the
cross-entropy 4sbv/t, i.e. sbh/t (5 + 4v/h).

We write the same counts with the element size ``e`` (2 bytes in the paper) and the mask size
``m`` (1 byte, 0 without dropout) so fp32 training and dropout-free models are covered:
16 e + 2 m = 34 and 2 e + m = 5 when e = 2, m = 1. Without dropout the softmax output is itself
the input of the attention over V, kept once: the scores cost e a s^2 b, not 2 e a s^2 b.
Section 4.3's outside-the-layers terms are divided by t because the paper runs them under
sequence parallelism; without it only the logits are split (a vocabulary-parallel output layer).
``flash_attention=True`` (our extension, not in the paper) drops the a s^2 b terms: a fused
attention kernel never stores the s x s scores.

The course trainer runs fp32 or ``torch.autocast``, which the paper does not cover: under autocast
the residual stream that each LayerNorm saves stays fp32 and every matmul keeps a 16-bit copy of its
weight for backward (:func:`autocast_activation_bytes`); whether the s x s scores are kept depends
on the kernel ``scaled_dot_product_attention`` picks on the device (:func:`sdpa_is_fused`).
:func:`trainer_activation_bytes` is the one count for a trainer run; the peak of a whole step adds
the model states and the loss's gradients to it (:func:`course_lib.analysis.memory.step_peak`).
Recomputation trades these bytes for FLOPs: :func:`recompute_flops_factor` (Sec. 5 of the paper).
"""

from __future__ import annotations

from course_lib.utils import check_count

RECOMPUTE = ("none", "selective", "full")


def _check(s: int, b: int, h: int, a: int, t: int) -> None:
    for name, value in (("seq_len (s)", s), ("batch_size (b)", b), ("n_embd (h)", h),
                        ("n_head (a)", a), ("tp (t)", t)):
        check_count(name, value)
    if h % a:
        raise ValueError(f"n_embd (h={h}) must be divisible by n_head (a={a})")
    if a % t:
        raise ValueError(f"tensor parallelism splits attention heads: n_head (a={a}) must be "
                         f"divisible by tp (t={t}); pick a tp that divides {a}")


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               bytes_per_value: int = 2, dropout: bool = True,
                               flash_attention: bool = False) -> float:
    """Bytes of activations one transformer layer keeps for the backward pass, per device.

    Korthikanti et al. 2022, Table 2 (with e = bytes_per_value = 2 and dropout masks of 1 byte).
    recompute: "none", "selective" (recompute the attention core: softmax, its dropout and the
    attention over V) or "full" (keep only the layer input, recompute the whole layer).
    """
    _check(s, b, h, a, t)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if bytes_per_value not in (1, 2, 4):
        raise ValueError(f"bytes_per_value must be 1, 2 or 4, got {bytes_per_value!r}")
    e, m = bytes_per_value, (1 if dropout else 0)
    sbh = s * b * h
    if recompute == "full":
        return float(e * sbh)  # Table 2, last row: 2 sbh
    # Attention core, a s^2 b (2 e + m): split over heads by tensor parallelism; gone when
    # recomputed (selective) or never stored (fused attention).
    # Without dropout the softmax output is the input of the attention over V, kept once (e).
    scores = e + (e + m if dropout else 0)
    core = 0.0 if (recompute == "selective" or flash_attention) else a * s * s * b * scores / t
    if sequence_parallel:
        # Sequence parallelism shards the LayerNorm/dropout region along s as well: all / t.
        return sbh * (16 * e + 2 * m) / t + core
    # The 10 = LayerNorm inputs (2 e) + layer/MLP inputs (2 e) + dropout masks (2 m) stay whole;
    # the 24 = 12 e inside the tensor-parallel matmuls is split t ways.
    return sbh * (4 * e + 2 * m + 12 * e / t) + core


def activation_bytes_outside_layers(s: int, b: int, h: int, v: int, t: int = 1,
                                    bytes_per_value: int = 2, dropout: bool = True,
                                    sequence_parallel: bool = False) -> float:
    """Embedding dropout mask, final LayerNorm and output-layer inputs and fp32 logits
    (Korthikanti et al. 2022, Section 4.3, no pipeline parallelism): sbh/t (5 + 4v/h) with
    sequence parallelism, as the paper counts them; without it the sbh terms are whole on every
    tensor-parallel rank and only the logits 4sbv/t are split."""
    check_count("vocab_size (v)", v)
    _check(s, b, h, 1, 1)
    check_count("tp (t)", t)
    e, m = bytes_per_value, (1 if dropout else 0)
    return s * b * h * (m + 2 * e) / (t if sequence_parallel else 1) + 4 * s * b * v / t


def activation_bytes(n_layer: int, s: int, b: int, h: int, a: int, v: int, t: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none",
                     bytes_per_value: int = 2, dropout: bool = True,
                     flash_attention: bool = False) -> float:
    """All activation bytes of a GPT per device: L layers plus the embedding and output layer."""
    check_count("n_layer (L)", n_layer)
    per_layer = activation_bytes_per_layer(s, b, h, a, t, sequence_parallel, recompute,
                                           bytes_per_value, dropout, flash_attention)
    return n_layer * per_layer + activation_bytes_outside_layers(s, b, h, v, t, bytes_per_value,
                                                                 dropout, sequence_parallel)


# --- under torch.autocast, in the course trainer ------------------------------------------------

def matmul_params(n_layer: int, h: int, v: int, bias: bool = True) -> tuple[int, int]:
    """(per layer, output layer) parameters that autocast casts to 16 bits in a GPT: the four
    Linear weights of a block, 12 h^2 (+ 9 h of biases), and the tied v x h output matrix."""
    return 12 * h * h + (9 * h if bias else 0), v * h


def autocast_activation_bytes(n_layer: int, s: int, b: int, h: int, a: int, v: int,
                              recompute: str = "none", dropout: bool = True,
                              flash_attention: bool = False, bias: bool = True,
                              low_bytes: int = 2, t: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes autograd keeps from forward to backward under ``torch.autocast`` (16-bit matmuls).

    Korthikanti et al. 2022's count with 2-byte values (:func:`activation_bytes`), plus what
    autocast holds in 4 bytes instead: the residual stream that each LayerNorm saves stays fp32
    (+2 sbh per LayerNorm: two per layer and the final one; with full recomputation the kept
    layer input is fp32, +2 sbh per layer), plus the 16-bit copies of the matmul weights that
    autocast makes in forward and backward needs (2 bytes per matmul parameter; recomputed, not
    kept, inside a fully recomputed block). With tensor parallelism (``t``) each rank casts its
    1/t of the matrices; the residual stream is whole on every rank unless ``sequence_parallel``
    cuts it along s too.
    """
    extra_bytes = 4 - low_bytes  # an fp32 tensor where the count assumes a 16-bit one
    per_layer_w, head_w = matmul_params(n_layer, h, v, bias)
    sbh = s * b * h / (t if sequence_parallel else 1)  # the residual stream on one rank
    base = activation_bytes(n_layer, s, b, h, a, v, t, sequence_parallel, recompute=recompute,
                            bytes_per_value=low_bytes, dropout=dropout, flash_attention=flash_attention)
    if recompute == "full":
        per_layer_extra = extra_bytes * sbh  # the fp32 block input
    else:
        per_layer_extra = 2 * extra_bytes * sbh + low_bytes * per_layer_w / t
    return base + n_layer * per_layer_extra + extra_bytes * sbh + low_bytes * head_w / t


def sdpa_is_fused(device_type: str, dropout: float) -> bool:
    """Whether the trainer's ``scaled_dot_product_attention`` runs a fused kernel that keeps no
    s x s scores for backward: on CUDA always (flash, cuDNN or memory-efficient), on a CPU only
    without dropout (with dropout it takes the unfused math path)."""
    return device_type == "cuda" or dropout == 0.0


def trainer_activation_bytes(n_layer: int, s: int, b: int, h: int, a: int, v: int, dtype: str,
                             recompute: str = "none", dropout: float = 0.0,
                             bias: bool = True, device_type: str = "cpu", t: int = 1,
                             sequence_parallel: bool = False) -> float:
    """The activation model for a course trainer run: fp32 -> Korthikanti with 4-byte values,
    bfloat16/float16 -> :func:`autocast_activation_bytes`, the attention's scores kept unless
    :func:`sdpa_is_fused` (a CPU with dropout keeps more than the paper counts: the model is then
    ~10-60 % low, see tests/test_precision.py). ``t``, ``sequence_parallel``: one rank of a
    tensor-parallel group (Korthikanti et al.'s Table 2 rows)."""
    flash = sdpa_is_fused(device_type, dropout)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16; got {dtype!r}")
    if dtype == "float32":
        count = activation_bytes(n_layer, s, b, h, a, v, t, sequence_parallel, recompute=recompute,
                                 bytes_per_value=4, dropout=dropout > 0, flash_attention=flash)
    else:
        count = autocast_activation_bytes(n_layer, s, b, h, a, v, recompute, dropout > 0, flash, bias,
                                          t=t, sequence_parallel=sequence_parallel)
    if sequence_parallel and t > 1 and recompute != "full":
        # The course's sequence parallelism all-gathers the input of its two column-parallel linears
        # (QKV, the MLP's first) and each linear keeps the whole gathered input for backward
        # (parallel.tensor.layers); Korthikanti et al. keep it split and gather it again in
        # backward (Sec. 4.2.2), which their count assumes: (1 - 1/t) of two inputs more per layer.
        count += n_layer * 2 * (4 if dtype == "float32" else 2) * s * b * h * (1 - 1 / t)
    return count


# --- what recomputation costs in FLOPs ----------------------------------------------------------

def selective_overhead(s: int, h: int, v: int = 0, n_layer: int = 1) -> float:
    """Extra FLOPs of selective recomputation as a share of a training step's model FLOPs, as
    Korthikanti et al. 2022 count it: model FLOPs 72 B L s h^2 (1 + s/6h + V/12hL) (Appendix A,
    Eq. 7), hardware FLOPs with selective recomputation 72 B L s h^2 (1 + s/3h + V/12hL) (Eq. 8),
    so (s/6h) / (1 + s/6h + V/12hL): 2.7 % for GPT-3 175B, as Sec. 5 states (its configuration:
    Table 3). The appendix's own words add less: one more forward of the core, 2 B s^2 h + 2 B s^2 h
    per layer, which is s/18h, a third of Eq. 8's term (0.9 % for GPT-3). We keep the paper's
    figure, the one it publishes; :func:`recompute_flops_factor`'s "full" counts a forward only."""
    core = s / (6 * h)
    return core / (1 + core + v / (12 * h * n_layer))


def recompute_flops_factor(recompute: str, s: int = 1024, h: int = 768, v: int = 0,
                           n_layer: int = 1) -> float:
    """Training FLOPs relative to no recomputation. Forward is 2N and backward 4N per token
    (Kaplan et al. 2020), so recomputing every block's forward adds 2N / 6N = 1/3 ("full";
    Narayanan et al. 2021's 96 B s L h^2 against 72); "selective" adds only the attention core
    (:func:`selective_overhead`)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be none, selective or full; got {recompute!r}")
    return {"none": 1.0, "full": 4 / 3,
            "selective": 1.0 + selective_overhead(s, h, v, n_layer)}[recompute]
