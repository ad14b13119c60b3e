"""Run a study's points one after another on this machine or inside a job's allocation.

Each run is ``hpctrain train`` under the system's launcher (``mpiexec -n N`` here; the
same line a job script would use on Polaris or Aurora, from ``hpctrain.jobs.launch_line``),
wrapped in ``timeout`` so a stuck run cannot hold the study. The model's prediction is
made before the run and stored in its record next to what was measured. A run that fails
or times out is recorded with its error and the study goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.jobs.job_system import job_system
from hpctrain.jobs.launch_line import detect_allocation, plan_launch
from hpctrain.scaling import records
from hpctrain.scaling.perfmodel import predict
from hpctrain.scaling.spec import Point, Study
from hpctrain.scaling.system_perf import SystemPerf

# Study runs measure step time: no evaluation, sampling or checkpoint at the end.
QUIET = ("--train.eval_interval=0", "--train.final_eval=false", "--train.sample_tokens=0",
         "--train.save_checkpoint=false", "--train.progress=false")
KILL_AFTER_S = 10  # after the timeout's SIGTERM, SIGKILL this much later


def train_command(study: Study, point: Point, out_dir: Path) -> list[str]:
    """``train RECIPE --...`` for one point (the launcher goes in front)."""
    m, arr = point.model, point.arrangement
    # Every key of the shape (architecture included), so the run trains what is modelled
    shape = [f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}"
             for k, v in m.gpt.shape().items()]
    cmd = ["train", study.recipe, *study.overrides, *shape,
           f"--train.batch_size={arr.global_batch}", f"--train.max_iters={study.steps}",
           f"--train.log_interval={study.steps}", f"--train.dtype={arr.dtype}",
           f"--parallel.zero={arr.zero}", f"--parallel.micro_batches={arr.micro_batches}",
           *QUIET, f"--train.out_dir={out_dir}"]
    if arr.pp > 1:  # only then: a trainer without pipelines still runs the other points
        cmd += [f"--parallel.pp={arr.pp}", f"--parallel.schedule={arr.schedule}",
                f"--parallel.virtual_stages={arr.virtual_stages}"]
    if arr.tp > 1:
        cmd += [f"--parallel.tp={arr.tp}",
                f"--parallel.sequence_parallel={str(arr.sequence_parallel).lower()}"]
    return cmd


def launch_argv(study: Study, point: Point, command: list[str], launch_system: str) -> list[str]:
    system = job_system(launch_system)
    if system.batch.scheduler == "none":
        return plan_launch(system, detect_allocation({}), command, ranks=point.arrangement.ranks)
    return plan_launch(system, detect_allocation(), command, nodes=point.nodes)


def _error_text(log: str, rc: int, timed_out: bool, timeout_s: float) -> str:
    if timed_out:
        return f"timed out after {timeout_s:.0f} s (timeout_s in [study])"
    lines = [ln for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):  # the trainer's one-line user error, if there is one
        if ln.startswith("error:") or "Error" in ln:
            return f"exit status {rc}: {ln.strip()[:500]}"
    return f"exit status {rc}: {lines[-1][:500] if lines else 'no output'}"


def run_point(study: Study, point: Point, repeat: int, index: int, folder: Path,
              system: SystemPerf | None, launch_system: str, env: dict) -> dict:
    out = folder / "runs" / f"{point.id}-r{repeat}"
    if out.exists():
        shutil.rmtree(out)  # a rerun must not read the previous run's summary
    out.mkdir(parents=True)
    command = train_command(study, point, out)
    record = new_record(study, point, repeat, index, command)
    if system is not None:
        pred = predict(system, point.model, point.arrangement)
        record["prediction"] = pred.to_dict()
    argv = ["timeout", "-k", str(KILL_AFTER_S), str(int(study.timeout_s))] + \
        launch_argv(study, point, command, launch_system)
    record["launch"] = argv
    t0 = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                timeout=study.timeout_s + 2 * KILL_AFTER_S).returncode
        except subprocess.TimeoutExpired:  # timeout(1) itself hung: should not happen
            rc = 124
        except FileNotFoundError as e:
            raise UserError(f"cannot start {e.filename!r}: the launcher (mpiexec) and "
                            "`timeout` must be on PATH") from None
    record["wall_s"] = time.perf_counter() - t0
    text = (out / "log.txt").read_text(errors="replace") if rc else ""
    return finish_record(record, out / "summary.json", rc, text, study.timeout_s, system)


def finish_record(record: dict, summary_path: Path, rc: int, log: str, timeout_s: float,
                  system: SystemPerf | None) -> dict:
    """Fill in what a run measured (``summary.json``), or its error."""
    if rc == 0 and summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        peak = system.peak_flops.get(record["config"]["dtype"]) if system else None
        record.update(status="ok", error=None,
                      measured=records.from_summary(summary, peak_flops=peak))
    else:
        rc = rc or 1  # exit 0 without a summary is a failure too
        record.update(status="failed", returncode=rc, measured=None,
                      error=_error_text(log, rc, rc in (124, 137), timeout_s))
    return record


def new_record(study: Study, point: Point, repeat: int, index: int, command: list) -> dict:
    return {"schema": records.SCHEMA, "study": study.name, "point": point.id,
          "index": index, "repeat": repeat, "series": point.series(),
          "parallel": point.parallel, "scaling": study.scaling,
          "config": {"model": {**point.model.fields(), "params": point.model.params},
                     "ranks": point.arrangement.ranks, "nodes": point.nodes,
                     "dp": point.arrangement.dp, "pp": point.arrangement.pp,
                     "tp": point.arrangement.tp,
                     "sequence_parallel": point.arrangement.sequence_parallel,
                     "zero": point.arrangement.zero,
                     "micro_batches": point.arrangement.micro_batches,
                     "micro_batch_rows": point.arrangement.micro_rows,
                     "global_batch": point.arrangement.global_batch,
                     "seq_len": point.model.block_size, "dtype": point.arrangement.dtype,
                     "schedule": point.arrangement.schedule,
                     "virtual_stages": point.arrangement.virtual_stages,
                     "steps": study.steps},
          "started": records.now(), "command": command}


def run_study(study: Study, folder: str | os.PathLike, *, system: SystemPerf | None,
              launch_system: str = "local", stream=None, threads: int = 1,
              quiet_wait_s: float = 0.0) -> list[dict]:
    """Run every point ``repeats`` times; write a record per run; return the records."""
    stream = stream or sys.stderr
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shared = {"git": records.git_state(), "environment": records.environment(),
              "launch_system": launch_system}
    write_study(study, folder, system, shared)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))  # one thread per rank: ranks share cores
    runs = [(p, r) for p in study.points for r in range(study.repeats)]
    out, t_start = [], time.perf_counter()
    _say(stream, f"study {study.name}: {len(study.points)} point(s) x {study.repeats} "
                 f"repeat(s) = {len(runs)} run(s), {study.steps} steps each; records in "
                 f"{folder}/records")
    for k, (point, r) in enumerate(runs):
        index = study.points.index(point)
        background = _wait_quiet(quiet_wait_s, stream)
        rec = run_point(study, point, r, index, folder, system, launch_system, env)
        rec.update(shared, background_busy_cores=background)
        records.write_record(records.record_path(folder, point.id, r), rec)
        out.append(rec)
        elapsed = time.perf_counter() - t_start
        eta = elapsed / (k + 1) * (len(runs) - k - 1)
        _say(stream, f"[{k + 1}/{len(runs)}] {point.id} r{r}: {_outcome(rec)} "
                     f"({rec['wall_s']:.1f} s; study {elapsed:.0f} s, ~{eta:.0f} s left)")
    failed = sum(r["status"] != "ok" for r in out)
    _say(stream, f"study {study.name}: {len(out) - failed} run(s) ok, {failed} failed, "
                 f"{time.perf_counter() - t_start:.0f} s; report: hpctrain scale report {folder}")
    return out


QUIET_CORES = 0.3
"""Below this many cores busy with other work the machine counts as quiet."""


def _wait_quiet(limit_s: float, stream) -> float | None:
    """Busy cores of other processes before a run; wait up to ``limit_s`` for them to go."""
    busy = records.busy_cores()
    deadline = time.monotonic() + limit_s
    said = False
    while busy is not None and busy > QUIET_CORES and time.monotonic() < deadline:
        if not said:
            _say(stream, f"  waiting for a quiet machine ({busy:.1f} core(s) busy with "
                         f"other work; up to {limit_s:.0f} s)")
            said = True
        time.sleep(2.0)
        busy = records.busy_cores()
    return busy


def _outcome(rec: dict) -> str:
    if rec["status"] != "ok":
        return f"FAILED: {rec['error']}"
    m = rec["measured"]
    text = f"{m['step_ms_median']:.1f} ms/step, {m['tokens_per_s'] / 1e3:.1f}k tok/s"
    pred = rec.get("prediction")
    if pred:
        p = pred["step_s"] * 1e3
        text += f" (predicted {p:.1f} ms, {100 * (p / m['step_ms_median'] - 1):+.0f}%)"
    return text


def write_study(study: Study, folder: Path, system: SystemPerf | None, shared: dict) -> None:
    meta = {"name": study.name, "description": study.description, "scaling": study.scaling,
            "spec": str(study.path), "spec_text": study.path.read_text(),
            "ranks": list(study.ranks), "nodes": list(study.nodes) if study.nodes else None,
            "steps": study.steps, "repeats": study.repeats, "system": study.system,
            "calibration": str(study.calibration) if study.calibration else None,
            "calibration_data": (json.loads(study.calibration.read_text())
                                 if study.calibration and study.calibration.is_file() else None),
            "system_source": system.source if system else None,
            "points": [p.id for p in study.points],
            "skipped": [{"point": a, "reason": b} for a, b in study.skipped],
            "started": records.now(), **shared}
    (folder / "study.json").write_text(json.dumps(meta, indent=1))


def _say(stream, line: str) -> None:
    stream.write(line + "\n")
    stream.flush()
