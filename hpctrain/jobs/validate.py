"""Pure checks of a job request. Every failure is a ``JobError`` whose message names the fix.

Directive values (job name, account, queue, array) are checked against small character
sets because they are pasted into ``#PBS``/``#SBATCH`` lines unquoted: a quote, ``$``,
``#`` or newline there could end the directive and start shell code.
"""

from __future__ import annotations

import re

from hpctrain.errors import JobError
from hpctrain.systems.registry import format_walltime, walltime_seconds

_JOB_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,62}")
_ACCOUNT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_QUEUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What a rendered directive line may contain, whatever produced it (last line of defense).
DIRECTIVE = re.compile(r"#(PBS|SBATCH) [A-Za-z0-9_.:=,%@+/-][A-Za-z0-9 _.:=,%@+/-]*")
# PBS Pro: -J start-end[:step][%max]; SLURM: --array=list-of-ranges[%max].
_PBS_ARRAY = re.compile(r"(\d+)-(\d+)(?::(\d+))?(?:%(\d+))?")
_SLURM_ARRAY = re.compile(r"(\d+(?:-\d+(?::\d+)?)?)(?:,\d+(?:-\d+(?::\d+)?)?)*(?:%(\d+))?")


def _safe(value: str, pattern: re.Pattern, what: str, example: str) -> str:
    if not pattern.fullmatch(value):
        raise JobError(f"{what} {value!r} has characters a batch directive cannot carry safely; "
                       f"use letters, digits, '_', '.', '-' (e.g. {example})")
    return value


def job_name(value: str) -> str:
    return _safe(value, _JOB_NAME, "--job-name", "--job-name gpt-debug; it must start "
                 "with a letter, at most 63 characters")


def account(value: str) -> str:
    return _safe(value, _ACCOUNT, "--account", "--account MyProject")


def queue_name(value: str) -> str:
    return _safe(value, _QUEUE, "--queue", "--queue debug")


def parse_walltime(value: str) -> int:
    """``HH:MM:SS`` (hours may exceed 24) -> seconds."""
    seconds = walltime_seconds(value)
    if seconds is None:
        raise JobError(f"--walltime {value!r} is not HH:MM:SS; e.g. --walltime 00:30:00 "
                       "for half an hour or 24:00:00 for a day")
    if seconds == 0:
        raise JobError("--walltime must be longer than 00:00:00, e.g. --walltime 00:30:00")
    return seconds


def nodes(value: int) -> int:
    if value < 1:
        raise JobError(f"--nodes {value}: a job needs at least 1 node, e.g. --nodes 2")
    return value


def queue_limits(system: str, queues: dict, queue: str, n_nodes: int,
                 walltime_s: int | None) -> None:
    """Check ``queue`` exists on ``system`` and takes ``n_nodes`` for ``walltime_s``
    (None: the site's default walltime, not checked here)."""
    if queue not in queues:
        raise JobError(f"{system} has no queue {queue!r}; use one of: "
                       + "; ".join(q.describe() for q in queues.values())
                       + " (or --no-queue-check if the site added it)")
    q = queues[queue]
    asked = walltime_s or 0
    fits = [o.name for o in queues.values()
            if o.min_nodes <= n_nodes <= o.max_nodes
            and (walltime_s is None or o.min_walltime <= asked <= o.max_walltime_for(n_nodes))]
    during = f" for {format_walltime(asked)}" if walltime_s else ""
    alternatives = (f"; queues that take {n_nodes} node(s){during}: "
                    f"{', '.join(fits)}") if fits else ""
    if n_nodes < q.min_nodes:
        raise JobError(f"queue {queue} on {system} takes at least {q.min_nodes} nodes, you "
                       f"asked for {n_nodes}: use --nodes {q.min_nodes} or another queue"
                       + alternatives)
    if n_nodes > q.max_nodes:
        raise JobError(f"queue {queue} on {system} takes at most {q.max_nodes} node(s), you "
                       f"asked for {n_nodes}: use --nodes {q.max_nodes} or another queue"
                       + alternatives)
    if walltime_s is None:
        return
    if walltime_s < q.min_walltime:
        raise JobError(f"queue {queue} on {system} takes jobs of at least "
                       f"{format_walltime(q.min_walltime)}, you asked for "
                       f"{format_walltime(walltime_s)}: use --walltime "
                       f"{format_walltime(q.min_walltime)} or longer")
    limit = q.max_walltime_for(n_nodes)
    if walltime_s > limit:
        raise JobError(f"queue {queue} on {system} allows at most {format_walltime(limit)} for "
                       f"{n_nodes} node(s), you asked for {format_walltime(walltime_s)}: use "
                       f"--walltime {format_walltime(limit)} or another queue" + alternatives)


