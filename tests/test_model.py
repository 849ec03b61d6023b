"""The GPT model: published GPT-2 parameter counts, generation, optimizer groups, FLOPs and MFU.

GPT-2 parameter counts as published by the Hugging Face checkpoints (``GPT2LMHeadModel``
``gpt2``: 124,439,808; ``gpt2-medium``: 354,823,168; tied embedding counted once), the models of
Radford et al. 2019 ("124M" and "350M" in nanoGPT's README). FLOPs per token: 6N + 12 L C T
(PaLM, Chowdhery et al. 2022, Appendix B), the formula of nanoGPT's ``estimate_mfu``.
"""

from __future__ import annotations

import math

import pytest
import torch

from course_lib.gpt.model import GPT, GPTConfig


def gpt2(n_layer: int, n_head: int, n_embd: int) -> GPT:
    cfg = GPTConfig(block_size=1024, vocab_size=50257, n_layer=n_layer, n_head=n_head, n_embd=n_embd, bias=True)
    with torch.device("meta"):  # shapes only: no memory, no time
        return GPT(cfg)


def test_gpt2_small_and_medium_parameter_counts():
    assert gpt2(12, 12, 768).num_params() == 124_439_808
    assert gpt2(24, 16, 1024).num_params() == 354_823_168


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dict(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32), **kw}))


def test_initial_loss_is_that_of_a_uniform_guess():
    model = tiny()
    g = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(65, (2, 8, 16), generator=g)
    logits, loss = model(idx, targets)
    assert logits.shape == (8, 16, 65)
    assert loss.item() == pytest.approx(math.log(65), abs=0.1)  # small init: near-uniform predictions
    assert model.transformer.wte.weight is model.lm_head.weight  # tied


def test_generate_shapes_determinism_and_top_k():
    model = tiny().eval()
    idx = torch.zeros((2, 3), dtype=torch.long)
    a = model.generate(idx, 20, top_k=5, generator=torch.Generator().manual_seed(1))
    b = model.generate(idx, 20, top_k=5, generator=torch.Generator().manual_seed(1))
    assert a.shape == (2, 23) and torch.equal(a, b) and torch.equal(a[:, :3], idx)
    # top_k=1 is greedy decoding: each new token is the argmax of the model's next-token logits
    g = model.generate(idx, 5, top_k=1)
    for t in range(3, 8):
        logits, _ = model(g[:, :t])
        assert torch.equal(g[:, t], logits[:, -1].argmax(-1))
    # longer than block_size: the context is cropped, generation goes on
    assert model.generate(idx, 30, generator=torch.Generator().manual_seed(0)).shape == (2, 33)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(idx, 1, temperature=0)


def test_optimizer_groups_decay_matrices_only():
    model = tiny(bias=True)
    decay, no_decay = model.param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    n = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert n == model.num_params()  # every parameter once (the tied embedding too)
    assert any(p is model.transformer.wte.weight for p in decay["params"])
    opt = model.configure_optimizers(0.1, 1e-3)
    assert isinstance(opt, torch.optim.AdamW) and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_one_adamw_rule_for_the_trainer_the_model_and_the_toy():
    """Frozen parameters get no optimizer state; the trainer, GPT.configure_optimizers and the
    parallelism tests' toy AdamW all build the same groups with the same (fused) kernel."""
    from course_lib.parallel import toy
    from course_lib.trainer.config import TrainConfig
    from course_lib.trainer.loop import optimizer_factory

    model = tiny(bias=True)
    model.transformer.wpe.weight.requires_grad_(False)  # e.g. a frozen position embedding
    groups = model.param_groups(0.1)
    assert not any(p is model.transformer.wpe.weight for g in groups for p in g["params"])
    assert sum(p.numel() for g in groups for p in g["params"]) == model.num_params() - model.transformer.wpe.weight.numel()
    ids = [[id(p) for p in g["params"]] for g in groups]
    for opt in (model.configure_optimizers(0.1, 1e-3), optimizer_factory(TrainConfig(weight_decay=0.1))(model),
                toy.adamw(model, weight_decay=0.1)):
        assert [[id(p) for p in g["params"]] for g in opt.param_groups] == ids
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0] and opt.defaults["fused"]


def test_flops_per_token_and_mfu():
    model = gpt2(12, 12, 768)
    n = 124_439_808 - 1024 * 768  # without the position embedding, as nanoGPT counts
    assert model.num_params(non_embedding=True) == n
    assert model.flops_per_token() == 6 * n + 12 * 12 * 768 * 1024
    # MFU is achieved FLOP/s over the peak: at 1e5 tokens/s on an A100 (312 TFLOP/s bf16)
    from course_lib.hardware import PROFILES

    peak = PROFILES["a100-80gb"].peak("bfloat16")
    assert model.estimate_mfu(1e5, peak) == pytest.approx(model.flops_per_token() * 1e5 / 312e12)
    assert math.isnan(model.estimate_mfu(1e5, None))


def test_a_config_of_the_wrong_type_is_named():
    """A string from a form or a float from arithmetic is refused by name, before any comparison."""
    for kw, msg in [({"n_layer": "4"}, "n_layer: expected int, got str '4'"),
                    ({"n_embd": 64.0}, "n_embd: expected int, got float 64.0"),
                    ({"bias": 1}, "bias: expected bool, got int 1")]:
        with pytest.raises(ValueError, match=msg):
            GPTConfig(**kw)
    assert GPTConfig(dropout=0).dropout == 0.0  # an int is taken for a float
