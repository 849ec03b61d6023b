"""Audit of sampling and fine-tuning against the data they read (gpt/sample.py, trainer/finetune.py).

Each test once failed:
- a run on the GPT-2 BPE dataset has 50304 output logits (50257 padded to a multiple of 64, as
  nanoGPT pads them) and sampling could draw a padding id, which tiktoken cannot decode
  (KeyError 'Invalid token for decoding: 50278' from a freshly initialised model);
- fine-tuning data encoded with another character vocabulary than the checkpoint's was taken
  silently: the same number of characters, so the weights loaded, but every id meant another one;
- a seed that is not a whole number was a RuntimeError of torch's after the checkpoint had been
  read, though sample() promises a ValueError before it reads anything.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from course_lib.gpt import checkpoint as ckpt_io
from course_lib.gpt import data
from course_lib.gpt.model import GPT, GPTConfig
from course_lib.gpt.sample import sample
from course_lib.registry import ConfigError
from course_lib.trainer.config import check_resume, make_config
from course_lib.trainer.finetune import finetune_config

GPT2_META = {"dataset": "shakespeare", "tokenizer": "gpt2", "vocab_size": data.GPT2_EOT + 1}
CHAR_META = {"dataset": "shakespeare_char", "tokenizer": "char", "vocab_size": 3, "chars": ["\n", "a", "b"]}


def _save_run(run, model: GPT, meta: dict, **state) -> None:
    ckpt_io.save_checkpoint(run / ckpt_io.BEST, {
        "format": ckpt_io.FORMAT_VERSION, "model": model.state_dict(), "iter_num": 40,
        "model_args": dataclasses.asdict(model.config), "meta": meta, **state})


@pytest.mark.timeout(60)
def test_sampling_a_gpt2_run_never_draws_a_padding_id(tmp_path):
    cfg = GPTConfig(block_size=8, vocab_size=data.model_vocab_size(GPT2_META), n_layer=1, n_head=1, n_embd=8)
    assert cfg.vocab_size == 50304 > GPT2_META["vocab_size"]
    model = GPT(cfg)
    # a model that ranks the 47 padding ids above every token (an untrained one draws them now and
    # then): the final LayerNorm outputs the constant u, the real tokens' (tied) embeddings are 0
    u = torch.ones(cfg.n_embd)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(u)
        model.transformer.wte.weight[: GPT2_META["vocab_size"]] = 0.0
        model.transformer.wte.weight[GPT2_META["vocab_size"]:] = 10 * u
    _save_run(tmp_path, model, GPT2_META)
    texts = sample(tmp_path, start="ROMEO:", num_samples=2, max_new_tokens=20, top_k=None, device="cpu")
    assert len(texts) == 2 and all(t.startswith("ROMEO:") for t in texts)
    # the same seed gives the same text
    assert sample(tmp_path, start="ROMEO:", num_samples=2, max_new_tokens=20, top_k=None, device="cpu") == texts


@pytest.mark.timeout(60)
def test_a_seed_that_is_no_whole_number_is_refused_before_the_checkpoint_is_read(tmp_path):
    for seed in (1.5, None, "7", True, 2**64):
        with pytest.raises(ValueError, match="seed must be"):
            sample(tmp_path / "no-run", seed=seed)  # no checkpoint: a CheckpointError if read


@pytest.mark.timeout(60)
def test_sample_takes_the_devices_a_run_takes_and_refuses_others_before_the_checkpoint_is_read(tmp_path, monkeypatch):
    # registry.device_error, the rule of the run's configuration and the rank placement: torch.device
    # alone took 'mps', 'meta' and 'cuda:01', which failed later, in torch, or not at all
    for device in ("mps", "meta", "cuda:01", "cuda:-1", "gpu", "CPU", 0):
        with pytest.raises(ValueError, match="device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
            sample(tmp_path / "no-run", device=device)  # no checkpoint: a CheckpointError if read
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"cuda:2.*2 CUDA GPUs \(cuda:0 to cuda:1\)"):
        sample(tmp_path / "no-run", device="cuda:2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"has 1 CUDA GPU \(cuda:0\)"):
        sample(tmp_path / "no-run", device="cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        sample(tmp_path / "no-run", device="cuda:0")


@pytest.mark.timeout(60)
def test_finetune_refuses_data_in_another_vocabulary(tmp_path):
    cfg = make_config("shakespeare_char_cpu", {"out_dir": str(tmp_path / "pre"), "eval_interval": 20})
    model = GPT(GPTConfig(block_size=8, vocab_size=3, n_layer=1, n_head=1, n_embd=8))
    (tmp_path / "pre").mkdir()
    _save_run(tmp_path / "pre", model, CHAR_META, config=cfg.to_dict(), best_val_loss=1.5)
    # a text of three characters too, but another three: its ids would load into the same weights
    (tmp_path / "other.txt").write_text("ac\nca\n" * 50)
    data.prepare("shakespeare_char", tmp_path / "other", source=tmp_path / "other.txt", quiet=True)
    with pytest.raises(ValueError, match="vocabulary"):
        finetune_config(tmp_path / "pre", tmp_path / "ft", tmp_path / "other", iters=5)
    assert not (tmp_path / "ft").exists()  # refused before the new run's directory was touched
    # data in the checkpoint's own vocabulary is taken
    (tmp_path / "same.txt").write_text("ab\nba\n" * 50)
    data.prepare("shakespeare_char", tmp_path / "same", source=tmp_path / "same.txt", quiet=True)
    assert finetune_config(tmp_path / "pre", tmp_path / "ft", tmp_path / "same", iters=5).max_iters == 45


def test_a_split_that_is_not_there_is_named():
    """load_tokens(..., "test") failed with a bare KeyError: 'test_tokens'."""
    with pytest.raises(ValueError, match="split must be one of train, val, got 'test'"):
        data.load_tokens(None, "shakespeare_char", "test")


def test_a_resume_on_data_in_another_vocabulary_is_refused(tmp_path):
    """data_dir may change on resume (RESUME_MAY_CHANGE): data of the same size in other characters
    resumed silently, every id now another character. check_resume (launcher and workers) refuses it."""
    for name, text in (("other", "ac\nca\n"), ("same", "ab\nba\n")):
        (tmp_path / f"{name}.txt").write_text(text * 50)
        data.prepare("shakespeare_char", tmp_path / name, source=tmp_path / f"{name}.txt", quiet=True)
    saved = make_config("shakespeare_char_cpu", {"out_dir": str(tmp_path / "run")})
    ck = {"config": saved.to_dict(), "world_size": 1, "iter_num": 40, "meta": CHAR_META}
    with pytest.raises(ConfigError, match="another vocabulary than the checkpoint's"):
        check_resume(ck, saved.replace(init_from="resume", data_dir=str(tmp_path / "other")), "last.pt", 1)
    check_resume(ck, saved.replace(init_from="resume", data_dir=str(tmp_path / "same")), "last.pt", 1)
