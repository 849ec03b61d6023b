"""Per-step training metrics: one object (:class:`RunMeter`) owns a run's timing, its
``metrics.csv`` (written row by row), its progress bar and its summary; timers do not stall the GPU;
:class:`SavedTensorMeter` measures the activations a forward keeps (the last section).

``metrics.csv`` holds one row per logged step (and one per evaluation): iter, train_loss, val_loss,
eval_train_loss, lr, grad_norm, step_ms, compute_ms, comm_ms, tokens_per_s, tflops, mfu, comm_mb,
act_mb, act_model_mb, loss_scale, skipped_steps (+ LAYOUT_COLUMNS for tp/pp/cp runs, + the
router's columns for a mixture of experts: :func:`moe_columns`).
``step_ms`` is wall time per iteration averaged since the previous row; ``compute_ms`` the time
in forward/backward and the optimizer step, less the communication the strategy timed inside them
(on a GPU the span between CUDA events on the compute stream, read at log steps: the timer adds
no host sync; the span holds whatever the stream waited for); ``comm_ms`` the exposed
communication the Strategy measured (``comm_s``: host time in blocking collectives and waits,
on a GPU from when the compute queued before them is done), which is not counted in
``compute_ms``: compute_ms + comm_ms <= step_ms. PyTorch's wrappers (torch_ddp, torch_zero1,
fsdp_*) communicate inside backward and step, whose compute waits for their collectives (gloo:
the host blocks; NCCL: the stream waits): their exposed communication is in ``compute_ms`` and
their ``comm_ms`` is 0 (the profiler separates the two: lesson 08, section 6). ``tflops`` is the
achieved model FLOP/s of the whole job and ``mfu`` that over the peak of all its devices (PaLM,
Chowdhery et al. 2022, App. B); on a CPU the peak is an estimate (course_lib.hardware).
``comm_mb``: bytes per step handed to collectives by our own strategies
(:class:`course_lib.parallel.comms.Comms`; empty for PyTorch's). ``act_mb``: the activations one
micro-batch keeps for backward on this rank, measured
(:class:`SavedTensorMeter`), next to Korthikanti et al.'s model
``act_model_mb`` for the run's dtype and ``--recompute``. fp16 runs log the ``loss_scale`` and the
``skipped_steps`` so far. Each row is on disk (file closed) as soon as it is written: a crash loses
nothing already logged.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from course_lib.analysis.activations import trainer_activation_bytes
from course_lib.gpt.moe import moe_stats
from course_lib.hardware import detect
from course_lib.utils import atomic_write_bytes, progress_bar

COLUMNS = ("iter", "train_loss", "val_loss", "eval_train_loss", "lr", "grad_norm", "step_ms", "compute_ms",
           "comm_ms", "tokens_per_s", "tflops", "mfu", "comm_mb", "act_mb", "act_model_mb", "loss_scale",
           "skipped_steps")
# Model-parallel runs (tp/pp/cp) add, per step, the most over ranks (ranks.json has every rank's):
LAYOUT_COLUMNS = ("bubble", "bubble_theory", "model_state_bytes", "peak_activation_bytes", "sent_bytes_tp",
                  "sent_bytes_sp", "sent_bytes_cp", "sent_bytes_pp", "sent_bytes_dp")
# ... and a mixture of experts on the grid, its all-to-all, router counts and expert gradients:
EP_COLUMNS = ("sent_bytes_ep", "sent_bytes_router", "sent_bytes_edp")


def moe_columns(n_expert: int) -> tuple[str, ...]:
    """A mixture of experts' columns (gpt/moe.py), per step since the previous row, over the whole
    global batch: the load-balancing loss (summed over the blocks, mean over ranks), the dropped
    assignments and the assignments routed to each expert (summed over the blocks)."""
    if not n_expert:
        return ()
    return ("moe_aux_loss", "moe_dropped", *(f"moe_tokens_e{i}" for i in range(n_expert)))


# Variables set by the launchers (torchrun's docs, "Environment Variables"; sbatch/srun "OUTPUT
# ENVIRONMENT VARIABLES"): TORCHELASTIC_RUN_ID is torchrun's --rdzv-id, GROUP_WORLD_SIZE its agents
# (one per node); SLURM_STEP_ID exists only inside an srun step.
LAUNCH_VARS = {"torchrun_run_id": "TORCHELASTIC_RUN_ID", "torchrun_agents": "GROUP_WORLD_SIZE",
               "slurm_job_id": "SLURM_JOB_ID", "slurm_step_id": "SLURM_STEP_ID",
               "slurm_step_nodes": "SLURM_STEP_NODELIST", "pbs_job_id": "PBS_JOBID"}


def launcher_info(env=None) -> dict:
    """Who started this process (recorded in run.json): the launch variables that are set."""
    env = os.environ if env is None else env
    return {key: env[var] for key, var in LAUNCH_VARS.items() if var in env}


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a metrics.csv (``path``, or a run directory's) as dicts of floats (NaN where a cell
    is empty); ``iter`` as int."""
    rows = []
    if Path(path).is_dir():  # a run directory: its metrics.csv
        path = Path(path) / "metrics.csv"
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = {k: (float(v) if v not in ("", None) else math.nan) for k, v in r.items()}
            row["iter"] = int(row["iter"])
            rows.append(row)
    return rows


