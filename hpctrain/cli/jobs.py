"""``hpctrain jobscript`` (a PBS/SLURM job script for a system) and ``hpctrain launch``
(inside a job: the system's launch line, run). Both take the hpctrain command the job
runs after ``--``; ``hpctrain/jobs/`` does the work, without torch or mpi4py."""

from __future__ import annotations

import argparse
import os
import sys

from hpctrain.errors import UserError

JOB_EPILOG = ("Everything after '--' is the hpctrain command the job runs: "
              "train RECIPE [--section.key=value ...].")


def add_jobscript(sub) -> None:
    p = sub.add_parser(
        "jobscript", help="write a PBS/SLURM job script for Polaris, Aurora, ... or any cluster",
        description="Render a job script for SYSTEM that runs `hpctrain train ...` on its "
                    "nodes: directives, module setup, CPU/GPU binding, GPU-aware MPI, a run "
                    "directory with the job's records, and the launch line. Queue limits "
                    "are checked before anything is written.",
        usage="hpctrain jobscript --system NAME [--nodes N] [--walltime HH:MM:SS] [--queue Q] "
              "[--account A] [options] [--output FILE] -- train RECIPE [overrides]",
        epilog=JOB_EPILOG + " Example: hpctrain jobscript --system polaris --nodes 2 "
               "--walltime 00:30:00 --queue debug --account MyProject --output job.sh "
               "-- train default --data.path=datasets/stdlib-char.h5")
    p.add_argument("--system", metavar="NAME", help="polaris, aurora, perlmutter, frontier, "
                   "pbs, slurm, local, or the path of your own system file (.toml)")
    p.add_argument("--list-systems", action="store_true",
                   help="show every system with its queues and limits, then exit")
    p.add_argument("--nodes", type=int, metavar="N", help="nodes to request (default 1)")
    p.add_argument("--walltime", metavar="HH:MM:SS")
    p.add_argument("--queue", metavar="Q", help="queue (PBS), QOS (Perlmutter) or partition")
    p.add_argument("--account", metavar="A", help="project/allocation to charge")
    p.add_argument("--job-name", metavar="NAME", help="job name (default hpctrain)")
    p.add_argument("--filesystems", nargs="+", metavar="FS",
                   help="filesystems the job needs, e.g. home:eagle (default: the system's)")
    p.add_argument("--env", action="extend", nargs="+", default=[], metavar="KEY=VAL",
                   help="export KEY=VAL in the job (overrides the system's value)")
    p.add_argument("--array", metavar="SPEC", help="job array, e.g. 0-7 or 0-31%%8; "
                   "'{array_index}' in an override becomes the sub-job's index")
    _add_profiler(p, "run local rank 0 of each node under Nsight Systems; reports go to "
                     "<run dir>/nsys/")
    p.add_argument("--ranks-per-node", type=int, metavar="N",
                   help="default: the system's (one per GPU or tile)")
    p.add_argument("--srun-mpi", metavar="PLUGIN", help="srun's --mpi= plugin on the "
                   "generic slurm system: pmi2, pmix, ... (default auto: chosen in the job "
                   "for the MPI library mpi4py loads)")
    p.add_argument("--venv", metavar="DIR", help="virtual environment to activate after the "
                   "module setup (default: the active one; 'none' for none; ~/ allowed)")
    p.add_argument("--setup", metavar="FILE", help="replace the system's module setup with "
                   "the commands in FILE (one per line; each must succeed)")
    p.add_argument("--run-root", metavar="DIR",
                   help="where the run directory <job name>/ is made (default: runs, under "
                        "the submit dir)")
    p.add_argument("--run-dir", metavar="DIR",
                   help="the run directory itself (default: <run root>/<job name>); every "
                        "submission of the script continues the run there; with --array "
                        "put {array_index} in it")
    p.add_argument("--stop-exit-code", type=int, metavar="N",
                   help="the job's exit status when training stopped early (signal, time "
                        "limit) with a checkpoint saved (default 75, which Slurm sites can "
                        "requeue on; 0 lets an afterok chain go on)")
    p.add_argument("--no-queue-check", action="store_true",
                   help="skip the queue limit checks (if the site changed its limits)")
    p.add_argument("--doctor", action="store_true", help="a job that runs `hpctrain doctor` "
                   "on the nodes instead of training (the same as '-- doctor')")
    p.add_argument("--output", "-o", metavar="FILE", help="write the script here "
                   "(atomically, executable) instead of printing it")


