"""The training loop: batches -> runner.train_step -> engine.step -> metrics / eval /
checkpoint / signals.

The trainer only composes. ``parallelize()`` decides how the model is split and how
gradients move (``hpctrain/parallel/``); ``BatchLoader`` reads this rank's rows
(``hpctrain/data/loader.py``); the checkpoint code saves what the engine holds. Every
rank runs this same loop on its share of each global batch; ``World`` is passed in, so
the single-process reference is the same code on ``MPI.COMM_SELF``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.comm.mpi import MPI
from hpctrain.comm.small_collectives import bcast_json
from hpctrain.comm.world import (THREAD_LEVEL_HINT, THREAD_LEVELS, Threads, World,
                                 choose_threads)
from hpctrain.config import Config, check_layout
from hpctrain.data.loader import BatchLoader
from hpctrain.data.mpiio import describe_reader
from hpctrain.errors import CommTimeout
from hpctrain.model.gpt import GPT
from hpctrain.parallel.parallelize import parallelize
from hpctrain.parallel.pipeline.schedules import SPLIT_BACKWARD
from hpctrain.progress import Progress
from hpctrain.train.deadline import Deadline
from hpctrain.train.evaluate import Evaluator
from hpctrain.train.metrics import MetricsLog, device_peak
from hpctrain.train.nonfinite import NonFiniteGuard
from hpctrain.train.outputs import RunOutputs
from hpctrain.train.result import LogWindow, TrainResult, add_step, bar_text, step_record
from hpctrain.train.run_status import (FINISHED, STOPPED, clear_status, read_status,
                                       status_record, write_status)
from hpctrain.train.rundir import claim_run_dir
from hpctrain.train.saving import CheckpointSaver
from hpctrain.train.schedule import learning_rate
from hpctrain.train.start import load_starting_point
from hpctrain.train.stop import SignalFlag, StopAgreement
from hpctrain.train.tensorboard import ScalarLog, summary_writer_class, tensorboard_dir
from hpctrain.train.timing import PhaseClock


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
        # Refused on every rank alike, before anything is claimed or written.
        self._tensorboard = tensorboard_dir(cfg.train.tensorboard, cfg.train.out_dir)
        self._writer_class = summary_writer_class() if self._tensorboard else None
        # Before anything is written: one run per out_dir (rundir.py).
        self.lock = claim_run_dir(Path(cfg.train.out_dir), cfg.train.resume,
                                  cfg.train.overwrite, world)
        try:
            self._build(cfg, world)
        except BaseException:
            self.lock.release()
            raise

    def _build(self, cfg: Config, world: World) -> None:
        t = cfg.train
        self.threads = Threads(t.threads, "--train.threads") if t.threads else \
            choose_threads(world.local_size)
        torch.set_num_threads(self.threads.count)
        self.grid = ProcessGrid.create(world, cfg.parallel.pp, tp=cfg.parallel.tp)
        self.batches = BatchLoader.open(cfg, world, dp_index=self.grid.dp_index,
                                        dp=self.grid.dp, device=world.accel)
        self.tokenizer = self.batches.tokenizer
        self.gpt_cfg = cfg.model.to_gpt(self.batches.vocab_size)
        torch.manual_seed(t.seed)
        # On the host, the same on every rank; parallelize() keeps this rank's part.
        self.par = parallelize(GPT(self.gpt_cfg), self.grid, cfg)
        self.model, self.engine, self.runner = self.par.model, self.par.engine, self.par.runner
        self.micro = cfg.parallel.micro_batches
        self.clock = PhaseClock(self.runner, self.engine)
        self.evaluator = Evaluator(self.model, self.runner, self.batches, world, t.eval_iters,
                                   self.grid.loss_ranks)
        self.tokens_per_step = t.batch_size * cfg.model.block_size
        self.peak = device_peak(world.accel.name, t.dtype, tf32=t.tf32,
                                accelerator=world.accel.is_accelerator,
                                override=t.peak_tflops, devices=world.devices)
        self.out_dir = Path(t.out_dir)
        self.guard = NonFiniteGuard(t.on_nonfinite, t.max_skipped_steps,
                                    self.out_dir / "checkpoints")
        self.deadline = Deadline.from_config(t.time_limit)  # the walltime's, if known
        self.saver = CheckpointSaver(
            self.out_dir / "checkpoints", self.engine, self.grid,
            {"config": cfg.to_dict(), "model": self.gpt_cfg.shape(),
             "tokenizer": self.tokenizer.meta()}, t.ckpt_keep, self._log,
            on_saved=self.deadline.record_save)
        self.start = load_starting_point(t, self.out_dir, self.engine, self.grid, self.runner,
                                         self.gpt_cfg.shape(), self.tokenizer.meta())
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", enabled=world.is_root,
                                  append=self.start.step > 0)
        self.scalars = ScalarLog(self._tensorboard if world.is_root else None,
                                 self._writer_class)
        self._segment = {"started_at": 0.0, "start_step": self.start.step}  # set by _fit
        self._t0 = time.perf_counter()
        self.finished_before = self._finished_before()
        if world.is_root and not self.finished_before:
            clear_status(self.out_dir)  # this run's end will say how it went

    def _finished_before(self) -> bool:
        """A resumed run whose checkpoint is its last step and whose status says it
        finished: a requeued or resubmitted job of a finished run has nothing to do
        (collective: rank 0 reads the status, every rank gets the answer)."""
        t, w = self.cfg.train, self.world
        if t.resume != "auto" or self.start.step != t.max_iters:
            return False
        found = read_status(self.out_dir) if w.is_root else None
        done = bool(found and found.get("status") == FINISHED
                    and found.get("max_iters") == t.max_iters)
        return bool(bcast_json(w.comm, done, timeout=w.timeout, what="the run's status"))

    def _log(self, line: str, bar: Progress | None = None) -> None:
        if not self.log_enabled:
            return
        if bar is not None and bar.enabled:
            bar.write(line)
        else:
            print(line, flush=True)

    # ---------------------------------------------------------------- the step
    def train_step(self, step: int) -> tuple[torch.Tensor, float]:
        """One optimizer step; returns (this rank's mean loss, grad norm).
        The norm is the same number on every rank; a NaN or inf one skipped the update."""
        with self.clock.timing("data"):
            x, y = self.batches.train(step)
        engine = self.engine
        loss_sum = self.runner.train_step(x.chunk(self.micro), y.chunk(self.micro),
                                          engine.grad_scale / self.micro,
                                          engine.prepare_for_backward)
        engine.finish()
        with self.clock.timing("optimizer"):
            norm = engine.step(learning_rate(step, self.cfg.optim, self.cfg.train.max_iters),
                               self.cfg.optim.grad_clip)
        self.runner.tie_weights()
        engine.zero_grad()
        self.guard.check(float(norm))
        return loss_sum / self.micro, norm

    def memory(self):
        """Per-rank bytes of parameters, gradients, optimizer state and comm buffers."""
        return self.engine.memory()

    # ---------------------------------------------------------------- the loop
    def fit(self, close: bool = True) -> TrainResult:
        """Train, evaluate and write the outputs; then release everything (``close``;
        ``close=False`` keeps the communicators for a caller that inspects the run and
        closes it). On an error only this process's own holds are let go (the lock, the
        signal handlers): the collective releases could wait for a rank that failed."""
        try:
            result = self._fit()
        except BaseException:
            self._release_own()
            raise
        if close:
            self.close()
        return result

    def _announce(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        self._log(f"hpctrain: {self.world.describe()}; {torch.get_num_threads()} thread(s) "
                  f"per rank ({self.threads.why})")
        for note in self.metrics.notes:
            self._log(f"metrics.jsonl: {note}")
        for note in self.lock.notes:
            self._log(f"out_dir: {note}")
        for part in (self.model.tensor_parallel, self.runner):
            if part is not None and part.describe():
                self._log(part.describe())
        if t.compile and self.grid.pp > 1 and cfg.parallel.schedule in SPLIT_BACKWARD:
            self._log("note: a compiled block's backward is one autograd node that B and W "
                      "cannot split: B runs it whole and W again (about twice the blocks' "
                      "backward); zero-bubble schedules gain most without --train.compile")
        rows = t.batch_size // self.grid.dp
        self._log(f"model: {self.gpt_cfg.num_params() / 1e6:.2f}M parameters, "
                  f"{self.engine.describe()}, {t.dtype}; global batch {t.batch_size} x "
                  f"{cfg.model.block_size} tokens = {rows} row(s) per rank in {self.micro} "
                  "micro-batch(es)")
        self._log(f"data: {describe_reader(self.batches.data.reader)}"
                  f"{self._reader_thread_note()}")
        peak = self.peak
        self._log(f"MFU against {peak.tflops:g} TFLOP/s per device x {peak.devices} device(s): "
                  f"{peak.why}" if peak.tflops else f"MFU: not reported ({peak.why})")
        if self.start.describe():
            self._log(self.start.describe())

    def _reader_thread_note(self) -> str:
        """Why batches are read in the main thread when prefetching was asked for: the
        background reader calls MPI-IO beside training's MPI, which needs MULTIPLE."""
        if not self.cfg.data.prefetch or self.batches.data.threaded:
            return ""
        level = THREAD_LEVELS.get(MPI.Query_thread(), "?")
        return (f"; read in the main thread, not in the background: MPI thread level "
                f"{level}, not multiple ({THREAD_LEVEL_HINT})")

    def _fit(self) -> TrainResult:
        t = self.cfg.train
        result = TrainResult()
        self._announce()
        if self.finished_before:
            self._log(f"nothing to do: {self.out_dir} holds this run, finished at step "
                      f"{t.max_iters}; raise --train.max_iters to train on")
            return result
        w = self.world
        stop = self._stop = StopAgreement(w.comm, self.signals, w.timeout, t.stop_check_steps,
                                          self.deadline)
        if stop.now("start-up"):  # a signal while the job was setting up
            return self._stopped_during_start_up(result)
        bar = Progress(t.max_iters - self.start.step, "train",
                       enabled=self.log_enabled and t.progress)
        start = time.perf_counter()
        self._segment["started_at"], self._t0 = round(time.time(), 3), start
        self._loop(result, bar, stop)
        bar.close()
        self.saver.finish_pending()
        result.wall_s = time.perf_counter() - start
        train_time = sum(result.step_times)
        steps_run = len(result.step_times)
        result.tokens_per_s = self.tokens_per_step * steps_run / train_time if train_time else 0.0
        if result.stopped_at is not None:
            self.saver.save(result.stopped_at)
            self._log(f"stopped by {self.signals.name} after step {result.stopped_at}; "
                      "checkpoint saved; run the same command with --train.resume=auto to "
                      "continue")
            self._record(STOPPED, result.stopped_at)
            return result
        return self._finish(result, stop)

    def _finish(self, result: TrainResult, stop: StopAgreement) -> TrainResult:
        """After the last step: the checkpoint first (a signal during the final
        evaluation, final.h5 or the sample then costs only those extras), then the
        evaluation and the outputs, each skipped at a signal (collective)."""
        t = self.cfg.train
        if t.save_checkpoint:
            self.saver.save(t.max_iters)
        if stop.now("after training"):
            return self._stopped_after_training(result, "the final evaluation")
        if t.final_eval:
            result.final_val_loss = self.evaluator.whole_split(stop)
            if result.final_val_loss is None:
                return self._stopped_after_training(result, "the final evaluation")
            self._write_record({"step": t.max_iters, "final_val_loss": result.final_val_loss})
            self._log(f"final validation loss over the whole split: {result.final_val_loss:.4f}")
            if stop.now("after the final evaluation"):
                return self._stopped_after_training(result, "final.h5 and the sample")
        facts = {"params": self.gpt_cfg.num_params(),
                 "flops_per_token": self.gpt_cfg.flops_per_token(),
                 "peak": self.peak}
        undone = RunOutputs(self.cfg, self.grid, self.par, self.tokenizer, facts,
                            self._log).write(result, self.guard.skipped, stop.local_stop)
        # Only rank 0 samples: every rank learns whether a signal cut the sample short.
        w = self.world
        undone = bcast_json(w.comm, undone, timeout=w.timeout, what="the end of the sample")
        if undone:
            return self._stopped_after_training(result, undone)
        self._record(FINISHED, t.max_iters)
        return result

    def _stopped_during_start_up(self, result: TrainResult) -> TrainResult:
        """A signal before the first step: nothing trained, nothing saved. A fresh run's
        empty metrics.jsonl goes, so that the next attempt starts as this one would
        have."""
        result.stopped_at = step = self.start.step
        kept = (f"the checkpoint of step {step} is unchanged" if step
                else "nothing was trained")
        self._log(f"stopped by {self.signals.name} during start-up; {kept}")
        if self.world.is_root and not step:
            self.metrics.close()
            (self.out_dir / "metrics.jsonl").unlink(missing_ok=True)
        self._record(STOPPED, step)
        return result

    def _stopped_after_training(self, result: TrainResult, skipped: str) -> TrainResult:
        """A signal after the last step: make sure the final checkpoint exists, skip the
        rest (collective)."""
        t = self.cfg.train
        if not t.save_checkpoint:
            self.saver.save(t.max_iters)
        result.stopped_at = t.max_iters
        self._log(f"stopped by {self.signals.name} after the last step ({t.max_iters}); its "
                  f"checkpoint is saved; skipped: {skipped} (run the same command with "
                  "--train.resume=auto to finish)")
        self._record(STOPPED, t.max_iters, skipped)
        return result

    def _record(self, status: str, step: int, skipped: str = "") -> None:
        """Rank 0 writes how the run ended (``run_status.py``)."""
        if self.world.is_root:
            reason = self.signals.cause if status == STOPPED else ""
            write_status(self.out_dir, status_record(status, step, self.cfg.train.max_iters,
                                                     reason, skipped))

    def _loop(self, result: TrainResult, bar: Progress, stop: StopAgreement) -> None:
        t, w = self.cfg.train, self.world
        window = LogWindow(w, self.grid.loss_ranks)
        self.deadline.record_startup()
        for step in range(self.start.step, t.max_iters):
            self.clock.start()
            try:
                loss, norm = self.train_step(step)
            except CommTimeout as e:  # say where the job was when it stopped
                raise CommTimeout(f"step {step + 1}: {e}") from None
            add_step(result, self.clock.stop())
            self.deadline.record_step(result.step_times[-1])
            if step == self.start.step:
                device = w.accel.describe_memory()
                self._log(f"memory per rank: {self.memory().describe()}"
                          f"{'; ' + device if device else ''}", bar)
            window.losses.append(loss)
            done = step + 1
            stopping = stop.agreed(done)  # the same answer on every rank
            is_eval = t.eval_interval > 0 and done % t.eval_interval == 0 and not stopping
            is_ckpt = (t.ckpt_interval > 0 and done % t.ckpt_interval == 0
                       and done < t.max_iters and not stopping)
            if (done % t.log_interval and not (is_eval or is_ckpt or stopping)
                    and done != t.max_iters):
                bar.update(1)
                continue
            self.saver.finish_pending()
            last, n, elapsed, means = window.flush(result)
            record = step_record(done, last, learning_rate(done - 1, self.cfg.optim, t.max_iters),
                                 self.tokens_per_step * n / elapsed, elapsed / n, float(norm),
                                 *means, flops_per_token=self.gpt_cfg.flops_per_token(),
                                 peak=self.peak, skipped=self.guard.skipped)
            if is_eval:
                record["val_loss"] = result.val_losses[done] = self.evaluator.estimate()
                self._log(f"step {done}: val loss {record['val_loss']:.4f}", bar)
            self._write_record(record)
            bar.update(1, bar_text(record), force=True)
            if stopping:
                result.stopped_at = done
                return
            if is_ckpt and self.guard.in_row:
                # Mid-way through non-finite steps the model may be what diverged: keep
                # the last good checkpoint as the one to resume from.
                self._log(f"step {done}: checkpoint skipped (the last {self.guard.in_row} "
                          "step(s) were non-finite)", bar)
            elif is_ckpt:
                self.saver.save(done, background=t.ckpt_background)
            window.restart()

    def _write_record(self, record: dict) -> None:
        """Rank 0: one record into metrics.jsonl (and TensorBoard), with where it sits in
        time: ``elapsed_s`` since this process's first step, ``started_at`` (the Unix
        time of that step) and ``start_step`` (the step it started from). A resumed run
        appends a segment of its own; `hpctrain report` joins segments by these fields
        (docs/design/run-report.md)."""
        record = {**record, "elapsed_s": time.perf_counter() - self._t0, **self._segment}
        self.metrics.write(record)
        self.scalars.write(record)

    # -------------------------------------------------------------- the end
    def close(self) -> None:
        """Release communicators, file handles, the metrics log, the signal handlers and
        the out_dir lock (every rank; a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._stop is not None:
                self._stop.close()
            # Newest first: the engine, the reader, then the grid they were built on.
            self.engine.close()
            self.batches.close()
            self.grid.close()
            self.metrics.close()
        finally:
            self._release_own()

    def _release_own(self) -> None:
        self.scalars.close()  # on an error too: what was logged stays readable
        if self._own_signals:
            self.signals.restore()
        self.lock.release()

