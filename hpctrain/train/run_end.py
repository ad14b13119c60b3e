"""How a run ends: finished, or stopped by a signal or its time limit (``stop.py``)
during start-up, in the loop or after the last step; each said in rank 0's log and in
``status.json`` (``run_status.py``).

A stop keeps what a resumed run needs: the loop's last step is saved (a periodic
evaluation the stop cut short is abandoned; a stop agreed right after a checkpoint keeps
that one); after the last step the final checkpoint comes first, so a signal during the
final evaluation, ``final.h5`` or the sample costs only those extras. Every method is
collective (every rank calls it at the same point) unless its docstring says otherwise."""

from __future__ import annotations

from pathlib import Path

from hpctrain.comm.small_collectives import bcast_json
from hpctrain.config import write_run_config
from hpctrain.output_paths import RUN_CONFIG, is_run_config
from hpctrain.train.outputs import write_summary
from hpctrain.train.result import TrainResult
from hpctrain.train.run_status import (FAILED, FINISHED, STOPPED, clear_status,
                                       read_status, status_record, write_status)
from hpctrain.train.stop import SignalFlag, StopAgreement


class RunEnd:
    def __init__(self, cfg, world, *, signals: SignalFlag, saver, evaluator, outputs, log):
        """``cfg``: the run's ``Config``; ``saver``: its ``CheckpointSaver``;
        ``evaluator``: its ``Evaluator`` (the final evaluation); ``outputs``: its
        ``RunOutputs`` (summary, ``final.h5``, sample); ``log(line)`` prints on rank 0."""
        self.cfg, self.world, self.signals, self.log = cfg, world, signals, log
        self.saver, self.evaluator, self.outputs = saver, evaluator, outputs
        self.out_dir = Path(cfg.train.out_dir)
        self.start_step = 0
        """The checkpoint step the run started from (``finished_before`` sets it)."""

    def finished_before(self, start_step: int) -> bool:
        """A resumed run whose checkpoint is its last step and whose status says it
        finished: a requeued or resubmitted job of a finished run has nothing to do
        (rank 0 reads the status, every rank gets the answer)."""
        t, w = self.cfg.train, self.world
        self.start_step = start_step
        if t.resume != "auto" or start_step != t.max_iters:
            return False
        found = read_status(self.out_dir) if w.is_root else None
        done = bool(found and found.get("status") == FINISHED
                    and found.get("max_iters") == t.max_iters)
        if done:  # written again: this attempt, too, ended with the run finished
            write_status(self.out_dir, found)
        return bool(bcast_json(w.comm, done, timeout=w.timeout, what="the run's status"))

    def begin_attempt(self) -> str:
        """Rank 0 removes an earlier attempt's status (this run's end will say how it
        went) and writes the run's resolved configuration, ``config.toml`` (local).
        Returns a line for the log ('' when there is nothing to say)."""
        if not self.world.is_root:
            return ""
        clear_status(self.out_dir)
        return write_run_config(self.out_dir, self.cfg)

    def failed(self, exc: BaseException) -> None:
        """Rank 0 records that ``exc`` ended the run (local, on the way out of an error):
        the job script and the next attempt read how it ended and from which checkpoint a
        resume goes on. A failure to write it must not hide ``exc``: it is left out."""
        if not self.world.is_root:
            return
        step = max(self.saver.saved_step or 0, self.start_step)
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
        try:
            self._write(status_record(FAILED, step, self.cfg.train.max_iters, why))
        except Exception:  # a full disk, say: the error that ended the run comes first
            pass

    def stopped_during_start_up(self, result: TrainResult, step: int,
                                metrics) -> TrainResult:
        """A signal before the first step (``step``: the one the run started from):
        nothing trained, nothing saved. A fresh run's empty metrics.jsonl (``metrics``:
        its ``MetricsLog``) and its config.toml go, so that the next attempt starts as
        this one would have."""
        result.stopped_at = step
        kept = (f"the checkpoint of step {step} is unchanged" if step
                else "nothing was trained")
        self.log(f"stopped by {self.signals.name} during start-up; {kept}")
        if self.world.is_root and not step:
            metrics.close()
            (self.out_dir / "metrics.jsonl").unlink(missing_ok=True)
            if is_run_config(self.out_dir / RUN_CONFIG):  # ours, written at the start
                (self.out_dir / RUN_CONFIG).unlink()
        self.record(STOPPED, step, summary=bool(step))  # a fresh run leaves no output
        return result

    def stopped_in_training(self, result: TrainResult) -> TrainResult:
        """The loop stopped after ``result.stopped_at``: save that step, unless the stop
        was agreed right after its checkpoint."""
        step, every = result.stopped_at, self.cfg.train.eval_interval
        if self.saver.saved_step != step:
            self.saver.save(step)
        # The evaluation due at this step, abandoned at the stop (a resumed run goes on
        # from the next step and does not redo it).
        cut = every > 0 and step % every == 0 and step not in result.val_losses
        self.log(f"stopped by {self.signals.name} after step {step}"
                 f"{' (its evaluation abandoned)' if cut else ''}; checkpoint saved; run "
                 "the same command with --train.resume=auto to continue")
        self.record(STOPPED, step)
        return result

    def finish(self, result: TrainResult, stop: StopAgreement, skipped_steps: int,
               write_record) -> TrainResult:
        """After the last step: the checkpoint first, then the evaluation and the
        outputs, each skipped at a signal. ``skipped_steps``: the non-finite steps the
        summary counts; ``write_record(record)`` adds one to metrics.jsonl (rank 0)."""
        t = self.cfg.train
        if t.save_checkpoint:
            self.saver.save(t.max_iters)
        if stop.now("after training"):
            return self.stopped_after_training(result, "the final evaluation")
        if t.final_eval:
            result.final_val_loss = self.evaluator.final_loss(stop)
            if result.final_val_loss is None:
                return self.stopped_after_training(result, "the final evaluation")
            write_record({"step": t.max_iters, "final_val_loss": result.final_val_loss})
            self.log(f"final validation loss {result.final_val_loss:.4f} over "
                     f"{self.evaluator.covered}")
            if stop.now("after the final evaluation"):
                return self.stopped_after_training(result, "final.h5 and the sample")
        undone = self.outputs.write(result, skipped_steps, stop.local_stop)
        # Only rank 0 samples: every rank learns whether a signal cut the sample short.
        w = self.world
        undone = bcast_json(w.comm, undone, timeout=w.timeout, what="the end of the sample")
        if undone:
            return self.stopped_after_training(result, undone)
        self.record(FINISHED, t.max_iters)
        return result

    def stopped_after_training(self, result: TrainResult, skipped: str) -> TrainResult:
        """A signal after the last step: make sure the final checkpoint exists, skip the
        rest (``skipped`` names it)."""
        t = self.cfg.train
        if not t.save_checkpoint:
            self.saver.save(t.max_iters)
        result.stopped_at = t.max_iters
        self.log(f"stopped by {self.signals.name} after the last step ({t.max_iters}); its "
                 f"checkpoint is saved; skipped: {skipped} (run the same command with "
                 "--train.resume=auto to finish)")
        self.record(STOPPED, t.max_iters, skipped)
        return result

    def record(self, status: str, step: int, skipped: str = "", *,
               summary: bool = True) -> None:
        """Rank 0 writes how the run ended (``run_status.py``; local); ``summary``: also
        a short summary.json where the end wrote no full one."""
        if self.world.is_root:
            reason = self.signals.cause if status == STOPPED else ""
            self._write(status_record(status, step, self.cfg.train.max_iters, reason,
                                      skipped), summary)

    def _write(self, record: dict, summary: bool = True) -> None:
        """status.json, and summary.json where the run's end wrote no full one (a stop
        before the end, an error): the record with the run's configuration, so every run
        that ends on its own leaves both."""
        write_status(self.out_dir, record)
        if summary and not self.outputs.summary_written:
            write_summary(self.out_dir, {**record, "world_size": self.world.size,
                                         "config": self.cfg.to_dict()})
