"""The training loop: batches -> runner.train_step -> engine.step -> metrics / eval /
checkpoint; how the run ends (finished or stopped) is ``run_end.py``'s.

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
from hpctrain.comm.world import Threads, World, choose_threads
from hpctrain.config import Config, check_layout
from hpctrain.data.loader import BatchLoader
from hpctrain.errors import CommTimeout
from hpctrain.model.gpt import GPT
from hpctrain.parallel.parallelize import parallelize, sequence_parts
from hpctrain.parallel.pipeline.schedules import SPLIT_BACKWARD
from hpctrain.progress import Progress
from hpctrain.train.deadline import Deadline
from hpctrain.train.evaluate import Evaluator
from hpctrain.train.expert_load import ExpertLoad
from hpctrain.train.metrics import MetricsLog, device_peak
from hpctrain.train.nonfinite import NonFiniteGuard
from hpctrain.train.outputs import RunOutputs
from hpctrain.train.result import (LogWindow, TrainResult, add_steps, bar_text, logs_step,
                                   step_record)
from hpctrain.train.run_end import RunEnd
from hpctrain.train.rundir import claim_run_dir
from hpctrain.train.saving import CheckpointSaver
from hpctrain.train.schedule import learning_rate
from hpctrain.train.start import load_starting_point
from hpctrain.train.stop import SignalFlag, StopAgreement
from hpctrain.train.tensorboard import ScalarSinks
from hpctrain.train.trace import StepTrace


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
        # Refused on every rank alike, before anything is written (packages, traced steps).
        self._sinks, self._traced = ScalarSinks.check(cfg), cfg.train.traced_steps
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
        grid = self.grid = ProcessGrid.of_config(world, cfg.parallel)
        self.batches = BatchLoader.open(cfg, world, dp_index=grid.dp_index, dp=grid.dp,
                                        device=world.accel, parts=sequence_parts(grid))
        self.tokenizer = self.batches.tokenizer
        self.gpt_cfg = cfg.model.to_gpt(self.batches.vocab_size)
        torch.manual_seed(t.seed)
        # On the host, the same on every rank; parallelize() keeps this rank's part.
        self.par = parallelize(GPT(self.gpt_cfg), self.grid, cfg)
        self.model, self.engine, self.runner = self.par.model, self.par.engine, self.par.runner
        self.micro = cfg.parallel.micro_batches
        self.expert_load = ExpertLoad(self.model, self.gpt_cfg, world, copies=grid.tp)
        self.clock = world.accel.clock  # host time on the CPU, device events on a GPU
        self.evaluator = Evaluator(self.model, self.runner, self.batches, world, t,
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
        self.start = load_starting_point(cfg, self.out_dir, self.engine, self.grid, self.runner,
                                         self.gpt_cfg.shape(), self.tokenizer.meta())
        self.trace = StepTrace(self._traced, self.out_dir, world, self._log, self.start.step)
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", enabled=world.is_root,
                                  resumed_at=self.start.step)
        self.scalars = self._sinks.open(world.is_root, self.start.step, self._log)
        self._segment = {"started_at": 0.0, "start_step": self.start.step}  # set by _fit
        self._t0 = time.perf_counter()
        facts = {"params": self.gpt_cfg.num_params(),
                 "flops_per_token": self.gpt_cfg.flops_per_token(), "peak": self.peak,
                 "changed_on_resume": list(self.start.changed)}
        outputs = RunOutputs(cfg, self.grid, self.par, self.tokenizer, facts, self._log)
        self.end = RunEnd(cfg, world, signals=self.signals, saver=self.saver,
                          evaluator=self.evaluator, outputs=outputs, log=self._log)
        self.finished_before = self.end.finished_before(self.start.step)
        if not self.finished_before:
            self.lock.notes.append(self.end.begin_attempt())

    def _log(self, line: str, bar: Progress | None = None) -> None:
        if self.log_enabled and bar is not None and bar.enabled:
            bar.write(line)
        elif self.log_enabled:
            print(line, flush=True)

    # ---------------------------------------------------------------- the step
    def train_step(self, step: int) -> tuple[torch.Tensor, float]:
        """One optimizer step; returns (this rank's mean loss, grad norm).
        The norm is the same number on every rank; a NaN or inf one skipped the update."""
        with self.clock.span("data"):
            x, y = self.batches.train(step)
        engine = self.engine
        loss_sum = self.runner.train_step(x.chunk(self.micro), y.chunk(self.micro),
                                          engine.grad_scale / self.micro,
                                          engine.prepare_for_backward)
        engine.finish()
        with self.clock.span("optimizer"):
            norm = engine.step(learning_rate(step, self.cfg.optim, self.cfg.train.max_iters),
                               self.cfg.optim.grad_clip)
        self.runner.tie_weights()
        engine.zero_grad()
        self.guard.check(float(norm))
        return loss_sum / self.micro, norm

    def memory(self):  # per-rank bytes of parameters, gradients, optimizer state, buffers
        return self.engine.memory()

    # ---------------------------------------------------------------- the loop
    def fit(self, close: bool = True) -> TrainResult:
        """Train, evaluate and write the outputs; then release everything (``close=False``
        keeps the communicators for a caller that inspects the run, and closes it). On an
        error status.json says so and only this process's own holds (the lock, the signal
        handlers) are let go: the collective releases could wait for a rank that failed."""
        try:
            result = self._fit()
        except BaseException as exc:
            self.end.failed(exc)  # status.json: how the run ended, whatever ended it
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
        for note in filter(None, self.lock.notes):
            self._log(f"out_dir: {note}")
        for part in (self.model.tensor_parallel, self.runner, self.par.fp8):
            if part is not None and part.describe():
                self._log(part.describe())
        if t.compile and self.grid.pp > 1 and cfg.parallel.schedule in SPLIT_BACKWARD:
            self._log("note: a compiled block's backward is one autograd node that B and W "
                      "cannot split: B runs it whole and W again (about twice the blocks' "
                      "backward); zero-bubble schedules gain most without --train.compile")
        self._log(f"model: {self.gpt_cfg.parameters_text()}, "
                  f"{self.engine.describe()}, {t.dtype}; global batch {t.batch_size} x "
                  f"{cfg.model.block_size} tokens = {t.batch_size // self.grid.dp} row(s) "
                  f"per rank in {self.micro} micro-batch(es)")
        self._log(f"data: {self.batches.describe()}")
        peak = self.peak
        self._log(f"MFU against {peak.tflops:g} TFLOP/s per device x {peak.devices} device(s): "
                  f"{peak.why}" if peak.tflops else f"MFU: not reported ({peak.why})")
        if self.start.describe():
            self._log(self.start.describe())

    def _fit(self) -> TrainResult:
        t = self.cfg.train
        result = TrainResult()
        self._announce()
        if self.finished_before:
            self._log(f"nothing to do: {self.out_dir} holds this run, finished at step "
                      f"{t.max_iters}; raise --train.max_iters to train on")
            return result
        stop = self._stop = StopAgreement(self.world.comm, self.signals, self.world.timeout,
                                          t.stop_check_steps, self.deadline)
        if stop.now("start-up"):  # a signal while the job was setting up
            return self.end.stopped_during_start_up(result, self.start.step, self.metrics)
        bar = Progress(t.max_iters - self.start.step, "train",
                       enabled=self.log_enabled and t.progress)
        start = time.perf_counter()
        self._segment["started_at"], self._t0 = round(time.time(), 3), start
        self._loop(result, bar, stop)  # ends at a log step: every step's phases are read
        bar.close()
        self.saver.finish_pending(end=True)
        result.wall_s = time.perf_counter() - start
        train_time, steps_run = sum(result.step_times), len(result.step_times)
        self.trace.close(self.start.step + steps_run)  # stopped inside the traced steps
        result.tokens_per_s = self.tokens_per_step * steps_run / train_time if train_time else 0.0
        if result.stopped_at is not None:
            return self.end.stopped_in_training(result)
        return self.end.finish(result, stop, self.guard.skipped, self._write_record)

    def _loop(self, result: TrainResult, bar: Progress, stop: StopAgreement) -> None:
        t, w = self.cfg.train, self.world
        window = LogWindow(w, self.grid.loss_ranks, self.clock, self.deadline)
        self.deadline.record_startup()
        for step in range(self.start.step, t.max_iters):
            self.trace.before(step + 1)
            self.clock.start()
            try:
                loss, norm = self.train_step(step)
            except CommTimeout as e:  # say where the job was when it stopped
                raise CommTimeout(f"step {step + 1}: {e}") from None
            add_steps(result, self.clock.stop(), self.deadline)
            self.trace.after(step + 1)
            self.saver.poll()  # publishes an asynchronous save once every rank wrote it
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
            if not logs_step(done, t, evaluates=is_eval, saves=is_ckpt, stops=stopping):
                bar.update(1)
                continue
            last, n, elapsed, means = window.flush(result)
            record = step_record(done, last, learning_rate(done - 1, self.cfg.optim, t.max_iters),
                                 self.tokens_per_step * n / elapsed, elapsed / n, float(norm),
                                 *means, flops_per_token=self.gpt_cfg.flops_per_token(),
                                 peak=self.peak, skipped=self.guard.skipped)
            record.update(self.expert_load.take(n))  # collective: every rank logs this step
            if is_eval:
                val = self.evaluator.estimate(stop)  # None: the ranks agreed on a stop in it
                stopping = val is None
                if not stopping:
                    record["val_loss"] = result.val_losses[done] = val
                    self._log(f"step {done}: val loss {val:.4f}", bar)
            self._write_record(record)
            bar.update(1, bar_text(record), force=True)
            if is_ckpt and self.guard.in_row:
                # Mid-way through non-finite steps the model may be what diverged: keep
                # the last good checkpoint as the one to resume from.
                self._log(f"step {done}: checkpoint skipped (the last {self.guard.in_row} "
                          "step(s) were non-finite)", bar)
            elif is_ckpt:
                self.saver.save(done, asynchronous=t.ckpt_async)
                stopping = stop.now(f"after the checkpoint of step {done}")  # sent during it
            if stopping:
                result.stopped_at = done
                return
            window.restart()

    def _write_record(self, record: dict) -> None:
        """Rank 0: a record into metrics.jsonl and TensorBoard, with what `hpctrain report`
        joins a resumed run's segments by (docs/design/run-report.md)."""
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

