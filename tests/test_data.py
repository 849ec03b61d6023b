"""Dataset preparation: published token counts, the offline GPT-2 tokenizer, idempotence, bad
input, batch sharding across ranks. (The shipped data inside a built wheel: tests/test_colab_wheel.py.)

Published counts for Tiny Shakespeare with a 90/10 split by characters: nanoGPT
``data/shakespeare_char/prepare.py`` (vocab 65; train 1,003,854 / val 111,540 tokens) and
``data/shakespeare/readme.md`` (GPT-2 BPE: train 301,966 / val 36,059 tokens).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from course_lib.gpt import data
from course_lib.utils import shipped_file


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    for name in data.DATASETS:
        data.prepare(name, root, quiet=True)
    return root


def test_char_counts_match_nanogpt(prepared):
    meta = json.loads((prepared / "shakespeare_char" / "meta.json").read_text())
    assert meta["vocab_size"] == 65 and len(meta["chars"]) == 65
    assert (meta["train_tokens"], meta["val_tokens"]) == (1_003_854, 111_540)
    train = np.fromfile(prepared / "shakespeare_char" / "train.bin", dtype=np.uint16)
    assert train.size == 1_003_854 and train.max() < 65
    # the ids decode back to the text's first characters
    _, decode = data.tokenizer(meta)
    assert decode(train[:14].tolist()) == shipped_file("tinyshakespeare.txt").read_text()[:14] == "First Citizen:"


def test_gpt2_counts_match_nanogpt(prepared):
    meta = data.load_meta(prepared, "shakespeare")
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257
    assert (meta["train_tokens"], meta["val_tokens"]) == (301_966, 36_059)
    assert data.load_tokens(prepared, "shakespeare", "val").numel() == 36_059
    assert data.model_vocab_size(meta) == 50304  # padded to a multiple of 64, like nanoGPT


def test_gpt2_encoding_built_offline_from_shipped_ranks():
    enc = data.gpt2_encoding()
    assert enc.encode("Hello world") == [15496, 995]  # GPT-2's published ids (tiktoken "gpt2")
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    text = "ROMEO: But soft, what light through yonder window breaks?\n  It is the east!"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_prepare_is_idempotent_and_repairs_truncated_output(tmp_path, capsys):
    out = data.prepare("shakespeare_char", tmp_path)
    mtime = (out / "train.bin").stat().st_mtime_ns
    data.prepare("shakespeare_char", tmp_path)
    assert "already prepared" in capsys.readouterr().out
    assert (out / "train.bin").stat().st_mtime_ns == mtime  # not rewritten
    # a truncated file is detected: loading says what to do, preparing again repairs it
    with open(out / "train.bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(data.DataError, match="prepare shakespeare_char --force"):
        data.load_tokens(tmp_path, "shakespeare_char", "train")
    data.prepare("shakespeare_char", tmp_path, quiet=True)
    assert data.load_tokens(tmp_path, "shakespeare_char", "train").numel() == 1_003_854


def test_missing_and_corrupt_input_give_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(data.DataError, match="not found at .*nope.txt"):
        data.prepare("shakespeare_char", tmp_path, source=tmp_path / "nope.txt")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(data.DataError, match="not UTF-8"):
        data.prepare("shakespeare_char", tmp_path, source=bad)
    # a damaged shipped text fails its sha256 check
    damaged = tmp_path / "tinyshakespeare.txt"
    damaged.write_text(shipped_file("tinyshakespeare.txt").read_text()[:-10])
    monkeypatch.setattr(data, "shipped_file", lambda name: damaged)
    with pytest.raises(data.DataError, match="corrupt: sha256"):
        data.prepare("shakespeare_char", tmp_path / "out")
    ranks = tmp_path / "gpt2.tiktoken"
    ranks.write_text("SGVsbG8= 0\nnot base64!! x\n")
    with pytest.raises(data.DataError, match="corrupt"):
        data.gpt2_encoding(ranks)
    with pytest.raises(data.DataError, match="unknown dataset 'openwebtext'"):
        data.prepare("openwebtext", tmp_path)


def test_a_data_dir_that_cannot_be_written_is_named_before_tokenizing(tmp_path):
    (tmp_path / "a_file").write_text("")  # cannot hold a folder, as root too (was a raw NotADirectoryError)
    with pytest.raises(data.DataError, match="cannot write the dataset into .*a_file/shakespeare_char "
                                             r"\(Not a directory\); choose another data_dir"):
        data.prepare("shakespeare_char", tmp_path / "a_file", quiet=True)


def test_unprepared_dataset_says_how_to_prepare(tmp_path):
    with pytest.raises(data.DataError, match=f"course data prepare shakespeare --data-dir {tmp_path}"):
        data.load_meta(tmp_path, "shakespeare")


def test_cli(tmp_path, capsys):
    assert data.cli(["prepare", "shakespeare_char", "--data-dir", str(tmp_path)]) == 0
    assert "train 1,003,854 tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        data.cli(["prepare", "wikipedia"])


def test_ranks_take_disjoint_slices_of_one_global_batch():
    tokens = torch.arange(10_000)
    one = data.TrainBatches(tokens, 8, 16, 1, 0, 1, seed=5)  # 1 rank, 8 rows
    two = [data.TrainBatches(tokens, 2, 16, 2, r, 2, seed=5) for r in range(2)]  # 2 ranks x 2 micro x 2 rows
    accum = data.TrainBatches(tokens, 4, 16, 2, 0, 1, seed=5)  # 1 rank x 2 micro x 4 rows
    for _ in range(3):
        x1, y1 = one.next()
        parts = [b.next() for b in two]
        xa, _ = accum.next()
        # laid out (micro, rank, row): the same rows, split over micro-steps, then ranks
        x2 = torch.cat([parts[r][0][a] for a in range(2) for r in range(2)])
        assert torch.equal(x1.reshape(-1, 16), x2)
        for a in range(2):  # micro-batch a of the ranks together = one process's micro-batch a (gpt/moe.py)
            assert torch.equal(xa[a], torch.cat([parts[r][0][a] for r in range(2)]))
        assert torch.equal(y1[..., :-1], x1[..., 1:])  # targets are the inputs shifted by one
        assert not torch.equal(parts[0][0], parts[1][0])  # ranks see different data


def test_eval_set_depends_on_the_global_batch_only():
    tokens = torch.arange(5_000)
    x1, y1 = data.eval_batches(tokens, 4, 8, 5, seed=1, dp_rank=0, dp_world_size=1)
    parts = [data.eval_batches(tokens, 2, 8, 5, seed=1, dp_rank=r, dp_world_size=2) for r in range(2)]
    assert x1.shape == (5, 4, 8) and [p[0].shape for p in parts] == [(5, 2, 8)] * 2  # 5 forwards on every rank
    assert torch.equal(torch.cat([p[0] for p in parts], dim=1), x1)  # batch k: rank 0's rows, then rank 1's
    assert torch.equal(torch.cat([p[1] for p in parts], dim=1), y1) and torch.equal(y1[..., :-1], x1[..., 1:])
    # 2 ranks x 2 micro-steps of 1 row: batch k is (micro 0: rank 0, rank 1), (micro 1: rank 0, rank 1)
    acc = [data.eval_batches(tokens, 1, 8, 5, seed=1, dp_rank=r, dp_world_size=2, grad_accum=2) for r in range(2)]
    assert [a[0].shape for a in acc] == [(10, 1, 8)] * 2  # 5 x 2 forwards on every rank
    steps = torch.stack([a[0].reshape(5, 2, 8) for a in acc], dim=2)  # (batch, micro, rank, T)
    assert torch.equal(steps.reshape(5, 4, 8), x1)
    again, _ = data.eval_batches(tokens, 4, 8, 5, seed=1, dp_rank=0, dp_world_size=1)
    other, _ = data.eval_batches(tokens, 4, 8, 5, seed=2, dp_rank=0, dp_world_size=1)
    assert torch.equal(again, x1) and not torch.equal(other, x1)  # fixed by its seed


def test_a_split_too_short_for_one_block_is_a_data_error_for_evaluation_too():
    """A small fine-tuning corpus's val split shorter than a block: named (DataError), as for the
    training split, not torch's "random_ expects 'from' to be less than 'to'" from eval_batches."""
    short = torch.arange(30)
    for make in (lambda: data.eval_batches(short, 2, 32, 1, seed=1, dp_rank=0, dp_world_size=1),
                 lambda: data.TrainBatches(short, 2, 32, 1, 0, 1, seed=1)):
        with pytest.raises(data.DataError, match="the split holds 30 tokens, too few for block_size 32"):
            make()
