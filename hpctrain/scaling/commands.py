"""The bodies of ``hpctrain scale run|report|calibrate`` and ``hpctrain plan``.

``hpctrain/cli.py`` only declares the options; the work is here, next to the package
it drives. User errors are ``UserError``s (one message, exit status 2).
"""

from __future__ import annotations

import json
from pathlib import Path

from hpctrain.errors import UserError


def data_vocab(study_path: str) -> int | None:
    """The vocabulary of the data a study trains on (for shapes without ``vocab_size``);
    None when the file cannot be read here (e.g. on a login node before staging)."""
    from hpctrain.config import load_config, parse_overrides
    from hpctrain.data.dataset import read_info
    from hpctrain.scaling.spec import tomllib

    try:
        s = tomllib.loads(Path(study_path).read_text()).get("study", {})
        cfg = load_config(s.get("recipe", "default"), parse_overrides(s.get("overrides", [])))
        return read_info(cfg.data.path).vocab_size
    except Exception:  # noqa: BLE001 - the spec check reports what is missing
        return None


def load_for_run(study_path: str, system_name: str | None = None):
    """The study and its (calibrated) performance profile."""
    from hpctrain.scaling.systems import load_perf

    study = _load_uncalibrated(study_path)[0]
    calib = study.calibration if study.calibration and study.calibration.is_file() else None
    if study.calibration and calib is None:
        raise UserError(f"{study_path} names calibration {study.calibration}, which does not "
                        f"exist; make it with `hpctrain scale calibrate {study_path} --output "
                        f"{study.calibration}` or drop the line")
    return study, load_perf(system_name or study.system, calib)


def cmd_scale(args) -> int:
    if args.action == "run":
        return _run(args)
    if args.action == "report":
        from hpctrain.scaling.report import build_report

        paths = build_report(args.folder)
        print("wrote " + ", ".join(str(p) for p in paths))
        return 0
    return _calibrate(args)


def _run(args) -> int:
    study, system = load_for_run(args.study)
    if args.jobs:
        from hpctrain.scaling.emit import emit_jobs

        for line in emit_jobs(study, args.jobs, system=args.system, account=args.account,
                              queue=args.queue, walltime=args.walltime, venv=args.venv,
                              one_job=args.one_job):
            print(line)
        return 0
    given = [f for f in ("system", "account", "queue", "walltime", "venv") if getattr(args, f)]
    if given or args.one_job:
        raise UserError(f"--{given[0] if given else 'one-job'} is for writing job scripts; add "
                        "--jobs DIR, or drop it to run here")
    from hpctrain.scaling.runner import run_study

    out = Path(args.out or f"runs/study-{study.name}")
    recs = run_study(study, out, system=system, launch_system=args.launch_system or "local",
                     quiet_wait_s=args.quiet_wait)
    return 0 if any(r["status"] == "ok" for r in recs) else 1


def _calibrate(args) -> int:
    from hpctrain.scaling.calibrate import calibrate
    from hpctrain.scaling.models import model_shape

    if args.study:
        study, _ = _load_uncalibrated(args.study)
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


def _load_uncalibrated(study_path: str):
    from hpctrain.scaling.spec import load_study
    from hpctrain.scaling.systems import load_perf

    from hpctrain.scaling.spec import tomllib

    try:  # nodes = [...] needs the profile's ranks per node before the points exist
        name = tomllib.loads(Path(study_path).read_text())["study"]["system"]
        rpn = load_perf(name).ranks_per_node or None
    except Exception:  # noqa: BLE001 - load_study reports a broken spec properly
        rpn = None
    study = load_study(study_path, ranks_per_node=rpn, vocab_size=data_vocab(study_path))
    return study, load_perf(study.system)


def cmd_plan(args) -> int:
    from hpctrain.scaling.planner import explain, plan, table

    result = plan(system=args.system, nodes=args.nodes, model=args.model,
                  global_batch=args.global_batch, seq_len=args.seq_len, dtype=args.dtype,
                  ranks_per_node=args.ranks_per_node, calibration=args.calibration)
    terms = explain(result, args.explain) if args.explain else None  # bad RANK: no table
    print(table(result, top=args.top))
    if terms:
        print()
        print(terms)
    return 0
