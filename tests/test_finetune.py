"""course_lib.trainer.finetune: pre-train, then fine-tune from the checkpoint on other text (notebook 7).

The speeches are checked against an independent count of the speaker lines in the shipped text;
the fine-tuning data must use the pre-training vocabulary and decode back to the text; a
fine-tuning run must start from the pre-trained weights (its first evaluation is that of the
pre-trained model on the new data, far below an untrained model's ln 65) and continue the
iteration count.
"""

from __future__ import annotations

import math

import pytest
import torch

from course_lib.gpt import checkpoint as ckpt_io
from course_lib.gpt import data
from course_lib.launch.training import train_in_process
from course_lib.registry import ConfigError
from course_lib.trainer.config import make_config
from course_lib.trainer.finetune import (
    finetune_config,
    prepare_finetune_data,
    speaker_counts,
    speeches,
)
from course_lib.trainer.metrics import read_metrics
from course_lib.utils import shipped_file


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return shipped_file("tinyshakespeare.txt").read_text()


def test_speeches(shakespeare):
    lovers = speeches(shakespeare, ["ROMEO", "JULIET"])
    counts = speaker_counts(lovers)
    assert set(counts) == {"ROMEO", "JULIET"}
    # every speech the corpus opens with "ROMEO:" / "JULIET:" after a blank line is kept, once
    for name in ("ROMEO", "JULIET"):
        assert counts[name] == shakespeare.count(f"\n\n{name}:\n") > 100
    # a verse line ending in a colon is no speaker: only lines after a blank line count
    assert speaker_counts("KING:\nHear me:\nnow.\n\nQUEEN:\nNo.\n") == {"KING": 1, "QUEEN": 1}
    assert all(block in shakespeare for block in lovers.strip().split("\n\n")[:50])
    with pytest.raises(ValueError, match="capitals"):
        speeches(shakespeare, ["romeo"])


def test_prepare_uses_the_pretraining_vocabulary(tmp_path, shakespeare):
    data.prepare("shakespeare_char", quiet=True)
    meta = data.load_meta(None, "shakespeare_char")
    text = speeches(shakespeare, ["JULIET"])
    out = prepare_finetune_data(text, tmp_path, meta)
    ft_meta = data.load_meta(out, "shakespeare_char")
    assert ft_meta["chars"] == meta["chars"] and ft_meta["vocab_size"] == 65
    _, decode = data.tokenizer(ft_meta)
    train, val = (data.load_tokens(out, "shakespeare_char", s) for s in ("train", "val"))
    assert decode(torch.cat([train, val]).tolist()) == text
    assert val.numel() == math.ceil(len(text) * 0.1)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        prepare_finetune_data("ROMEO: ¿qué?", tmp_path, meta)


@pytest.mark.timeout(240)
def test_finetune_starts_from_the_pretrained_weights(tmp_path, shakespeare):
    data.prepare("shakespeare_char", quiet=True)
    tiny = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 8, "eval_iters": 4,
            "warmup_iters": 2, "threads": 1, "log_interval": 2}
    pre = make_config("shakespeare_char_cpu", {**tiny, "out_dir": str(tmp_path / "pre"), "max_iters": 40,
                                              "lr_decay_iters": 40, "eval_interval": 20})
    pre_summary = train_in_process(pre, progress=False)
    ft_data = prepare_finetune_data(speeches(shakespeare, ["ROMEO", "JULIET"]), tmp_path / "ft-data",
                                    data.load_meta(None, "shakespeare_char"))
    cfg = finetune_config(tmp_path / "pre", tmp_path / "ft", ft_data, iters=6, eval_interval=4)
    assert (cfg.init_from, cfg.max_iters, cfg.data_dir) == ("resume", 46, str(ft_data))
    train_in_process(cfg, progress=False)
    rows = read_metrics(tmp_path / "ft" / "metrics.csv")
    assert rows[0]["iter"] == 40 and rows[-1]["iter"] == 46 and not math.isnan(rows[0]["val_loss"])
    first_val = rows[0]["val_loss"]
    # pre-trained on all of Shakespeare: far better than an untrained model's uniform guess
    assert first_val < math.log(65) - 0.4 and abs(first_val - pre_summary["best_val_loss"]) < 0.3
    assert (tmp_path / "ft" / "best.pt").is_file()
    with pytest.raises(ValueError, match="eval_interval=3 does not divide"):
        finetune_config(tmp_path / "pre", tmp_path / "ft2", ft_data, iters=5, eval_interval=3)
    with pytest.raises(ConfigError, match="learning_rate"):
        finetune_config(tmp_path / "pre", tmp_path / "ft2", ft_data, iters=5, learning_rate=3e-4)


def test_finetune_config_checks_everything_before_it_writes(tmp_path):
    """A refused fine-tuning config leaves every run as it was: the checks once ran after the new
    run's directory had been cleared, so a bad eval_interval wiped an earlier fine-tuning run, and
    out_dir = pretrained_dir replaced the pre-trained run's checkpoints with its best.pt."""
    cfg = make_config("shakespeare_char_cpu", {"out_dir": str(tmp_path / "pre"), "eval_interval": 20})
    state = {"format": ckpt_io.FORMAT_VERSION, "config": cfg.to_dict(), "iter_num": 40, "best_val_loss": 1.5}
    for run in ("pre", "ft"):
        ckpt_io.save_checkpoint(tmp_path / run / ckpt_io.LAST, {**state, "tag": run})
        ckpt_io.save_checkpoint(tmp_path / run / ckpt_io.BEST, {**state, "tag": run})
        (tmp_path / run / "metrics.csv").write_text("iter\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for kw, error, match in [
            ({"out_dir": tmp_path / "pre"}, ValueError, "the pre-trained run's own directory"),
            ({"eval_interval": 3}, ValueError, "eval_interval=3 does not divide"),
            ({"learning_rate": 3e-4}, ConfigError, "learning_rate"),
            ({"overwrite": False}, ValueError, "already holds a run; pass overwrite=True"),
            ({"iters": 0}, ValueError, "iters must be a whole number >= 1")]:
        with pytest.raises(error, match=match):
            finetune_config(**{"pretrained_dir": tmp_path / "pre", "out_dir": tmp_path / "ft",
                               "data_dir": tmp_path / "data", "iters": 5, **kw})
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before, kw
    cfg = finetune_config(tmp_path / "pre", tmp_path / "ft", tmp_path / "data", iters=5)
    assert sorted(p.name for p in (tmp_path / "ft").iterdir()) == ["last.pt"] and cfg.max_iters == 45
    assert ckpt_io.load_checkpoint(tmp_path / "ft" / ckpt_io.LAST)["tag"] == "pre"


def test_finetune_data_does_not_replace_the_corpus(tmp_path, shakespeare):
    data.prepare("shakespeare_char", tmp_path / "data", quiet=True)
    meta = data.load_meta(tmp_path / "data", "shakespeare_char")
    corpus = {p.name: p.read_bytes() for p in (tmp_path / "data" / "shakespeare_char").iterdir()}
    with pytest.raises(ValueError, match="holds the corpus prepared from .*choose another data_dir"):
        prepare_finetune_data(speeches(shakespeare, ["ROMEO"]), tmp_path / "data", meta)
    assert {p.name: p.read_bytes() for p in (tmp_path / "data" / "shakespeare_char").iterdir()} == corpus
    ft = prepare_finetune_data(speeches(shakespeare, ["ROMEO"]), tmp_path / "ft-data", meta)
    prepare_finetune_data(speeches(shakespeare, ["JULIET"]), ft, meta)  # a re-run cell replaces its own text
