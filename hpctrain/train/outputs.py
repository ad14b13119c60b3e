"""The end of a run: ``summary.json``, ``final.h5`` (one file, whole model) and a sample.

The collective parts come first (consolidating ZeRO shards, gathering pipeline stages,
the largest peak memory, averaged time shares); then rank 0 writes. The sample stops
at a signal (``should_stop``, asked before every token): it is then not saved, and the
summary says the run stopped."""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path

import numpy as np

from hpctrain.atomic import temporary_file
from hpctrain.checkpoint.single_file import save_single_file
from hpctrain.comm.small_collectives import allreduce_array
from hpctrain.parallel.pipeline import pass_time_advice, pass_times
from hpctrain.parallel.pipeline.schedules import SPLIT_BACKWARD
from hpctrain.parallel.runner import Runner
from hpctrain.train.metrics import finite_record
from hpctrain.train.result import TrainResult
from hpctrain.train.run_status import FINISHED, STOPPED
from hpctrain.train.timing import (PHASES, peak_rss_bytes, phase_medians, summarize,
                                   warmup_steps)


def write_summary(out_dir: Path, summary: dict) -> None:
    """``<out_dir>/summary.json``, written whole or not at all (non-finite numbers as
    null): the full one at a run's end, or ``run_end.py``'s short one."""
    with temporary_file(out_dir / "summary.json") as tmp:
        tmp.write_text(json.dumps(finite_record(summary), indent=1))


