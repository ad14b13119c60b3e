"""The bodies of ``hpctrain scale run|report|calibrate`` and ``hpctrain plan``.

``hpctrain/cli.py`` only declares the options; the work is here, next to the package
it drives. User errors are ``UserError``s (one message, exit status 2).
"""

from __future__ import annotations

import json
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.scaling.calibrate import calibrate
from hpctrain.scaling.emit import emit_jobs
from hpctrain.scaling.models import model_shape
from hpctrain.scaling.planner import explain, plan, table
from hpctrain.scaling.report import build_report
from hpctrain.scaling.runner import run_study
from hpctrain.scaling.spec import load_study, study_system


def cmd_scale(args) -> int:
    if args.action == "run":
        return _run(args)
    if args.action == "report":
        paths = build_report(args.folder)
        print("wrote " + ", ".join(str(p) for p in paths))
        return 0
    return _calibrate(args)


def _run(args) -> int:
    study = load_study(args.study)
    system = study_system(study)
    if args.jobs:
        for line in emit_jobs(study, args.jobs, system=args.system, account=args.account,
                              queue=args.queue, walltime=args.walltime, venv=args.venv,
                              one_job=args.one_job):
            print(line)
        return 0
    given = [f for f in ("system", "account", "queue", "walltime", "venv") if getattr(args, f)]
    if given or args.one_job:
        raise UserError(f"--{given[0] if given else 'one-job'} is for writing job scripts; add "
                        "--jobs DIR, or drop it to run here")
    out = Path(args.out or f"runs/study-{study.name}")
    recs = run_study(study, out, system=system, launch_system=args.launch_system or "local",
                     quiet_wait_s=args.quiet_wait)
    return 0 if any(r["status"] == "ok" for r in recs) else 1


def _calibrate(args) -> int:
    if args.study:
        study = load_study(args.study)
        shapes = list({p.model.key: p.model for p in study.points}.values())
        dtypes = sorted({p.layout.dtype for p in study.points})
        ranks = args.ranks or sorted({p.layout.ranks for p in study.points} |
                                     {p.layout.dp for p in study.points})
    else:
        shapes, dtypes, ranks = [model_shape(args.model)], ["fp32"], args.ranks or [2, 4]
    out = Path(args.output)
    if not out.parent.is_dir():
        raise UserError(f"--output {out}: directory {out.parent} does not exist")
    result = calibrate(shapes, dtypes, ranks)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def cmd_plan(args) -> int:
    result = plan(system=args.system, nodes=args.nodes, model=args.model,
                  global_batch=args.global_batch, seq_len=args.seq_len, dtype=args.dtype,
                  ranks_per_node=args.ranks_per_node, calibration=args.calibration,
                  recompute=args.recompute, loss_chunk=args.loss_chunk)
    terms = explain(result, args.explain) if args.explain else None  # bad RANK: no table
    print(table(result, top=args.top))
    if terms:
        print()
        print(terms)
    return 0
