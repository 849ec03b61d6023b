"""A damaged checkpoint is refused, not loaded: ``torch.save`` writes a zip archive whose entries
carry CRC-32s that ``torch.load`` never checks, so one flipped bit in a tensor loaded silently.
``load_checkpoint`` checks them first and names the file, the damaged entry and what to do; an
intact checkpoint loads as before (also with ``mmap=True``), through ``course sample`` and a resume
too. Truncated and non-zip files get a clear error of their own.

The checkpoints are a real run's: one tiny in-process training (well under a second) writes
last.pt and best.pt, and each test damages its own copy of them."""

from __future__ import annotations

import re
import shutil
import struct
import zipfile

import pytest
import torch

from course_lib.gpt import checkpoint as ckpt_io
from course_lib.gpt.data import prepare
from course_lib.gpt.sample import cli as sample_cli
from course_lib.gpt.sample import load_model
from course_lib.launch.training import train_in_process
from course_lib.trainer.config import make_config
from course_lib.trainer.loop import train

TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2, max_iters=2, lr_decay_iters=2,
            warmup_iters=0, eval_interval=2, eval_iters=1, log_interval=1, dropout=0.0, device="cpu", threads=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data folder, run directory) of a finished tiny run: its last.pt and best.pt."""
    root = tmp_path_factory.mktemp("integrity")
    prepare("shakespeare_char", root / "data", quiet=True)
    train(config(root / "data", root / "run"), progress=False)
    return root / "data", root / "run"


def config(data_dir, out_dir, **kw):
    return make_config("shakespeare_char_cpu", {**TINY, "data_dir": str(data_dir), "out_dir": str(out_dir), **kw})


@pytest.fixture
def run_dir(trained, tmp_path):
    """This test's copy of the run (copytree: last.pt and best.pt become two files)."""
    return shutil.copytree(trained[1], tmp_path / "run")


def largest_tensor_entry(path) -> zipfile.ZipInfo:
    with zipfile.ZipFile(path) as z:
        return max((i for i in z.infolist() if re.search(r"/data/\d+$", i.filename)), key=lambda i: i.file_size)


def flip_bit(path, info: zipfile.ZipInfo | None = None) -> str:
    """Flip one bit in the middle of an entry's data (default: the largest tensor); returns its name.
    The data starts after the local header, whose extra field (torch's alignment padding) may
    differ in length from the central directory's, so the offsets are read from the local header."""
    info = info or largest_tensor_entry(path)
    with open(path, "rb+") as f:
        f.seek(info.header_offset)
        header = f.read(30)
        assert header[:4] == b"PK\x03\x04"
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        pos = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x10]))
    return info.filename


