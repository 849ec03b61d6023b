"""Fine-tuning a pre-trained run on new text: the second stage of an LLM's life (notebook 7).

    from course_lib.trainer.finetune import speeches, prepare_finetune_data, finetune_config
    text = speeches(shakespeare, ["ROMEO", "JULIET"])            # the new, smaller corpus
    data_dir = prepare_finetune_data(text, "runs/ft-data", base_meta=meta)
    cfg = finetune_config("runs/pretrain", "runs/finetune", data_dir, iters=500)
    course_lib.notebook.live_plot.train_live(cfg)           # or course_lib.launch.training.train_in_process(cfg)

Pre-training learns the language from a large corpus starting from random weights; fine-tuning
starts from those weights and trains on a smaller, more specific corpus (for a chat model:
instructions and answers, then human preferences; Ouyang et al. 2022, "Training language models
to follow instructions with human feedback", Sec. 3). Here the specific corpus is what two
characters of the play say, and the effect is visible in samples: they give those two the
word far more often than the pre-trained model does (:func:`speaker_counts`).

The trainer continues a run exactly (``init_from="resume"``) and lets a resumed run read its
data from another folder (``data_dir``), so a fine-tuning run is a copy of the pre-trained
checkpoint in a new run directory, continued on the new data. The text must be encoded with
the pre-trained model's tokenizer (its vocabulary is part of the weights), so the new data
folder reuses the pre-training dataset's name and meta. The learning rate goes on with the
pre-training schedule, which has decayed to ``min_lr`` by then: the small learning rate
fine-tuning wants. Adam's moments carry over too.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np

from course_lib.gpt import checkpoint as ckpt_io
from course_lib.gpt.data import load_meta, tokenizer
from course_lib.trainer.config import TrainConfig, check_resumable, check_same_vocabulary, clear_run
from course_lib.utils import atomic_write_bytes, check_count

FINETUNE_SOURCE = "fine-tuning text"  # meta.json's source for a folder of prepare_finetune_data
SPEAKER = re.compile(r"^([A-Z][A-Za-z' ]*[A-Za-z]):$")  # a speech's first line: "ROMEO:", "First Citizen:"
# the same after a blank line (or at the start): a verse line may end with a colon too
HEADING = re.compile(r"(?:\A|(?<=\n\n))([A-Z][A-Za-z' ]*[A-Za-z]):(?=\n)")


def speeches(text: str, speakers: list[str]) -> str:
    """Every speech (a "NAME:" line and the lines after it, up to a blank line) of ``speakers``."""
    wanted = set(speakers)
    kept = [block for block in text.split("\n\n")
            if (m := SPEAKER.match(block.split("\n", 1)[0])) and m.group(1) in wanted]
    if not kept:
        raise ValueError(f"no speech of {sorted(wanted)} in the text: names are in capitals, e.g. 'ROMEO'")
    return "\n\n".join(kept) + "\n"


def speaker_counts(text: str) -> Counter:
    """How often each speaker's name opens a speech ("NAME:" on its own line after a blank one)."""
    return Counter(HEADING.findall(text))


def prepare_finetune_data(text: str, data_dir: str | os.PathLike, base_meta: dict, val_fraction: float = 0.1) -> Path:
    """Write ``DATA_DIR/DATASET/{train.bin,val.bin,meta.json}`` for ``text``, encoded with the
    tokenizer of ``base_meta`` (the pre-training dataset's meta.json); returns DATA_DIR. A folder
    that holds a prepared corpus (gpt.data.prepare's) is refused: the text would replace it."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    folder = Path(data_dir) / base_meta["dataset"]
    if (folder / "meta.json").is_file():
        old = json.loads((folder / "meta.json").read_text()).get("source")
        if old != FINETUNE_SOURCE:
            raise ValueError(f"{folder} holds the corpus prepared from {old}: the fine-tuning text would "
                             "replace it; choose another data_dir (e.g. runs/finetune-data)")
    encode, _ = tokenizer(base_meta)
    ids = np.asarray(encode(text), dtype=np.uint16)  # ValueError for a character outside the vocabulary
    n_val = math.ceil(len(ids) * val_fraction)
    splits = {"train": ids[:-n_val], "val": ids[-n_val:]}
    meta = {k: v for k, v in base_meta.items() if not k.startswith(("train_", "val_", "source"))}
    meta["source"] = FINETUNE_SOURCE
    for split, arr in splits.items():
        atomic_write_bytes(folder / f"{split}.bin", arr.tobytes())
        meta[f"{split}_tokens"] = int(arr.size)
    atomic_write_bytes(folder / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    return Path(data_dir)


def finetune_config(pretrained_dir: str | os.PathLike, out_dir: str | os.PathLike, data_dir: str | os.PathLike,
                    iters: int, which: str = "best", overwrite: bool = True, **changes):
    """A config that continues ``pretrained_dir``'s checkpoint for ``iters`` more iterations on the
    data in ``data_dir``, as a new run in ``out_dir``. ``changes``: fields a resumed run may change
    (eval_interval, eval_iters, log_interval, device, ...; see course_lib.trainer.config.RESUME_MAY_CHANGE).
    Everything is checked before ``out_dir`` is touched; a run already there is replaced, as a
    re-run cell of launch_training replaces its run (``overwrite=False`` refuses instead)."""
    check_count("iters", iters)
    if which not in ("best", "last"):
        raise ValueError(f"which must be 'best' or 'last', got {which!r}")
    out = Path(out_dir)
    if out.resolve() == Path(pretrained_dir).resolve():
        raise ValueError(f"out_dir is the pre-trained run's own directory ({out}): the fine-tuning run "
                         "would replace its checkpoints; choose a new one (e.g. runs/finetune)")
    if not overwrite and (out / ckpt_io.LAST).exists():
        raise ValueError(f"{out} already holds a run; pass overwrite=True to replace it, or choose another out_dir")
    ck = ckpt_io.load_checkpoint(Path(pretrained_dir) / f"{which}.pt")
    cfg = TrainConfig.from_dict(ck["config"]).replace(
        out_dir=str(out), data_dir=str(data_dir), init_from="resume", max_iters=ck["iter_num"] + iters,
        run_name="", **changes)
    check_resumable(ck["config"], cfg, out / ckpt_io.LAST)  # ConfigError names a field it may not change
    if "meta" in ck:  # every trainer checkpoint has it (sampling reads it)
        check_same_vocabulary(ck["meta"], load_meta(data_dir, cfg.dataset), Path(data_dir) / cfg.dataset)
    if ck["iter_num"] % cfg.eval_interval:  # the trainer evaluates at multiples of eval_interval
        raise ValueError(f"eval_interval={cfg.eval_interval} does not divide the checkpoint's iteration "
                         f"{ck['iter_num']}: choose one that does, so the run starts by evaluating the "
                         "pre-trained model on the new data")
    # checked: now the new run's directory holds only the pre-trained state, as its last
    # checkpoint; "best" restarts on the new data
    clear_run(out)
    ck["best_val_loss"] = math.inf
    ckpt_io.save_checkpoint(out / ckpt_io.LAST, ck)
    return cfg
