"""``run_doctor``: every check of the doctor in order, the result on rank 0."""

from __future__ import annotations

import json
from pathlib import Path

from hpctrain.comm import device_collectives
from hpctrain.comm.world import World
from hpctrain.doctor.comm_checks import check_allreduce, check_mpi, check_p2p, check_ranks
from hpctrain.doctor.node_check import NodeCheck, format_node_check
from hpctrain.sizes import MiB
from hpctrain.doctor.setup_checks import check_setup
from hpctrain.doctor.thresholds import judge
from hpctrain.doctor.train_step import check_train

DEFAULT_SIZES_MIB = (1.0, 25.0, 150.0)


def run_doctor(world: World, *, sizes_mib=DEFAULT_SIZES_MIB, model: str = "auto",
               json_path: str | None = None, out=print, system=None,
               thresholds: bool = True) -> int:
    """Run every check (collective over ``world``); rank 0 prints the result with
    ``out`` and writes ``json_path``. ``system``: the job's system (what the
    set-up checks expect of it). Returns 0 when every check passed, else 1."""
    result = NodeCheck()
    check_ranks(world, result)
    check_mpi(world, result)
    check_setup(world, result, result.sections.get("ranks"), system)
    check_allreduce(world, result, sizes_mib)
    check_p2p(world, result, int(min(sizes_mib) * MiB))
    check_train(world, result, model)
    device_collectives.stop()  # the allreduce rows may have started the device library
    if world.is_root and thresholds:
        # Floors are a real GPU's: not the fake device's (the CPU in disguise).
        judge(result, accelerator=world.accel.kind in ("cuda", "xpu"), ranks=world.size)
    if world.is_root:
        result.sections["world"] = {"size": world.size, "nodes": world.n_nodes,
                                    "device": world.accel.kind}
        for line in format_node_check(result):
            out(line)
        if json_path:
            path = Path(json_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    return 1 if world.comm.bcast(bool(result.failures), root=0) else 0