class RunOutputs:
    def __init__(self, cfg, grid, par, tokenizer, facts: dict, log):
        """``facts``: ``params``, ``flops_per_token``, ``peak`` (``metrics.Peak``) for the
        summary; ``log(line)`` prints on rank 0."""
        self.cfg, self.grid, self.par, self.tokenizer = cfg, grid, par, tokenizer
        self.world = grid.world
        self.facts, self.log = facts, log
        self.out_dir = Path(cfg.train.out_dir)
        self.summary_written = False
        """Whether this process wrote the run's full summary.json (rank 0, at the end)."""

    def _sum(self, values, what: str):
        w = self.world
        return allreduce_array(w.comm, values, timeout=w.timeout, what=what)

    def write(self, result: TrainResult, skipped: int, should_stop=None) -> str:
        """Collective: every rank calls it after the last step. Returns what a stop left
        undone on this rank ('the sample'; '' when nothing was)."""
        t, engine, runner = self.cfg.train, self.par.engine, self.par.runner
        state = None
        if t.save_checkpoint or t.sample_tokens > 0:
            state = runner.whole_model_state(engine.consolidated_state())
        memory = engine.memory()
        # Every rank's bytes; the largest peak is what has to fit on a node's share.
        by_rank = self._memory_by_rank(memory)
        timing = self._timing(result)
        passes = self._pass_times(result)
        undone = ""
        # ZeRO-3 samples from gathered parameters (every rank gathers, rank 0 samples).
        with engine.gathered() if t.sample_tokens > 0 else contextlib.nullcontext():
            if self.world.is_root:
                if t.save_checkpoint:
                    self._final_checkpoint(state)
                if t.sample_tokens > 0 and not self._sample(state, should_stop):
                    undone = "the sample"
                self._summary(result, memory, by_rank, timing, skipped, undone, passes)
        return undone

    def _sample(self, state: dict, should_stop) -> bool:
        """Rank 0: generate, print and save the sample; False when a signal cut it short
        (nothing saved)."""
        t = self.cfg.train
        cut = []

        def stop_now() -> bool:  # asked before each token: a True cuts the sample short
            if should_stop is not None and should_stop():
                cut.append(True)
            return bool(cut)

        text = self.par.runner.whole_model(state).complete(
            self.tokenizer, t.sample_prompt, t.sample_tokens, should_stop=stop_now)
        if cut:
            self.log("sample: stopped by a signal before its last token; not saved")
            return False
        (self.out_dir / "sample.txt").write_text(text)
        self.log(f"sample ({t.sample_tokens} tokens):\n{text}")
        return True

    def _final_checkpoint(self, state: dict) -> None:
        params = {n: s["param"] for n, s in state.items()}
        moments = {n: {k: v for k, v in s.items() if k != "param"} for n, s in state.items()}
        path = save_single_file(self.out_dir / "final.h5", params, moments,
                                step=self.cfg.train.max_iters, config=self.cfg.to_dict(),
                                tokenizer=self.tokenizer.meta())
        self.log(f"checkpoint: {path}")

    def _memory_by_rank(self, memory) -> list[dict]:
        """Every rank's model-state bytes (``Memory``) and peak RSS, in rank order: ranks
        differ (pipeline stages hold different layers; ZeRO shards round up)."""
        mine = {**memory.to_dict(), "peak_rss_bytes": peak_rss_bytes()}
        keys = list(mine)
        table = np.zeros((self.world.size, len(keys)), dtype=np.int64)
        table[self.world.rank] = [int(mine[k]) for k in keys]
        table = self._sum(table.ravel(), "memory per rank").reshape(table.shape)
        return [{k: int(v) for k, v in zip(keys, row)} for row in table]

    def _timing(self, result: TrainResult) -> dict:
        """Step-time summary, with each time share averaged over the ranks (pipeline
        stages wait differently: the first stage idles at the end of a step, the last
        at the start)."""
        timing = summarize(result.step_times, result.data_times, result.comm_times,
                           result.bubble_times)
        keys = ("compute", "comm", "bubble", "data")
        local = [timing.get("shares", {}).get(k, 0.0) for k in keys]
        mean = self._sum(local, "time shares") / self.world.size
        if timing:
            timing["shares"] = dict(zip(keys, map(float, mean)))
        # Milliseconds per step of each phase, each rank's median averaged over the ranks.
        mine = phase_medians(result.phases, timing.get("warmup_steps", 0))
        names = (*PHASES, "step")
        per_rank = self._sum([mine.get(k, 0.0) for k in names], "phase times")
        if mine:
            timing["phases_ms"] = {k: float(v) / self.world.size
                                   for k, v in zip(names, per_rank)}
        timing["clock"] = self.world.accel.clock.name  # host, or device events
        return timing

    def _pass_times(self, result: TrainResult) -> dict | None:
        """Zero-bubble schedules: the F, B, W times the stages measured after the warm-up
        steps (allocation, compilation) against those the order was built for
        (``pass_time_advice.advice``). Stage 0 does not count: its first chunk has no input
        gradient (B empty, W the whole backward). Collective."""
        par = self.cfg.parallel
        if self.grid.pp == 1 or par.schedule not in SPLIT_BACKWARD:
            return None
        kept = result.phases[warmup_steps(len(result.phases)):]
        # W's seconds hold the gradient hooks' reductions (they fire as W accumulates).
        f, fused, w, hooks = (sum(p[k] for p in kept)
                              for k in ("forward", "backward", "weight", "hooks"))
        mine = [f, fused - w, w - hooks] if self.grid.stage > 0 else [0.0, 0.0, 0.0]
        seen = pass_times.measured(*self._sum(mine, "pass times"))
        if seen is None:
            return None
        runner: Runner = self.par.runner  # a pipeline's: its order_times are set
        rec = pass_time_advice.advice(par.schedule, self.grid.pp, par.micro_batches,
                                      runner.order_times, seen)
        self.log(pass_time_advice.advice_line(par.schedule, rec))
        return rec

    def _summary(self, result: TrainResult, memory, by_rank: list[dict], timing: dict,
                 skipped: int, undone: str, passes: dict | None) -> None:
        t = self.cfg.train
        steps = result.step_times
        summary = {
            "status": STOPPED if undone else FINISHED, **({"skipped": undone} if undone else {}),
            "steps": t.max_iters, "world_size": self.world.size,
            "final_val_loss": result.final_val_loss, "wall_s": result.wall_s,
            "tokens_per_s": result.tokens_per_s,
            "step_ms_median": 1e3 * statistics.median(steps) if steps else None,
            "timing": timing,
            "peak_rss_bytes_max_rank": max(r["peak_rss_bytes"] for r in by_rank),
            "flops_per_token": self.facts["flops_per_token"],
            "peak_tflops": self.facts["peak"].tflops, "peak": self.facts["peak"].to_dict(),
            "params": self.facts["params"], "memory_per_rank": memory.to_dict(),
            "memory_by_rank": by_rank,
            "grid": {"dp": self.grid.dp, "pp": self.grid.pp, "tp": self.grid.tp,
                     "cp": self.grid.cp, "ep": self.grid.ep,
                     "sequence_parallel": self.cfg.parallel.sequence_parallel},
            "skipped_steps": skipped,
            **({"pipeline_pass_times": passes} if passes else {}),
            **({"changed_on_resume": self.facts["changed_on_resume"]}
               if self.facts.get("changed_on_resume") else {}),
            "config": self.cfg.to_dict()}
        write_summary(self.out_dir, summary)
        self.summary_written = True
        self.log(f"done: {t.max_iters} steps in {result.wall_s:.1f} s, "
                 f"{result.tokens_per_s / 1e3:.1f}k tokens/s; outputs in {self.out_dir}/")
