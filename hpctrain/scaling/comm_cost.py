"""Alpha-beta cost of the collectives a training step uses (pure functions, seconds).

A message of ``n`` bytes over one link costs ``alpha + n / bandwidth`` (Hockney's model).
Reduce-scatter, allgather and allreduce cost what the ring algorithms cost (Thakur,
Rabenseifner and Gropp, IJHPCA 2005), or recursive halving/doubling where that is
cheaper, as the library's algorithm selection does (``FORMULAS`` takes the cheaper).
A calibrated ``Fit`` at exactly this group size is used as is: it already holds the
machine's oversubscription and the library's choice of algorithm.
The formulas and their sources: docs/design/scaling-model.md ("The performance model").
"""

from __future__ import annotations

import math

from hpctrain.systems.perf import Fit, Link

KINDS = ("allreduce", "reduce_scatter", "allgather", "p2p", "shm_allreduce")
"""``shm_allreduce`` is the trainer's node shared-memory reduction of CPU gradients
(``hpctrain/comm/shm_allreduce.py``): it has no formula, only a calibrated fit, and the
model uses it where a calibration has one."""


def ring_allreduce(p: int, n_bytes: float, link: Link) -> float:
    if p <= 1 or n_bytes <= 0:
        return 0.0
    return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * n_bytes / link.bandwidth


def reduce_scatter(p: int, n_bytes: float, link: Link) -> float:
    if p <= 1 or n_bytes <= 0:
        return 0.0
    return (p - 1) * link.alpha_s + (p - 1) / p * n_bytes / link.bandwidth


def allgather(p: int, n_bytes: float, link: Link) -> float:
    # The mirror image of reduce-scatter: the same steps and bytes, no arithmetic.
    return reduce_scatter(p, n_bytes, link)


def p2p(n_bytes: float, link: Link) -> float:
    return 0.0 if n_bytes <= 0 else link.alpha_s + n_bytes / link.bandwidth


def halving_doubling(kind: str, p: int, n_bytes: float, link: Link) -> float:
    """Rabenseifner's allreduce and recursive-halving reduce-scatter / doubling allgather
    (Thakur et al. 2005): log2(p) rounds instead of p - 1."""
    if p <= 1 or n_bytes <= 0:
        return 0.0
    rounds = math.ceil(math.log2(p))
    volume = (p - 1) / p * n_bytes / link.bandwidth
    if kind == "allreduce":
        return 2 * rounds * link.alpha_s + 2 * volume
    return rounds * link.alpha_s + volume


def _best(ring, kind):
    def cost(p: int, n_bytes: float, link: Link) -> float:
        return min(ring(p, n_bytes, link), halving_doubling(kind, p, n_bytes, link))
    return cost


FORMULAS = {"allreduce": _best(ring_allreduce, "allreduce"),
            "reduce_scatter": _best(reduce_scatter, "reduce_scatter"),
            "allgather": _best(allgather, "allgather")}


def group_link(intra: Link, inter: Link, *, group_size: int, members_per_node: int,
               ranks_per_node: int) -> Link:
    """The link that limits a ring over ``group_size`` ranks, ``members_per_node`` of which
    share each node.

    Inside one node the ring runs on the node's fabric (NVLink, Xe Link). Across nodes
    every ring enters and leaves each node once, and the node's NICs are shared by the
    ``ranks_per_node / members_per_node`` groups that have members on the node (a
    data-parallel group of a pipelined job holds one stage of each replica), so each ring
    gets that share of the node's injection bandwidth, and never more than the fabric."""
    if group_size <= members_per_node:
        return intra
    rings_per_node = max(1, ranks_per_node // max(1, members_per_node))
    return Link(alpha_s=max(intra.alpha_s, inter.alpha_s),
                bandwidth=min(intra.bandwidth, inter.bandwidth / rings_per_node))


def all_to_all(p: int, n_bytes: float, intra: Link, inter: Link, *, members_per_node: int,
               ranks_per_node: int) -> float:
    """Each of ``p`` ranks holds ``n_bytes`` and sends 1/p of them to every other rank in
    p - 1 pairwise steps: (p - 1)/p of its bytes leave it. The (m - 1)/p share bound for the
    m - 1 members on its node crosses the node's fabric; the (p - m)/p rest leaves through
    the node's NICs, which every rank of the node loads at once (every group exchanges in
    the same step). The two shares move side by side: the slower sets the time."""
    if p <= 1 or n_bytes <= 0:
        return 0.0
    m = max(1, min(members_per_node, p))
    on_node = (m - 1) / p * n_bytes / intra.bandwidth
    if m == p:
        return (p - 1) * intra.alpha_s + on_node
    off_node = ranks_per_node * (p - m) / p * n_bytes / inter.bandwidth
    return (p - 1) * max(intra.alpha_s, inter.alpha_s) + max(on_node, off_node)
