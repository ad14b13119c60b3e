"""``hpctrain scale run STUDY --jobs DIR``: job scripts instead of local runs.

Per point (default): one script per point and repeat, each made by the job generator
(``hpctrain.jobs``), plus ``DIR/submit_all.sh`` and ``DIR/jobs.json`` (job names to
points), so ``hpctrain scale report DIR`` collects the finished runs. One job
(``--one-job``): one script for the largest point's nodes, whose launch is ``hpctrain
scale run STUDY --launch-system SYSTEM``: inside the allocation each point starts with the
system's own launch line on as many nodes as it needs.
Both ways: docs/design/scaling-model.md ("``scale run``").
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.jobs.attempts import latest_attempt
from hpctrain.jobs.render import SUBMIT, render, write_script
from hpctrain.jobs.shell import Var, literal, word
from hpctrain.jobs.spec import build_spec
from hpctrain.scaling import records
from hpctrain.scaling.perfmodel import predict
from hpctrain.scaling.runner import finish_record, new_record, train_command, write_study
from hpctrain.scaling.spec import Study, load_study, study_system


def _command(study: Study, point) -> list[str]:
    """The point's ``train ...`` arguments; the job sets ``--train.out_dir`` itself."""
    return [c for c in train_command(study, point, Path("x"))
            if not c.startswith("--train.out_dir=")]


def study_launch(study: Study, system: str) -> tuple:
    """What a ``--one-job`` script runs: the study runner, which starts each point with
    the system's launch line inside the allocation; records under ``$RUN_DIR/study``."""
    return (word(Var("PYTHON")), *(literal(a) for a in (
        "-m", "hpctrain", "scale", "run", str(study.path.resolve()), "--launch-system",
        system, "--out")), word(Var("RUN_DIR"), "/study"))


def emit_jobs(study: Study, folder: str, *, system: str | None, account: str | None,
              queue: str | None, walltime: str | None, venv: str | None,
              one_job: bool = False) -> list[str]:
    """Write the scripts; return lines to print."""
    if not system:
        raise UserError("--jobs needs --system (polaris, aurora, ...: the system the jobs run on)")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    runs = (out / "runs").resolve()
    common = dict(system=system, walltime=walltime, queue=queue, account=account, venv=venv,
                  run_root=str(runs))
    lines = []
    if one_job:
        nodes = max(p.nodes for p in study.points)
        spec = build_spec(**common, nodes=nodes, command=_command(study, study.points[0]),
                          job_name=f"study-{study.name}"[:63],
                          launch=study_launch(study, system))
        path = write_script(out / f"study-{study.name}.sh", render(spec))
        lines.append(f"wrote {path}: all {len(study.points)} point(s) in one job of {nodes} "
                     f"node(s); submit with {SUBMIT[spec.system.batch.scheduler]} {path}; the "
                     f"study's records land in {runs}/study-{study.name}/study")
        return lines
    index, submit = {}, []
    for i, point in enumerate(study.points):
        for r in range(study.repeats):
            name = f"{study.name}-p{i:03d}r{r}"[:63]
            spec = build_spec(**common, nodes=point.nodes, command=_command(study, point),
                              job_name=name)
            path = write_script(out / f"{name}.sh", render(spec))
            index[name] = {"point": point.id, "index": i, "repeat": r}
            submit.append(f"{SUBMIT[spec.system.batch.scheduler]} "
                          f"{shlex.quote(str(path.resolve()))}")
    (out / "jobs.json").write_text(json.dumps({"study": str(study.path.resolve()),
                                               "jobs": index}, indent=1))
    script = out / "submit_all.sh"
    script.write_text("#!/bin/bash\nset -euo pipefail\n" + "\n".join(submit) + "\n")
    script.chmod(0o755)
    lines.append(f"wrote {len(index)} job script(s) to {out}/ and {script} to submit them; "
                 f"afterwards: hpctrain scale report {out}")
    return lines


def collect(folder: str | Path) -> int:
    """Records for the finished per-point jobs of ``folder`` (from their run directories'
    ``summary.json`` and ``exit_code``); returns how many runs were found."""
    folder = Path(folder)
    index = json.loads((folder / "jobs.json").read_text())
    study = load_study(index["study"])
    system = study_system(study)
    points = {p.id: p for p in study.points}
    if not (folder / "study.json").is_file():
        write_study(study, folder, system, {"git": records.git_state(),
                                            "environment": None, "launch_system": "jobs"})
    found = 0
    for name, job in index["jobs"].items():
        run = folder / "runs" / name
        attempt = latest_attempt(run)
        if attempt is None or job["point"] not in points:
            continue  # not run yet
        point = points[job["point"]]
        found += 1
        rec = new_record(study, point, job["repeat"], job["index"],
                         train_command(study, point, run))
        rec["prediction"] = predict(system, point.model, point.arrangement).to_dict()
        code = attempt / "exit_code"
        rc = int(code.read_text().strip() or 1) if code.is_file() else 1
        log = f"job {name} ({attempt.name}) exited with status {rc}" if code.is_file() else \
            f"job {name} ({attempt.name}) has no exit_code (still running, or killed at " \
            "its walltime)"
        rec = finish_record(rec, run / "summary.json", rc, log, study.timeout_s, system)
        records.write_record(records.record_path(folder, point.id, job["repeat"]), rec)
    return found
