"""The training loop: sampler -> reader -> forward/backward -> bucketed allreduce ->
clip -> AdamW -> metrics, with periodic evaluation and a final checkpoint.

Every rank runs this same loop on its share of each global batch. ``World`` is passed in,
so the single-process reference is the same code on ``MPI.COMM_SELF``.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from hpctrain.checkpoint.collective import begin_save, find_resume, load_checkpoint, model_shape
from hpctrain.checkpoint.single_file import replicated_state, save_checkpoint
from hpctrain.comm.collectives import allreduce_array
from hpctrain.comm.grid import ProcessGrid
from hpctrain.comm.world import World, threads_per_rank
from hpctrain.config import Config, ConfigError, check_layout
from hpctrain.data.loader import open_dataset
from hpctrain.data.sampler import EVAL_STREAM, all_windows, make_sampler
from hpctrain.errors import CommTimeout, DataError, NonFiniteError
from hpctrain.model.gpt import GPT, GPTConfig
from hpctrain.parallel.data_parallel import DataParallel
from hpctrain.parallel.pipeline.consolidate import gather_parameters
from hpctrain.parallel.pipeline.executor import PipelineExecutor
from hpctrain.parallel.pipeline.stage import PipelineStage
from hpctrain.parallel.zero import Zero
from hpctrain.profiling import nvtx_range
from hpctrain.progress import Progress
from hpctrain.train.metrics import MetricsLog, finite_record, peak_tflops
from hpctrain.train.optim import (build_optimizer, clip_grads_, global_grad_norm,
                                  learning_rate, param_groups)
from hpctrain.train.rundir import claim_run_dir
from hpctrain.train.stop import SignalFlag, StopAgreement
from hpctrain.train.timing import peak_rss_bytes, summarize

FULL_EVAL_ROWS = 64  # windows per forward pass in the final whole-split evaluation


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    """Mean loss over the whole global batch, one per step."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Periodic validation estimates by step."""
    final_val_loss: float | None = None
    """Loss over the whole validation split at the end."""
    step_times: list[float] = field(default_factory=list)
    data_times: list[float] = field(default_factory=list)
    """Seconds each step waited for its batch (the reader thread was behind)."""
    comm_times: list[float] = field(default_factory=list)
    """Seconds each step waited for gradient reductions after backward (not hidden)."""
    bubble_times: list[float] = field(default_factory=list)
    """Seconds each step's pipeline stage sat idle waiting for a neighbour (pp > 1)."""
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    stopped_at: int | None = None
    """The step after which a scheduler's signal stopped training (None: it finished)."""


