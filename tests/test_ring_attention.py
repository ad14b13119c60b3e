"""Context parallelism's pure parts in one process: the load-balanced chunk layout
(every token once, in order, equal causal work), the log-sum-exp merge and a block's
backward against torch's attention, and a ring of one rank against
``F.scaled_dot_product_attention``; rings of 2, 3 and 8 ranks as threads of this process
passing blocks through a stand-in communicator (odd and larger rings than the MPI legs
run). The ring over 2 and 4 MPI ranks: ``tests/test_ring_attention_mpi.py``."""

import collections
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hpctrain.errors import ConfigError
from hpctrain.parallel.context import blocks, chunks
from hpctrain.parallel.context.ring_attention import ring_attention

SCALE = 0.25  # 1 / sqrt(16)


def _qkv(T, nh=4, nkv=4, hs=16, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, nh, T, hs, generator=g), torch.randn(B, nkv, T, hs, generator=g),
            torch.randn(B, nkv, T, hs, generator=g))


def test_the_layout_of_two_and_four_ranks_written_out():
    assert chunks.positions(0, 2, 8).tolist() == [0, 1, 6, 7]
    assert chunks.positions(1, 2, 8).tolist() == [2, 3, 4, 5]
    assert [chunks.positions(r, 4, 8).tolist() for r in range(4)] == [[0, 7], [1, 6],
                                                                      [2, 5], [3, 4]]
    assert chunks.rank_chunks(1, 4) == (1, 6)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_every_token_is_held_once_and_each_chunk_is_in_order(cp):
    T = 2 * cp * 5
    held = [chunks.positions(r, cp, T) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(T))
    for pos in held:
        assert len(pos) == T // cp
        for chunk in pos.chunk(2):
            assert (chunk.diff() == 1).all()  # consecutive: one chunk of the sequence


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_matches_the_positions_and_gather_inverts_it(cp):
    T = 2 * cp * 3
    x = torch.randn(2, T, 5)
    parts = [chunks.split_sequence(x, r, cp) for r in range(cp)]
    for r, part in enumerate(parts):
        assert torch.equal(part, x[:, chunks.positions(r, cp, T)])
    assert torch.equal(chunks.gather_sequence(parts), x)
    heads = x.transpose(1, 2)  # (B, C, T): tokens along another dimension
    assert torch.equal(chunks.gather_sequence(
        [chunks.split_sequence(heads, r, cp, dim=2) for r in range(cp)], dim=2), heads)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_every_rank_computes_the_same_causal_pairs(cp):
    T = 2 * cp * 7
    work = [chunks.causal_pairs(chunks.positions(r, cp, T)) for r in range(cp)]
    assert work == [T * (T + 1) // 2 // cp] * cp  # the same share of every pair


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_every_ring_step_gives_every_rank_two_chunk_blocks_of_work(cp):
    """The balance holds per step, as the ring needs (each step ends in a transfer all
    wait for): a full chunk-pair block counts 1, a diagonal one 1/2; the first step is
    the rank's own keys (two diagonals, one full block)."""
    for rank in range(cp):
        for step in range(cp):
            pairs = list(blocks.chunk_pairs(rank, (rank - step) % cp, cp))
            assert sum(0.5 if diagonal else 1.0 for *_, diagonal in pairs) == 2.0
            assert sum(diagonal for *_, diagonal in pairs) == (2 if step == 0 else 0)


@pytest.mark.parametrize("cp,c", [(2, 1), (2, 16), (4, 1), (4, 64), (8, 1000)])
def test_a_contiguous_split_overloads_the_last_rank_as_the_design_note_says(cp, c):
    """The imbalance the load balancing removes: with cp contiguous pieces of c tokens,
    the last rank's pairs over the mean are (2 c cp - c + 1) / (c cp + 1), which tends
    to (2 cp - 1) / cp (docs/design/context-parallel.md)."""
    T = c * cp
    work = [chunks.causal_pairs(torch.arange(r * c, (r + 1) * c)) for r in range(cp)]
    assert max(work) == work[-1]
    ratio = work[-1] * cp / sum(work)
    assert ratio == pytest.approx((2 * c * cp - c + 1) / (c * cp + 1), rel=1e-12)
    assert sum(work) == T * (T + 1) // 2


def test_a_length_that_does_not_cut_into_two_cp_chunks_is_refused():
    with pytest.raises(ConfigError, match="multiple of 8"):
        chunks.positions(0, 4, 36)
    with pytest.raises(ValueError, match="rank 2"):
        chunks.rank_chunks(2, 2)


def test_the_causal_relation_of_two_chunks():
    assert blocks.relation(3, 5) is blocks.Relation.SKIP
    assert blocks.relation(3, 3) is blocks.Relation.DIAGONAL
    assert blocks.relation(3, 0) is blocks.Relation.FULL


@pytest.mark.parametrize("nkv", [4, 2, 1])
def test_merging_two_halves_of_the_keys_equals_attention_over_all(nkv):
    q, k, v = _qkv(32, nkv=nkv)
    whole = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    halves = [blocks.attend(q, kh, vh, SCALE, diagonal=False)
              for kh, vh in zip(k.chunk(2, dim=2), v.chunk(2, dim=2))]
    start = (torch.zeros(q.shape), torch.full(q.shape[:-1], float("-inf")))
    for order in (halves, halves[::-1]):
        out, lse = start
        for o, l in order:
            out, lse = blocks.merge(out, lse, o, l)
        torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, torch.logsumexp(
            q @ k.repeat_interleave(4 // nkv, 1).transpose(-2, -1) * SCALE, -1))


def test_a_late_chunk_merged_from_a_full_and_a_diagonal_block_is_causal_attention():
    q, k, v = _qkv(32, nkv=2)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    late = slice(16, 32)
    early_keys = blocks.attend(q[:, :, late], k[:, :, :16], v[:, :, :16], SCALE, False)
    own_keys = blocks.attend(q[:, :, late], k[:, :, late], v[:, :, late], SCALE, True)
    out, _ = blocks.merge(*own_keys, *early_keys)
    torch.testing.assert_close(out, whole[:, :, late], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("diagonal", [False, True])
def test_a_blocks_backward_from_the_lse_equals_autograd(diagonal):
    q, k, v = (t.requires_grad_() for t in _qkv(16, nkv=2))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=diagonal, enable_gqa=True)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(dout)
    with torch.no_grad():
        o, lse = blocks.attend(q, k, v, SCALE, diagonal)
        delta = (dout * o).sum(-1)
        grads = blocks.attend_backward(q, k, v, dout, lse, delta, SCALE, diagonal)
    for mine, torchs in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, torchs, rtol=1e-5, atol=1e-5)


def test_dropout_is_refused_with_the_fix():
    q, k, v = _qkv(8)
    with pytest.raises(ConfigError, match="dropout to 0"):
        ring_attention(q, k, v, ring=None, dropout_p=0.1)


def test_shapes_that_do_not_fit_are_refused_before_any_transfer():
    q, k, v = _qkv(8, nkv=4)
    with pytest.raises(ValueError, match="do not fit"):
        ring_attention(q, k[:, :3], v[:, :3], ring=None)  # 3 kv heads for 4 query heads
    with pytest.raises(ValueError, match="one shape"):
        ring_attention(q, k, v[:, :2], ring=None)
    with pytest.raises(ValueError, match="two equal chunks"):
        ring_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], ring=None)


