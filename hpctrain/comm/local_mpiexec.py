"""The MPI launcher of this machine, for the tests and tools that start ranks themselves.

    launcher = find_launcher()
    subprocess.run(launcher.command(2, sys.executable, "-m", "hpctrain", "train", "default"),
                   env=launcher.environ())

or from a shell (the Makefile's test legs):
``python -m hpctrain.comm.local_mpiexec -n 2 CMD...``.

The binary is ``MPIEXEC``, else the ``mpiexec`` beside this Python, else the one on
``PATH``; its family (``--version``) decides the flags added to start N ranks here (Open
MPI: ``--oversubscribe``, and permission to run as root, which job scripts never add).
Which, and why: docs/systems/mpi.md ("Testing against another MPI"). Under MPICH, a
watcher removes the shared-memory segments a launch leaves (``shm_segments.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

FAMILIES = ("hydra", "openmpi", "intel", "pals", "slurm", "unknown")
ROOT_PERMISSION = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPICH_YIELD = "MPIR_CVAR_ENABLE_HEAVY_YIELD"
"""MPICH's ranks waiting for a message sleep between polls instead of calling
``sched_yield``: on a machine where the ranks share the cores with each other and with
other work (the test legs run side by side), a spinning rank takes the core the rank it
waits for needs. Set in the environment, it is left as it is (docs/systems/mpi.md)."""


def family_of(version_text: str, program: str = "") -> str:
    """The launcher family from its ``--version`` output (and its name, for ``srun``)."""
    text = version_text.lower()
    if "open mpi" in text or "openrte" in text or "open-mpi" in text:
        return "openmpi"
    if "intel(r) mpi" in text:
        return "intel"
    if "hydra" in text:
        return "hydra"
    if "pals" in text or "/pals/" in program.lower():
        return "pals"
    if Path(program).name == "srun" or text.startswith("slurm"):
        return "slurm"
    return "unknown"


@functools.lru_cache(maxsize=None)
def _probe(program: str) -> tuple[str, str]:
    """(family, first line of ``--version``) of the launcher ``program``."""
    try:
        p = subprocess.run([program, "--version"], capture_output=True, text=True,
                           timeout=30, stdin=subprocess.DEVNULL)
        text = (p.stdout + p.stderr).strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown", ""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return family_of(text, program), first


@dataclasses.dataclass(frozen=True)
class Launcher:
    argv: tuple[str, ...]
    """The launcher and any flags given with it in ``MPIEXEC``."""
    family: str
    """One of ``FAMILIES``."""
    version: str = ""
    """The first line of its ``--version`` output."""
    root: bool = False
    """This process runs as root (Open MPI then needs its permission variables)."""

    def flags(self) -> list[str]:
        """What this family needs to start ranks on this machine."""
        if self.family == "hydra":
            return ["-launcher", "fork"]
        if self.family == "openmpi":
            return ["--oversubscribe"]
        return []

    def command(self, n: int, *cmd: str) -> list[str]:
        """``cmd`` on ``n`` ranks of this machine."""
        return [*self.argv, *self.flags(), "-n", str(n), *cmd]

    def env(self) -> dict[str, str]:
        """The variables to add to a launch's environment."""
        if self.family == "openmpi":  # --oversubscribe already makes its waits yield
            return dict(ROOT_PERMISSION) if self.root else {}
        if self.family == "hydra" and MPICH_YIELD not in os.environ:
            return {MPICH_YIELD: "1"}
        return {}

    def environ(self, base=None, **extra: str) -> dict[str, str]:
        """``base`` (default: this process's environment) with ``env()`` and ``extra``."""
        return {**(os.environ if base is None else base), **self.env(), **extra}

    def describe(self) -> str:
        version = f": {self.version}" if self.version else ""
        return f"{shlex.join(self.argv)} ({self.family}{version})"


def launcher_argv(env=None, python: str | None = None) -> list[str]:
    """The launcher's command words: ``MPIEXEC``, else the ``mpiexec`` beside ``python``,
    else ``mpiexec`` on ``PATH``."""
    env = os.environ if env is None else env
    words = shlex.split(env.get("MPIEXEC", ""))
    if words:
        return words
    sibling = Path(python or sys.executable).parent / "mpiexec"
    return [str(sibling) if sibling.exists() else "mpiexec"]


def find_launcher(env=None, python: str | None = None) -> Launcher:
    """The launcher tests and tools use on this machine (see the module docstring)."""
    argv = launcher_argv(env, python)
    found = shutil.which(argv[0])  # an absolute path: PATH and cwd may differ in a child
    argv[0] = os.path.abspath(found) if found else argv[0]
    family, version = _probe(argv[0])
    return Launcher(tuple(argv), family, version,
                    root=hasattr(os, "geteuid") and os.geteuid() == 0)


def main(args: list[str]) -> int:
    """``python -m hpctrain.comm.local_mpiexec -n N [--] CMD...``: run CMD on N ranks of
    this machine (``--print``: only show the line); ``--describe``: name the launcher."""
    launcher = find_launcher()
    if args[:1] == ["--describe"]:
        print(launcher.describe())
        return 0
    show = args[:1] == ["--print"]
    args = args[1:] if show else args
    if len(args) < 3 or args[0] != "-n" or not args[1].isdigit():
        print("usage: python -m hpctrain.comm.local_mpiexec [--print] -n N [--] CMD...  |  "
              "--describe", file=sys.stderr)
        return 2
    cmd = args[3:] if args[2] == "--" else args[2:]
    argv = launcher.command(int(args[1]), *cmd)
    if show:
        print(shlex.join(argv))
        return 0
    env = launcher.environ()
    sys.stdout.flush()
    if launcher.family == "hydra":  # what MPICH's ranks leave in /dev/shm goes after
        from hpctrain.comm.shm_segments import sweep_when_done

        sweep_when_done()
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
