"""A stage's backward split in two: B (input gradient) now, W (weight gradients) later.

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) need
the gradient of a stage's input at once, because the previous stage waits for it, but
the parameters' gradients only before the optimizer step. B is ``backward(inputs=[x])``
with pre-hooks that keep the output gradients where branches to parameters leave the
path; W runs ``backward`` from those kept gradients into the parameters, so no
activation gradient is computed twice and ``.grad`` accumulates through autograd's own
hooks. How, and what it costs: ``docs/design/pipeline.md`` ("Zero bubble: B and W
apart").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


def _grad_node(t: torch.Tensor) -> Node | None:
    """A tensor's node in the graph: its ``grad_fn``, or a leaf's ``AccumulateGrad``."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


ON_PATH, TO_PARAM = 1, 2
"""Bits of ``_reach_flags``: the node reaches the stage input's node / a parameter's."""


def _reach_flags(root: Node, x_node: Node, param_nodes) -> tuple[dict, dict]:
    """One walk of the graph below ``root``: every node's ``ON_PATH | TO_PARAM`` bits, and
    its children (``next_functions`` without the empty ones)."""
    flags: dict[Node, int] = {}
    children: dict[Node, list[Node]] = {}
    stack = [root]
    while stack:
        node = stack[-1]
        if node in flags:
            stack.pop()
            continue
        kids = children.get(node)
        if kids is None:  # first visit: the children go first
            kids = children[node] = [n for n, _ in node.next_functions if n is not None]
            todo = [c for c in kids if c not in flags]
            if todo:
                stack.extend(todo)
                continue
        bits = (ON_PATH if node is x_node else 0) | (TO_PARAM if node in param_nodes else 0)
        for c in kids:
            bits |= flags.get(c, 0)
        flags[node] = bits
        stack.pop()
    return flags, children


def _reaches(roots: list[Node], targets: set[Node]) -> dict[Node, bool]:
    """For every node below ``roots``: whether some node of ``targets`` is reachable."""
    memo: dict[Node, bool] = {}
    for root in roots:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in memo and not expanded:
                continue
            children = [n for n, _ in node.next_functions if n is not None]
            if expanded:
                memo[node] = node in targets or any(memo[c] for c in children)
                continue
            memo.setdefault(node, node in targets)  # a cycle guard; overwritten below
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in memo)
    return memo


@dataclass
class _Group:
    roots: list[Node]
    """Nodes on the input path where a branch towards these parameters leaves."""
    params: list[torch.Tensor]
    grads: dict[Node, tuple] = field(default_factory=dict)
    """root -> the gradients of its outputs, kept by B's pre-hook."""


class WeightGradients:
    """What B kept for W: run once, then the graph is released."""

    def __init__(self, groups: list[_Group], fallback: tuple | None):
        self._groups = groups
        self._fallback = fallback  # (output, gradient, params): no input path, W does all

    def run(self, progress=None) -> None:
        """Accumulate every parameter's gradient of this micro-batch into ``.grad``.
        ``progress()`` is called between the groups (the executor tests its messages
        there, so a send posted after B moves while W computes)."""
        if self._fallback is not None:
            out, grad, params = self._fallback
            torch.autograd.backward(out, grad, inputs=params)
        for g in self._groups:
            edges, grads = [], []
            for root in g.roots:
                for i, grad in enumerate(g.grads.get(root, ())):
                    if grad is not None:
                        edges.append(GradientEdge(root, i))
                        grads.append(grad)
            if not edges:
                continue
            pins = [root.register_prehook(lambda _g, kept=g.grads[root]: kept)
                    for root in g.roots if root in g.grads] if len(g.roots) > 1 else []
            try:
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=g.params)
            finally:
                for h in pins:
                    h.remove()
            if progress is not None:
                progress()
        self._groups, self._fallback = [], None


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor,
                   params: list[torch.Tensor]) -> WeightGradients:
    """B: set ``x.grad`` (``x``: a leaf that requires grad, or the token ids of the first
    chunk, which have none) and return what W needs for ``params``' gradients."""
    params = [p for p in params if p.requires_grad]
    x_node = _grad_node(x) if x.requires_grad else None
    root = out.grad_fn
    if x_node is None or root is None:
        return WeightGradients([], (out, grad, params))
    param_nodes = {_grad_node(p): p for p in params}
    node_of = {id(p): n for n, p in param_nodes.items()}
    flags, children = _reach_flags(root, x_node, param_nodes)
    groups: dict[Node, _Group] = {}  # branch root or parameter node -> its group
    for node, bits in flags.items():
        if not bits & ON_PATH:
            continue
        branches = [n for n in children[node]
                    if flags[n] & (ON_PATH | TO_PARAM) == TO_PARAM]
        if not branches:
            continue
        reached = [param_nodes[n] for n, hit in _reaches(branches, param_nodes.keys()).items()
                   if hit and n in param_nodes]
        group = next((groups[node_of[id(p)]] for p in reached if node_of[id(p)] in groups),
                     None)
        if group is None:
            group = _Group([], [])
        group.roots.append(node)
        for p in reached:
            if all(p is not q for q in group.params):
                group.params.append(p)
            groups[node_of[id(p)]] = group
        groups[node] = group
    unique = list({id(g): g for g in groups.values()}.values())
    hooks = []
    for g in unique:
        for r in g.roots:
            hooks.append(r.register_prehook(
                lambda grads, g=g, r=r: g.grads.__setitem__(r, tuple(grads))))
    try:
        torch.autograd.backward(out, grad, retain_graph=True, inputs=[x])
    finally:
        for h in hooks:
            h.remove()
    covered = {id(p) for g in unique for p in g.params}
    rest = [p for p in params if id(p) not in covered
            and flags.get(node_of[id(p)], 0) & TO_PARAM]
    return WeightGradients(unique, (out, grad, rest) if rest else None)
