"""Per-rank set-up that must happen before Python imports MPI, then ``exec`` the rank.

    mpiexec ... python -m hpctrain.jobs.bind --device-env CUDA_VISIBLE_DEVICES \\
        --devices 4 --order reverse [--nsys-dir DIR] -- python -m hpctrain train ...

Importing ``mpi4py.MPI`` initializes MPI (and the GPU runtime, with GPU-aware MPI), so the
device mask is set here first, from the local rank the launcher announces (``direct`` or
``reverse`` order); with ``--nsys-dir`` local rank 0 of each node runs under ``nsys``.
It imports neither torch nor mpi4py and replaces itself with the command
(``os.execvp``), so the rank's process, environment and CPU binding stay the launcher's.
The orders and why: docs/design/job-scripts.md ("Per-rank set-up before MPI starts").
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from hpctrain.comm.abort import env_rank

LOCAL_RANK_VARS = ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                   "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")


def local_rank(env: dict | None = None) -> int | None:
    env = os.environ if env is None else env
    for name in LOCAL_RANK_VARS:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def device_index(rank_on_node: int, devices: int, order: str = "direct") -> int:
    i = rank_on_node % devices
    return devices - 1 - i if order == "reverse" else i


def nsys_prefix(out_dir: str, rank: int) -> list[str]:
    name = f"{socket.gethostname().split('.')[0]}-rank{rank}"
    return ["nsys", "profile", "--trace=cuda,nvtx,mpi,osrt", "--mpi-impl=mpich",
            "--force-overwrite=true", "--output", os.path.join(out_dir, name)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m hpctrain.jobs.bind [options] -- COMMAND ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m hpctrain.jobs.bind")
    p.add_argument("--device-env", help="variable that selects the rank's device")
    p.add_argument("--devices", type=int, default=0, help="devices per node")
    p.add_argument("--order", choices=["direct", "reverse"], default="direct")
    p.add_argument("--nsys-dir", help="profile local rank 0 with nsys into this directory")
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        p.error("name the command to run after --")
    rank_on_node = local_rank()
    if rank_on_node is None and (args.device_env or args.nsys_dir):
        print("hpctrain.jobs.bind: error: no local rank in the environment ("
              + ", ".join(LOCAL_RANK_VARS) + "); run it under the system's mpiexec or srun",
              file=sys.stderr, flush=True)
        return 2
    if args.device_env and args.devices > 0:
        os.environ[args.device_env] = str(device_index(rank_on_node, args.devices, args.order))
    if args.nsys_dir and rank_on_node == 0:
        os.makedirs(args.nsys_dir, exist_ok=True)
        command = nsys_prefix(args.nsys_dir, env_rank()) + command
    sys.stdout.flush()
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"hpctrain.jobs.bind: error: cannot run {command[0]!r}: {e.strerror}",
              file=sys.stderr, flush=True)
        return 127
    return 0  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main())
