"""Which ``srun --mpi=`` plugin wires the ranks of the MPI that mpi4py uses.

    python -m hpctrain.jobs.srun_mpi      # prints e.g. pmi2; the reason goes to stderr

``srun`` starts tasks; they form one MPI job only if srun's MPI plugin speaks the
process-management interface of the MPI library, else every task is a 1-rank job
(``comm/world_check.py`` stops those). The library decides (Open MPI: ``pmix``, HPE Cray
MPICH: ``cray_shasta``, MPICH and the PyPI wheel: ``pmi2``), among the plugins
``srun --mpi=list`` offers. Job scripts run this in the job; ``hpctrain launch`` runs it
as a subprocess, so that its own process never loads MPI.
Each library's plugin and why: docs/systems/generic-slurm.md.
"""

from __future__ import annotations

import re
import subprocess
import sys

DEFAULT_ORDER = ("pmix", "pmi2")
_LIBRARY_PROBE = ("import mpi4py; mpi4py.rc.initialize = False\n"
                  "from mpi4py import MPI; print(MPI.Get_library_version())")


def offered(list_output: str) -> list[str]:
    """Plugin names from ``srun --mpi=list`` (Slurm 22.05: "MPI plugin types are..." then
    one name a line; newer versions print ``srun: MPI types are...`` and ``srun: pmix``)."""
    names = []
    for line in list_output.splitlines():
        line = re.sub(r"^srun:\s*", "", line.strip())
        if re.fullmatch(r"[a-z][a-z0-9_]*", line) and line not in names:
            names.append(line)
    return names


def preference(library_version: str | None) -> tuple[tuple[str, ...], str]:
    """(plugins in order of preference, why) for the MPI library's version string."""
    v = library_version or ""
    if "Open MPI" in v:
        return ("pmix",), "Open MPI speaks PMIx"
    if "CRAY MPICH" in v.upper():
        return ("cray_shasta", "pmi2", "pmix"), "HPE Cray MPICH"
    if re.search(r"MPICH|MVAPICH|Intel\(R\) MPI", v):
        if "pmix" in v.lower():  # MPICH's configure line names --with-pmix
            return ("pmix", "pmi2"), "MPICH built with PMIx"
        return ("pmi2", "pmix"), "MPICH without PMIx speaks PMI-2"
    return DEFAULT_ORDER, "MPI library not identified"


def choose(offered_plugins: list[str], library_version: str | None) -> tuple[str, str]:
    """(plugin, reason). Falls back to the first preference when srun offers none of them
    (srun then fails at once, naming ``--mpi=list``, rather than starting lone ranks)."""
    order, why = preference(library_version)
    for name in order:
        if name in offered_plugins:
            return name, f"{why}; srun offers {', '.join(offered_plugins) or 'nothing'}"
    return order[0], (f"{why}, but srun --mpi=list offers none of {', '.join(order)} "
                      f"(it offers {', '.join(offered_plugins) or 'nothing'})")


def library_version(python: str = sys.executable) -> str | None:
    """The MPI library mpi4py loads, without initializing MPI; None if it cannot tell."""
    try:
        p = subprocess.run([python, "-c", _LIBRARY_PROBE], capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def srun_list(srun: str = "srun") -> str:
    try:
        p = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return p.stdout + "\n" + p.stderr


def detect(python: str = sys.executable) -> tuple[str, str]:
    return choose(offered(srun_list()), library_version(python))


def main() -> int:
    plugin, reason = detect()
    print(f"hpctrain: srun --mpi={plugin} ({reason})", file=sys.stderr)
    print(plugin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