class Trainer:
    def __init__(self, cfg: Config, world: World, *, verbose: bool = True,
                 signals: SignalFlag | None = None):
        """``signals``: the flag the command line installed at start-up; without one the
        trainer installs its own (restored by ``close()``)."""
        self.cfg, self.world = cfg, world
        self.log_enabled = verbose and world.is_root
        self._own_signals = signals is None
        self.signals = SignalFlag().install() if signals is None else signals
        self._stop: StopAgreement | None = None
        self._closed = False
        check_layout(cfg, world.size)
        # Before anything is written: one run per out_dir (rundir.py).
        self.lock = claim_run_dir(Path(cfg.train.out_dir), cfg.train.resume,
                                  cfg.train.overwrite, world)
        try:
            self._build(cfg, world)
        except BaseException:
            self.lock.release()
            raise

    def _build(self, cfg: Config, world: World) -> None:
        torch.set_num_threads(cfg.train.threads or threads_per_rank(world.local_size))
        self.device = torch.device(world.device)

        # Collective MPI-IO reads (--data.reader) through a prefetching thread.
        self.data = open_dataset(cfg.data, world)
        self._next_batch = None  # (step, read in flight) of the next training batch
        self.data.check_fits(cfg.model.block_size, cfg.model.vocab_size)
        if cfg.data.verify:
            self._verify_data()
        mcfg = cfg.model
        self.gpt_cfg = GPTConfig(vocab_size=mcfg.vocab_size or self.data.vocab_size,
                                 block_size=mcfg.block_size, n_layer=mcfg.n_layer,
                                 n_head=mcfg.n_head, n_embd=mcfg.n_embd,
                                 dropout=mcfg.dropout, bias=mcfg.bias)
        torch.manual_seed(cfg.train.seed)
        gpt = GPT(self.gpt_cfg)  # on the host; what this rank keeps goes to the device
        self.n_params = gpt.num_params()
        self.flops_per_token = gpt.flops_per_token()
        par = cfg.parallel
        # dp x pp ranks; gradients are reduced over the data-parallel axis only.
        self.grid = ProcessGrid.create(world, par.pp)
        dp_world = self.grid.dp_world
        self.pipe = None
        if par.pp > 1:
            # Every rank builds the whole model from the same seed and keeps its stage.
            self.model = PipelineStage(gpt, self.grid.stage, par.pp, par.virtual_stages,
                                       device=self.device)
        else:
            self.model = gpt.to(self.device)
        del gpt
        # Plain data parallelism for fp32 without sharding; ZeRO for the rest (stage 0
        # with bf16 is replicated data parallelism with fp32 master weights).
        self.zero = par.zero > 0 or cfg.train.dtype != "fp32"
        if self.zero:
            self.dp = Zero(self.model, dp_world, cfg.optim, stage=par.zero,
                           dtype=cfg.train.dtype, bucket_mb=par.bucket_mb,
                           first_bucket_mb=par.first_bucket_mb,
                           blocks=list(self.model.h) if par.pp == 1 else None)
            self.optimizer = None
        else:
            self.dp = DataParallel(self.model, dp_world, bucket_mb=par.bucket_mb,
                                   first_bucket_mb=par.first_bucket_mb,
                                   allreduce=par.allreduce)
            self.dp.broadcast_parameters()
            self.optimizer = build_optimizer(param_groups(self.model, cfg.optim.weight_decay),
                                             cfg.optim)

        if par.pp > 1:  # the engine may have turned the parameters into bf16
            self.model.sync_head_dtype()
        t = cfg.train
        self.block = mcfg.block_size
        self.micro = cfg.parallel.micro_batches
        self.rows_per_rank = t.batch_size // self.grid.dp  # every stage of a replica alike
        self.rows_per_micro = self.rows_per_rank // self.micro
        if par.pp > 1:
            self.pipe = PipelineExecutor(self.model, self.grid, kind=par.schedule,
                                         n_micro=self.micro, seq=self.block,
                                         timeout=world.timeout)
        self.sampler = make_sampler(cfg.data.sampler, self.data.splits["train"].n_tokens,
                                    self.block, t.batch_size, t.seed)
        # Periodic estimates use the same fixed random windows every time.
        self.eval_sampler = make_sampler("random", self.data.splits["val"].n_tokens,
                                         self.block, t.batch_size, t.seed, stream=EVAL_STREAM)
        self.tokens_per_step = t.batch_size * self.block
        self.peak = peak_tflops(world.device, t.dtype, t.peak_tflops)
        self.out_dir = Path(t.out_dir)
        self.nonfinite_steps = 0
        """Steps whose gradient norm was NaN or inf (skipped with on_nonfinite=skip)."""
        self._nonfinite_in_row = 0
        self._pending_save = None
        self.start_step = 0
        resume_from = find_resume(t.resume, self.out_dir)
        if resume_from is not None:
            self.start_step = load_checkpoint(
                resume_from, model=self.model, engine=self.dp, optimizer=self.optimizer,
                world=world, model_shape=model_shape(self.gpt_cfg), grid=self.grid)
            if self.pipe is not None:  # the head's copy of the embedding, from stage 0
                self.pipe.tie_weights()
            if self.start_step > t.max_iters:
                raise ConfigError(f"the checkpoint is at step {self.start_step}, past "
                                  f"--train.max_iters={t.max_iters}; raise max_iters to go on")
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", enabled=world.is_root,
                                  append=self.start_step > 0)

    # ------------------------------------------------------------------ helpers
    def _verify_data(self) -> None:
        """Every rank checks the CRC of a share of the blocks; all agree on the verdict.
        Staged copies are checked node by node: each node reads its own copy."""
        w = self.world
        staged = bool(self.cfg.data.stage_dir)
        bad = self.data.verify(w.local_rank if staged else w.rank,
                               w.local_size if staged else w.size)
        n_bad = int(allreduce_array(w.comm, [len(bad)], timeout=w.timeout,
                                    what="dataset checksum verdict")[0])
        if n_bad:
            detail = f" ({', '.join(bad[:3])})" if bad else ""
            raise DataError(f"{self.data.path}: {n_bad} block(s) fail their CRC-32 check"
                            f"{detail}; the file is corrupt, re-create it with `hpctrain prepare`")

    def _allreduce(self, values, what: str) -> np.ndarray:
        return allreduce_array(self.world.comm, values, timeout=self.world.timeout, what=what)

    def _batch(self, split: str, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.data.submit(self._load, split, np.array(starts, dtype=np.int64))
        return self._to_device(*self.data.wait(rows, f"reading {split} data"))

    def _train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's rows, read by the reader thread while the previous step computed;
        the next step's read is queued now (the sampler is a pure function of the step)."""
        pending, self._next_batch = self._next_batch, None
        if pending is None or pending[0] != step:  # the first step, or a resumed one
            pending = (step, self.data.submit(self._load_train, step))
        if step + 1 < self.cfg.train.max_iters:
            self._next_batch = (step + 1, self.data.submit(self._load_train, step + 1))
        return self._to_device(*self.data.wait(pending[1], "the training batch"))

    def _load_train(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # In the reader thread, the only user of self.sampler. Every rank reads as many
        # rows, so the collective reads need not agree on a count first.
        g = self.grid
        return self._load("train", self.sampler.local_starts(step, g.dp_index, g.dp),
                          uniform=True)

    def _load(self, split: str, starts: np.ndarray, uniform: bool = False):
        tokens = torch.from_numpy(self.data.reader.read(split, starts, self.block + 1,
                                                        uniform=uniform))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device.type == "cuda":
            x, y = x.pin_memory().to(self.device, non_blocking=True), \
                y.pin_memory().to(self.device, non_blocking=True)
        return x, y

    def _log(self, line: str, bar: Progress | None = None) -> None:
        if not self.log_enabled:
            return
        if bar is not None and bar.enabled:
            bar.write(line)
        else:
            print(line, flush=True)

    # ---------------------------------------------------------------- the step
    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step; returns (this rank's mean loss, grad norm, data seconds)."""
        lr = learning_rate(step, self.cfg.optim, self.cfg.train.max_iters)
        t0 = time.perf_counter()
        x, y = self._train_batch(step)
        data_s = time.perf_counter() - t0
        scale = self.dp.grad_scale / self.micro
        if self.pipe is not None:
            loss_sum = self._pipeline_step(x, y, scale)
        else:
            loss_sum = torch.zeros((), device=self.device)
            for m in range(self.micro):
                rows = slice(m * self.rows_per_micro, (m + 1) * self.rows_per_micro)
                self.dp.prepare_for_backward(sync=m == self.micro - 1)
                with nvtx_range("forward"):
                    loss = self.model(x[rows], y[rows])
                with nvtx_range("backward"):
                    (loss * scale).backward()
                loss_sum += loss.detach()
            self.dp.finish()
        norm = self._optimizer_step(lr)
        self.dp.zero_grad()
        return loss_sum / self.micro, norm, data_s

    def _pipeline_step(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        """Every micro-batch through the pipeline, then one gradient reduction over the
        data-parallel axis. Returns the summed loss (zero except on the last stage)."""
        self.dp.prepare_for_backward(sync=False)  # accumulate over the micro-batches
        # Bucket reductions start from the hooks of the stage's last backward pass (with
        # one chunk per stage every bucket fills then; interleaved chunks whose last
        # pass came earlier are launched by finish()).
        loss_sum = self.pipe.train_step(
            x.split(self.rows_per_micro), y.split(self.rows_per_micro), scale,
            before_last_backward=lambda: self.dp.prepare_for_backward(sync=True))
        self.dp.finish()
        return loss_sum if loss_sum is not None else torch.zeros((), device=self.device)

    def _optimizer_step(self, lr: float):
        """Clip to the global norm and update; returns the norm before clipping.

        The norm is the same number on every rank (it is computed after the reduction),
        so a NaN or inf anywhere is seen everywhere and every rank decides alike."""
        clip = self.cfg.optim.grad_clip
        norm = self.dp.grad_norm() if self.zero else global_grad_norm(self.dp.grad_tensors())
        if self.pipe is not None:  # the stages hold disjoint parameters: add the squares
            squares = allreduce_array(self.grid.pp_comm, [float(norm) ** 2],
                                      timeout=self.world.timeout, what="gradient norm over "
                                      "pipeline stages")
            norm = torch.tensor(float(squares[0]) ** 0.5)
        if not math.isfinite(float(norm)):
            self._skip_nonfinite(float(norm))
            return norm  # skip: no update (zero_grad follows)
        self._nonfinite_in_row = 0
        if self.zero:
            self.dp.step(lr, clip, norm=float(norm))
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if clip > 0:
                clip_grads_(self.dp.grad_tensors(), clip, norm)
            with nvtx_range("optimizer"):
                self.optimizer.step()
        if self.pipe is not None:
            self.pipe.tie_weights()
        return norm

    def _skip_nonfinite(self, norm: float) -> None:
        """A NaN/inf gradient norm (the same on every rank): abort, or skip the update,
        but not forever: a diverged model makes every step non-finite."""
        t = self.cfg.train
        self.nonfinite_steps += 1
        self._nonfinite_in_row += 1
        if t.on_nonfinite == "abort":
            raise NonFiniteError(
                f"the gradient norm is {norm} (a NaN or inf loss or gradient); "
                "lower --optim.lr, keep --optim.grad_clip on, check the data, or pass "
                "--train.on_nonfinite=skip to skip such steps")
        if self._nonfinite_in_row >= t.max_skipped_steps:
            latest = self.out_dir / "checkpoints"
            kept = (f"the last good checkpoint ({latest}) is kept: resume from it with a "
                    "lower --optim.lr" if (latest / "latest").is_file()
                    else "no checkpoint was written; restart with a lower --optim.lr")
            raise NonFiniteError(
                f"{self._nonfinite_in_row} steps in a row had a NaN or inf gradient norm "
                f"(--train.max_skipped_steps={t.max_skipped_steps}): training has diverged; "
                f"{kept}")

    def memory(self):
        """Per-rank bytes of parameters, gradients, optimizer state and comm buffers."""
        return self.dp.memory() if self.zero else self.dp.memory(self.optimizer)

    # -------------------------------------------------------------- evaluation
    @torch.no_grad()
    def estimate_val_loss(self) -> float:
        """Mean loss over ``eval_iters`` fixed global batches of the validation split."""
        g = self.grid
        self.model.eval()
        local = 0.0
        for k in range(self.cfg.train.eval_iters):
            x, y = self._batch("val", self.eval_sampler.local_starts(k, g.dp_index, g.dp))
            local += self._eval_loss(x, y) or 0.0
        self.model.train()
        total = self._allreduce([local / self.cfg.train.eval_iters], "validation estimate")
        return float(total[0]) / g.dp  # one loss per replica (its last stage)

    def _eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """Mean loss of a batch; None on the pipeline stages that do not hold the loss."""
        if self.pipe is None:
            return self.model(x, y).item()
        loss = self.pipe.forward_loss(x, y)
        return None if loss is None else loss.item()

    @torch.no_grad()
    def full_val_loss(self, stop: StopAgreement | None = None) -> float | None:
        """Token-weighted loss over every non-overlapping window of the validation split;
        None when ``stop`` reports a signal (checked before each forward pass: the
        evaluation can take longer than a scheduler's grace period)."""
        g = self.grid
        self.model.eval()
        starts = all_windows(self.data.splits["val"].n_tokens, self.block)
        mine = np.array_split(starts, g.dp)[g.dp_index]
        # Every rank runs the same number of forward passes (ZeRO-3 gathers parameters
        # inside forward, collectively); a rank out of windows runs one and ignores it.
        most = -(-len(starts) // g.dp)
        total, count = 0.0, 0
        for i in range(0, most, FULL_EVAL_ROWS):
            if stop is not None and stop.now("final evaluation"):
                self.model.train()
                return None
            rows = mine[i:i + FULL_EVAL_ROWS]
            x, y = self._batch("val", rows if len(rows) else starts[:1])
            loss = self._eval_loss(x, y)
            if len(rows) and loss is not None:
                total += loss * y.numel()
                count += y.numel()
        self.model.train()
        sums = self._allreduce([total, count], "final validation loss")
        return float(sums[0] / sums[1])

    # ---------------------------------------------------------------- the loop
    def fit(self) -> TrainResult:
        """Train, evaluate and write the outputs; then release everything (``close``).
        On an error only this process's own holds are let go (the lock, the signal
        handlers): the collective releases could wait for a rank that failed."""
        try:
            result = self._fit()
        except BaseException:
            self._release_own()
            raise
        self.close()
        return result

    def _fit(self) -> TrainResult:
        cfg, w, t = self.cfg, self.world, self.cfg.train
        result = TrainResult()
        self._log(f"hpctrain: {w.describe()}; {torch.get_num_threads()} thread(s) per rank")
        for note in self.lock.notes:
            self._log(f"out_dir: {note}")
        if self.pipe is not None:
            self._log(f"pipeline: {self.grid.describe()}, {cfg.parallel.schedule} schedule, "
                      f"{cfg.parallel.virtual_stages} chunk(s) per stage, layers "
                      f"{self.model.chunk_layers}")
        summed = (f" summed by {self.dp.transport}" if self.grid.dp > 1 and not self.zero
                  else "")
        self._log(f"model: {self.n_params / 1e6:.2f}M parameters, "
                  f"{len(self.dp.buckets)} gradient bucket(s){summed}, "
                  f"ZeRO stage {cfg.parallel.zero}, "
                  f"{t.dtype}; global batch {t.batch_size} x "
                  f"{self.block} tokens = {self.rows_per_rank} row(s) per rank in "
                  f"{self.micro} micro-batch(es)")
        if self.start_step:
            self._log(f"resumed from the checkpoint of step {self.start_step}")
        stop = self._stop = StopAgreement(w.comm, self.signals, w.timeout, t.stop_check_steps)
        if stop.now("start-up"):  # a signal while the job was setting up
            result.stopped_at = self.start_step
            kept = (f"the checkpoint of step {self.start_step} is unchanged"
                    if self.start_step else "nothing was trained")
            self._log(f"stopped by {self.signals.name} during start-up; {kept}")
            return result
        bar = Progress(t.max_iters - self.start_step, "train",
                       enabled=self.log_enabled and t.progress)
        start = time.perf_counter()
        self._loop(result, bar, stop)
        bar.close()
        self.finish_pending_save()
        result.wall_s = time.perf_counter() - start
        train_time = sum(result.step_times)
        steps_run = len(result.step_times)
        result.tokens_per_s = self.tokens_per_step * steps_run / train_time if train_time else 0.0
        if result.stopped_at is not None:
            self.save_sharded(result.stopped_at)
            self._log(f"stopped by {self.signals.name} after step {result.stopped_at}; "
                      "checkpoint saved; run the same command with --train.resume=auto to "
                      "continue")
            return result
        # The checkpoint first: a signal during the final evaluation, final.h5 or the
        # sample then costs only those extras.
        if t.save_checkpoint:
            self.save_sharded(t.max_iters)
        if stop.now("after training"):
            return self._stopped_after_training(result, "the final evaluation")
        if t.final_eval:
            result.final_val_loss = self.full_val_loss(stop)
            if result.final_val_loss is None:
                return self._stopped_after_training(result, "the final evaluation")
            self.metrics.write({"step": t.max_iters, "final_val_loss": result.final_val_loss})
            self._log(f"final validation loss over the whole split: {result.final_val_loss:.4f}")
            if stop.now("after the final evaluation"):
                return self._stopped_after_training(result, "final.h5 and the sample")
        self._finish(result)
        return result

    def _stopped_after_training(self, result: TrainResult, skipped: str) -> TrainResult:
        """A signal after the last step: make sure the final checkpoint exists, skip the
        rest (collective)."""
        t = self.cfg.train
        if not t.save_checkpoint:
            self.save_sharded(t.max_iters)
        result.stopped_at = t.max_iters
        self._log(f"stopped by {self.signals.name} after the last step ({t.max_iters}); its "
                  f"checkpoint is saved; skipped: {skipped} (run the same command with "
                  "--train.resume=auto to finish)")
        return result

    def _loop(self, result: TrainResult, bar: Progress, stop: StopAgreement) -> None:
        t, w = self.cfg.train, self.world
        window_losses: list[torch.Tensor] = []
        window_t0, window_steps = time.perf_counter(), 0
        for step in range(self.start_step, t.max_iters):
            t0, comm0, bubble0 = time.perf_counter(), self.dp.stats.wait_s, self._bubble_s()
            try:
                loss, norm, d = self.train_step(step)
            except CommTimeout as e:  # say where the job was when it stopped
                raise CommTimeout(f"step {step + 1}: {e}") from None
            result.step_times.append(time.perf_counter() - t0)
            result.data_times.append(d)
            result.comm_times.append(self.dp.stats.wait_s - comm0)
            result.bubble_times.append(self._bubble_s() - bubble0)
            if step == self.start_step:
                self._log(f"memory per rank: {self.memory().describe()}", bar)
            window_losses.append(loss)
            window_steps += 1
            done = step + 1
            stopping = stop.agreed(done)  # the same answer on every rank
            is_eval = t.eval_interval > 0 and done % t.eval_interval == 0 and not stopping
            is_ckpt = (t.ckpt_interval > 0 and done % t.ckpt_interval == 0
                       and done < t.max_iters and not stopping)
            if (done % t.log_interval and not (is_eval or is_ckpt or stopping)
                    and done != t.max_iters):
                bar.update(1)
                continue
            # Log step: one small collective turns every step's local loss since the last
            # log into the mean over the whole global batch.
            self.finish_pending_save()
            elapsed = time.perf_counter() - window_t0
            local = torch.stack(window_losses).double().cpu().numpy()
            # Each replica's last stage holds its loss; the other stages add zeros.
            global_losses = self._allreduce(local, "loss reduction") / self.grid.dp
            result.losses.extend(global_losses.tolist())
            tok_s = self.tokens_per_step * window_steps / elapsed
            window = slice(-window_steps, None)  # this log window's steps
            record = self._record(done, float(global_losses[-1]), tok_s, elapsed / window_steps,
                                  float(norm), *(statistics.fmean(times[window]) for times in (
                                      result.data_times, result.comm_times,
                                      result.bubble_times)))
            if is_eval:
                record["val_loss"] = result.val_losses[done] = self.estimate_val_loss()
                self._log(f"step {done}: val loss {record['val_loss']:.4f}", bar)
            self.metrics.write(record)
            bar.update(1, self._bar_text(record), force=True)
            window_losses, window_steps = [], 0
            if stopping:
                result.stopped_at = done
                return
            if is_ckpt and self._nonfinite_in_row:
                # Mid-way through non-finite steps the model may be what diverged: keep
                # the last good checkpoint as the one to resume from.
                self._log(f"step {done}: checkpoint skipped (the last {self._nonfinite_in_row} "
                          "step(s) were non-finite)", bar)
            elif is_ckpt:
                self.save_sharded(done, background=t.ckpt_background)
            window_t0 = time.perf_counter()

    def _bubble_s(self) -> float:
        return self.pipe.stats.bubble_s if self.pipe is not None else 0.0

    def _record(self, step, loss, tok_s, step_s, norm, data_s, wait_s, bubble_s) -> dict:
        tflops = self.flops_per_token * tok_s / self.world.size / 1e12
        return {"step": step, "loss": loss,
                "lr": learning_rate(step - 1, self.cfg.optim, self.cfg.train.max_iters),
                "tokens_per_s": tok_s, "step_ms": step_s * 1e3, "grad_norm": norm,
                "tflops_per_device": tflops,
                "mfu": tflops / self.peak if self.peak else None,
                "data_ms": data_s * 1e3, "comm_wait_ms": wait_s * 1e3,
                "bubble_ms": bubble_s * 1e3, "skipped_steps": self.nonfinite_steps}

    @staticmethod
    def _bar_text(r: dict) -> str:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        skipped = f" | skipped {r['skipped_steps']}" if r["skipped_steps"] else ""
        return (f"loss {r['loss']:.4f} | {r['tokens_per_s'] / 1e3:.1f}k tok/s | "
                f"{r['tflops_per_device']:.3f} TFLOP/s/dev | MFU {mfu}{skipped}")

    def _finish(self, result: TrainResult) -> None:
        t = self.cfg.train
        # Collective parts first (ZeRO consolidates shards and gathers parameters on every
        # rank); then rank 0 writes.
        state = full_model = None
        if self.pipe is not None:
            # The stages are put together on rank 0 for final.h5 (parameters only) and
            # the sample.
            if t.save_checkpoint or t.sample_tokens > 0:
                full_model = self._gather_pipeline()
            if t.save_checkpoint and full_model is not None:
                state = ({n: p.detach() for n, p in full_model.named_parameters()}, None)
        elif t.save_checkpoint:
            state = self._consolidated_state()
        memory = self.memory()
        # The largest rank's peak is what has to fit on a node's share of memory.
        peak_rss = int(allreduce_array(self.world.comm, [peak_rss_bytes()], op=MPI.MAX,
                                       timeout=self.world.timeout, what="peak memory")[0])
        timing = self._timing(result)
        # ZeRO-3 samples from gathered parameters (every rank gathers, rank 0 samples).
        gather = self.zero and t.sample_tokens > 0
        with self.dp.gathered() if gather else contextlib.nullcontext():
            if self.world.is_root:
                self._write_outputs(result, state, memory, peak_rss, timing,
                                    full_model if full_model is not None else self.model)

    def close(self) -> None:
        """Release communicators, file handles, the metrics log, the signal handlers and
        the out_dir lock (every rank; a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._stop is not None:
                self._stop.close()
            self.dp.close()
            self.data.close()
            self.metrics.close()
        finally:
            self._release_own()

    def _release_own(self) -> None:
        if self._own_signals:
            self.signals.restore()
        self.lock.release()

    def save_sharded(self, step: int, background: bool = False) -> Path | None:
        """Every rank writes its shard of ``<out_dir>/checkpoints/step_<step>`` (collective).
        In the background, the checkpoint is published by ``finish_pending_save``."""
        self.finish_pending_save()
        pending = begin_save(
            self.out_dir / "checkpoints", step, model=self.model, engine=self.dp,
            optimizer=self.optimizer, world=self.world, config=self.cfg.to_dict(),
            model_shape=model_shape(self.gpt_cfg), keep=self.cfg.train.ckpt_keep,
            tokenizer=self.data.tokenizer.meta(), background=background, grid=self.grid)
        if background:
            self._pending_save = pending
            return None
        path = pending.finish()
        self._log(f"checkpoint: {path}")
        return path

    def finish_pending_save(self) -> None:
        """Publish a background checkpoint (collective: every rank at the same step)."""
        if self._pending_save is not None:
            pending, self._pending_save = self._pending_save, None
            self._log(f"checkpoint: {pending.finish()}")

    def _consolidated_state(self):
        if not self.zero:
            return replicated_state(self.model, self.optimizer)
        full = self.dp.consolidated_state()
        params = {name: s.pop("param") for name, s in full.items()}
        return params, full

    def _gather_pipeline(self) -> GPT | None:
        """The whole model on rank 0, put together from the stages (None elsewhere)."""
        # The fp32 master weights (ZeRO keeps them apart from bf16 compute parameters);
        # consolidating ZeRO state is collective over the data-parallel ranks.
        mine = ({n: s["param"] for n, s in self.dp.consolidated_state().items()} if self.zero
                else dict(self.model.named_parameters()))
        params = gather_parameters(mine, self.grid, self.world.timeout)
        if params is None:
            return None
        model = GPT(self.gpt_cfg)
        model.load_state_dict({**params, "lm_head.weight": params["wte.weight"]})
        return model.to(self.device)

    def _timing(self, result: TrainResult) -> dict:
        """Step-time summary, with each time share averaged over the ranks (pipeline
        stages wait differently: the first stage idles at the end of a step, the last
        at the start). Collective."""
        timing = summarize(result.step_times, result.data_times, result.comm_times,
                           result.bubble_times)
        keys = ("compute", "comm", "bubble", "data")
        local = [timing.get("shares", {}).get(k, 0.0) for k in keys]
        mean = self._allreduce(local, "time shares") / self.world.size
        if timing:
            timing["shares"] = dict(zip(keys, map(float, mean)))
        return timing

    def _write_outputs(self, result: TrainResult, state, memory, peak_rss: int, timing: dict,
                       model: torch.nn.Module) -> None:
        t = self.cfg.train
        summary = {
            "steps": t.max_iters, "world_size": self.world.size,
            "final_val_loss": result.final_val_loss, "wall_s": result.wall_s,
            "tokens_per_s": result.tokens_per_s,
            "step_ms_median": 1e3 * statistics.median(result.step_times) if result.step_times else None,
            "timing": timing,
            "peak_rss_bytes_max_rank": peak_rss,
            "flops_per_token": self.flops_per_token, "peak_tflops": self.peak,
            "params": self.n_params, "memory_per_rank": memory.to_dict(),
            "grid": {"dp": self.grid.dp, "pp": self.grid.pp},
            "skipped_steps": self.nonfinite_steps,
            "config": self.cfg.to_dict()}
        if state is not None:
            path = save_checkpoint(self.out_dir / "final.h5", *state, step=t.max_iters,
                                   config=self.cfg.to_dict(),
                                   tokenizer=self.data.tokenizer.meta())
            self._log(f"checkpoint: {path}")
        if t.sample_tokens > 0:
            text = self.sample(t.sample_prompt, t.sample_tokens, model=model)
            (self.out_dir / "sample.txt").write_text(text)
            self._log(f"sample ({t.sample_tokens} tokens):\n{text}")
        (self.out_dir / "summary.json").write_text(json.dumps(finite_record(summary), indent=1))
        self._log(f"done: {t.max_iters} steps in {result.wall_s:.1f} s, "
                  f"{result.tokens_per_s / 1e3:.1f}k tokens/s; outputs in {self.out_dir}/")

    def sample(self, prompt: str, n_tokens: int, seed: int = 0,
               model: torch.nn.Module | None = None) -> str:
        model = self.model if model is None else model
        tok = self.data.tokenizer
        ids = torch.tensor(tok.encode(prompt or "\n").astype(np.int64), device=self.device)[None]
        gen = torch.Generator(device=self.device).manual_seed(seed)
        model.eval()
        out = model.generate(ids, n_tokens, temperature=0.8, top_k=50, generator=gen)
        model.train()
        return tok.decode(out[0].tolist())
