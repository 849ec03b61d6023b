"""The labs' task offline: extractive question answering with a Hugging Face BERT, trained with
Lightning Fabric's strategies, timed against ONE baseline, the same program on one rank (notebook 11).

    from course_lib.experiments.frameworks_qa import qa_examples, train_qa, strategy_table
    one = run_ranks(train_qa, 1, "single", BERT_TINY)      # the baseline
    two = run_ranks(train_qa, 2, "ddp", BERT_TINY)         # the same program on 2 ranks
    strategy_table({"single": one, "ddp": two}, refused={...})

The data set is built from the shipped Tiny Shakespeare, nothing downloaded: a context is a few
consecutive speeches, each written "NAME : first line"; the question quotes one of those lines
("who speaks : ... ?") and the answer is the span of that speech's speaker name in the context
(the shape of SQuAD's extractive answers: a start and an end token, Rajpurkar et al. 2016). Words
are the tokens (a vocabulary of the text's most frequent words, as no tokenizer is downloaded).

The model is ``transformers.BertForQuestionAnswering`` (Devlin et al. 2019), randomly
initialised: :data:`BERT_BASE` is bert-base's shape (L=12, H=768, A=12, 110 M parameters, the
paper's Sec. 3), :data:`BERT_MINI` and :data:`BERT_TINY` the L=4/H=256 and L=2/H=128 shapes of
Turc et al. 2019 ("Well-Read Students Learn Better": two of its 24 compact BERTs, L in 2..12 and H
in 128..768, released as BERT-Mini and BERT-Tiny) for a CPU. Dropout is off, so one
rank and two ranks take the same steps (the losses are returned and compared).

Each run reports its training time and the peak memory of each rank: the CUDA allocator's peak
on a GPU, else the process's peak resident set (``ru_maxrss``: it includes the interpreter and
torch, about the same on every rank and strategy), beside the model states it holds.
"""

from __future__ import annotations

import re
import resource
import time
from collections import Counter
from types import SimpleNamespace

import torch
import torch.distributed as dist

from course_lib.hardware import MB
from course_lib.experiments.frameworks_fabric import fabric_setup, fabric_step, inner_optimizer, make_fabric
from course_lib.parallel.footprint import measure_model_states
from course_lib.utils import shipped_file

BERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}
BERT_MINI = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024}
BERT_TINY = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 512}
# The second lab's table (BERT-base, SQuAD, Fabric on 2 A100s; seconds of training), as its author
# reported it (issue 29 quotes it); its baseline was a different program, run on one A100.
LAB_SECONDS = {"baseline (1 A100)": 5109, "dp": 5252, "ddp": 997, "fsdp": 1046, "deepspeed": 1074}
LAB_DEVICES = 2
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
WORD = re.compile(r"[a-z']+|[^\sa-z']")


def speech_openings(text: str | None = None) -> list[tuple[str, str]]:
    """(speaker, first line of the speech) for every speech of the play text."""
    text = text if text is not None else shipped_file("tinyshakespeare.txt").read_text()
    out = []
    for block in text.split("\n\n"):
        lines = block.strip().split("\n")
        if len(lines) >= 2 and lines[0].endswith(":"):
            out.append((lines[0][:-1], lines[1]))
    return out


def words(s: str) -> list[str]:
    return WORD.findall(s.lower())


def qa_examples(n: int, *, context_speeches: int = 4, max_len: int = 96, vocab_size: int = 2000,
                seed: int = 0, text: str | None = None) -> dict:
    """``n`` question-answering examples as tensors: input_ids, token_type_ids, attention_mask
    (n, max_len) and start_positions, end_positions (n,); plus the vocabulary and one example as text.

    Input: [CLS] who speaks : LINE ? [SEP] NAME : LINE NAME : LINE ... [SEP], padded. The answer
    is the speaker's name in the context (its first and last word)."""
    all_speeches = speech_openings(text)
    counts = Counter(w for name, line in all_speeches for w in words(name) + words(line))
    vocab = SPECIAL + [w for w, _ in counts.most_common(vocab_size - len(SPECIAL))]
    index = {w: i for i, w in enumerate(vocab)}

    def ids(ws: list[str]) -> list[int]:
        return [index.get(w, 1) for w in ws]  # 1: [UNK]

    g = torch.Generator().manual_seed(seed)
    rows, starts, ends, shown = [], [], [], None
    while len(rows) < n:
        first = int(torch.randint(len(all_speeches) - context_speeches, (1,), generator=g))
        chosen = all_speeches[first:first + context_speeches]
        asked = int(torch.randint(context_speeches, (1,), generator=g))
        question = ["[CLS]", "who", "speaks", ":"] + words(chosen[asked][1]) + ["?", "[SEP]"]
        context, span = [], None
        for i, (name, line) in enumerate(chosen):
            if i == asked:
                span = (len(question) + len(context), len(question) + len(context) + len(words(name)) - 1)
            context += words(name) + [":"] + words(line)
        tokens = question + context + ["[SEP]"]
        if len(tokens) > max_len:  # long lines: draw again rather than cut an answer off
            continue
        rows.append((ids(question), ids(context + ["[SEP]"])))
        starts.append(span[0])
        ends.append(span[1])
        if shown is None:
            shown = {"question": " ".join(question), "context": " ".join(context),
                     "answer": " ".join(tokens[span[0]:span[1] + 1])}
    input_ids = torch.zeros(n, max_len, dtype=torch.long)
    token_type = torch.zeros(n, max_len, dtype=torch.long)
    mask = torch.zeros(n, max_len, dtype=torch.long)
    for r, (q, c) in enumerate(rows):
        input_ids[r, :len(q) + len(c)] = torch.tensor(q + c)
        token_type[r, len(q):len(q) + len(c)] = 1
        mask[r, :len(q) + len(c)] = 1
    return {"input_ids": input_ids, "token_type_ids": token_type, "attention_mask": mask,
            "start_positions": torch.tensor(starts), "end_positions": torch.tensor(ends),
            "vocab": vocab, "example": shown}


