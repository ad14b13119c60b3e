"""What a healthy GPU node reaches in the doctor's measurements: floors, not targets.

A node below a floor works, but something in it is set up wrong (a link that falls back
to PCIe or TCP, a staging path where GPU-aware MPI was expected, a GPU shared or
throttled), and training on it would be slow. The floors (device-library and MPI
allreduce bandwidth, the bf16 round trip, MFU of a compiled GPT-2 124M step) are set well
below what the hardware does. They apply on accelerators only, the bandwidths only with
several ranks; ``hpctrain doctor --no-thresholds`` reports without judging.
Each floor beside what a healthy node does:
docs/design/devices.md ("Run ``hpctrain doctor`` first").
"""

from __future__ import annotations

from hpctrain.doctor.node_check import NodeCheck
from hpctrain.sizes import MiB

MIN_BUSBW_GBPS = {"device library": 40.0, "mpi direct": 5.0, "mpi staged": 1.0}
MIN_P2P_GBPS = 1.0
MIN_MFU = 0.20


def _kind(row: dict) -> str:
    if row["transport"] != "mpi":
        return "device library"
    return "mpi staged" if row["staged"] else "mpi direct"


def judge(result: NodeCheck, *, accelerator: bool, ranks: int) -> None:
    """Fail the checks whose measurement is below its floor (rank 0's result)."""
    if not accelerator:
        return
    s = result.sections
    if ranks > 1:
        device = [r for r in s.get("allreduce", []) if r.get("memory") == "device"
                  and r.get("status") == "ok"]
        largest = max((r["size_mib"] for r in device), default=None)
        for r in device:
            floor = MIN_BUSBW_GBPS[_kind(r)]
            if r["size_mib"] == largest and r["busbw_GBps"] < floor:
                result.fail("allreduce", f"device memory through {r['transport']} "
                            f"({_kind(r)}): {r['busbw_GBps']:.1f} GB/s bus bandwidth at "
                            f"{r['size_mib']:g} MiB, below the {floor:g} GB/s a healthy node "
                            "reaches (doctor/thresholds.py)")
        p2p = s.get("p2p", {})
        if p2p.get("round_trip_ms"):
            gbps = 2 * p2p["bytes"] / (p2p["round_trip_ms"] / 1e3) / 1e9
            p2p["GBps"] = gbps
            if gbps < MIN_P2P_GBPS:
                result.fail("p2p", f"bf16 round trips of {p2p['bytes'] / MiB:g} MiB move "
                            f"{gbps:.2f} GB/s, below {MIN_P2P_GBPS:g} GB/s")
    train = s.get("train", {})
    if train.get("model") == "gpt2-124m" and train.get("mfu") is not None \
            and train["mfu"] < MIN_MFU:
        result.fail("train", f"the {train['model']} step reaches {100 * train['mfu']:.1f}% "
                    f"MFU, below {100 * MIN_MFU:.0f}% (a throttled, shared or misbound GPU?)")
