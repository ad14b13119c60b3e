"""``hpctrain doctor``: the node check of ``hpctrain/doctor/``, on every rank of an
``mpiexec``."""

from __future__ import annotations

from hpctrain.errors import UserError
from hpctrain.sizes import MAX_WAIT_S, finite


def add_doctor(sub) -> None:
    p = sub.add_parser(
        "doctor", help="check this node: devices, MPI, allreduce, bf16 p2p, a training step",
        description="An acceptance check to run with mpiexec in a one-node job before "
                    "training: each rank's device and CPU affinity, the MPI library and "
                    "thread level, GPU-aware MPI per vendor, the node's set-up (ranks "
                    "sharing a GPU, NUMA binding, pip's MPICH on a site with its own MPI, a "
                    "CPU-only torch on a GPU node), allreduce of host and device buffers "
                    "through MPI and the device's collective library (checked and timed), "
                    "a bf16 round trip between rank pairs and compiled GPT training steps "
                    "(tokens/s, MFU); bandwidths and MFU below a healthy node's floors fail. "
                    "Exits 1 naming any failed check.")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "xpu", "fake"],
                   help="as --train.device (fake: the CPU posing as a GPU)")
    p.add_argument("--gpu-aware", default="auto", choices=["auto", "yes", "no"],
                   help="as --comm.gpu_aware")
    p.add_argument("--sizes", type=float, nargs="+", default=[1.0, 25.0, 150.0],
                   metavar="MIB", help="allreduce sizes in MiB (default 1 25 150)")
    p.add_argument("--model", default="auto", choices=["auto", "small", "gpt2-124m"],
                   help="the training step's model (auto: gpt2-124m on a GPU, else small)")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON here")
    p.add_argument("--no-thresholds", action="store_true",
                   help="report the bandwidths and MFU without judging them against the "
                        "floors of a healthy GPU node (hpctrain/doctor/thresholds.py)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long any wait may take before the job aborts (default 300)")


def cmd_doctor(args) -> int:
    from hpctrain.cli.job_world import job_system, job_world
    from hpctrain.doctor.run import run_doctor

    finite(args.timeout, "--timeout", 0.0, MAX_WAIT_S, low_open=True, error=UserError)
    system = job_system()
    world = job_world(timeout=args.timeout, device=args.device, gpu_aware=args.gpu_aware)
    try:
        return run_doctor(world, sizes_mib=args.sizes, model=args.model, json_path=args.json,
                          out=lambda line: print(line, flush=True), system=system,
                          thresholds=not args.no_thresholds)
    finally:
        world.close()