def add_launch(sub) -> None:
    p = sub.add_parser(
        "launch", help="inside a job: build the system's mpiexec/srun line and run it",
        description="Detect the batch system (PBS_JOBID, SLURM_JOB_ID, or none), read the "
                    "node count, build the launch line for the system, print it and run it. "
                    "Returns the launcher's exit status.",
        usage="hpctrain launch [--system NAME] [--dry-run] [options] -- train RECIPE [overrides]",
        epilog=JOB_EPILOG + " Without a batch system: `mpiexec -n <ranks>` on this machine, "
               "one rank per CPU core unless --ranks says otherwise.")
    p.add_argument("--system", metavar="NAME", help="default: $HPCTRAIN_SYSTEM (set by job "
                   "scripts), else pbs, slurm or local after the detected batch system")
    p.add_argument("--dry-run", action="store_true", help="print the launch line, run nothing")
    p.add_argument("--nodes", type=int, metavar="N",
                   help="node count (default: from the allocation; lets --dry-run preview)")
    p.add_argument("--ranks-per-node", type=int, metavar="N")
    p.add_argument("--ranks", type=int, metavar="N", help="ranks on this machine (local only)")
    p.add_argument("--srun-mpi", metavar="PLUGIN", help="srun's --mpi= plugin (default: the "
                   "system's; auto chooses it for the MPI library mpi4py loads)")
    _add_profiler(p, "run local rank 0 under nsys")


def _add_profiler(p, help: str) -> None:
    p.add_argument("--profiler", choices=["nsys"], help=help)
    # The old name, read this release: elsewhere "profile" was a system.
    p.add_argument("--profile", choices=["nsys"], dest="old_profile", help=argparse.SUPPRESS)


def _profiler(args) -> str | None:
    if args.old_profile:
        from hpctrain.config.loading import deprecation_line

        print(deprecation_line("--profile", "--profiler"), file=sys.stderr)
    return args.profiler or args.old_profile


def cmd_jobscript(args, command: list[str]) -> int:
    from hpctrain.jobs.job_system import describe_systems
    from hpctrain.jobs.render import SUBMIT, render, run_dir_text, write_script
    from hpctrain.jobs.spec import build_spec

    if args.list_systems:
        print(describe_systems())
        return 0
    if args.doctor:
        if command and command[0] != "doctor":
            raise UserError("--doctor runs `hpctrain doctor` instead of a command: drop "
                            f"'-- {' '.join(command)}'")
        command = command or ["doctor"]
    spec = build_spec(system=args.system, command=command, nodes=args.nodes,
                      walltime=args.walltime, queue=args.queue, account=args.account,
                      job_name=args.job_name, filesystems=args.filesystems, env=args.env,
                      array=args.array, profiler=_profiler(args),
                      ranks_per_node=args.ranks_per_node, venv=args.venv,
                      setup_file=args.setup, run_root=args.run_root,
                      check_queue=not args.no_queue_check, srun_mpi=args.srun_mpi,
                      run_dir=args.run_dir, stop_exit_code=args.stop_exit_code)
    text = render(spec)  # validated and rendered in full before anything is written
    for warning in spec.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if not args.output:
        sys.stdout.write(text)
        return 0
    path = write_script(args.output, text)
    p = spec.system
    where = f", queue {spec.queue}" if spec.queue else ""
    when = f", walltime {spec.walltime}" if spec.walltime else ""
    rpn = spec.ranks_per_node or p.launch.ranks_per_node or "one per core"
    print(f"wrote {path}: {p.name}, {spec.nodes} node(s) x {rpn} rank(s){where}{when}")
    print(f"submit it from the directory its relative paths refer to:  "
          f"{SUBMIT[p.batch.scheduler]} {path}")
    result = "jobs/<job id>/doctor.json" if spec.command[0] == "doctor" else "metrics.jsonl"
    print(f"results: {run_dir_text(spec)}/{result} (submitted again, the run continues there)")
    return 0


def cmd_launch(args, command: list[str]) -> int:
    from hpctrain.jobs.command import check_command
    from hpctrain.jobs.job_system import job_system, srun_mpi
    from hpctrain.jobs.launch_line import detect_allocation, plan_launch, run_launch

    check_command(command)
    if args.srun_mpi is not None:
        srun_mpi(args.srun_mpi)
    alloc = detect_allocation()
    system = args.system or os.environ.get("HPCTRAIN_SYSTEM") or \
        {"pbs": "pbs", "slurm": "slurm", "none": "local"}[alloc.scheduler]
    argv = plan_launch(job_system(system), alloc, command, nodes=args.nodes,
                       ranks_per_node=args.ranks_per_node, ranks=args.ranks,
                       profiler=_profiler(args), srun_mpi=args.srun_mpi)
    return run_launch(argv, dry_run=args.dry_run)
