"""Data-parallel throughput measured the way a user runs it: separate jobs.

Each configuration is its own ``mpiexec`` job of ``hpctrain train`` (or of torch DDP),
one thread per rank, and its speed is the median ``step_ms`` that ``metrics.jsonl``
records after the warm-up steps:

  alone     1 rank, per-rank batch b
  pair      two independent 1-rank jobs started together: what the two cores give two
            processes, the ceiling of any data-parallel scheme
  dp2       hpctrain, 2 ranks, global batch 2b
  ddp2      torch DDP (gloo), 2 ranks, the same model, data and fused AdamW

The configurations take turns within a round (their order rotates from round to
round), so drift of the machine spreads over all of them. Efficiency = tok/s(dp2) /
tok/s(pair); weak scaling = tok/s(dp2) / (2 x tok/s(alone)). ``summary.json`` of the
``alone`` and ``dp2`` jobs gives the per-phase breakdown (``timing.phases_ms``).

    python perf/bench_dp.py --end-to-end ...   (runs this beside the in-process figures)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (ROOT, launch_env, mpiexec, run_worker, scratch_dir,  # noqa: E402
                         spread, worker_args)

CONFIGS = ("alone", "pair", "dp2", "ddp2")
# model -> (steps per job, warm-up steps left out)
STEPS = {"shakespeare-char": (300, 50), "gpt-10M": (25, 10)}
LOG_INTERVAL = 5


def train_command(overrides: list[str], ranks: int, out_dir: str) -> list[str]:
    return mpiexec(ranks, sys.executable, "-m", "hpctrain", "train", "shakespeare-char",
                   *overrides, f"--train.out_dir={out_dir}",
                   f"--train.log_interval={LOG_INTERVAL}")


def _start(cmd: list[str]) -> subprocess.Popen:
    env = launch_env(OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 1200) -> None:
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(proc.args)} failed:\n{out[-3000:]}")


def _job_figures(out_dir: str, warmup: int) -> dict:
    """Median step_ms over the log windows after the warm-up, and the phase breakdown."""
    records = [json.loads(line) for line in Path(out_dir, "metrics.jsonl").read_text()
               .splitlines() if line.strip()]
    steps = [r["step_ms"] for r in records if "step_ms" in r and r["step"] > warmup]
    summary = json.loads(Path(out_dir, "summary.json").read_text())
    return {"step_ms": statistics.median(steps),
            "phases_ms": summary["timing"].get("phases_ms", {})}


def _hpctrain_jobs(overrides_for, ranks: list[int], warmup: int) -> list[dict]:
    """Start one ``hpctrain train`` job per entry of ``ranks`` at once; their figures."""
    dirs = [scratch_dir(f"e2e-{n}") for n in ranks]
    procs = [_start(train_command(overrides_for(n), n, d)) for n, d in zip(ranks, dirs)]
    for p in procs:
        _finish(p)
    return [_job_figures(d, warmup) for d in dirs]


def ddp_worker(out: Path, overrides: list[str], steps: int) -> None:
    from mpi4py import MPI

    from hpctrain.parallel.optim import build_optimizer, param_groups
    from perf.common import torch_ddp_step_times

    times = torch_ddp_step_times(overrides + [f"--train.max_iters={steps}"],
                                 lambda m, cfg: build_optimizer(
                                     param_groups(m, cfg.optim.weight_decay), cfg.optim))
    every = MPI.COMM_WORLD.gather(times, root=0)
    if MPI.COMM_WORLD.rank == 0:
        out.write_text(json.dumps({"step_s": [max(t) for t in zip(*every)]}))


def measure(name: str, overrides_for, tokens_per_rank_step: int, rounds: int,
            quick: bool = False) -> dict:
    """``overrides_for(ranks)``: the ``--section.key=value`` list of a job of that many
    ranks (the global batch grows with them); ``tokens_per_rank_step``: b x T."""
    steps, warmup = STEPS[name]
    if quick:
        steps, warmup = max(3 * LOG_INTERVAL, steps // 10), LOG_INTERVAL
    runs: list[dict] = []
    for r in range(rounds):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        tok, phases = {}, {}
        for config in order:
            t0 = time.perf_counter()
            if config == "ddp2":
                res = run_worker(2, __file__, [json.dumps(overrides_for(2)), str(steps)],
                                 retries=1)  # gloo teardown: retry
                step_ms = 1e3 * statistics.median(res["step_s"][warmup:])
                tok[config] = 2 * tokens_per_rank_step / (step_ms / 1e3)
            else:
                ranks = {"alone": [1], "pair": [1, 1], "dp2": [2]}[config]
                jobs = _hpctrain_jobs(lambda n: overrides_for(n) + [
                    f"--train.max_iters={steps}"], ranks, warmup)
                tok[config] = sum(n * tokens_per_rank_step / (j["step_ms"] / 1e3)
                                  for n, j in zip(ranks, jobs))
                if config in ("alone", "dp2"):
                    phases[config] = jobs[0]["phases_ms"]
            print(f"  {name} round {r + 1}: {config} {tok[config]:,.0f} tok/s "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        runs.append({"tokens_per_s": tok, "phases_ms": phases,
                     "efficiency": tok["dp2"] / tok["pair"],
                     "weak_scaling": tok["dp2"] / (2 * tok["alone"]),
                     "ceiling": tok["pair"] / (2 * tok["alone"]),
                     "vs_ddp": tok["dp2"] / tok["ddp2"]})
    keys = ("efficiency", "weak_scaling", "ceiling", "vs_ddp")
    return {"steps_per_job": steps, "warmup_steps": warmup, "rounds": len(runs),
            **{k: spread([run[k] for run in runs]) for k in keys},
            "tokens_per_s": {c: spread([run["tokens_per_s"][c] for run in runs])
                             for c in CONFIGS},
            "phases_ms": {c: _median_phases([run["phases_ms"][c] for run in runs])
                          for c in ("alone", "dp2")},
            "runs": runs}


def _median_phases(per_run: list[dict]) -> dict:
    names = per_run[0].keys() if per_run else ()
    return {k: statistics.median(p[k] for p in per_run) for k in names}


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        ddp_worker(out, json.loads(rest[0]), int(rest[1]))
