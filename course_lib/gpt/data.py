"""Datasets for the trainer: prepare token files once, then sample batches from them.

    course data prepare shakespeare_char     # character-level, vocab 65
    course data prepare shakespeare          # GPT-2 BPE (tiktoken, built from the shipped ranks)

Both read the shipped Tiny Shakespeare text (``data/tinyshakespeare.txt``, no network), split it
90/10 by characters and write ``DATA_DIR/NAME/{train.bin,val.bin,meta.json}``: uint16 token ids
and a JSON description. The published counts for this corpus and split (nanoGPT's
``data/shakespeare_char/prepare.py`` and ``data/shakespeare/readme.md``) are 65 characters with
1,003,854 train / 111,540 val tokens, and 301,966 / 36,059 GPT-2 tokens.

Sampling is data parallel by construction: every step draws one *global* batch of start
offsets from a generator seeded identically on all ranks, and rank ``dp_rank`` takes its own
slice. The stream of global batches therefore depends only on the seed and the global batch
size, so 2 ranks x B rows train on exactly the rows of 1 process x 2B (and of B x 2
accumulation steps).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from course_lib.utils import atomic_write_bytes, default_data_dir, shipped_file

DATASETS = ("shakespeare_char", "shakespeare")
DATA_FORMAT_VERSION = 1
TEXT_FILE = "tinyshakespeare.txt"
SPLITS = ("train", "val")  # nanoGPT's 90 % / 10 %
TEXT_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
GPT2_RANKS_FILE = "gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# GPT-2's pre-tokenisation regex (openai/gpt-2, src/encoder.py) and its one special token.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT = 50256


class DataError(RuntimeError):
    """A missing, corrupt or unprepared dataset; the message says what to do."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_checked(path: Path, sha256: str | None, what: str) -> bytes:
    if not path.is_file():
        raise DataError(f"{what} not found at {path}; restore it from the repository (data/) "
                        "or reinstall the package")
    data = path.read_bytes()
    if sha256 is not None and _sha256(data) != sha256:
        raise DataError(f"{what} at {path} is corrupt: sha256 {_sha256(data)[:16]}... does not match "
                        f"the shipped file's {sha256[:16]}...; restore it from the repository (data/)")
    return data


def gpt2_encoding(ranks_file: str | os.PathLike | None = None):
    """The GPT-2 byte-level BPE as a ``tiktoken.Encoding``, built offline from the shipped ranks.

    ``ranks_file`` holds one ``base64(token) rank`` pair per line (tiktoken's format); we parse it
    here rather than through ``tiktoken.load`` because that caches a copy in a temp folder.
    """
    import tiktoken  # only the GPT-2 BPE needs it

    path = Path(ranks_file) if ranks_file else shipped_file(GPT2_RANKS_FILE)
    data = _read_checked(path, GPT2_RANKS_SHA256 if ranks_file is None else None, "GPT-2 BPE ranks")
    ranks = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise DataError(f"GPT-2 BPE ranks at {path} are corrupt (line {n}: {line[:40]!r})") from e
    if len(ranks) != GPT2_EOT:
        raise DataError(f"GPT-2 BPE ranks at {path} hold {len(ranks)} entries, expected {GPT2_EOT}")
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": GPT2_EOT})


def _write_dataset(out: Path, train_ids, val_ids, meta: dict) -> None:
    for split, ids in (("train", train_ids), ("val", val_ids)):
        arr = np.asarray(ids, dtype=np.uint16)
        meta[f"{split}_tokens"] = int(arr.size)
        meta[f"{split}_sha256"] = _sha256(arr.tobytes())
        atomic_write_bytes(out / f"{split}.bin", arr.tobytes())
    # meta.json last: a crash mid-way never leaves a meta.json describing files that are not there
    atomic_write_bytes(out / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())


def _is_prepared(out: Path, source_sha: str) -> bool:
    try:
        meta = json.loads((out / "meta.json").read_text())
        return (meta.get("format") == DATA_FORMAT_VERSION and meta.get("source_sha256") == source_sha
                and all((out / f"{s}.bin").stat().st_size == 2 * meta[f"{s}_tokens"] for s in SPLITS))
    except (OSError, ValueError, KeyError):
        return False


