"""Run a pipeline schedule over MPI point-to-point.

The executor walks this stage's action list (``schedules.schedule``) once per step:
``forward``, ``backward`` (B only in a zero-bubble schedule, ``split_backward.py``),
``weight`` (W), and sends and receives straight from tensor memory. Receives are posted
``LOOKAHEAD`` actions ahead of their use, so an early message lands in its buffer
without a buffer per micro-batch. Time blocked in receives is the stage's bubble
(``stats.bubble_s``). ``docs/design/pipeline.md`` ("The executor").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.comm.transport import MPITransport
from hpctrain.comm.watchdog import wait_all
from hpctrain.model.gpt import GPT
from hpctrain.model.common.moe import set_loss_scale
from hpctrain.parallel.pipeline.consolidate import gather_parameters
from hpctrain.parallel.pipeline import schedules as S
from hpctrain.parallel.pipeline.split_backward import backward_input
from hpctrain.parallel.pipeline.pass_times import EQUAL, PassTimes
from hpctrain.parallel.pipeline.stage import PipelineStage
from hpctrain.parallel.runner import assemble_gpt
from hpctrain.profiling import profile_range

LOOKAHEAD = 2  # receives posted ahead of the action that consumes them
TIE_TAG_OFFSET = 1  # tied-embedding messages use tags above every schedule tag


@dataclass
class PipelineStats:
    bubble_s: float = 0.0
    """Seconds blocked waiting for a neighbour's activation or gradient."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    weight_s: float = 0.0
    """Seconds in this stage's training forward, backward (B when split) and W passes
    (host clock: on a GPU it counts kernel launches, not kernels still running);
    evaluation's forwards are not counted."""
    messages: int = 0
    bytes_sent: int = 0
    sends_deferred: int = 0
    """Sends queued because the device had not yet written their tensor (posted later,
    while the host went on queuing work)."""
    peak_in_flight: int = 0
    """Most micro-batch chunks held between their forward and backward."""

    @property
    def compute_s(self) -> float:
        """Seconds in forward and backward passes together."""
        return self.forward_s + self.backward_s + self.weight_s


@dataclass
class _Walk:
    """One walk of ``PipelineExecutor.run`` over an action list: what it was given, and
    what it keeps from one action to the next."""
    actions: list
    xs: list
    ys: list
    loss_scale: float
    backward: bool
    before_backward: Callable[[bool], None] | None
    last_backward: int
    """Index of this stage's last action that accumulates parameter gradients: backward,
    or weight in a split schedule (-1: none)."""
    tie_recv: tuple | None
    """The posted receive of the tied embedding's gradient (first stage, with backward)."""
    recv_at: list[int]
    """Indices of the receive actions, in order."""
    posted: dict[int, tuple] = field(default_factory=dict)
    """Action index -> (buffer, MPI buffer, request) of a receive posted ahead."""
    next_post: int = 0
    """Index into ``recv_at`` of the next receive to post."""
    recv_index: int = 0
    """Index into ``recv_at`` of the next receive to wait for."""
    inputs: dict[tuple, torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple, torch.Tensor] = field(default_factory=dict)
    """(micro-batch, chunk) -> a forward's input and output, kept for its backward."""
    weights: dict[tuple, object] = field(default_factory=dict)
    """(micro-batch, chunk) -> what its B kept for its W (split schedules)."""
    received: dict[tuple, torch.Tensor] = field(default_factory=dict)
    """(receive op, micro-batch, chunk) -> a received activation or gradient."""
    sends: list = field(default_factory=list)
    """``_Send``s not known to be complete, oldest first."""
    loss_sum: torch.Tensor | None = None
    in_flight: int = 0
    """Micro-batch chunks between their forward and their backward."""


@dataclass
class _Send:
    """A message queued by this stage: posted once the device has written its tensor."""
    tensor: torch.Tensor
    """Kept alive until the send completes."""
    buf: object
    peer: int
    tag: int
    request: object = None
    """None until posted."""