class MetricsWriter:
    """Append rows to ``metrics.csv``. On resume at ``start_iter`` the rows from ``start_iter`` on
    (written after the checkpoint by the interrupted run) are dropped first, so every iteration
    appears once."""

    def __init__(self, path: str | os.PathLike, start_iter: int = 0, columns: tuple = COLUMNS):
        self.path, self.columns = Path(path), columns
        keep = []
        if start_iter > 0 and self.path.is_file():
            with open(self.path, newline="") as f:
                keep = [r for r in csv.DictReader(f) if r.get("iter", "").isdigit() and int(r["iter"]) < start_iter]
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, self.columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(keep)
        os.replace(tmp, self.path)

    def write(self, row: dict) -> None:
        """Append one row; the file is closed again at once (one row per log step: cheap)."""
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns, extrasaction="ignore").writerow(
                {k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v) for k, v in row.items()})


class SpanTimer:
    """Sums the duration of code spans: perf_counter on a CPU, CUDA events on a GPU.

    ``start()``/``stop()`` only record; ``total_s()`` (called at log steps) synchronises once.
    """

    def __init__(self, device_type: str):
        self.cuda = device_type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._spans, self._open, self._cpu_s = [], None, 0.0

    def start(self) -> None:
        if self.cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((self._open, end))
        else:
            self._cpu_s += time.perf_counter() - self._open

    def total_s(self) -> float:
        if self.cuda and self._spans:
            self._spans[-1][1].synchronize()
            self._cpu_s += sum(a.elapsed_time(b) for a, b in self._spans) / 1e3
            self._spans = []
        return self._cpu_s


def throughput(steps: int, elapsed_s: float, compute_s: float, comm_s: float, tokens_per_iter: int,
               flops_per_token: float, peak_flops_total: float | None) -> dict:
    """The timing columns for ``steps`` iterations that took ``elapsed_s`` of wall time."""
    tokens_per_s = steps * tokens_per_iter / elapsed_s
    achieved = flops_per_token * tokens_per_s
    return {
        "step_ms": 1e3 * elapsed_s / steps,
        "compute_ms": 1e3 * compute_s / steps,
        "comm_ms": 1e3 * comm_s / steps,
        "tokens_per_s": tokens_per_s,
        "tflops": achieved / 1e12,
        "mfu": achieved / peak_flops_total if peak_flops_total else math.nan,
    }


def announce_run(cfg, info: dict) -> None:
    """Write ``run.json`` (what this run resolved to) and ``config.json``, print the header."""
    out = Path(cfg.out_dir)
    cfg.save()
    atomic_write_bytes(out / "run.json", (json.dumps(info, indent=1) + "\n").encode())
    cpu = info["device"] == "cpu"
    threads = info["threads_per_worker"]
    where = f"{info['world_size']} x {info['device']}" + (f" ({threads} thread{'s' * (threads != 1)} each)" if cpu else "")
    lay = info["layout"]
    ranks = "dp ranks" if cfg.model_parallel_size > 1 else "ranks"
    batch = (f"global batch {info['global_batch']} sequences = batch_size {cfg.batch_size} x grad_accum "
             f"{cfg.gradient_accumulation_steps} x {lay['dp']} {ranks}; {info['tokens_per_iter']:,} tokens/iter")
    lines = [f"{where} | strategy {info['strategy']} | {info['dtype']} | {info['n_params'] / 1e6:.2f}M parameters",
             batch]
    if cfg.on_grid(cfg.n_expert):
        experts = (f"; ep {cfg.ep} (of dp): {cfg.n_expert // cfg.ep} of {cfg.n_expert} experts per rank, "
                   f"experts data-parallel over dp/ep = {lay['dp'] // cfg.ep}" if cfg.n_expert else "")
        lines.append(f"layout dp {lay['dp']} x tp {lay['tp']}{' (+sp)' if lay['sequence_parallel'] else ''} x "
                     f"pp {lay['pp']} ({lay['pp_schedule']}) x cp {lay['cp']}; {info['strategy']} across dp x cp"
                     + experts)
    if info["peak_flops_per_device"] and info["peak_is_estimate"]:
        lines.append(f"MFU is relative to an ESTIMATED CPU peak of {info['peak_flops_per_device'] / 1e9:.0f} "
                     "GFLOP/s per worker (cores x 2.5 GHz x FLOP/cycle)")
    if cfg.init_from == "resume":
        lines.append(f"resumed from {out / 'last.pt'} at iter {info['start_iter']}")
    if cfg.decay_lr and cfg.warmup_iters >= cfg.max_iters > 0:
        lines.append(f"note: warmup_iters ({cfg.warmup_iters}) >= max_iters ({cfg.max_iters}): the run ends inside "
                     f"its warmup, below learning_rate {cfg.learning_rate:g} (lower warmup_iters for a short run)")
    for line in lines:
        print(f"[{cfg.name}] {line}", flush=True)


