"""Round trips through the transfer engine: every pool kind, layout, backend, dtype and page size, byte-exact; host
pools registered in many small chunks too (the DMA backends match the kernel engine there); bad page and layer lists
are refused by name and move nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.operands import no_automatic_collection
from helpers.pools import (
    SMALL_MHA,
    engine_on,
    fill_device,
    fill_host,
    host_bytes,
    host_page,
    host_page_offsets,
    poison_device,
    read_device,
    small_engine,
)
from helpers.runtimes import is_split

from kvtier.errors import IllegalAddress, InvalidArgument, KvtierError
from kvtier.memory import CpuAddress, HostKind, get_device_accessible_ptr
from kvtier.pools import DevicePool, HostLayout, HostPool, KVGeometry
from kvtier.runtime import create
from kvtier.runtime.emulated import EmulatedRuntime
from kvtier.transfer import TransferEngine

LAYOUTS = [layout.value for layout in HostLayout]
BACKENDS = ["kernel", "staged", "direct", "batch"]
DTYPES = {"fp16": 2, "bf16": 2, "fp8": 1}


def geometry(kind: str, itemsize: int, page_size: int, layers: int = 2) -> KVGeometry:
    if kind == "mha":
        return KVGeometry.mha(layers, kv_heads=2, head_dim=32 * (2 // itemsize), itemsize=itemsize,
                              page_size=page_size)
    if kind == "mla":
        return KVGeometry.mla(layers, latent_bytes=576 if itemsize == 2 else 656, page_size=page_size)
    return KVGeometry.k_only(layers, heads=1, head_dim=64 // itemsize * 2, itemsize=itemsize, page_size=page_size)


def round_trip(runtime, g, layout, backend, device_pages=12, host_pages=16, count=5, index_bytes=8):
    rng = np.random.default_rng()
    dev = DevicePool.allocate(g, device_pages, 0, runtime=runtime)
    host = HostPool.allocate(g, layout, pages=host_pages, runtime=runtime)
    engine = TransferEngine(dev, host, backend=backend, index_bytes=index_bytes)
    try:
        data = fill_device(dev)
        host_before = fill_host(host)
        src = rng.choice(device_pages, count, replace=False)
        slots = rng.choice(host_pages, count, replace=False)
        engine.backup(src, slots).wait()
        after_backup = host_bytes(host)
        touched = np.zeros(host.buffer.nbytes, bool)
        for page in slots:
            for offset, size in host.page_spans(int(page)):
                touched[offset:offset + size] = True
        np.testing.assert_array_equal(after_backup[~touched], host_before[~touched])
        poison_device(dev)
        dst = rng.choice(device_pages, count, replace=False)
        engine.load(slots, dst).wait()
        for tensor in range(g.tensors):
            for layer in range(g.layers):
                got = read_device(dev, tensor, layer)
                np.testing.assert_array_equal(got[dst], data[(tensor, layer)][src])
                untouched = np.setdiff1d(np.arange(device_pages), dst)
                assert (got[untouched] == 0xEE).all()
    finally:
        engine.close()
        host.close()
        dev.close()


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla", "k_only"])
def test_round_trip(runtime, kind, layout, backend, dtype, page_size):
    round_trip(runtime, geometry(kind, DTYPES[dtype], page_size), layout, backend,
               count=3 if page_size == 64 else 5)


@pytest.mark.parametrize("row_bytes", [64, 576, 656, 2048])
def test_odd_row_sizes_with_int32_indices(runtime, row_bytes):
    g = KVGeometry.mla(3, latent_bytes=row_bytes, page_size=16)
    for layout in LAYOUTS:
        round_trip(runtime, g, layout, "kernel", index_bytes=4)


def test_empty_transfers_are_noops(runtime):
    g = geometry("mha", 2, 16)
    with engine_on(runtime, g, "page_first", device_pages=4, host_pages=4) as (dev, host, engine):
            before = fill_host(host)
            fill_device(dev)
            engine.backup([], []).wait()
            transfer = engine.load([], [])
            transfer.wait()
            transfer.wait_layer(1)
            np.testing.assert_array_equal(host_bytes(host), before)


def test_layerwise_load_marks_each_layer(runtime):
    g = geometry("mha", 2, 16, layers=4)
    with engine_on(runtime, g, "layer_first", device_pages=6, host_pages=6) as (dev, host, engine):
            data = fill_device(dev)
            engine.backup([0, 1], [4, 5]).wait()
            poison_device(dev)
            transfer = engine.load([4, 5], [2, 3], layers=[1, 3])
            transfer.wait_layer(1)
            np.testing.assert_array_equal(read_device(dev, 0, 1)[[2, 3]], data[(0, 1)][[0, 1]])
            transfer.wait()
            np.testing.assert_array_equal(read_device(dev, 1, 3)[[2, 3]], data[(1, 3)][[0, 1]])
            assert (read_device(dev, 0, 0) == 0xEE).all() and (read_device(dev, 1, 2) == 0xEE).all()
            assert transfer.done() and sorted(transfer.layer_events) == [1, 3]
            with pytest.raises(KvtierError, match="layer 0 is not part"):
                transfer.wait_layer(0)


def test_graph_replay_reads_host_data_written_after_capture(runtime):
    g = geometry("mha", 2, 16)
    with engine_on(runtime, g, "page_first_direct", device_pages=4, host_pages=4) as (dev, host, engine):
            poison_device(dev)
            captured = engine.capture_load([3, 0], [1, 2], layer=1)
            for _ in range(2):
                snapshot = fill_host(host)
                captured.replay()
                captured.stream.synchronize()
                for tensor in range(g.tensors):
                    got = read_device(dev, tensor, 1)
                    for host_page, dev_page in ((3, 1), (0, 2)):
                        offset = tensor * host.tensor_bytes + host_page * host.strides.page + host.strides.layer
                        np.testing.assert_array_equal(got[dev_page], snapshot[offset:offset + g.page_bytes])
                    assert (read_device(dev, tensor, 0) == 0xEE).all()
            captured.close()


def test_split_tables_hold_aliases_and_metadata_holds_cpu_addresses(split):
    g = geometry("mha", 2, 16)
    with engine_on(split, g, "layer_first", device_pages=4, host_pages=4) as (dev, host, engine):
            tensors, backend = range(g.tensors), engine._backend
            aliases = tuple(get_device_accessible_ptr(r, 0) for t in tensors for r in host.layer_regions(t))
            assert backend.host_table.entries == aliases
            cpu_addresses = [c.value for t in tensors for c in host.layer_cpu_addresses(t)]
            assert not {e.value for e in backend.host_table.entries} & set(cpu_addresses)
            assert backend.device_table.entries == tuple(a for t in tensors for a in dev.layer_device_addresses(t))
            cpu = host.buffer.cpu_address
            for pieces in host.page_metadata([0, 3]):
                for address, size in pieces:
                    assert 0 <= address - cpu < host.buffer.nbytes and size == g.page_bytes


def test_kernel_handed_cpu_addresses_faults(split):
    """The guard that would have caught the seed: bypass the boundary, put CPU addresses in a table."""
    from kvtier.kernels import ChunkCopy, KernelLauncher
    from kvtier.memory import DeviceAddress
    from kvtier.pools import build_pointer_table

    g = geometry("mha", 2, 16)
    dev = DevicePool.allocate(g, 4, 0, runtime=split)
    host = HostPool.allocate(g, "layer_first", pages=4, runtime=split)
    engine = TransferEngine(dev, host)
    backend = engine._backend
    wrong = [DeviceAddress(c.value, 0) for t in range(g.tensors) for c in host.layer_cpu_addresses(t)]
    bad_table = build_pointer_table(split, 0, wrong)
    (src_index, dst_index), _ = backend.rings["h2d"].upload([np.array([1]), np.array([2])])
    call = ChunkCopy(src=engine.plan.host_side(bad_table), dst=engine.plan.device_side(backend.device_table),
                     src_index=src_index, dst_index=dst_index, index_bytes=8, n_units=1, layer_begin=0, n_layers=1,
                     n_pieces=1, chunk_bytes=g.page_bytes, n_tensors=g.tensors, table_layers=g.layers)
    KernelLauncher(split).copy_chunks(call, device=0, stream=engine.streams["h2d"])
    with pytest.raises(IllegalAddress, match="not mapped"):
        engine.streams["h2d"].synchronize()
    with pytest.raises(IllegalAddress, match="poisoned"):
        engine.close()
    bad_table.close(), host.close(), dev.close()


def test_bad_input_is_refused_before_anything_is_written(runtime):
    g = geometry("mha", 2, 16)
    with engine_on(runtime, g, "page_first", device_pages=4, host_pages=4) as (dev, host, engine):
            before = fill_host(host)
            fill_device(dev)
            for dev_pages, host_pages, match in [([0, 4], [0, 1], "device page index 4"),
                                                 ([0, 1], [0, -1], "host page index -1"),
                                                 ([0, 1], [0], "must match"),
                                                 (np.array([0.0, 1.0]), [0, 1], "integers")]:
                with pytest.raises(KvtierError, match=match):
                    engine.backup(dev_pages, host_pages)
            with pytest.raises(KvtierError, match="layer 2 is out of range"):
                engine.load([0], [0], layers=[0, 2])
            engine.synchronize()
            np.testing.assert_array_equal(host_bytes(host), before)


def test_pageable_host_pool(runtime):
    g = geometry("mha", 2, 16)
    dev = DevicePool.allocate(g, 4, 0, runtime=runtime)
    host = HostPool.allocate(g, "layer_first", pages=4, kind=HostKind.PAGEABLE, runtime=runtime)
    try:
        with pytest.raises(KvtierError, match="pageable"):
            TransferEngine(dev, host, backend="kernel")
    finally:
        host.close(), dev.close()
    round_trip_pageable(runtime, g)


def round_trip_pageable(runtime, g):
    dev = DevicePool.allocate(g, 4, 0, runtime=runtime)
    host = HostPool.allocate(g, "layer_first", pages=4, kind=HostKind.PAGEABLE, runtime=runtime)
    engine = TransferEngine(dev, host, backend="direct")
    try:
        data = fill_device(dev)
        engine.backup([3, 1], [0, 2]).wait()
        poison_device(dev)
        engine.load([0, 2], [0, 1]).wait()
        np.testing.assert_array_equal(read_device(dev, 1, 1)[[0, 1]], data[(1, 1)][[3, 1]])
    finally:
        engine.close(), host.close(), dev.close()


def test_split_pool_over_chunks_with_scattered_aliases_is_refused_for_kernels(split):
    g = geometry("mha", 2, 16)
    host = HostPool.allocate(g, "page_first_direct", pages=8, runtime=split,
                             register_chunk_bytes=2 * g.layers * g.page_bytes)
    dev = DevicePool.allocate(g, 4, 0, runtime=split)
    try:
        assert is_split(split) and len(host.buffer.chunks) > 1
        with pytest.raises(KvtierError, match="not contiguous"):
            TransferEngine(dev, host)
    finally:
        host.close(), dev.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_staged_in_several_batches(runtime, layout):
    g = geometry("mha", 2, 16, layers=3)
    dev = DevicePool.allocate(g, 10, 0, runtime=runtime)
    host = HostPool.allocate(g, layout, pages=12, runtime=runtime)
    engine = TransferEngine(dev, host, backend="staged", staging_bytes=2 * g.bytes_per_page, relayout_blocks=4)
    try:
        data = fill_device(dev)
        src, slots = np.array([9, 0, 4, 7, 2]), np.array([5, 6, 1, 11, 2])
        engine.backup(src, slots).wait()
        poison_device(dev)
        dst = np.array([1, 3, 5, 8, 6])
        transfer = engine.load(slots, dst, layers=[2, 0])
        transfer.wait_layer(2)
        transfer.wait()
        for tensor in range(g.tensors):
            for layer in (0, 2):
                np.testing.assert_array_equal(read_device(dev, tensor, layer)[dst], data[(tensor, layer)][src])
            assert (read_device(dev, tensor, 1) == 0xEE).all()
    finally:
        engine.close(), host.close(), dev.close()


@pytest.mark.parametrize("direction", ["backup", "load"])
def test_staged_layer_first_moves_each_run_of_random_slots_as_one_strided_copy(split, monkeypatch, direction):
    """A layer_first host keeps a slot's layers a fixed stride apart: one strided copy per run and tensor, not one
    copy per run, tensor and layer (the per-call cost held random-slot staged copies to 21-31% of the link)."""
    g = geometry("mha", 2, 16, layers=6)
    dev = DevicePool.allocate(g, 12, 0, runtime=split)
    host = HostPool.allocate(g, "layer_first", pages=16, runtime=split)
    engine = TransferEngine(dev, host, backend="staged", relayout_blocks=4)
    heights: list[int] = []
    groups = split.groups

    def counted(*args):
        found = groups(*args)
        heights.extend(int(count) for count in found[:, 1])
        return found

    try:
        data = fill_device(dev)
        src, slots = np.array([9, 0, 4, 7, 2]), np.array([5, 13, 1, 11, 2])  # runs: [1, 2], [5], [11], [13]
        if direction == "load":
            engine.backup(src, slots).wait()
            poison_device(dev)
        monkeypatch.setattr(split, "groups", counted)
        if direction == "backup":
            engine.backup(src, slots).wait()
            monkeypatch.undo()
            poison_device(dev)
            engine.load(slots, src).wait()
        else:
            engine.load(slots, src).wait()
            monkeypatch.undo()
        assert heights == [g.layers] * (4 * g.tensors)
        for tensor in range(g.tensors):
            for layer in range(g.layers):
                np.testing.assert_array_equal(read_device(dev, tensor, layer)[src], data[(tensor, layer)][src])
    finally:
        engine.close(), host.close(), dev.close()


def test_slot_runs():
    from kvtier.transfer.staged import slot_runs

    assert slot_runs(np.array([1, 2, 3, 7, 8, 10])) == [(0, 1, 3), (3, 7, 2), (5, 10, 1)]
    assert slot_runs(np.array([], np.int64)) == []


@pytest.mark.parametrize("backend", ["kernel", "staged"])
def test_backup_and_load_at_once(runtime, backend):
    g = geometry("mha", 2, 16, layers=2)
    dev = DevicePool.allocate(g, 12, 0, runtime=runtime)
    host = HostPool.allocate(g, "page_first_direct", pages=12, runtime=runtime)
    engine = TransferEngine(dev, host, backend=backend, staging_bytes=2 * g.bytes_per_page)
    try:
        data = fill_device(dev)
        host_data = fill_host(host)
        backup = engine.backup([0, 1, 2, 3], [0, 1, 2, 3])
        load = engine.load([8, 9, 10, 11], [8, 9, 10, 11])
        backup.wait(), load.wait()
        for tensor in range(g.tensors):
            for layer in range(g.layers):
                got = read_device(dev, tensor, layer)
                for page in (8, 9, 10, 11):
                    offset = tensor * host.tensor_bytes + page * host.strides.page + layer * host.strides.layer
                    np.testing.assert_array_equal(got[page], host_data[offset:offset + g.page_bytes])
        after = host_bytes(host)
        for page in range(4):
            for tensor in range(g.tensors):
                offset = tensor * host.tensor_bytes + page * host.strides.page
                expected = np.concatenate([data[(tensor, layer)][page] for layer in range(g.layers)])
                np.testing.assert_array_equal(after[offset:offset + g.layers * g.page_bytes], expected)
    finally:
        engine.close(), host.close(), dev.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_of_no_layers_moves_nothing(runtime, backend):
    g = geometry("mha", 2, 16)
    with engine_on(runtime, g, "layer_first", backend=backend) as (dev, host, engine):
        fill_host(host)
        poison_device(dev)
        transfer = engine.load([0, 1], [2, 3], layers=[])
        transfer.wait()
        assert transfer.layer_events == {}
        assert all((read_device(dev, t, layer) == 0xEE).all() for t in range(g.tensors) for layer in range(g.layers))


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_of_layer_runs_in_one_operation_each(runtime, backend):
    """``per_layer=False``: layers 0-1 and 3 of 4 land (two operations), layer 2 stays poisoned, no layer events."""
    g = geometry("mha", 2, 16, layers=4)
    with engine_on(runtime, g, "page_first", device_pages=6, host_pages=6, backend=backend,
                   staging_bytes=2 * g.bytes_per_page) as (dev, host, engine):
        data = fill_device(dev)
        engine.backup([5, 0, 3], [1, 4, 2]).wait()
        poison_device(dev)
        transfer = engine.load([1, 4, 2], [2, 1, 4], layers=[3, 0, 1], per_layer=False)
        transfer.wait()
        assert transfer.layer_events == {}
        for tensor in range(g.tensors):
            for layer in range(g.layers):
                got = read_device(dev, tensor, layer)
                if layer == 2:
                    assert (got == 0xEE).all()
                else:
                    np.testing.assert_array_equal(got[[2, 1, 4]], data[(tensor, layer)][[5, 0, 3]])
                    assert (got[[0, 3, 5]] == 0xEE).all()


def test_layer_spans():
    from kvtier.transfer.plan import layer_spans

    assert layer_spans([3, 0, 1, 2, 5], per_layer=False) == [(3, 1), (0, 3), (5, 1)]
    assert layer_spans([0, 1], per_layer=True) == [(0, 1), (1, 1)]
    assert layer_spans([], per_layer=False) == []


@pytest.mark.parametrize("layout, heads, unit_major", [
    ("layer_first", 8, False), ("page_first", 8, True), ("page_first", 1, True), ("page_first_direct", 8, True),
    ("page_head", 8, False), ("page_head", 1, True)])
def test_many_layer_copies_walk_unit_by_unit_where_the_host_keeps_a_units_layers_together(layout, heads, unit_major):
    """page_first keeps a token's layers adjacent, page_first_direct (and page_head with one head) a page's: a backup
    of every layer then writes whole host pages instead of one row per layer and token (the 1152-byte MLA rows that
    ran at 50% at 2 SMs)."""
    from kvtier.pools.geometry import host_strides
    from kvtier.transfer.plan import plan_for

    g = KVGeometry.mha(4, kv_heads=heads, head_dim=64, itemsize=2, page_size=16)
    plan = plan_for(g, host_strides(g, layout, 8))
    assert plan.unit_major is unit_major
    if unit_major:  # one unit's chunks, layer after layer, are one contiguous host run
        units_stride = plan.host.page if plan.unit == "page" else plan.host.slot
        assert plan.host.layer * g.layers == units_stride and plan.host.layer == plan.chunk_bytes


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_captured_shape_loads_new_pages_at_every_call(runtime, monkeypatch, layout):
    """One graph for loads of 3 pages: each call writes its own page lists into the graph's indices (poisoned
    destinations, fresh data each time), queues no kernel launch from Python, and is ordered like a load."""
    from helpers.pools import launch_names

    g = geometry("mha", 2, 16, layers=4)
    with engine_on(runtime, g, layout, device_pages=8, host_pages=10) as (dev, host, engine):
        shape = engine.capture_shape(3, layers=[3, 1, 2])
        names = launch_names(runtime, monkeypatch)
        rng = np.random.default_rng()
        for _ in range(3):
            snapshot = fill_host(host)
            poison_device(dev)
            slots, pages = rng.choice(10, 3, replace=False), rng.choice(8, 3, replace=False)
            transfer = shape.load(slots, pages)
            transfer.wait()
            with pytest.raises(KvtierError, match="no layer events"):
                transfer.wait_layer(1)
            for tensor in range(g.tensors):
                for layer in range(g.layers):
                    got = read_device(dev, tensor, layer)
                    if layer == 0:
                        assert (got == 0xEE).all()
                        continue
                    for slot, page in zip(slots.tolist(), pages.tolist(), strict=True):
                        start = host.tensor_offset(tensor) + slot * host.strides.page + layer * host.strides.layer
                        rows = [snapshot[start + t * host.strides.slot:start + t * host.strides.slot + g.row_bytes]
                                for t in range(g.page_size)]
                        np.testing.assert_array_equal(got[page], np.concatenate(rows))
                    untouched = np.setdiff1d(np.arange(dev.pages), pages)
                    assert (got[untouched] == 0xEE).all()
        engine.load([0, 1, 2], [5, 6, 7]).wait()
        assert names, "the plain loads launch kernels"
        names.clear()
        shape.load([0, 1, 2], [5, 6, 7]).wait()
        assert names == [], "a captured shape launched kernels from Python"
        with pytest.raises(KvtierError, match="loads 3 pages"):
            shape.load([0, 1], [2, 3])
        with pytest.raises(KvtierError, match="more than once"):
            shape.load([0, 1, 2], [2, 2, 3])
        shape.close()
        with pytest.raises(KvtierError, match="closed"):
            shape.load([0, 1, 2], [5, 6, 7])


def test_a_captured_shape_is_refused_by_other_backends_and_closes_with_its_engine(split):
    g = geometry("mha", 2, 16)
    with engine_on(split, g, "layer_first", backend="staged") as (dev, host, engine):
        with pytest.raises(KvtierError, match="kernel backend"):
            engine.capture_shape(2)
    with engine_on(split, g, "layer_first") as (dev, host, engine):
        shape = engine.capture_shape(2)
        with pytest.raises(KvtierError, match="pages"):
            engine.capture_shape(0)
    with pytest.raises(KvtierError, match="closed"):
        shape.load([0, 1], [2, 3])


def test_captured_shape_loads_queue_without_waiting_for_the_work_they_follow(split):
    """Eight loads queued behind a long model kernel: none waits on the CPU for an earlier one (each has its own
    staging slot), and each lands its own pages once the model is done."""
    g = geometry("mha", 2, 16, layers=2)
    with engine_on(split, g, "layer_first", device_pages=16, host_pages=16) as (dev, host, engine):
        shape = engine.capture_shape(2)
        snapshot = fill_host(host)
        poison_device(dev)
        model = split.create_stream(0)
        split.busy(model, 100_000)
        done = split.create_event(0)
        pairs = [(np.array([2 * i, 2 * i + 1]), np.array([15 - 2 * i, 14 - 2 * i])) for i in range(8)]
        transfers = [shape.load(slots, pages, after=model) for slots, pages in pairs]
        done.record(model)
        assert not done.query(), "queuing the loads waited for the model"
        for transfer in transfers:
            transfer.wait()
        for tensor in range(g.tensors):
            for layer in range(g.layers):
                got = read_device(dev, tensor, layer)
                for slots, pages in pairs:
                    for slot, page in zip(slots.tolist(), pages.tolist(), strict=True):
                        start = host.tensor_offset(tensor) + slot * host.strides.page + layer * host.strides.layer
                        np.testing.assert_array_equal(got[page], snapshot[start:start + g.page_bytes])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_duplicate_destinations_are_refused_and_nothing_moves(runtime, backend):
    with engine_on(runtime, SMALL_MHA, "page_first", backend=backend) as (dev, host, engine):
        snapshot = fill_host(host)
        fill_device(dev)
        with pytest.raises(InvalidArgument, match="host_pages names page 3 more than once"):
            engine.backup([0, 1], [3, 3])
        engine.synchronize()
        np.testing.assert_array_equal(host_bytes(host), snapshot)
        poison_device(dev)
        with pytest.raises(InvalidArgument, match="device_pages names page 2 more than once"):
            engine.load([0, 1], [2, 2])
        engine.synchronize()
        assert (read_device(dev, 1, 1) == 0xEE).all()
        engine.backup([1, 1], [0, 2]).wait()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_round_trip_through_a_host_pool_of_many_registrations(runtime, backend, layout):
    """Merged runs crossed registration boundaries: direct/batch on layer_first and staged on every layout failed
    with cudaErrorInvalidValue (on the H200 too, past 64 GiB)."""
    if backend == "kernel" and is_split(runtime):
        pytest.skip("split aliases of separate registrations are not contiguous: the kernel backend refuses them")
    rng = np.random.default_rng()
    pages = 12
    granule = SMALL_MHA.page_bytes if layout == "layer_first" else SMALL_MHA.layers * SMALL_MHA.page_bytes
    dev = DevicePool.allocate(SMALL_MHA, pages, 0, runtime=runtime)
    host = HostPool.allocate(SMALL_MHA, layout, pages=pages, runtime=runtime, register_chunk_bytes=3 * granule)
    engine = TransferEngine(dev, host, backend=backend, staging_bytes=5 * SMALL_MHA.bytes_per_page)
    try:
        assert len(host.buffer.chunks) > 4
        data = fill_device(dev)
        slots = np.arange(pages)
        sources = rng.permutation(pages)
        engine.backup(sources, slots).wait()
        poison_device(dev)
        targets = rng.permutation(pages)
        engine.load(slots, targets).wait()
        for tensor in range(SMALL_MHA.tensors):
            for layer in range(SMALL_MHA.layers):
                np.testing.assert_array_equal(read_device(dev, tensor, layer)[targets], data[(tensor, layer)][sources])
    finally:
        engine.close(), host.close(), dev.close()


def test_int32_indices_refuse_values_they_cannot_hold():
    from kvtier.transfer.plan import index_values

    assert index_values(np.array([0, (1 << 31) - 1]), 4).dtype == np.int32
    with pytest.raises(InvalidArgument, match="int32"):
        index_values(np.array([5, 1 << 31]), 4)
    assert index_values(np.array([1 << 40]), 8)[0] == 1 << 40


@pytest.mark.parametrize("layers, match", [([0.5], "layers must hold integers"),
                                           (["1"], "layers must hold integers"),
                                           ([True], "layers must hold integers"),
                                           ([1, 1], "repeat"), (3, "sequence of layer indices")])
def test_bad_layers_name_the_argument(split, layers, match):
    with engine_on(split, SMALL_MHA, "page_first") as (dev, host, engine):
        with pytest.raises(InvalidArgument, match=match):
            engine.load([0], [1], layers=layers)


@pytest.mark.parametrize("pages, match", [([[0, 1], [2]], "device_pages must be a flat sequence"),
                                          ([0.0, 1.0], "device_pages must hold integers"),
                                          ([True, False], "device_pages must hold integers"),
                                          ("01", "device_pages must be a sequence"),
                                          (np.zeros((1, 2), np.int64), "flat")])
def test_bad_page_lists_name_the_argument(split, pages, match):
    with engine_on(split, SMALL_MHA, "page_first") as (dev, host, engine):
        with pytest.raises(InvalidArgument, match=match):
            engine.backup(pages, [0, 1])


def test_torch_index_tensors_are_accepted(split):
    with engine_on(split, SMALL_MHA, "page_first") as (dev, host, engine):
        engine.backup(torch.tensor([0, 1]), torch.tensor([3, 2], dtype=torch.int32)).wait()


def test_a_captured_shape_loads_from_strided_int64_page_arrays():
    """``shape.load(host_pages, device_pages)`` with int64 numpy page arrays that are views with a stride (``a[::2]``,
    ``a[::-1]``, a column of a 2-D array) raised a bare numpy ValueError ("To change to a dtype of a different size,
    the last axis must be contiguous") on hosts whose unit is the page (``layer_first``, ``page_first_direct``);
    plain ``engine.load``/``engine.backup`` on the kernel backend failed the same way. Any flat integer sequence is
    accepted (``index_array`` says so) and the load moves the right bytes. (Found adversarially, issue #13.)"""
    g = geometry("mha", 2, 4)
    runtime = EmulatedRuntime("split", seed=3)
    with engine_on(runtime, g, "layer_first", device_pages=8, host_pages=10) as (dev, host, engine):
        shape = engine.capture_shape(3)
        snapshot = fill_host(host)
        poison_device(dev)
        slots = np.arange(10, dtype=np.int64)[::3][:3]        # 0, 3, 6: a strided view
        pages = np.arange(8, dtype=np.int64)[::-2][:3]        # 7, 5, 3: a negative stride
        shape.load(slots, pages).wait()
        for tensor in range(g.tensors):
            for layer in range(g.layers):
                got = read_device(dev, tensor, layer)
                for slot, page in zip(slots.tolist(), pages.tolist(), strict=True):
                    np.testing.assert_array_equal(got[page], host_page(host, snapshot, tensor, layer, slot))
                assert (got[np.setdiff1d(np.arange(8), pages)] == 0xEE).all()


def test_a_second_shape_load_does_not_block_the_cpu_on_the_first_loads_after():
    """The second ``shape.load`` blocked the calling thread — while holding the engine lock, so every other thread's
    ``load``/``backup`` (the cache's backup thread) waited too — until everything the *first* load was ordered after
    had run: the one staging area was reused after a CPU wait for the first load's index copy, which sat behind the
    first load's ``after`` (typically the model's stream, i.e. a whole forward pass). Here the second load has
    ``after=None`` and must return while the model stream's long kernel still runs, as plain ``engine.load`` queued
    the same way does (README: no load() synchronizes). (Found adversarially, issue #13.)"""
    g = geometry("mha", 2, 4)
    runtime = EmulatedRuntime("split", seed=1)
    with engine_on(runtime, g, "layer_first", device_pages=8, host_pages=8) as (dev, host, engine):
        shape = engine.capture_shape(2)
        fill_host(host)
        model = runtime.create_stream(0)
        runtime.busy(model, 100_000)
        model_done = runtime.create_event(0)
        model_done.record(model)
        engine.load([1, 2], [3, 4], after=model)
        engine.load([5, 6], [1, 2], after=None)
        assert not model_done.query(), "precondition: plain loads queue without waiting"
        shape.load([1, 2], [3, 4], after=model)
        assert not model_done.query()
        shape.load([5, 6], [1, 2], after=None)
        assert not model_done.query(), "the second shape load waited on the CPU for the model's stream"
        engine.synchronize()


# Byte-exact checks of every backend, host layout and geometry against a numpy model of the layouts, over
# combinations the tests above do not reach: several registration chunks under the staged backend, odd layer orders,
# int32 indices, signal and non-signal loads compared to one model.
GEOMETRIES = [KVGeometry.mha(4, kv_heads=2, head_dim=16, itemsize=2, page_size=4),
              KVGeometry.mha(2, kv_heads=8, head_dim=8, itemsize=2, page_size=3),
              KVGeometry.mla(5, latent_bytes=96, page_size=4),
              KVGeometry.k_only(3, heads=3, head_dim=16, itemsize=2, page_size=5)]


def _set_device_layer(dev: DevicePool, tensor: int, layer: int, data: np.ndarray) -> None:
    dev.runtime.memcpy(dev.layer_device_addresses(tensor)[layer], CpuAddress(data.ctypes.data), data.nbytes)
    dev.runtime.legacy_stream(dev.device).synchronize()


def _check_ops(seed: int, g: KVGeometry, layout: str, backend: str, ops, *, dev_pages: int, host_pages: int,
               register_chunk_bytes: int | None = None, **engine_kwargs) -> None:
    mode = "unified" if register_chunk_bytes and backend == "kernel" else "split"   # split aliases of separate
    runtime = EmulatedRuntime(mode, seed=seed)                                        # chunks are not contiguous
    rng = np.random.default_rng(seed)
    dev = DevicePool.allocate(g, dev_pages, 0, runtime=runtime)
    extra = {} if register_chunk_bytes is None else {"register_chunk_bytes": register_chunk_bytes}
    host = HostPool.allocate(g, layout, pages=host_pages, runtime=runtime, **extra)
    engine = TransferEngine(dev, host, backend=backend, **engine_kwargs)
    view = host.buffer.as_tensor().numpy()
    try:
        for op in ops:
            view[:] = rng.integers(0, 256, view.size, dtype=np.uint8)
            before_host = view.copy()
            before_dev = {}
            for t in range(g.tensors):
                for layer in range(g.layers):
                    before_dev[(t, layer)] = rng.integers(0, 256, dev.layer_bytes, dtype=np.uint8)
                    _set_device_layer(dev, t, layer, before_dev[(t, layer)])
            if op[0] == "backup":
                _, device_pages, slots = op
                engine.backup(device_pages, slots).wait()
                want = before_host.copy()
                for (t, layer), data in before_dev.items():
                    for d, h in zip(device_pages, slots, strict=True):
                        want[host_page_offsets(host, t, layer, h)] = data[d * g.page_bytes:(d + 1) * g.page_bytes]
                bad = np.flatnonzero(view != want)
                assert not bad.size, f"{op}: {bad.size} host bytes wrong, first at {bad[:4]}"
            else:
                _, slots, device_pages, layers, per_layer = op
                engine.load(slots, device_pages, layers=layers, per_layer=per_layer).wait()
                chosen = range(g.layers) if layers is None else layers
                for (t, layer), data in before_dev.items():
                    want = data.copy()
                    if layer in chosen:
                        for d, h in zip(device_pages, slots, strict=True):
                            want[d * g.page_bytes:(d + 1) * g.page_bytes] = \
                                before_host[host_page_offsets(host, t, layer, h)]
                    bad = np.flatnonzero(read_device(dev, t, layer).reshape(-1) != want)
                    assert not bad.size, f"{op}: tensor {t} layer {layer}: {bad.size} device bytes wrong"
    finally:
        del view
        engine.close()
        host.close()
        dev.close()


def _random_ops(rng, g: KVGeometry, dev_pages: int, host_pages: int, count: int = 4):
    ops = []
    for _ in range(count):
        k = int(rng.integers(1, min(dev_pages, host_pages) + 1))
        if rng.random() < 0.5:
            if rng.random() < 0.5:                          # a run of consecutive host slots, maybe shuffled
                first = int(rng.integers(0, host_pages - k + 1))
                slots = rng.permutation(np.arange(first, first + k)).tolist()
            else:
                slots = rng.choice(host_pages, k, replace=False).tolist()
            ops.append(("backup", rng.integers(0, dev_pages, k).tolist(), slots))   # sources may repeat
        else:
            layers = None if rng.random() < 0.3 else rng.permutation(g.layers)[:rng.integers(1, g.layers + 1)].tolist()
            slots, pages = rng.integers(0, host_pages, k).tolist(), rng.choice(dev_pages, k, replace=False).tolist()
            ops.append(("load", slots, pages, layers, bool(rng.random() < 0.7)))
    return ops


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend, options", [("kernel", {}), ("kernel", {"layer_signals": False}),
                                              ("kernel", {"index_bytes": 4}), ("staged", {"small": True}),
                                              ("direct", {}), ("batch", {})],
                         ids=["kernel-signals", "kernel-events", "kernel-int32", "staged-small", "direct", "batch"])