class PipelineExecutor:
    def __init__(self, stage: PipelineStage, grid: ProcessGrid, *, kind: str, n_micro: int,
                 seq: int, timeout: float, memory_probe=None,
                 order_times: PassTimes = EQUAL):
        self.stage, self.grid = stage, grid
        self.kind, self.n_micro = kind, n_micro
        self.p, self.s, self.v = grid.pp, grid.stage, stage.virtual
        self.seq = seq  # tokens per row; a received activation has its micro-batch's rows
        self.timeout = timeout
        self.comm = grid.pp_comm
        self.accel, self.aware = grid.world.accel, grid.world.gpu_aware
        # Activations keep to MPI whatever --comm.collectives says (docs/design/pipeline.md).
        self.p2p = MPITransport(self.comm, self.accel, self.aware)
        self._sends: list[_Send] = []
        """The sends of the schedule being run (posted before any blocking wait)."""
        self.device = next(stage.parameters()).device
        self.dtype = next(stage.parameters()).dtype  # activations travel in it (bf16)
        # The zero-bubble orders are built for these relative F, B, W times (every rank
        # of the run is given the same ones, so every stage builds the same order).
        self.order_times = order_times
        self.actions = S.schedule(kind, self.p, n_micro, self.s, self.v, order_times)
        self.split = kind in S.SPLIT_BACKWARD  # B and W apart
        self._weights = [*stage.parameters()] + \
            ([stage.head_copy] if stage.head_copy is not None else [])
        self.stats = PipelineStats()
        self.tie_tag = S.max_tag(self.p, max(n_micro, 1), self.v, kind) + TIE_TAG_OFFSET
        # Called after every forward with no argument; the benchmark samples memory there.
        self.memory_probe = memory_probe

    # ------------------------------------------------------------------ messages
    def _tag(self, a: S.Action) -> int:
        return S.message_tag(a.op, a.micro, a.chunk, self.s, self.p, self.v, self.kind)

    def _hand_over(self, walk: _Walk, a: S.Action, tensor: torch.Tensor, step: int) -> bool:
        """Where model chunk g + ``step`` is this stage's too (the tip of zbv's V), leave
        ``tensor`` (an output, or an input's gradient) for it as if received; true if so."""
        local = S.local_neighbour(self.kind, self.s, a.chunk, self.p, self.v, step)
        if local is None:
            return False
        op = S.RECV_ACT if step > 0 else S.RECV_GRAD
        walk.received[(op, a.micro, local)] = tensor.detach()
        return True

    def _post_recv(self, a: S.Action, rows: int):
        buf = torch.empty(self.stage.activation_shape(rows, self.seq), dtype=self.dtype,
                          device=self.device)
        mpi = self.p2p.buffer(buf)
        return buf, mpi, self.p2p.recv(mpi, a.peer, self._tag(a))

    def _send(self, tensor: torch.Tensor, peer: int, tag: int, pending: list) -> None:
        """Queue a send without blocking the host: it is posted as soon as the device has
        written ``tensor`` (its event, or its staging copy's, has passed), at a later
        action or before any blocking wait."""
        tensor = tensor.detach().contiguous()
        buf = self.p2p.buffer(tensor)
        buf.prepare()
        send = _Send(tensor, buf, peer, tag)
        pending.append(send)
        if buf.ready():
            self._post(send)
        else:
            self.stats.sends_deferred += 1
        self.stats.messages += 1
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()

    def _post(self, send: _Send) -> None:
        send.request = self.p2p.send(send.buf, send.peer, send.tag)  # waits if not ready

    def _post_ready(self, pending: list, block: bool = False) -> None:
        """Post the queued sends whose tensors are written (``block``: all of them)."""
        for send in pending:
            if send.request is None and (block or send.buf.ready()):
                self._post(send)

    def _drop_finished(self, pending: list) -> None:
        # Post what became ready; free the memory of sends that completed (activations
        # of finished micro-batches).
        self._post_ready(pending)
        while pending and pending[0].request is not None and pending[0].request.Test():
            pending.pop(0)

    def _wait(self, requests: list, what: str, bubble: bool = True) -> None:
        # A peer may be waiting for one of our queued sends before it can answer: post
        # them all first (the host would block here anyway).
        self._post_ready(self._sends, block=True)
        with self.accel.clock.span("bubble") if bubble else contextlib.nullcontext() as idle:
            wait_all(requests, timeout=self.timeout, what=f"pipeline stage {self.s}: {what}")
        if bubble:
            self.stats.bubble_s += idle.host_s

    # ------------------------------------------------------------------- running
    def run(self, actions: list[S.Action], xs: list, ys: list, loss_scale: float,
            backward: bool, before_backward=None) -> torch.Tensor | None:
        """Run ``actions``; return the sum of the micro-batch losses on the last stage
        (None elsewhere). ``before_backward(last)`` is called right before each backward
        pass, ``last`` true for this stage's last one (with the tied embedding's whole
        gradient in place)."""
        walk = _Walk(actions, xs, ys, loss_scale, backward, before_backward,
                     last_backward=max((i for i, a in enumerate(actions) if a.op ==
                                        (S.WEIGHT if self.split else S.BACKWARD)),
                                       default=-1),
                     tie_recv=self._post_tie_recv() if backward else None,
                     recv_at=[i for i, a in enumerate(actions) if a.op in S.RECVS])
        do = {S.RECV_ACT: self._receive, S.RECV_GRAD: self._receive,
              S.FORWARD: self._forward, S.SEND_ACT: self._send_activation,
              S.BACKWARD: self._backward, S.SEND_GRAD: self._send_input_gradient,
              S.WEIGHT: self._weight}
        self._sends = walk.sends
        for i, a in enumerate(actions):
            do[a.op](walk, i, a)
            self._drop_finished(walk.sends)
        self._post_ready(walk.sends, block=True)
        self._wait([send.request for send in walk.sends], "completing sends")
        self._sends = []
        return walk.loss_sum

    def _post_ahead(self, walk: _Walk, upto: int) -> None:
        """Post every receive up to action ``upto`` not posted yet."""
        while walk.next_post < len(walk.recv_at) and walk.recv_at[walk.next_post] <= upto:
            i = walk.recv_at[walk.next_post]
            a = walk.actions[i]
            walk.posted[i] = self._post_recv(a, walk.xs[a.micro].size(0))
            walk.next_post += 1

    def _receive(self, walk: _Walk, i: int, a: S.Action) -> None:
        # Keep LOOKAHEAD receives posted beyond this one.
        self._post_ahead(walk, walk.recv_at[min(walk.recv_index + LOOKAHEAD,
                                                len(walk.recv_at) - 1)])
        walk.recv_index += 1
        buf, mpi, req = walk.posted.pop(i)
        self._wait([req], f"{a} from stage {a.peer}")
        mpi.complete()
        walk.received[(a.op, a.micro, a.chunk)] = buf

    def _forward(self, walk: _Walk, i: int, a: S.Action) -> None:
        key = (a.micro, a.chunk)
        if self.stage.is_first_chunk(a.chunk):
            x = walk.xs[a.micro]
        else:
            x = walk.received.pop((S.RECV_ACT, *key))
            x.requires_grad_(walk.backward)
        last = self.stage.is_last_chunk(a.chunk)
        with self.accel.clock.span("forward") as f, \
                profile_range(f"forward m{a.micro} c{a.chunk}"):
            out = self.stage.chunk_forward(a.chunk, x, walk.ys[a.micro] if last else None)
        if walk.backward:
            self.stats.forward_s += f.host_s
        if last:
            walk.loss_sum = out.detach() if walk.loss_sum is None else walk.loss_sum + out.detach()
        handed = not last and self._hand_over(walk, a, out, +1)
        if walk.backward:
            walk.inputs[key], walk.outputs[key] = x, out
            walk.in_flight += 1
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, walk.in_flight)
        elif not handed:  # kept for its send
            walk.outputs[key] = out
        if self.memory_probe is not None:
            self.memory_probe()

    def _send_activation(self, walk: _Walk, i: int, a: S.Action) -> None:
        key = (a.micro, a.chunk)
        out = walk.outputs[key] if walk.backward else walk.outputs.pop(key)
        self._send(out, a.peer, self._tag(a), walk.sends)

    def _backward(self, walk: _Walk, i: int, a: S.Action) -> None:
        if self.split:
            return self._backward_input(walk, a)
        key = (a.micro, a.chunk)
        x, out = walk.inputs.pop(key), walk.outputs.pop(key)
        if i == walk.last_backward and walk.tie_recv is not None:
            self._add_tied_gradient(walk.tie_recv)
        if walk.before_backward is not None:
            walk.before_backward(i == walk.last_backward)
        with self.accel.clock.span("backward") as b, \
                profile_range(f"backward m{a.micro} c{a.chunk}"):
            if self.stage.is_last_chunk(a.chunk):
                self.accel.backward(out * walk.loss_scale)
            else:
                self.accel.backward(out, walk.received.pop((S.RECV_GRAD, *key)))
        self.stats.backward_s += b.host_s
        walk.in_flight -= 1
        if self.stage.is_last_chunk(a.chunk) and a.micro == self.n_micro - 1:
            self._send_tied_gradient(walk.sends)
        if not self.stage.is_first_chunk(a.chunk):
            walk.inputs[key] = x  # its .grad goes back at the next send_grad

    def _backward_input(self, walk: _Walk, a: S.Action) -> None:
        """B: the input's gradient now; what W needs is kept in ``walk.weights``."""
        key = (a.micro, a.chunk)
        x, out = walk.inputs.pop(key), walk.outputs.pop(key)
        if self.stage.is_last_chunk(a.chunk):
            out, grad = out * walk.loss_scale, None
        else:
            grad = walk.received.pop((S.RECV_GRAD, *key))
        kept = []
        with self.accel.clock.span("backward") as b, \
                profile_range(f"backward-input m{a.micro} c{a.chunk}"):
            self.accel.autograd(lambda: kept.append(backward_input(out, grad, x, self._weights)))
        self.stats.backward_s += b.host_s
        walk.weights[key] = kept[0]
        if not self.stage.is_first_chunk(a.chunk) and not self._hand_over(walk, a, x.grad, -1):
            walk.inputs[key] = x  # its .grad goes back at the next send_grad

    def _weight(self, walk: _Walk, i: int, a: S.Action) -> None:
        """W: the parameters' gradients of micro-batch ``a.micro``, into ``.grad``."""
        weights = walk.weights.pop((a.micro, a.chunk))
        tie = None
        if i == walk.last_backward and walk.tie_recv is not None:
            # Wait for the head's gradient only when autograd reaches the embedding (the
            # end of this W), not before it: the last stage sends it after its own last W.
            tie = self.stage.embedding_weight.register_hook(self._tied_gradient_hook(walk.tie_recv))
        if walk.before_backward is not None:
            walk.before_backward(i == walk.last_backward)
        try:
            with self.accel.clock.span("weight") as w, \
                    profile_range(f"backward-weight m{a.micro} c{a.chunk}"):
                self.accel.autograd(lambda: weights.run(lambda: self._drop_finished(walk.sends)))
        finally:
            if tie is not None:
                tie.remove()
        self.stats.weight_s += w.host_s
        walk.in_flight -= 1
        if self.stage.is_last_chunk(a.chunk) and a.micro == self.n_micro - 1:
            self._send_tied_gradient(walk.sends)

    def _send_input_gradient(self, walk: _Walk, i: int, a: S.Action) -> None:
        x = walk.inputs.pop((a.micro, a.chunk))
        self._send(x.grad, a.peer, self._tag(a), walk.sends)

    def train_step(self, xs: list, ys: list, loss_scale: float,
                   before_backward: Callable[[bool], None] | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch (``xs``/``ys``: one tensor each);
        returns the summed loss (zero on stages without the head). The gradient engine
        syncs from ``before_backward(last=True)``, so its bucket reductions start during
        this stage's last backward pass (``Runner``, ``parallel/runner.py``)."""
        set_loss_scale(self.stage, loss_scale)
        loss = self.run(self.actions, xs, ys, loss_scale, backward=True,
                        before_backward=before_backward)
        return loss if loss is not None else torch.zeros((), device=self.device)

    def describe(self) -> str:
        return (f"pipeline: {self.grid.describe()}, {self.kind} schedule, {self.v} chunk(s) "
                f"per stage, layers {self.stage.chunk_layers}")

    @torch.no_grad()
    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The loss of one batch through every stage (last stage; None elsewhere)."""
        return self.run(S.forward_only(self.p, self.s, self.v, self.kind), [x], [y], 1.0,
                        backward=False)

    # ------------------------------------------------------------ tied embedding
    # The last stage sends the head's gradient of the tied embedding as soon as its
    # last micro-batch has gone backward; the first stage adds it to the embedding's
    # gradient before its own last backward pass, so the bucket holding the embedding
    # is complete when its reduction starts (the hooks launch it during that pass).
    @property
    def tied(self) -> bool:
        """Whether the first and the last stage share a tied embedding (placed in a V,
        the head is on the first stage)."""
        return self.p > 1 and self.stage.cfg.tie_embeddings and self.kind not in S.V_PLACED

    def _post_tie_recv(self):
        if not self.stage.has_embedding or not self.tied:
            return None
        buf = torch.empty_like(self.stage.embedding_weight)
        mpi = self.p2p.buffer(buf)
        return buf, mpi, self.p2p.recv(mpi, self.p - 1, self.tie_tag)

    def _tied_gradient(self, tie_recv) -> torch.Tensor:
        """The head's gradient of the tied embedding, once it has come."""
        buf, mpi, req = tie_recv
        self._wait([req], "receiving the tied-embedding gradient", bubble=False)
        mpi.complete()
        return buf

    def _add_tied_gradient(self, tie_recv) -> None:
        buf = self._tied_gradient(tie_recv)
        embedding = self.stage.embedding_weight
        if embedding.grad is None:
            embedding.grad = buf
        else:
            embedding.grad.add_(buf)

    def _tied_gradient_hook(self, tie_recv):
        """A hook on the embedding's gradient that adds the head's, once it has come."""
        return lambda grad: grad + self._tied_gradient(tie_recv)

    def _send_tied_gradient(self, sends: list) -> None:
        st = self.stage
        if not self.tied:
            return
        self._send(st.head_copy.grad, 0, self.tie_tag, sends)
        st.head_copy.grad = None  # the send holds the tensor until it completes

    def tie_weights(self) -> None:
        """After the optimizer step: the head's copy takes the updated embedding."""
        st, last = self.stage, self.p - 1
        if not self.tied:
            return
        if st.has_embedding:
            sends: list = []
            self._send(st.embedding_weight, last, self.tie_tag + 1, sends)
            self._post_ready(sends, block=True)
            self._wait([send.request for send in sends], "sending the tied embedding",
                       bubble=False)
        elif st.has_head:
            mpi = self.p2p.buffer(st.head_copy.data)
            req = self.p2p.recv(mpi, 0, self.tie_tag + 1)
            self._wait([req], "receiving the tied embedding", bubble=False)
            mpi.complete()

    # ----------------------------------------------------------- the whole model
    def whole_model_state(self, full: dict) -> dict | None:
        """Every stage's fp32 parameters (``full``: this stage's consolidated state) on
        world rank 0, None elsewhere; the moments stay behind (a pipeline's final.h5
        holds parameters only). Collective over replica 0's stages."""
        params = gather_parameters({n: s["param"] for n, s in full.items()}, self.grid,
                                   self.timeout)
        return None if params is None else {n: {"param": t} for n, t in params.items()}

    def whole_model(self, state: dict) -> GPT:
        """A GPT put together from ``whole_model_state``'s result (on rank 0), for sampling."""
        return assemble_gpt(self.stage.cfg, state, self.device)
