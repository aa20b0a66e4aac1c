"""How a request's pages map between two sides, without a wire: runs merge where both ends continue, pairs of
layouts that would scatter rows are converted locally first (every byte checked), and the wire's batches stay
within Mooncake's limits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers.disagg import DEVICE, GEOMETRY, expected, make_pool, read_kv, write_kv

from kvtier.disagg.plan import Side, compatible, gather, plan_runs
from kvtier.disagg.wire import MAX_ENTRY_BYTES, batches
from kvtier.pools import HostPool

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def side(pool, layout=None) -> Side:
    return Side.of(pool, "bfloat16", device_direct=layout == DEVICE)


@pytest.mark.parametrize("src_layout, dst_layout", list(itertools.product(LAYOUTS + [DEVICE], repeat=2)))
def test_runs_or_a_conversion_move_every_byte_to_its_place(rt, src_layout, dst_layout):
    """Compatible pairs go run by run (checked by copying each run); the others through a gather into the
    receiver's layout, then runs. Either way each destination page holds its source page's KV."""
    src = make_pool(GEOMETRY, src_layout, 12, rt)
    dst = make_pool(GEOMETRY, dst_layout, 12, rt)
    try:
        src_pages, dst_pages = np.array([3, 4, 5, 0, 11]), np.array([7, 8, 9, 1, 2])
        data = expected(1, len(src_pages))
        write_kv(src, src_pages, data)
        a, b = side(src, src_layout), side(dst, dst_layout)
        fits = compatible(a, b)
        assert fits == (src_layout == dst_layout or {src_layout, dst_layout} <= {"layer_first", "page_first_direct",
                                                                                   DEVICE})
        if DEVICE in (src_layout, dst_layout) or not fits:
            if not fits and DEVICE not in (src_layout, dst_layout):
                staging = HostPool.allocate(GEOMETRY, dst_layout, pages=len(src_pages), runtime=rt)
                gather(src, src_pages, staging, np.arange(len(src_pages)))
                assert np.array_equal(read_kv(staging, np.arange(len(src_pages))), data)
                staging.close()
            return
        runs = plan_runs(a, src_pages, b, dst_pages)
        assert runs.nbytes == len(src_pages) * GEOMETRY.bytes_per_page
        for s, d, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.lengths.tolist(), strict=True):
            rt.memcpy(dst.buffer.cpu_address + (d - dst.buffer.cpu_address.value),
                      src.buffer.cpu_address + (s - src.buffer.cpu_address.value), n)
        assert np.array_equal(read_kv(dst, dst_pages), data)
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("layout, runs_per_request", [("layer_first", 2 * 4), ("page_first", 2),
                                                      ("page_first_direct", 2), ("page_head", 2)])
def test_consecutive_pages_on_both_sides_make_one_run_per_piece_kind(rt, layout, runs_per_request):
    pool = make_pool(GEOMETRY, layout, 16, rt)
    other = make_pool(GEOMETRY, layout, 16, rt)
    try:
        runs = plan_runs(side(pool), np.arange(2, 10), side(other), np.arange(5, 13))
        assert len(runs.lengths) == runs_per_request
        scattered = plan_runs(side(pool), np.arange(2, 10), side(other), np.arange(13, 5, -1))
        assert len(scattered.lengths) == runs_per_request * 8
    finally:
        pool.close()
        other.close()


def test_batches_stay_within_entry_and_byte_limits():
    lengths = np.array([100, 3 * MAX_ENTRY_BYTES + 5, 7] + [64] * 20, dtype=np.int64)
    local = np.cumsum(np.concatenate(([0], lengths[:-1]))) + 1000
    remote = local + (1 << 40)
    got = list(batches(local, remote, lengths, max_entries=4, max_bytes=1 << 20))
    assert all(len(b[0]) <= 4 for b in got)
    assert all(sum(b[2]) <= 1 << 20 for b in got if len(b[2]) > 1)
    flat = [(s, d, n) for b in got for s, d, n in zip(*b, strict=True)]
    assert sum(n for _, _, n in flat) == lengths.sum() and max(n for _, _, n in flat) <= MAX_ENTRY_BYTES
    assert all(d - s == 1 << 40 for s, d, _ in flat)
    covered = sorted((s, s + n) for s, _, n in flat)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