class RunMeter:
    """What one training run measures and shows: compute and communication time, the rows of
    ``metrics.csv``, the progress bar, the header (run.json) and the summary (summary.json).

    The trainer only says what happened: ``with meter.compute():`` around its own work,
    ``meter.evaluated(...)`` after an evaluation, ``meter.log(...)`` after a step, ``meter.finish()``
    at the end. Files are written and lines printed on rank 0 only; every rank keeps the numbers.
    """

    def __init__(self, cfg, rt, strategy, strategy_name: str, num_params: int, flops_per_token: float,
                 start_iter: int, progress: bool):
        self.cfg, self.world_size, self.strategy = cfg, rt.world_size, strategy
        self.master = rt.rank == 0
        dp = rt.world_size // cfg.model_parallel_size  # ranks holding different samples
        self.tokens_per_iter = cfg.batch_size * cfg.gradient_accumulation_steps * dp * cfg.block_size
        self.layout = cfg.on_grid(cfg.n_expert)  # tp/pp/cp (ep): per-rank memory, bytes and bubble
        self.moe_columns = moe_columns(cfg.n_expert)
        self.strategy_device = rt.device  # where the router's counts are all-reduced (NCCL: a GPU)
        self.flops_per_token = flops_per_token  # the whole model's (the trainer counts it before wrapping)
        profile = detect(rt.device)
        peak = profile.training_peak(rt.dtype)  # None: unknown, MFU is then NaN
        self.peak_total = peak * rt.devices if peak else None  # ranks sharing a GPU share its peak
        self.info = {"strategy": strategy_name, "world_size": rt.world_size, "device": rt.device, "dtype": rt.dtype,
                     "threads_per_worker": rt.threads, "n_params": num_params,
                     "tokens_per_iter": self.tokens_per_iter, "devices": rt.devices,
                     "global_batch": cfg.batch_size * cfg.gradient_accumulation_steps * dp,
                     "layout": {"dp": dp, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp,
                                "sequence_parallel": cfg.sequence_parallel, "pp_schedule": cfg.pp_schedule,
                                **({"ep": cfg.ep, "n_expert": cfg.n_expert} if cfg.n_expert else {})},
                     "hardware": profile.name, "peak_flops_per_device": peak, "peak_is_estimate": profile.estimated,
                     "torch": torch.__version__, "start_iter": start_iter, "launcher": launcher_info(),
                     "backend": dist.get_backend() if dist.is_initialized() else None}
        self.writer = None
        if self.master:
            announce_run(cfg, self.info)  # run.json, config.json and the header lines
            self.writer = MetricsWriter(Path(cfg.out_dir) / "metrics.csv", start_iter,
                                        COLUMNS + (LAYOUT_COLUMNS if self.layout else ())
                                        + (EP_COLUMNS if self.layout and cfg.n_expert else ()) + self.moe_columns)
        # on stdout, with the eval lines: one stream keeps their order when a launcher relays it
        self.bar = progress_bar(total=cfg.max_iters, initial=start_iter, desc=cfg.name, unit="it",
                                dynamic_ncols=True, file=sys.stdout, disable=not (self.master and progress))
        self.timer = SpanTimer(rt.device_type)
        self.last_eval: dict = {}  # the latest evaluation (for the bar and the summary)
        self.postfix: dict = {}  # what the bar shows beside it (loss, val, ms)
        self.pending_eval: dict | None = None  # an evaluation not yet in a row
        self.run_steps, self.run_s = 0, 0.0  # every timed step, for the summary's ms/iter
        self._restart()

    def _restart(self) -> None:
        """Start a new timing window (after a row, or after an evaluation: that is not step time)."""
        self.t_last, self.steps, self.comm_start, self.comm_in_compute = time.perf_counter(), 0, self.strategy.comm_s, 0.0
        self.timer.reset()
        if self.layout:
            self.strategy.figures()  # restart its byte counts too (an evaluation's traffic is not a step's)
        self.bytes_start = self._comm_bytes()  # after that restart: read before it, comm_mb went negative
        if self.moe_columns:
            moe_stats(self.strategy.module)  # and the router's counts

    @contextmanager
    def compute(self):
        """Time the enclosed work as compute, less the communication the strategy timed inside it
        (e.g. ZeRO's parameter all-gather in its step)."""
        comm_before = self.strategy.comm_s
        self.timer.start()
        try:
            yield
        finally:
            self.timer.stop()
            self.comm_in_compute += self.strategy.comm_s - comm_before

    def evaluated(self, it: int, losses: dict, is_best: bool) -> None:
        self.last_eval = self.pending_eval = losses
        if self.master:
            self.bar.write(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                           + (" (best)" if is_best else ""))
        self._restart()

    def wants_row(self, it: int) -> bool:
        """Whether step ``it`` gets a row (log steps, and the first step after an evaluation)."""
        return it % self.cfg.log_interval == 0 or self.pending_eval is not None

    def _comm_bytes(self) -> float:
        """Bytes our strategies' Comms counted so far (model parallel: every group's); nan for PyTorch's."""
        return self.strategy.comm_bytes()

    def log(self, it: int, loss_sum: torch.Tensor, lr: float, grad_norm: torch.Tensor | None,
            extra: dict | None = None) -> None:
        """Count the step just done; at log steps (and after an evaluation) write its row.

        ``loss_sum`` is this rank's loss of the step (a device tensor: no host sync until here);
        ``extra``: more columns for the row (activations, loss scale)."""
        self.steps += 1
        if not self.wants_row(it):
            return
        if self.world_size > 1:  # the loss of the global batch (a collective at log steps only)
            dist.all_reduce(loss_sum)
            loss_sum /= self.world_size
        train_loss = loss_sum.item()  # the one host sync per logged step
        elapsed = time.perf_counter() - self.t_last
        comm_s = self.strategy.comm_s - self.comm_start
        row = {"iter": it, "train_loss": train_loss, "lr": lr,
               "grad_norm": grad_norm.item() if grad_norm is not None else None,
               **throughput(self.steps, elapsed, self.timer.total_s() - self.comm_in_compute, comm_s,
                            self.tokens_per_iter, self.flops_per_token, self.peak_total)}
        row.update(comm_mb=(self._comm_bytes() - self.bytes_start) / self.steps / 1e6, **(extra or {}))
        if self.pending_eval is not None:
            row.update(val_loss=self.pending_eval["val"], eval_train_loss=self.pending_eval["train"])
        if self.layout:
            row.update(self._layout_figures(it))
        if self.moe_columns:
            row.update(self._moe_figures())
        if self.master:
            self.writer.write(row)
        self.bar.update(it + 1 - self.bar.n)
        self.postfix = {"loss": f"{train_loss:.4f}", "val": f"{self.last_eval.get('val', math.nan):.4f}",
                        "ms": f"{row['step_ms']:.0f}"}  # (no eval yet after a mid-interval resume: nan)
        self.bar.set_postfix(self.postfix, refresh=False)
        self.run_steps, self.run_s, self.pending_eval = self.run_steps + self.steps, self.run_s + elapsed, None
        self._restart()

    def _layout_figures(self, it: int) -> dict:
        """Every rank's figures per step since the last row (a collective at log steps only);
        rank 0 writes them all to ranks.json and the row gets the most over ranks."""
        mine = self.strategy.figures()
        mine.update({k: v / self.steps for k, v in mine.items() if k.startswith("sent_bytes_")})
        ranks = [None] * self.world_size
        dist.all_gather_object(ranks, mine)
        if self.master:
            atomic_write_bytes(Path(self.cfg.out_dir) / "ranks.json",
                               (json.dumps({"iter": it, "ranks": ranks}, indent=1) + "\n").encode())
        return {k: max(r.get(k, 0.0) for r in ranks) for k in LAYOUT_COLUMNS + EP_COLUMNS if k in mine}

    def _moe_figures(self) -> dict:
        """The router's statistics per step since the last row, over every rank's tokens (a
        collective at log steps only; tp ranks hold the same tokens, counted once)."""
        s = moe_stats(self.strategy.module)
        v = torch.cat([s["tokens_per_expert"].sum(0).double(), s["dropped"].sum().double().reshape(1),
                       torch.tensor([s["aux_loss"]], dtype=torch.float64)])
        if self.world_size > 1:
            v = v.to(self.strategy_device)
            dist.all_reduce(v)
            v = v.cpu()
        counts = (v[:-1] / (self.cfg.tp * self.steps)).tolist()
        # aux: each pp stage holds its blocks' part, the other ranks copies (tp) or shares (dp, cp) of it
        return {"moe_aux_loss": v[-1].item() * self.cfg.pp / self.world_size, "moe_dropped": counts[-1],
                **{f"moe_tokens_e{i}": c for i, c in enumerate(counts[:-1])}}

    def finish(self, it: int, best_val: float) -> dict:
        """The last row (the final evaluation), summary.json and the closing line; returns the summary."""
        cfg = self.cfg
        # the final evaluation's val (no step row follows it to update the bar)
        self.bar.set_postfix({**self.postfix, "val": f"{self.last_eval['val']:.4f}"}, refresh=False)
        self.bar.update(cfg.max_iters - self.bar.n)
        self.bar.close()
        summary = {"out_dir": str(cfg.out_dir), "iters": cfg.max_iters, "val_loss": self.last_eval["val"],
                   "train_loss": self.last_eval["train"], "best_val_loss": best_val, "world_size": self.world_size,
                   "strategy": self.info["strategy"],
                   "ms_per_iter": 1e3 * self.run_s / self.run_steps if self.run_steps else math.nan}
        if self.master:
            self.writer.write({"iter": it, "val_loss": self.last_eval["val"], "eval_train_loss": self.last_eval["train"]})
            atomic_write_bytes(Path(cfg.out_dir) / "summary.json", (json.dumps(summary, indent=1) + "\n").encode())
            print(f"[{cfg.name}] done: iter {cfg.max_iters}, train loss {summary['train_loss']:.4f}, "
                  f"val loss {summary['val_loss']:.4f} (best {best_val:.4f}), {summary['ms_per_iter']:.1f} ms/iter",
                  flush=True)
        return summary


