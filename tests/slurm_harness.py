"""A one-node Slurm cluster on this machine, for the `slurm` test leg (``make test-slurm``).

    python -m tests.slurm_harness [--keep] -- COMMAND ...

writes a ``slurm.conf`` for this host (its name, ``nproc`` CPUs, the memory of
/proc/meminfo) into a temporary directory, starts ``munged``, ``slurmctld`` and
``slurmd`` there as children in the foreground, waits until the node is idle, runs
COMMAND with ``SLURM_CONF`` pointing at the cluster and ``HPCTRAIN_TEST_SLURM=1``, and
stops the daemons again by their PIDs, whatever happened (an exception, Ctrl-C or a
SIGTERM to the harness). Its exit status is COMMAND's.

Nothing outside the temporary directory is used: munge gets its own key and socket
(``AuthInfo=socket=...``), the daemons their own ports, state and spool directories.
Accounting is off (``accounting_storage/none``), so ``sacct`` does not work here; a job's
final state comes from ``scontrol show job`` while slurmctld remembers it (``MinJobAge``)
and from the completion records of ``jobcomp/filetxt`` (``$HPCTRAIN_SLURM_JOBCOMP``).

Needs root (slurmd starts job steps as their users) and Debian's ``slurm-wlm`` and
``munge`` packages; ``make test-slurm`` installs them when missing.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_memory_mb() -> int:
    """RealMemory: a little less than MemTotal, since slurmd refuses a node whose
    configured memory exceeds what it measures."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 * 9 // 10
    return 1024


def slurm_conf(root: Path, host: str, cpus: int, memory_mb: int, ports: tuple[int, int]) -> str:
    """One node, one partition; every path inside ``root``."""
    ctld_port, slurmd_port = ports
    first_job_id = random.randrange(1_000, 60_000_000)
    return f"""\
ClusterName=hpctrain-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
PlugStackConfig={root}/plugstack.conf
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
ReturnToService=2
# Job ids start at a random number: MPICH names its shared-memory segments after the
# PMI job (job and step id), and a rank killed in an earlier cluster on this machine
# leaves its segments in /dev/shm, where a later job of the same id would find them
# and hang or fail in MPI_Init.
FirstJobId={first_job_id}
# Completed jobs stay visible to `scontrol show job` for 10 minutes.
MinJobAge=600
# Between SIGTERM and SIGKILL at the time limit: the trainer saves in this time.
KillWait=30
SlurmctldDebug=info
SlurmdDebug=info
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
# FORCE:4: up to 4 jobs share a core, so the tests' jobs run side by side on a small VM.
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def processes_under(conf: Path) -> list[int]:
    """The processes started under the cluster whose configuration is ``conf`` (their
    environment names it: the daemons pass theirs on to job steps), this one excepted."""
    marker = f"SLURM_CONF={conf}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        if marker in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def kill_leftovers(conf: Path) -> int:
    """SIGKILL every process still running under the cluster of ``conf`` (a rank whose
    slurmstepd was stopped keeps running and spinning otherwise); how many."""
    killed = 0
    for pid in processes_under(conf):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


class Cluster:
    """The daemons of a one-node cluster under ``root``; ``stop()`` is safe to repeat."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.procs: dict[str, subprocess.Popen] = {}
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), "HPCTRAIN_TEST_SLURM": "1",
                "HPCTRAIN_SLURM_JOBCOMP": str(self.root / "jobcomp.txt"),
                "HPCTRAIN_SLURM_LOGS": str(self.root / "log")}

    def write_config(self) -> None:
        # munged wants every directory above its socket searchable by all.
        self.root.chmod(0o755)
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(mode=0o755, exist_ok=True)
        (self.root / "plugstack.conf").write_text("")
        self.conf.write_text(slurm_conf(self.root, self.host, os.cpu_count() or 1,
                                        node_memory_mb(), (free_port(), free_port())))

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=self.env)
        log.close()

    def start(self) -> None:
        missing = [d for d in DAEMONS if not shutil.which(d)]
        if missing:
            raise SystemExit(f"slurm harness: {', '.join(missing)} not found; install them "
                             "with `apt-get install -y slurm-wlm munge` (make test-slurm does)")
        self.write_config()
        m = self.root / "munge"
        subprocess.run(["mungekey", "--create", f"--keyfile={m}/munge.key"], check=True)
        self._spawn("munged", ["munged", "--foreground", f"--socket={m}/munge.socket",
                               f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid",
                               f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"])
        self._wait(lambda: (m / "munge.socket").exists(), "munged to open its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), "slurmctld to answer")
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.host])
        self._wait(lambda: self._ok(["sinfo", "-h", "-N", "-o", "%T"], "idle"),
                   "the node to become idle")

    def _ok(self, argv: list[str], expect: str) -> bool:
        p = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=30)
        return p.returncode == 0 and expect in p.stdout

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"slurm harness: {', '.join(dead)} exited while waiting "
                                   f"for {what}; logs in {self.root / 'log'}\n" + self.logs())
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"slurm harness: timed out waiting for {what}; logs in "
                           f"{self.root / 'log'}\n" + self.logs())

    def logs(self, lines: int = 20) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def _jobs_left(self) -> bool:
        p = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True,
                           env=self.env, timeout=30)
        return p.returncode == 0 and bool(p.stdout.strip())

    def stop(self) -> None:
        """Cancel jobs left behind (their slurmstepd outlive slurmd), stop the daemons by
        PID, slurmd first (SIGKILL for one that ignores SIGTERM), then kill any process
        still running under this cluster's configuration."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--partition=debug"], env=self.env,
                           capture_output=True, timeout=30)
            deadline = time.monotonic() + STOP_TIMEOUT + 30  # KillWait
            while time.monotonic() < deadline and self._jobs_left():
                time.sleep(0.5)
        for name in reversed(DAEMONS):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT)
        killed = kill_leftovers(self.conf)
        if killed:
            print(f"slurm harness: killed {killed} processes the jobs left running",
                  file=sys.stderr)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the `finally` that stops the daemons


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m tests.slurm_harness [--keep] -- COMMAND ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m tests.slurm_harness")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]
    if os.geteuid() != 0:
        print("slurm harness: needs root (slurmd runs job steps as their users)",
              file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    root = Path(tempfile.mkdtemp(prefix="hpctrain-slurm-"))
    cluster = Cluster(root)
    start = time.monotonic()
    try:
        cluster.start()
        print(f"slurm harness: node {cluster.host} up in {time.monotonic() - start:.1f} s "
              f"(SLURM_CONF={cluster.conf})", flush=True)
        child = subprocess.Popen(command, env=cluster.env)
        try:
            return child.wait()
        finally:
            if child.poll() is None:  # the harness was stopped: stop the tests too
                child.terminate()
                child.wait(timeout=STOP_TIMEOUT)
    finally:
        cluster.stop()
        if args.keep:
            print(f"slurm harness: kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