def bert_qa(shape: dict, vocab_size: int, max_len: int):
    """A randomly initialised ``BertForQuestionAnswering`` of this shape, dropout off."""
    try:
        # here, not at the top: transformers is the optional extra course-lib[frameworks]
        from transformers import BertConfig, BertForQuestionAnswering
    except ImportError as e:
        raise ImportError("transformers is not installed: pip install 'course-lib[frameworks]'") from e
    cfg = BertConfig(vocab_size=vocab_size, max_position_embeddings=max_len, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, **shape)
    return BertForQuestionAnswering(cfg)


def peak_memory_bytes(device: torch.device) -> int:
    """The CUDA allocator's peak on a GPU, else this process's peak resident set (bytes)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


KEYS = ("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions")


def train_qa(rank: int, world: int, strategy: str, shape: dict, steps: int = 6, global_batch: int = 16,
             max_len: int = 96, vocab_size: int = 2000, lr: float = 3e-4, seed: int = 0,
             accelerator: str = "cpu", devices: int | None = None) -> dict:
    """Train the QA BERT with Fabric's ``strategy`` on the ranks of this call: ``steps`` steps of
    ``global_batch`` examples, each rank its share. Same data, weights and steps on any number of
    ranks ("dp" on one rank with ``devices`` GPUs). Returns (on each rank) losses, seconds (set-up excluded, first step included), peak
    memory and model-state bytes of this rank, the parameter count."""
    if global_batch % world:
        raise ValueError(f"global_batch {global_batch} must divide among {world} ranks")
    data = qa_examples(steps * global_batch, max_len=max_len, vocab_size=vocab_size, seed=seed)
    per = global_batch // world
    fabric = make_fabric(strategy, accelerator=accelerator, devices=devices)
    torch.manual_seed(seed)
    model, opt = fabric_setup(fabric, bert_qa(shape, len(data["vocab"]), max_len),
                       lambda m: torch.optim.AdamW(m.parameters(), lr=lr))
    if fabric.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(fabric.device)
    losses = []
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for step in range(steps):
        first = step * global_batch + rank * per
        batch = {k: fabric.to_device(data[k][first:first + per]) for k in KEYS}
        loss = fabric_step(fabric, model, opt, **batch)
        if world > 1:
            dist.all_reduce(loss)
        losses.append(loss.item() / world)
    seconds = time.perf_counter() - t0
    held = measure_model_states(SimpleNamespace(module=model, optimizer=inner_optimizer(opt)))
    return {"strategy": strategy, "ranks": world, "losses": losses, "seconds": seconds,
            "peak_bytes": peak_memory_bytes(fabric.device), "model_state_bytes": held.total,
            "num_params": sum(p.numel() for p in bert_qa(shape, len(data["vocab"]), max_len).parameters()),
            "example": data["example"]}


def lab_speedups() -> dict[str, float]:
    """The speedups the lab's table implies over its baseline: ddp's 5.1x on 2 devices is more
    than 2x, so the baseline cannot have been the same program (notebook 11)."""
    base = LAB_SECONDS["baseline (1 A100)"]
    return {k: base / v for k, v in LAB_SECONDS.items() if k != "baseline (1 A100)"}


def strategy_table(runs: dict[str, list[dict]], refused: dict[str, str] | None = None,
                   baseline: str = "single") -> list[dict]:
    """The labs' table from measurements: per strategy the ranks, seconds, peak memory per rank
    (the largest rank's), model states per rank, speedup over the one baseline (the same program
    on one rank), and the loss it reached; then a row per refused strategy with the refusal."""
    base = max(r["seconds"] for r in runs[baseline])
    table = []
    for name, per_rank in runs.items():
        seconds = max(r["seconds"] for r in per_rank)  # the job ends with its slowest rank
        table.append({"strategy": name, "ranks": per_rank[0]["ranks"], "seconds": seconds,
                      "peak MB / rank": max(r["peak_bytes"] for r in per_rank) / MB,
                      "model states MB / rank": max(r["model_state_bytes"] for r in per_rank) / MB,
                      "speedup vs 1 rank": base / seconds, "final loss": per_rank[0]["losses"][-1],
                      "note": ""})
    for name, why in (refused or {}).items():
        table.append({"strategy": name, "ranks": None, "seconds": None, "peak MB / rank": None,
                      "model states MB / rank": None, "speedup vs 1 rank": None, "final loss": None,
                      "note": why})
    return table
