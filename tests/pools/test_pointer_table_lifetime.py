"""A prepared copy outlives the other owners of its pointer tables.

CI (2026-12-04) failed once with an illegal address in ``test_two_threads_preparing_one_kept_plan_each_launch_their_own
_indices``: two threads missing the compat table cache at once each built a table for the same entries; the second
thread's table replaced the first's in the cache and in the kept plan, so the first thread's only reference was its
own frame, gone when ``Plan.bind`` returned: the table was freed before its launch read it. Both tests below failed
before the fix (a :class:`PreparedCopy` now holds what it resolved; the cache keeps the first table stored)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from helpers.compat import two_paused_mla_loads
from helpers.operands import MODES, POISON, dev_idx, device

from kvtier.compat.sglang import kvcacheio as io
from kvtier.kernels.launch import ChunkCopy, ChunkSide, KernelLauncher
from kvtier.pools.pointer_table import build_pointer_table
from kvtier.runtime import create


@pytest.mark.parametrize("spec", MODES)
def test_a_prepared_copy_keeps_its_tables_after_every_other_owner_drops_them(spec):
    rt = create(spec)
    n, row = 16, 64
    src, dst = device(rt, (n, row)), device(rt, (n, row), data=False)
    si, di = dev_idx(rt, [3, 0, 9]), dev_idx(rt, [1, 15, 4])
    tables = [build_pointer_table(rt, 0, [x.address]) for x in (src, dst)]
    copy = ChunkCopy(src=ChunkSide(tables[0], row, 0), dst=ChunkSide(tables[1], row, 0), src_index=si.address,
                     dst_index=di.address, index_bytes=8, n_units=3, layer_begin=0, n_layers=1, n_pieces=1,
                     chunk_bytes=row)
    prepared = KernelLauncher(rt).prepare(copy, [(0, 1)], device=0)
    del tables, copy
    gc.collect()
    prepared(0, 1, rt.default_stream(0))
    rt.synchronize(0)
    want = torch.full((n, row), POISON, dtype=torch.uint8)
    want[[1, 15, 4]] = src.cpu()[[3, 0, 9]]
    assert torch.equal(dst.cpu(), want)


@pytest.mark.parametrize("spec", MODES)
def test_two_threads_building_one_table_at_once_launch_over_live_tables(spec):
    """Forced interleaving: both threads miss the table cache before either stores; A stores its tables first, B
    after, and A launches only once B has stored its kept preparation."""
    rt = create(spec)
    n, row = 32, 16
    src, dst = device(rt, (n, row)), device(rt, (n, row), data=False)
    io.transfer_kv_per_layer_mla(src, dst, dev_idx(rt, []), dev_idx(rt, []), row)   # a plan, no tables yet
    missed = threading.Barrier(2, timeout=60)
    a_built, a_assigned, b_stored = threading.Event(), threading.Event(), threading.Event()

    def me():
        return threading.current_thread().name

    def build():
        missed.wait()                               # both looked these entries up and found no table
        if me() == "B":
            a_built.wait(60)                        # B stores its table after A's
            a_built.clear()

    def stored():
        if me() == "A":
            a_built.set()

    def give_tables():
        if me() == "B":
            a_assigned.wait(60)                     # B gives the plan its tables after A

    def sides():
        if me() == "A":
            a_assigned.set()

    def returns():
        if me() == "A":
            b_stored.wait(60)                       # A launches once B stored its preparation
        else:
            b_stored.set()

    two_paused_mla_loads(rt, src, dst, row, {"operands.build_table": build, "operands.table_stored": stored,
                                             "kvcacheio.bind_tables": give_tables, "kvcacheio.bind_sides": sides,
                                             "kvcacheio.bind_return": returns})
