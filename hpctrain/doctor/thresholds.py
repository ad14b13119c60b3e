"""What a healthy GPU node reaches in the doctor's measurements: floors, not targets.

A node below a floor works, but something in it is set up wrong (a link that falls back
to PCIe or TCP, a staging path where GPU-aware MPI was expected, a GPU shared or
throttled), and training on it would be slow. The floors are set well below what the
hardware does, so a healthy node passes with room to spare:

| measurement | floor | what a healthy node does |
|---|---|---|
| device-memory allreduce, largest size, bus bandwidth, device library (NCCL, RCCL, oneCCL) | 40 GB/s | GPUs of a node talk over NVLink / Infinity Fabric / Xe Link: hundreds of GB/s (nccl-tests on 4x A100 NVLink: about 230) |
| the same through MPI reading device memory directly | 5 GB/s | GPU-aware Cray MPICH / MPICH: tens of GB/s within a node |
| the same through MPI staged in host memory | 1 GB/s | two PCIe copies per bucket and a sum on CPU cores: a few GB/s |
| bf16 round trip between rank pairs, device memory | 1 GB/s | NVLink or shared memory: tens of GB/s even for 1 MiB |
| MFU of a compiled GPT-2 124M bf16 step (``--model gpt2-124m``, the default on a GPU) | 20% | nanoGPT-class training reaches about 40% on A100 and H100 |

They apply on accelerators only (CPU nodes vary too much), the bandwidths only with
several ranks (one rank moves nothing), and only to rows whose transport is there.
``hpctrain doctor --no-thresholds`` reports the numbers without judging them.
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