def assert_same(a, b):
    """Equal nested checkpoint contents: tensors bit for bit, everything else by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_an_intact_checkpoint_loads_as_torch_load_reads_it(run_dir):
    path = run_dir / ckpt_io.LAST
    want = torch.load(path, map_location="cpu", weights_only=True)
    assert want["format"] == ckpt_io.FORMAT_VERSION and want["iter_num"] == 2
    assert_same(ckpt_io.load_checkpoint(path), want)
    assert_same(ckpt_io.load_checkpoint(path, mmap=True), want)


def test_a_flipped_bit_in_a_tensor_is_refused_naming_the_file_and_the_entry(run_dir):
    path = run_dir / ckpt_io.LAST
    intact = torch.load(path, weights_only=True)
    entry = flip_bit(path)
    # the premise: torch.load itself reads the damaged file without complaint, one value changed
    with pytest.raises(AssertionError):
        assert_same(torch.load(path, weights_only=True), intact)
    assert zipfile.ZipFile(path).testzip() == entry
    for mmap in (False, True):
        with pytest.raises(ckpt_io.CheckpointError) as e:
            ckpt_io.load_checkpoint(path, mmap=mmap)
        msg = str(e.value)
        assert str(path) in msg and repr(entry) in msg and "corrupt" in msg, msg
        # best.pt is another file here (copytree), so it is the way out
        assert f"{run_dir / ckpt_io.BEST}" in msg and "--ckpt=best" in msg and "cp " in msg, msg


def test_a_damaged_pickle_entry_is_refused_too(run_dir):
    path = run_dir / ckpt_io.BEST
    with zipfile.ZipFile(path) as z:
        pickle_entry = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    entry = flip_bit(path, pickle_entry)
    with pytest.raises(ckpt_io.CheckpointError, match=re.escape(repr(entry))) as e:
        ckpt_io.load_checkpoint(path)
    assert f"{run_dir / ckpt_io.LAST}" in str(e.value) and "--ckpt=last" in str(e.value)


def test_when_best_is_last_the_message_says_both_are_damaged(trained, tmp_path):
    """A new best is linked as last.pt (copy_checkpoint): one file, two names, no way out but a copy."""
    path = shutil.copytree(trained[1], tmp_path / "run") / ckpt_io.LAST
    ckpt_io.copy_checkpoint(path.with_name(ckpt_io.BEST), path)  # the hard link a new best leaves
    flip_bit(path)
    with pytest.raises(ckpt_io.CheckpointError) as e:
        ckpt_io.load_checkpoint(path)
    assert "best.pt is the same file" in str(e.value) and "start the run again" in str(e.value)


def test_a_truncated_or_non_zip_file_gets_a_clear_error(run_dir, tmp_path):
    data = (run_dir / ckpt_io.LAST).read_bytes()
    for cut in (10, len(data) // 2, len(data) - 10):  # torch.load: a miniz error, or "[Errno 22] Invalid argument"
        (tmp_path / "cut.pt").write_bytes(data[:cut])
        for mmap in (False, True):
            with pytest.raises(ckpt_io.CheckpointError, match=r"cut\.pt.* is truncated .*corrupt"):
                ckpt_io.load_checkpoint(tmp_path / "cut.pt", mmap=mmap)
    # torch's legacy format (no zip, no checksums): course_lib never writes it, and cannot check it
    torch.save(torch.load(run_dir / ckpt_io.LAST, weights_only=True), tmp_path / "legacy.pt",
               _use_new_zipfile_serialization=False)
    with pytest.raises(ckpt_io.CheckpointError, match=r"legacy\.pt is not a zip archive.*corrupt"):
        ckpt_io.load_checkpoint(tmp_path / "legacy.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ckpt_io.CheckpointError, match=r"empty\.pt is not a zip archive"):
        ckpt_io.load_checkpoint(tmp_path / "empty.pt")


def test_the_loaded_file_is_the_verified_one(run_dir, monkeypatch):
    """A run may rename a new last.pt into place while ``course sample`` reads it: the load reads the
    file that was verified (one open file), and an mmap load (which opens the path again) notices."""
    path, spare = run_dir / ckpt_io.LAST, run_dir / "spare.pt"
    intact = path.read_bytes()
    shutil.copyfile(path, spare)
    flip_bit(spare)
    damaged = spare.read_bytes()
    want = torch.load(path, weights_only=True)
    real_load = torch.load

    def replaced_then_load(f, *a, **kw):
        spare.write_bytes(damaged)
        spare.replace(path)  # the rename a writer does, between the check and the load
        return real_load(f, *a, **kw)

    monkeypatch.setattr(torch, "load", replaced_then_load)
    assert_same(ckpt_io.load_checkpoint(path), want)
    spare.write_bytes(intact)
    spare.replace(path)
    with pytest.raises(ckpt_io.CheckpointError, match="replaced while it was read"):
        ckpt_io.load_checkpoint(path, mmap=True)


def test_course_sample_refuses_a_damaged_checkpoint(run_dir, capsys):
    model, meta, it = load_model(run_dir, "best")
    assert it == 2 and meta["dataset"] == "shakespeare_char"
    entry = flip_bit(run_dir / ckpt_io.BEST)
    with pytest.raises(ckpt_io.CheckpointError, match=re.escape(repr(entry))):
        load_model(run_dir, "best")
    assert sample_cli(["--out_dir", str(run_dir), "--max_new_tokens", "2", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("course sample: error: ") and str(run_dir / ckpt_io.BEST) in err and repr(entry) in err
    assert "--ckpt=last" in err
    assert sample_cli(["--out_dir", str(run_dir), "--ckpt", "last", "--max_new_tokens", "2", "--device", "cpu"]) == 0


def test_a_resume_refuses_a_damaged_last_checkpoint(trained, run_dir):
    entry = flip_bit(run_dir / ckpt_io.LAST)
    cfg = config(trained[0], run_dir, init_from="resume", max_iters=4)
    with pytest.raises(ckpt_io.CheckpointError, match=re.escape(repr(entry))):
        train_in_process(cfg, progress=False)  # the launcher's check (an mmap load) finds it
    with pytest.raises(ckpt_io.CheckpointError, match=re.escape(repr(entry))):
        train(cfg, progress=False)  # and so does the trainer's own load