def test_every_byte_against_a_numpy_model_of_the_layouts(layout, backend, options):
    """All-layer backups (unit-major on page_first / page_first_direct / one-head page_head hosts), per-layer and
    per_layer=False loads with layer subsets in odd orders, random and consecutive slots, repeated sources, on hosts
    registered in several chunks: every byte of the destination pool is compared with a numpy model."""
    options = dict(options)
    for seed in range(8):
        rng = np.random.default_rng(seed)
        g = GEOMETRIES[seed % len(GEOMETRIES)]
        dev_pages, host_pages = int(rng.integers(2, 9)), int(rng.integers(3, 14))
        kwargs = {k: v for k, v in options.items() if k != "small"}
        if options.get("small"):
            kwargs["staging_bytes"] = int(g.bytes_per_page * rng.integers(1, 4))
        if seed % 2:
            granularity = g.page_bytes if layout == "layer_first" else g.layers * g.page_bytes
            kwargs["register_chunk_bytes"] = math.lcm(granularity, 4096)
        _check_ops(seed, g, layout, backend, _random_ops(rng, g, dev_pages, host_pages), dev_pages=dev_pages,
                   host_pages=host_pages, **kwargs)


@pytest.mark.parametrize("mode", ["emulated:split", "emulated:split:lazy", "emulated:unified"])
@pytest.mark.parametrize("backend", ["direct", "batch", "staged"])
@no_automatic_collection()
def test_ok_dma_engines_over_host_pools_in_small_chunks_match_the_kernel_engine(mode, backend):
    """Host pools of every layout registered in chunks of one or two granules (so slot runs cross registration
    boundaries; on split aliases the chunks' aliases do not continue each other), one and two heads: a backup of 7
    pages into a run of consecutive slots over a boundary, then per-layer, whole and layer-subset loads back, each
    byte for byte equal to the kernel engine over an unchunked pool of the same layout and the same random bytes."""
    rt = create(mode)
    for layout in LAYOUTS:
        for chunk, heads in ((12288, 1), (24581, 2)):
            g, dev, host_pool, engine = small_engine(rt, backend, layout, heads=heads, register_chunk_bytes=chunk)
            reference = HostPool.allocate(g, layout, pages=10, runtime=rt)
            check = TransferEngine(dev, reference, backend="kernel")
            try:
                assert host_pool.buffer.registration_boundaries
                data = fill_device(dev)
                reference.buffer.as_tensor().numpy()[:] = fill_host(host_pool)
                src, slots = np.array([7, 0, 3, 5, 1, 2, 6]), np.array([3, 4, 5, 6, 7, 8, 9])
                engine.backup(src, slots).wait()
                check.backup(src, slots).wait()
                assert np.array_equal(host_bytes(host_pool), host_bytes(reference)), (layout, chunk)
                dst = np.array([2, 6, 0, 4, 7, 1, 3])
                for per_layer, layers in ((True, None), (False, [2, 0]), (True, [1])):
                    poison_device(dev)
                    transfer = engine.load(slots, dst, layers=layers, per_layer=per_layer)
                    if per_layer:
                        transfer.wait_layer((layers or [0])[0])
                    transfer.wait()
                    got = {(t, layer): read_device(dev, t, layer) for t in range(g.tensors)
                           for layer in range(g.layers)}
                    poison_device(dev)
                    check.load(slots, dst, layers=layers, per_layer=per_layer).wait()
                    for (t, layer), value in got.items():
                        assert np.array_equal(value, read_device(dev, t, layer)), (layout, chunk, t, layer)
                        if layers is None or layer in layers:
                            assert np.array_equal(value[dst], data[(t, layer)][src])
            finally:
                engine.close(), check.close(), host_pool.close(), reference.close(), dev.close()
