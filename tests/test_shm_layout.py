"""How the shared-memory allreduce lays out a node's window and splits each bucket."""

import pytest

from hpctrain.comm.shm_allreduce import shared_bytes_needed, slice_bounds


@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 1000, 40_007])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 12])
def test_slices_cover_the_bucket_once_on_cache_line_boundaries(numel, parts):
    bounds = slice_bounds(numel, parts)
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == numel
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    # 16 fp32 = 64 bytes: slices of different owners never share a cache line
    assert all(b % 16 == 0 or b == numel for b in bounds)
    widths = [b - a for a, b in zip(bounds, bounds[1:])]
    assert max(widths) <= -(-numel // parts) + 15  # balanced up to the alignment


def test_each_bucket_and_the_flag_rows_get_their_own_cache_lines():
    assert shared_bytes_needed([1]) == 64 + 64
    assert shared_bytes_needed([16, 17]) == 2 * 64 + 64 + 128