def prepare(name: str, data_dir: str | os.PathLike | None = None, *, source: str | os.PathLike | None = None,
            force: bool = False, quiet: bool = False) -> Path:
    """Write ``DATA_DIR/NAME/{train.bin,val.bin,meta.json}``; returns that folder.

    Idempotent: a folder already prepared from the same text is left alone (``force`` redoes it).
    ``source`` replaces the shipped text (its hash is then not checked).
    """
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    out = Path(data_dir or default_data_dir()) / name
    src = Path(source) if source else shipped_file(TEXT_FILE)
    raw = _read_checked(src, None if source else TEXT_SHA256, "Tiny Shakespeare text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{src} is not UTF-8 text ({e}); restore it from the repository (data/)") from e
    if not text:
        raise DataError(f"{src} is empty; restore it from the repository (data/)")
    source_sha = _sha256(raw)
    if not force and _is_prepared(out, source_sha):
        if not quiet:
            print(f"{name}: already prepared in {out}")
        return out
    try:  # before the text is tokenized: a data_dir that is a file, read-only or mistyped
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot write the dataset into {out} ({e.strerror or e}); choose another data_dir") from None
    n = len(text)
    train_text, val_text = text[: int(n * 0.9)], text[int(n * 0.9):]  # 90/10 by characters
    meta = {"format": DATA_FORMAT_VERSION, "dataset": name, "source": src.name, "source_sha256": source_sha,
            "dtype": "uint16"}
    if name == "shakespeare_char":
        chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(chars)}
        meta.update(tokenizer="char", vocab_size=len(chars), chars=chars)
        train_ids = [stoi[c] for c in train_text]
        val_ids = [stoi[c] for c in val_text]
    else:
        enc = gpt2_encoding()
        meta.update(tokenizer="gpt2", vocab_size=enc.n_vocab)
        train_ids, val_ids = enc.encode_ordinary(train_text), enc.encode_ordinary(val_text)
    _write_dataset(out, train_ids, val_ids, meta)
    if not quiet:
        print(f"{name}: vocab {meta['vocab_size']:,}, train {meta['train_tokens']:,} tokens, "
              f"val {meta['val_tokens']:,} tokens -> {out}")
    return out


def load_meta(data_dir: str | os.PathLike | None, name: str) -> dict:
    folder = Path(data_dir or default_data_dir()) / name
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"dataset {name!r} is not prepared in {folder} ({e.__class__.__name__}); "
                        f"run: course data prepare {name}"
                        + (f" --data-dir {data_dir}" if data_dir else "")) from e


def load_tokens(data_dir: str | os.PathLike | None, name: str, split: str):
    """The token ids of one split as an int64 torch tensor (Tiny Shakespeare fits in memory)."""
    import torch  # here: `course data` and the configurations import this module without torch

    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    meta = load_meta(data_dir, name)
    path = Path(data_dir or default_data_dir()) / name / f"{split}.bin"
    arr = np.fromfile(path, dtype=np.uint16) if path.is_file() else None
    if arr is None or arr.size != meta[f"{split}_tokens"]:
        raise DataError(f"{path} is missing or truncated; run: course data prepare {name} --force")
    return torch.from_numpy(arr.astype(np.int64))


def model_vocab_size(meta: dict) -> int:
    """Characters exactly; GPT-2's 50257 padded to a multiple of 64 (50304) like nanoGPT, for speed."""
    v = meta["vocab_size"]
    return v if meta["tokenizer"] == "char" else 64 * math.ceil(v / 64)


def tokenizer(meta: dict):
    """(encode, decode) functions for a dataset's meta.json."""
    if meta["tokenizer"] == "char":
        stoi = {c: i for i, c in enumerate(meta["chars"])}
        def encode(s: str) -> list[int]:
            unknown = sorted(set(s) - stoi.keys())
            if unknown:
                raise ValueError(f"characters not in the vocabulary: {''.join(unknown)!r}")
            return [stoi[c] for c in s]
        return encode, lambda ids: "".join(meta["chars"][i] for i in ids)
    enc = gpt2_encoding()
    return (lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})), enc.decode


def _check_long_enough(tokens, block_size: int) -> None:
    """DataError unless a split holds more than one block of tokens (a window is block_size + 1)."""
    if tokens.numel() <= block_size + 1:
        raise DataError(f"the split holds {tokens.numel()} tokens, too few for block_size {block_size}; "
                        "lower block_size or use a larger dataset")


