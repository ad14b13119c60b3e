"""``hpctrain scale run | report | calibrate`` (scaling studies) and ``hpctrain plan``
(parallel arrangements ranked by the performance model); ``hpctrain/scaling/`` does the work."""

from __future__ import annotations

import json
from pathlib import Path

from hpctrain.errors import UserError


def add_scale(sub) -> None:
    p = sub.add_parser("scale", help="scaling studies: run a sweep, report it, calibrate the "
                                     "performance model",
                       description="Scaling studies from a TOML sweep spec (see "
                                   "perf/studies/local.toml): run every point, write one JSON "
                                   "record per run, build a Markdown/HTML report with plots.")
    acts = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    a = acts.add_parser("run", help="run every point of a study (or write job scripts)",
                        description="Run each point with the system's launcher under a time "
                                    "limit; a failed point is recorded and the study goes on. "
                                    "With --jobs DIR nothing runs: job scripts are written.")
    a.add_argument("study", metavar="STUDY.toml")
    a.add_argument("--out", metavar="DIR", help="records and runs go here "
                   "(default: runs/study-<name>)")
    a.add_argument("--launch-system", metavar="NAME", default=None,
                   help="system whose launcher runs the points: local (default), or "
                        "polaris/aurora/... inside a job's allocation")
    a.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                   help="before each run wait up to S seconds until other processes leave "
                        "the cores alone (a shared machine); the busy cores are recorded")
    a.add_argument("--jobs", metavar="DIR", help="write job scripts here instead of running")
    a.add_argument("--one-job", action="store_true", help="with --jobs: one script that runs "
                   "all points on one allocation (the largest point's nodes)")
    for flag, hint in (("--system", "system for --jobs (polaris, aurora, ...)"),
                       ("--account", "project to charge"), ("--queue", "queue"),
                       ("--walltime", "HH:MM:SS per job")):
        a.add_argument(flag, help=hint)
    a.add_argument("--venv", metavar="DIR", help="environment the jobs activate")
    a = acts.add_parser("report", help="tables and plots from a study's records",
                        description="Write DIR/report.md, DIR/report.html and DIR/plots/*.png "
                                    "from DIR/records/*.json.")
    a.add_argument("folder", metavar="DIR")
    a = acts.add_parser("calibrate", help="measure this machine for the performance model",
                        description="Time forward+backward per model shape, AdamW, and the "
                                    "collectives at each rank count (under mpiexec); write a "
                                    "calibration file that studies and plan use.")
    a.add_argument("study", nargs="?", metavar="STUDY.toml",
                   help="calibrate for this study's model shapes, dtype and rank counts")
    a.add_argument("--output", required=True, metavar="FILE.json")
    a.add_argument("--ranks", type=int, nargs="+", metavar="N",
                   help="group sizes for the collectives (default: the study's, else 2 4)")
    a.add_argument("--model", default="default", metavar="NAME",
                   help="model preset to calibrate without a study (default: default)")


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="rank the parallel arrangements of a model on N nodes by "
                                    "predicted step time",
                       description="Enumerate (dp, pp, tp, cp, ep, ZeRO stage, micro-batches) "
                                   "arrangements that fit device memory, predict each step "
                                   "with the performance model and print them fastest first. "
                                   "Fix any part of the layout (--dp --tp --pp --cp --ep --zero "
                                   "--micro-batch --schedule) to plan only around it.")
    p.add_argument("--system", required=True, metavar="NAME",
                   help="polaris, aurora, local, a system file (.toml) with a [perf] table, "
                        "or a folder holding one")
    p.add_argument("--nodes", type=int, required=True, metavar="N")
    p.add_argument("--model", default="", metavar="NAME",
                   help="a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt3-2.7b, "
                        "gpt3-6.7b, gpt3-13b, llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, "
                        "default), a "
                        "model .toml, or a Hugging Face config.json")
    p.add_argument("--shape", default="", metavar="K=V,...",
                   help="any model instead of --model: n_layer=..,n_embd=..,n_head=..,"
                        "n_kv_head=..,ffn=..,vocab=..[,seq=..][,arch=gpt|llama][,experts=..,"
                        "top_k=..,shared=..,moe_ffn=..,moe_every=..]")
    for flag, hint in (("--dp", "data-parallel replicas"), ("--tp", "tensor-parallel ranks "
                       "(inside a node)"), ("--pp", "pipeline stages"),
                       ("--cp", "context-parallel ranks (ring attention)"),
                       ("--ep", "expert-parallel ranks (a mixture of experts' experts spread "
                        "over dp x cp)"),
                       ("--zero", "ZeRO stage 0-3"),
                       ("--micro-batch", "sequences per micro-batch")):
        p.add_argument(flag, type=int, default=None, metavar="N",
                       help=f"fix the {hint} (default: the planner chooses)")
    p.add_argument("--schedule", default=None, metavar="NAME",
                   help="fix the pipeline schedule: 1f1b, interleaved, zb-h1, zbv, gpipe")
    p.add_argument("--global-batch", type=int, default=0, metavar="SEQ",
                   help="sequences per optimizer step (default: 512, GPT-2's, or one per "
                        "rank when there are more ranks)")
    p.add_argument("--seq-len", "--seq", type=int, default=0, metavar="T",
                   help="context length (default: the model's)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--recompute", default="none", choices=["none", "selective", "block"],
                   help="as --model.recompute: block keeps only each layer's input (a third "
                        "more compute); selective keeps the matrix multiplies' outputs and "
                        "recomputes the element-wise work")
    p.add_argument("--recompute-every", type=int, default=0, metavar="N",
                   help="as --model.recompute_every: every N-th block recomputed wholly, the "
                        "others as --recompute says (default 0: none)")
    p.add_argument("--loss-chunk", type=int, default=0, metavar="N",
                   help="as --model.loss_chunk: the head's logits N tokens at a time "
                        "(default 0: automatic, as the trainer; -1: all at once)")
    p.add_argument("--ranks-per-node", type=int, default=0, metavar="N",
                   help="default: the system's (one per GPU or tile)")
    p.add_argument("--collectives", default="auto", choices=["auto", "mpi", "xccl"],
                   help="as --comm.transport: whose links carry the gradients (auto: the "
                        "GPU's library where the system has its figures)")
    p.add_argument("--ckpt-interval", type=int, default=0, metavar="N",
                   help="as --train.ckpt_interval: count a checkpoint every N steps in the "
                        "step time (default 0: not counted)")
    p.add_argument("--ckpt-async", action="store_true",
                   help="as --train.ckpt_async=true: the write overlaps training")
    p.add_argument("--calibration", metavar="FILE.json", help="measured numbers to use")
    p.add_argument("--top", type=int, default=12, metavar="K", help="rows to print")
    p.add_argument("--explain", nargs="?", const=1, type=int, metavar="RANK",
                   help="show the terms of the arrangement ranked RANK (default 1)")


