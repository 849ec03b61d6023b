"""Checkpoints: atomic writes (a crash mid-write keeps the old file), weights_only loading,
best-as-link semantics, clear errors, and the resume-compatibility check."""

from __future__ import annotations

import random

import pytest
import torch

from course_lib.gpt import checkpoint as ckpt_io
from course_lib.registry import ConfigError
from course_lib.trainer.config import TrainConfig, check_resumable


def state(x: float) -> dict:
    return {"format": ckpt_io.FORMAT_VERSION, "model": {"w": torch.full((4,), x)}, "iter_num": int(x)}


def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    ckpt_io.save_checkpoint(path, state(1.0))
    real_save = torch.save

    def crash_half_way(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)
        f.truncate(10)  # a partial file on disk ...
        raise OSError("disk full")  # ... and the writer dies

    monkeypatch.setattr(torch, "save", crash_half_way)
    with pytest.raises(OSError, match="disk full"):
        ckpt_io.save_checkpoint(path, state(2.0))
    monkeypatch.undo()
    assert ckpt_io.load_checkpoint(path)["iter_num"] == 1  # the old checkpoint, intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no temp file left behind


def test_best_keeps_its_contents_when_last_is_replaced(tmp_path):
    ckpt_io.save_checkpoint(tmp_path / "last.pt", state(1.0))
    ckpt_io.copy_checkpoint(tmp_path / "last.pt", tmp_path / "best.pt")
    ckpt_io.save_checkpoint(tmp_path / "last.pt", state(2.0))
    assert ckpt_io.load_checkpoint(tmp_path / "best.pt")["iter_num"] == 1
    assert ckpt_io.load_checkpoint(tmp_path / "last.pt")["iter_num"] == 2


def test_loading_is_weights_only_and_errors_are_clear(tmp_path):
    import datetime

    # an arbitrary object (any class outside torch's allowlist): weights_only refuses to unpickle it
    torch.save({**state(1.0), "evil": datetime.timedelta(days=1)}, tmp_path / "bad.pt")
    assert torch.load(tmp_path / "bad.pt", weights_only=False)["iter_num"] == 1  # a valid file
    with pytest.raises(ckpt_io.CheckpointError, match="cannot read checkpoint"):
        ckpt_io.load_checkpoint(tmp_path / "bad.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt_io.CheckpointError, match="corrupt"):
        ckpt_io.load_checkpoint(tmp_path / "junk.pt")
    with pytest.raises(ckpt_io.CheckpointError, match="no checkpoint at .*train first"):
        ckpt_io.load_checkpoint(tmp_path / "missing.pt")
    torch.save({"w": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(ckpt_io.CheckpointError, match="not a course_lib checkpoint"):
        ckpt_io.load_checkpoint(tmp_path / "other.pt")


def test_rng_state_round_trip():
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(1)
    random.seed(1)
    saved = ckpt_io.rng_state(gen.get_state())
    first = (torch.rand(3), random.random(), torch.randint(100, (3,), generator=gen))
    torch.manual_seed(99)
    random.seed(99)
    gen.manual_seed(99)
    ckpt_io.set_rng_state(saved, gen)
    again = (torch.rand(3), random.random(), torch.randint(100, (3,), generator=gen))
    assert torch.equal(first[0], again[0]) and first[1] == again[1] and torch.equal(first[2], again[2])


def test_resume_compatibility_names_every_incompatible_field():
    saved = TrainConfig(n_layer=4, learning_rate=1e-3).to_dict()
    ok = TrainConfig(n_layer=4, learning_rate=1e-3, max_iters=5000, eval_interval=10, out_dir="elsewhere",
                     init_from="resume", strategy="torch_ddp", threads=1)
    check_resumable(saved, ok)  # how long and where it runs may change
    with pytest.raises(ConfigError) as e:
        check_resumable(saved, TrainConfig(n_layer=6, learning_rate=3e-4), "run/last.pt")
    msg = str(e.value)
    assert "cannot resume run/last.pt" in msg and "n_layer: checkpoint has 4, now 6" in msg
    assert "learning_rate: checkpoint has 0.001, now 0.0003" in msg and "--n_layer=4" in msg
    with pytest.raises(ConfigError, match="at iteration 300, past max_iters=200; pass --max_iters=300"):
        check_resumable(saved, ok.replace(max_iters=200), "run/last.pt", iter_num=300)


def test_a_resumed_run_may_turn_the_teaching_checks_on():
    """--check_collectives and --check_replicas_every compare what the ranks do, not what they
    compute: a resumed run (one that hangs, say) may turn them on."""
    saved = TrainConfig(n_layer=4).to_dict()
    check_resumable(saved, TrainConfig(n_layer=4, check_collectives=True, check_replicas_every=5))
