"""``hpctrain`` command line: prepare, train, sample, ckpt, jobscript, launch, scale, plan,
doctor, report.

    hpctrain prepare --corpus stdlib --output datasets/stdlib-char.h5
    mpiexec -n 4 hpctrain train default --train.max_iters=200
    hpctrain sample --checkpoint runs/default --prompt "def "
    hpctrain ckpt import --from hf models/gpt2 --output ckpt/gpt2    # then --train.init_from
    hpctrain jobscript --system polaris --nodes 2 --walltime 00:30:00 --queue debug \
        --account PROJECT --output job.sh -- train default
    hpctrain launch --dry-run -- train default        # inside a PBS/SLURM job
    hpctrain scale run perf/studies/local.toml && hpctrain scale report runs/study-local
    hpctrain plan --system polaris --nodes 64 --model gpt2-xl
    mpiexec -n 4 hpctrain doctor --json doctor.json   # check a node before training
    hpctrain report runs/default                        # plots and an HTML page of a run

``COMMANDS`` maps each name to its parser and handler in its family's module, which
imports torch and mpi4py only inside the handler; a user's error is one message, exit 2.
Why, and the families: docs/design/layers.md.
"""

from __future__ import annotations

import argparse
import sys

from hpctrain.cli.ckpt import add_ckpt, cmd_ckpt
from hpctrain.cli.doctor import add_doctor, cmd_doctor
from hpctrain.cli.jobs import add_jobscript, add_launch, cmd_jobscript, cmd_launch
from hpctrain.cli.prepare import add_prepare, cmd_prepare
from hpctrain.cli.report import add_report, cmd_report
from hpctrain.cli.scaling import add_plan, add_scale, cmd_plan, cmd_scale
from hpctrain.cli.train import add_sample, add_train, cmd_sample, cmd_train
from hpctrain.comm.world_check import LaunchMismatch
from hpctrain.errors import EXIT_USER_ERROR, UserError

OVERRIDES = "overrides"
"""The words argparse does not know are the command's ``--section.key=value`` options."""
AFTER_DASHES = "after --"
"""The words after ``--`` are the hpctrain command a job runs, split off before argparse."""


class Command:
    """A subcommand: ``declare(subparsers)`` adds its parser (options and help); ``run``
    handles it and returns the exit status: ``run(args)``, or ``run(args, words)`` when
    the command takes ``words`` (OVERRIDES or AFTER_DASHES; None: a word argparse does not
    know is an error). A plain class, not a dataclass: every command line imports this
    module, and ``dataclasses`` (with ``inspect``) would add to its start-up."""

    def __init__(self, declare, run, words: str | None = None):
        self.declare, self.run, self.words = declare, run, words


COMMANDS: dict[str, Command] = {  # in the order `hpctrain --help` lists them
    "prepare": Command(add_prepare, cmd_prepare),
    "train": Command(add_train, cmd_train, words=OVERRIDES),
    "sample": Command(add_sample, cmd_sample),
    "jobscript": Command(add_jobscript, cmd_jobscript, words=AFTER_DASHES),
    "launch": Command(add_launch, cmd_launch, words=AFTER_DASHES),
    "ckpt": Command(add_ckpt, cmd_ckpt),
    "scale": Command(add_scale, cmd_scale),
    "plan": Command(add_plan, cmd_plan),
    "doctor": Command(add_doctor, cmd_doctor),
    "report": Command(add_report, cmd_report),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpctrain", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.declare(sub)
    return parser


def _version() -> str:
    from hpctrain import __version__

    return f"hpctrain {__version__}"


def _split_job_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``jobscript``/``launch`` take the command to run after ``--``: split it off whole,
    so that its options never reach argparse."""
    command = COMMANDS.get(argv[0]) if argv else None
    if command is not None and command.words == AFTER_DASHES and "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, None


def main(argv: list[str] | None = None) -> int:
    """Run one command; ``argv`` None: the process's own command line (the console script,
    ``python -m hpctrain``), which owns the process's signal handlers to its exit."""
    owns_process = argv is None
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    argv, job_command = _split_job_command(argv)
    args, extra = parser.parse_known_args(argv)
    args.owns_process = owns_process
    command = COMMANDS[args.command]
    try:
        if command.words == OVERRIDES:
            return command.run(args, extra)
        if extra and command.words == AFTER_DASHES:
            raise UserError(f"unrecognized arguments: {' '.join(extra)}; the command to run "
                            f"goes after '--': hpctrain {args.command} [options] -- train "
                            "RECIPE [--section.key=value ...]")
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if command.words == AFTER_DASHES:
            return command.run(args, job_command or [])
        return command.run(args)
    except UserError as exc:
        return _report(exc)


def _report(exc: UserError) -> int:
    """One message for the job, on stderr, and the exit status of a user's error."""
    from hpctrain.comm.abort import abort_job, env_rank

    comm = _mpi_world_if_running()
    if comm is not None and comm.Get_size() > 1:
        # Other ranks may be waiting in a collective: every rank agrees and exits 2,
        # or the job is aborted (comm/abort.py).
        abort_job(comm, exc)
    # Rank 0 speaks for the job; a 1-rank world speaks for itself (srun copies that
    # never joined one job each carry their own SLURM_PROCID).
    alone = (comm is not None and comm.Get_size() == 1) or isinstance(exc, LaunchMismatch)
    if env_rank() == 0 or alone:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def _mpi_world_if_running():
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD
    return None


if __name__ == "__main__":
    sys.exit(main())