# --- the activations a forward keeps for backward, measured ----------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor holds only its shard


class SavedTensorMeter:
    """Count the bytes saved for backward inside the ``with`` (parameters are not activations):
    the activations a rank holds.

        with SavedTensorMeter(model) as meter:
            loss = model(x, y)[1]
        meter.bytes    # bytes of the distinct storages saved for backward, parameters excluded

    This is Korthikanti et al. 2022's quantity (the activation memory of training, their Sec. 4),
    measured rather than modelled: every tensor an operation saves for its backward passes through a
    ``saved_tensors_hooks`` pack hook, and each storage is counted once (q, k and v are views of one
    matmul output; a tensor saved by two operations is one allocation). With activation
    recomputation (``torch.utils.checkpoint``) the recomputed region saves only its inputs, so the
    count shows the saving. The trainer measures one micro-batch per logged step and writes it to
    ``metrics.csv`` next to :func:`modelled_bytes` (``act_mb``, ``act_model_mb``).
    """

    def __init__(self, model: nn.Module):
        self.params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.saved: dict[int, tuple[int, str]] = {}  # storage address -> (bytes, dtype name)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = _local(t).untyped_storage()
        if st.data_ptr() not in self.params:
            self.saved[st.data_ptr()] = (st.nbytes(), str(t.dtype).removeprefix("torch."))
        return t

    @property
    def bytes(self) -> int:
        return sum(n for n, _ in self.saved.values())

    def by_dtype(self) -> dict[str, int]:
        """Bytes per dtype: under autocast, what stayed fp32 and what is 16-bit."""
        out: dict[str, int] = {}
        for n, dtype in self.saved.values():
            out[dtype] = out.get(dtype, 0) + n
        return out

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def modelled_bytes(cfg, vocab_size: int, dtype: str, device_type: str = "cpu") -> float:
    """The activation model for one micro-batch of a trainer run (``cfg`` a TrainConfig):
    :func:`course_lib.analysis.activations.trainer_activation_bytes`."""
    return trainer_activation_bytes(cfg.n_layer, cfg.block_size, cfg.batch_size, cfg.n_embd, cfg.n_head,
                                    vocab_size, dtype, cfg.recompute, cfg.dropout, cfg.bias, device_type)