def test_a_ring_of_one_rank_is_causal_attention_with_its_gradients():
    from mpi4py import MPI

    from hpctrain.parallel.context.ring import MPIRing

    q, k, v = (t.requires_grad_() for t in _qkv(24, nkv=2))
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    out = ring_attention(q, k, v, MPIRing(MPI.COMM_SELF))
    expected = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.backward(dout)
    expected.backward(dout)
    for mine, theirs in zip((q, k, v), ref):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-5)


class _Request:
    def __init__(self, test):
        self._test, self._done = test, False

    def Test(self, status=None):
        self._done = self._done or self._test()
        return self._done


class _ThreadComm:
    """The point-to-point part of an mpi4py communicator for ranks that are threads:
    a send copies into the mailbox of (source, dest, tag), a receive takes the oldest."""

    def __init__(self, mail: dict, lock: threading.Lock, rank: int, size: int):
        self._mail, self._lock, self._rank, self._size = mail, lock, rank, size

    def Get_size(self):
        return self._size

    def Get_rank(self):
        return self._rank

    def Isend(self, buf, dest, tag):
        with self._lock:
            self._mail[(self._rank, dest, tag)].append(np.array(buf, copy=True))
        return _Request(lambda: True)

    def Irecv(self, buf, source, tag):
        def test():
            with self._lock:
                box = self._mail[(source, self._rank, tag)]
                if not box:
                    return False
                buf[...] = box.popleft()
                return True
        return _Request(test)


@pytest.mark.parametrize("cp", [2, 3, 8])
@pytest.mark.parametrize("nkv", [4, 2])
@pytest.mark.parametrize("tile", ["fused", 256, 3])
def test_a_ring_of_threads_equals_causal_attention_on_every_rank(cp, nkv, tile, monkeypatch):
    """``tile``: torch's fused CPU kernel on whole chunks, or the matrix-multiply path
    with ``QUERY_TILE`` queries at a time; 3 cuts each chunk of 8 into tiles of 3, 3
    and 2, the diagonal's keys cut after each tile's last query."""
    from hpctrain.parallel.context import ring_attention as module
    from hpctrain.parallel.context.ring import MPIRing

    monkeypatch.setattr(blocks, "FUSED", tile == "fused")
    monkeypatch.setattr(module, "QUERY_TILE", 256 if tile == "fused" else tile)

    T = 16 * cp
    q, k, v = _qkv(T, nkv=nkv)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    expected.backward(dout)
    mail, lock, failures = collections.defaultdict(collections.deque), threading.Lock(), {}

    def rank(r):
        try:
            idx = chunks.positions(r, cp, T)
            mine = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
            out = ring_attention(*mine, MPIRing(_ThreadComm(mail, lock, r, cp), timeout=30.0))
            out.backward(dout[:, :, idx])
            torch.testing.assert_close(out, expected[:, :, idx], rtol=1e-5, atol=1e-5)
            for name, t, whole in zip("qkv", mine, ref):
                torch.testing.assert_close(t.grad, whole.grad[:, :, idx], rtol=1e-5,
                                           atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")
        except Exception as e:  # reported below, rank by rank
            failures[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, "\n".join(f"rank {r}: {e}" for r, e in sorted(failures.items()))
    assert not any(mail.values())  # every block sent was received