def cmd_scale(args) -> int:
    if args.action == "run":
        return _run(args)
    if args.action == "report":
        from hpctrain.scaling.study_report import build_study_report

        paths = build_study_report(args.folder)
        print("wrote " + ", ".join(str(p) for p in paths))
        return 0
    return _calibrate(args)


def _run(args) -> int:
    from hpctrain.scaling.emit import emit_jobs
    from hpctrain.scaling.runner import run_study
    from hpctrain.scaling.spec import load_study, study_system

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
    from hpctrain.scaling.calibrate import calibrate
    from hpctrain.scaling.models import preset_shape
    from hpctrain.scaling.spec import load_study

    if args.study:
        study = load_study(args.study)
        shapes = list({p.model.key: p.model for p in study.points}.values())
        dtypes = sorted({p.arrangement.dtype for p in study.points})
        ranks = args.ranks or sorted({p.arrangement.ranks for p in study.points} |
                                     {p.arrangement.dp for p in study.points})
    else:
        shapes, dtypes, ranks = [preset_shape(args.model)], ["fp32"], args.ranks or [2, 4]
    out = Path(args.output)
    if not out.parent.is_dir():
        raise UserError(f"--output {out}: directory {out.parent} does not exist")
    result = calibrate(shapes, dtypes, ranks)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def cmd_plan(args) -> int:
    from hpctrain.scaling.checkpoint_cost import Checkpointing
    from hpctrain.scaling.planner import Fixed, explain, plan, table

    fixed = Fixed(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, zero=args.zero,
                  micro_batch=args.micro_batch, schedule=args.schedule)
    result = plan(system=args.system, nodes=args.nodes, model=args.model, shape=args.shape,
                  global_batch=args.global_batch, seq_len=args.seq_len, dtype=args.dtype,
                  ranks_per_node=args.ranks_per_node, calibration=args.calibration,
                  recompute=args.recompute, loss_chunk=args.loss_chunk,
                  collectives=args.collectives, fixed=fixed,
                  recompute_every=args.recompute_every,
                  checkpointing=Checkpointing(args.ckpt_interval, args.ckpt_async))
    terms = explain(result, args.explain) if args.explain else None  # bad RANK: no table
    print(table(result, top=args.top))
    if terms:
        print()
        print(terms)
    return 0