def _windows(tokens, starts, block_size: int):
    """Rows ``tokens[s : s + block_size + 1]`` for each start: (..., T + 1) -> inputs x and targets y."""
    import torch  # here: `course data` and the configurations import this module without torch

    rows = tokens[starts.unsqueeze(-1) + torch.arange(block_size + 1)]  # (..., T + 1), one gather
    return rows[..., :-1].contiguous(), rows[..., 1:].contiguous()


class TrainBatches:
    """Per-step micro-batches for one rank: ``next()`` -> x, y of shape (grad_accum, B, T).

    Each call draws grad_accum * dp_world_size * B start offsets from ``generator`` (identical on
    every rank) and keeps this rank's slice of the global batch, laid out (micro, rank, row): the
    ranks' micro-batches a together are micro-batch a of one process with dp_world_size * B rows
    (the same draws), so what is computed per micro-batch across ranks, as a mixture of experts'
    router counts (gpt/moe.py), is the same in every layout.
    ``resume_state`` is the generator state before the latest draw: a checkpoint taken while
    that batch is pending saves it, so the resumed run draws the same batch again.
    """

    def __init__(self, tokens, batch_size: int, block_size: int, grad_accum: int, dp_rank: int,
                 dp_world_size: int, seed: int, device="cpu"):
        import torch  # here: `course data` and the configurations import this module without torch

        _check_long_enough(tokens, block_size)
        self.tokens, self.block_size, self.device = tokens, block_size, torch.device(device)
        self.shape = (grad_accum, dp_world_size, batch_size)
        self.dp_rank = dp_rank
        self.generator = torch.Generator().manual_seed(seed)
        self.resume_state = self.generator.get_state()
        self.pin = self.device.type == "cuda"

    def next(self):
        import torch  # here: `course data` and the configurations import this module without torch

        self.resume_state = self.generator.get_state()  # drawing again from here repeats this batch
        starts = torch.randint(self.tokens.numel() - self.block_size, self.shape, generator=self.generator)
        x, y = _windows(self.tokens, starts[:, self.dp_rank], self.block_size)  # (accum, B, T) each
        if self.pin:  # page-locked host memory lets the copy overlap with compute
            return (x.pin_memory().to(self.device, non_blocking=True),
                    y.pin_memory().to(self.device, non_blocking=True))
        return x.to(self.device), y.to(self.device)



def eval_batches(tokens, batch_size: int, block_size: int, n_batches: int, seed: int, dp_rank: int,
                 dp_world_size: int, grad_accum: int = 1):
    """A fixed evaluation set: ``n_batches`` global batches (``grad_accum x dp_world_size x
    batch_size`` rows each, laid out as TrainBatches lays out a step) from ``seed``, the same at
    every eval; this dp rank's rows of each. The set depends on the global batch only, not on how
    it is split: one process with ``batch_size=8`` evaluates the very rows that 2 ranks with
    ``batch_size=2`` and 2 micro-steps share. Each rank runs ``n_batches x grad_accum`` forwards of
    ``batch_size`` rows (nanoGPT's ``eval_iters`` batches when ``grad_accum`` is 1).
    Returns x, y (n_batches * grad_accum, B, T) on the CPU: the trainer moves one batch at a time
    to the device, so a large set (many micro-steps) costs host memory, not device memory.
    A split of no more than ``block_size + 1`` tokens is a DataError, as for TrainBatches.
    """
    import torch  # here: `course data` and the configurations import this module without torch

    _check_long_enough(tokens, block_size)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(tokens.numel() - block_size, (n_batches, grad_accum, dp_world_size, batch_size), generator=g)
    return _windows(tokens, starts[:, :, dp_rank].flatten(0, 1), block_size)


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="course data", description="Prepare the course's datasets (offline).")
    sub = p.add_subparsers(dest="action", required=True)
    pp = sub.add_parser("prepare", help="tokenise Tiny Shakespeare into train.bin / val.bin / meta.json")
    pp.add_argument("name", choices=DATASETS, help="shakespeare_char (characters, nanoGPT's char recipe) or "
                    "shakespeare (GPT-2's BPE tokens)")
    pp.add_argument("--data-dir", default=None, help=f"where to write NAME/ (default: {default_data_dir()})")
    pp.add_argument("--force", action="store_true", help="prepare again even if already done")
    args = p.parse_args(argv)
    try:
        prepare(args.name, args.data_dir, force=args.force)
    except (DataError, FileNotFoundError) as e:
        print(f"course data: error: {e}", file=sys.stderr)
        return 1
    return 0