def filesystems(system: str, valid: tuple, requested: list[str]) -> tuple[str, ...]:
    """``['home:eagle']`` or ``['home', 'eagle']`` -> ``('home', 'eagle')``, all known."""
    names = tuple(dict.fromkeys(n for item in requested for n in re.split(r"[:,]", item) if n))
    if names and not valid:
        raise JobError(f"{system} has no filesystems directive; drop --filesystems")
    bad = [n for n in names if n not in valid]
    if bad:
        raise JobError(f"{system} has no filesystem {', '.join(map(repr, bad))}; valid: "
                       f"{', '.join(valid)} (e.g. --filesystems {':'.join(valid[:2])})")
    return names


def array(scheduler: str, spec: str, throttle_limit: int | None, where: str) -> str:
    """Check a job-array range for the scheduler, and a queue's ``%`` throttle rule."""
    if scheduler == "pbs":
        m = _PBS_ARRAY.fullmatch(spec)
        if not m:
            raise JobError(f"--array {spec!r}: PBS arrays are START-END[:STEP][%MAX], "
                           "e.g. --array 0-7 or --array 0-31%8")
        start, end, _, throttle = m.groups()
        if int(start) >= int(end):
            raise JobError(f"--array {spec!r}: PBS needs START < END (at least two sub-jobs), "
                           f"e.g. --array {start}-{int(start) + 1}")
    elif scheduler == "slurm":
        m = _SLURM_ARRAY.fullmatch(spec)
        if not m:
            raise JobError(f"--array {spec!r}: SLURM arrays are ranges or lists with an "
                           "optional %MAX, e.g. --array 0-7, --array 1,3,5 or --array 0-31%8")
        throttle = m.group(2)
    else:
        raise JobError("--array needs a batch system; this system has none")
    if throttle_limit is not None:
        if throttle is None or not 1 <= int(throttle) <= throttle_limit:
            raise JobError(f"job arrays on {where} need a %N throttle with N <= "
                           f"{throttle_limit}: e.g. --array {spec.split('%')[0]}%{throttle_limit}")
    return spec


def env_pair(item: str) -> tuple[str, str]:
    """``KEY=VALUE`` -> ``(KEY, VALUE)``; the value may hold anything but a NUL byte."""
    key, sep, value = item.partition("=")
    if not sep or not _ENV_KEY.fullmatch(key):
        raise JobError(f"--env {item!r}: expected KEY=VALUE with KEY made of letters, digits "
                       "and '_' (e.g. --env OMP_NUM_THREADS=4)")
    no_nul(value, f"--env {key}")
    return key, value


def no_nul(value: str, what: str) -> str:
    if "\x00" in value:
        raise JobError(f"{what} contains a NUL byte, which no shell can pass on; remove it")
    return value


def ranks_per_node(value: int) -> int:
    if value < 1:
        raise JobError(f"--ranks-per-node {value}: use at least 1")
    return value


def directive_line(line: str) -> str:
    """A rendered directive must stay one line of plain characters."""
    if not DIRECTIVE.fullmatch(line):
        raise JobError(f"directive {line!r} contains characters a batch system would not "
                       "parse safely; fix the system file or the value you passed")
    return line


def run_dir(value: str | None, *, run_root: str | None, array: bool) -> None:
    """``--run-dir``: one directory per run; with ``--array`` one per sub-job."""
    if value is None:
        return
    no_nul(value, "--run-dir")
    if not value.strip():
        raise JobError("--run-dir names the run directory, e.g. --run-dir runs/gpt-small")
    if run_root:
        raise JobError("--run-dir names the run directory itself; drop --run-root (it only "
                       "says where <job name>/ goes when --run-dir is not given)")
    if array and "{array_index}" not in value:
        raise JobError(f"--run-dir {value!r} with --array: every sub-job needs its own run "
                       "directory; put {array_index} in it, e.g. --run-dir "
                       "runs/sweep-{array_index}")


def exit_code(value: int) -> int:
    if not 0 <= value <= 255:
        raise JobError(f"--stop-exit-code {value}: an exit status is 0 to 255 (default 75)")
    return value


_SIGNAL = re.compile(r"--signal=(?:[RB]+:)?(\w+)@(\d+)")


def signal_lead(directives, walltime_s: int | None) -> tuple[str, ...]:
    """A warning when a ``--signal=SIG@N`` directive asks for the stop signal more than a
    quarter of the walltime before its end: the run would stop soon after it started."""
    if not walltime_s:
        return ()
    for directive in directives:
        m = _SIGNAL.search(directive)
        if m and int(m.group(2)) > walltime_s / 4:
            lead, wall = int(m.group(2)), format_walltime(walltime_s)
            return (f"{m.group(0)} sends SIG{m.group(1)} {lead} s before the end of the "
                    f"{wall} walltime, more than a quarter of it: training stops and saves "
                    f"about {max(0, walltime_s - lead)} s into the job. Ask for a longer "
                    f"--walltime, or submit with a shorter lead (sbatch "
                    f"--signal={m.group(1)}@{max(1, walltime_s // 10)} SCRIPT); the trainer "
                    "also stops on its own before the walltime",)
    return ()
