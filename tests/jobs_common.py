"""What the job-script tests share: the systems' example requests, rendering a script,
and reading its directives and launch line back."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from hpctrain.jobs.render import render
from hpctrain.jobs.spec import build_spec

REPO = Path(__file__).resolve().parents[1]
# A global batch that splits over every job size below (8 to 1600 ranks): the job
# generator checks the training layout against the job's rank count.
CMD = ["train", "default", "--data.path=datasets/stdlib-char.h5", "--train.batch_size=9600"]
NASTY = ["x'; touch PWNED; '", "$(touch PWNED)", "`touch PWNED`", "a\ntouch PWNED",
         'say "hi" \\ $HOME ${X} * ? ~ # !', "tab\there\rcr", "ünïcødé ∑"]
CLUSTERS = {
    "polaris": dict(nodes=2, walltime="00:30:00", queue="debug", account="P"),
    "aurora": dict(nodes=16, walltime="01:00:00", queue="debug-scaling", account="P"),
    "perlmutter": dict(nodes=2, walltime="00:30:00", queue="debug", account="P"),
    "frontier": dict(nodes=2, walltime="01:00:00", queue="batch", account="P"),
    "pbs": dict(nodes=2, walltime="01:00:00", ranks_per_node=4),
    "slurm": dict(nodes=2, walltime="01:00:00", ranks_per_node=4),
    "local": dict(),
}


def script(system: str, command=CMD, **kw) -> str:
    args = {**CLUSTERS[system], "venv": ".venv", **kw}
    return render(build_spec(system=system, command=list(command), **args))


def directives(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("#PBS", "#SBATCH"))]


def launch_block(text: str) -> list[str]:
    """The LAUNCH=( ... ) array of a script, as the words bash would build (unexpanded)."""
    lines = text.splitlines()
    start = lines.index("LAUNCH=(")
    end = lines.index(")", start)
    return [w for line in lines[start + 1:end] for w in shlex.split(line)]


def bash_n(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=10)

