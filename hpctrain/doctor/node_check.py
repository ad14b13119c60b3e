"""The node check's result (``NodeCheck``): what each check found (``sections``), the
checks that failed, and the text rank 0 prints."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpctrain.sizes import MiB

SECTIONS = ("ranks", "mpi", "gpu_aware", "setup", "allreduce", "p2p", "train")


@dataclass
class NodeCheck:
    sections: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    """``"check: why"`` for each failed check."""

    def fail(self, check: str, why: str) -> None:
        self.failures.append(f"{check}: {why}")

    def to_dict(self) -> dict:
        return {**self.sections, "failures": self.failures, "ok": not self.failures}


def format_node_check(result: NodeCheck) -> list[str]:
    s = result.sections
    w = s["world"]
    lines = [f"hpctrain doctor: {w['size']} rank(s) on {w['nodes']} node(s), device "
             f"{w['device']}", "", "ranks:"]
    for r in s["ranks"]:
        vis = f"  {r['visibility']}" if r["visibility"] else ""
        lines.append(f"  rank {r['rank']:>3} {r['host']} local {r['local_rank']}: "
                     f"{r['device']}, cpus {r['cpus']} ({r['n_cpus']}){vis}")
    if s.get("ranks_note"):
        lines.append(f"  note: {s['ranks_note']}")
    m = s["mpi"]
    lines += ["", f"MPI: {m['library']} (MPI {m['standard']}, mpi4py {m['mpi4py']})",
              f"  thread level {m['thread_level']} (needs {m['thread_level_needed']}): "
              f"{'ok' if m['ok'] else 'FAILED'}", "GPU-aware MPI:"]
    for vendor, a in s["gpu_aware"]["per_vendor"].items():
        lines.append(f"  {vendor:<10} {'yes' if a['aware'] else 'no'} ({a['reason']})")
    lines.append(f"  this device: {s['gpu_aware']['this_device']}")
    setup = s.get("setup", {})
    lines += ["", f"set-up (system {setup.get('system') or 'not named'}): "
                  + ("ok" if not setup.get("problems") else "see FAILED below")]
    lines += ["", "allreduce (fp32 sum):",
              f"  {'size':>8} {'memory':<7} {'through':<8} {'status':<15} {'ms':>9} "
              f"{'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in s["allreduce"]:
        if "size_mib" not in r:
            lines.append(f"  {'':>8} {r['memory']:<7} {'':<8} {r['status']}")
            continue
        head = f"  {r['size_mib']:>5g} MiB {r['memory']:<7} {r['transport']:<8} {r['status']:<15}"
        if "time_ms" in r:
            head += (f" {r['time_ms']:>9.3f} {r['algbw_GBps']:>11.2f} {r['busbw_GBps']:>11.2f}"
                     + ("  (staged via host)" if r["staged"] else ""))
        lines.append(head.rstrip())
    p = s["p2p"]
    if "bytes" in p:
        lines += ["", f"bf16 round trip ({p['memory']} memory, {p['bytes'] / MiB:g} MiB, "
                      f"pairs {' '.join(f'{a}<->{b}' for a, b in p['pairs'])}): "
                      f"{p['status']}, {p['round_trip_ms']:.2f} ms"]
    else:
        lines += ["", f"bf16 round trip: {p['status']}"]
    t = s["train"]
    mfu = f", MFU {100 * t['mfu']:.1f}%" if t["mfu"] is not None else \
        ", MFU n/a (peak of this device unknown)"
    compiled = ", compiled" if t.get("compiled") else ""
    lines += ["", f"training step: {t['model']} ({t['params'] / 1e6:.1f}M parameters, "
                  f"{t['dtype']}{compiled}, {t['batch_per_rank']}x{t['block_size']} tokens "
                  "per rank): "
                  f"{t['status']}, loss {t['losses'][-1]:.3f}, {t['step_s'] * 1e3:.0f} ms, "
                  f"{t['tokens_per_s']:,.0f} tokens/s{mfu}"]
    if t["memory"]:
        lines.append(f"  {t['memory']}")
    lines.append("")
    if result.failures:
        lines += ["FAILED:"] + [f"  {f}" for f in result.failures]
    else:
        lines.append("all checks passed")
    return lines
