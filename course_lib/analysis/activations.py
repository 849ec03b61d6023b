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
16 e + 2 m = 34 and 2 e + m = 5 when e = 2, m = 1. ``flash_attention=True`` (our extension, not
in the paper) drops the a s^2 b terms: a fused attention kernel never stores the s x s scores.
"""

from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")


def _check(s: int, b: int, h: int, a: int, t: int) -> None:
    for name, value in (("seq_len (s)", s), ("batch_size (b)", b), ("n_embd (h)", h),
                        ("n_head (a)", a), ("tp (t)", t)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
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
    core = 0.0 if (recompute == "selective" or flash_attention) else a * s * s * b * (2 * e + m) / t
    if sequence_parallel:
        # Sequence parallelism shards the LayerNorm/dropout region along s as well: all / t.
        return sbh * (16 * e + 2 * m) / t + core
    # The 10 = LayerNorm inputs (2 e) + layer/MLP inputs (2 e) + dropout masks (2 m) stay whole;
    # the 24 = 12 e inside the tensor-parallel matmuls is split t ways.
    return sbh * (4 * e + 2 * m + 12 * e / t) + core


def activation_bytes_outside_layers(s: int, b: int, h: int, v: int, t: int = 1,
                                    bytes_per_value: int = 2, dropout: bool = True) -> float:
    """Embedding dropout mask, final LayerNorm and output-layer inputs and fp32 logits
    (Korthikanti et al. 2022, Section 4.3, no pipeline parallelism): sbh/t (5 + 4v/h)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"vocab_size (v) must be a whole number >= 1, got {v!r}")
    _check(s, b, h, 1, 1)
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ValueError(f"tp (t) must be a whole number >= 1, got {t!r}")
    e, m = bytes_per_value, (1 if dropout else 0)
    return (s * b * h * (m + 2 * e) + 4 * s * b * v) / t


def activation_bytes(n_layer: int, s: int, b: int, h: int, a: int, v: int, t: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none",
                     bytes_per_value: int = 2, dropout: bool = True,
                     flash_attention: bool = False) -> float:
    """All activation bytes of a GPT per device: L layers plus the embedding and output layer."""
    if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
        raise ValueError(f"n_layer (L) must be a whole number >= 1, got {n_layer!r}")
    per_layer = activation_bytes_per_layer(s, b, h, a, t, sequence_parallel, recompute,
                                           bytes_per_value, dropout, flash_attention)
    return n_layer * per_layer + activation_bytes_outside_layers(s, b, h, v, t, bytes_per_value,
                                                                 dropout)
