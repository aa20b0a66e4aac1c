"""Per-layer loads as one launch: the kernel advances a device counter per layer, a signal stream turns each counter
reaching its target into that layer's event.

The ordering tests run on the eager emulator over many seeds: streams run in a seeded random order, so a layer event
that fired before its layer landed (a wrong target, a counter that another load already advanced) shows up as stale
bytes read by the consumer for some seed. The negative control proves the check can fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.pools import engine_on, fill_host, host_page_offsets, host_page_rows, launch_names

from kvtier.errors import AddressDomainError, InvalidArgument, KvtierError
from kvtier.kernels import ChunkCopy, ChunkSide, KernelLauncher
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind
from kvtier.pools import HostPool, KVGeometry, build_pointer_table
from kvtier.runtime.emulated import EmulatedRuntime
from kvtier.transfer.signals import LayerSignals

G = KVGeometry.mha(4, kv_heads=2, head_dim=32, itemsize=2, page_size=16)
SEEDS = range(10)


# 8 layers of 64-byte rows: a per-layer load from a page_first host walks layers two at a time (signal_group 2)
GROUPED = KVGeometry.mla(8, latent_bytes=64, page_size=16)


def _stale_layer_reads(seed: int, layout: str, backend: str = "kernel", G: KVGeometry = G) -> int:  # noqa: N803
    """Two loads into the same pages, the second behind a busy model stream; a consumer stream waits for each layer
    event of the second and reads that layer at once. Returns how many (tensor, layer, page) reads were stale."""
    runtime = EmulatedRuntime("split", seed=seed)
    pages, first_slots, second_slots = np.array([3, 0]), np.array([1, 4]), np.array([5, 2])
    with engine_on(runtime, G, layout, device_pages=6, host_pages=6, backend=backend,
                   staging_bytes=G.bytes_per_page) as (dev, host, engine), \
            HostBuffer.allocate(G.bytes_per_page * 2, HostKind.PINNED, runtime=runtime) as out:
        assert isinstance(engine._backend.signals, LayerSignals)
        snapshot = fill_host(host)
        engine.load(first_slots, pages)
        model = runtime.create_stream(0)
        runtime.busy(model, 40)
        launch = runtime.launch

        def slow_launch(program, name, **kwargs):  # each copy kernel takes a while to start
            runtime.busy(kwargs["stream"], 20)
            launch(program, name, **kwargs)

        runtime.launch = slow_launch
        second = engine.load(second_slots, pages, after=model)
        runtime.launch = launch
        consumer = runtime.create_stream(0)
        view, offset, expected = out.as_tensor().numpy(), 0, []
        for layer in range(G.layers):
            second.stream_wait(consumer, layer=layer)
            for tensor in range(G.tensors):
                base = dev.layer_device_addresses(tensor)[layer]
                for page, slot in zip(pages.tolist(), second_slots.tolist(), strict=True):
                    runtime.memcpy_async(out.cpu_address + offset, base + page * G.page_bytes, G.page_bytes,
                                         stream=consumer)
                    expected.append((offset, host_page_rows(host, snapshot, tensor, layer, slot)))
                    offset += G.page_bytes
        consumer.synchronize()
        stale = sum(not np.array_equal(view[at:at + G.page_bytes], want) for at, want in expected)
        del view
        second.wait()
        return stale


@pytest.mark.parametrize("backend", ["kernel", "staged"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_each_layer_event_fires_after_its_layer_landed(layout, backend):
    """staged: one page of staging, so the pages go in two batches and only the last one's relayout signals."""
    stale = {seed: _stale_layer_reads(seed, layout, backend) for seed in SEEDS}
    assert not any(stale.values()), f"stale reads per seed: {stale}"


def test_layers_walked_in_groups_fire_after_their_group_landed():
    """A page_first host of 64-byte rows: the load walks layers two at a time (a group's first layer waits for the
    group's counter, the second gets its event right after)."""
    from kvtier.transfer.plan import plan_for

    with HostPool.allocate(GROUPED, "page_first", pages=2, runtime=EmulatedRuntime("split", seed=0)) as host:
        assert plan_for(GROUPED, host.strides).signal_group() == 2
    stale = {seed: _stale_layer_reads(seed, "page_first", "kernel", GROUPED) for seed in SEEDS}
    assert not any(stale.values()), f"stale reads per seed: {stale}"


def test_the_group_check_fails_when_a_group_signals_before_its_last_layer(monkeypatch):
    """Negative control for the grouped walk: a reference kernel that counts a group's chunks as soon as its first
    layer is copied lets the second layer's event fire early."""
    from kvtier.kernels import reference

    def early(memory, sides, units, groups, group_orders, n_pieces, chunk_bytes, width, counters, per_layer):
        for layers, order in zip(groups, group_orders, strict=True):  # one tensor: a chunk's plane is its layer
            for _ in range(reference.LAYER_STEPS):
                yield
            head = [pair for pair in order if pair[0] == layers[0]]
            reference._copy(memory, sides, units, head, n_pieces, chunk_bytes, width)
            reference._read(memory, counters + 8 * layers[0], 1, np.uint64)[0] += np.uint64(per_layer * len(layers))
            for _ in range(reference.LAYER_STEPS):
                yield
            reference._copy(memory, sides, units, order, n_pieces, chunk_bytes, width)

    monkeypatch.setattr(reference, "_signalled", early)
    assert any(_stale_layer_reads(seed, "page_first", "kernel", GROUPED) for seed in SEEDS)


def test_the_check_fails_when_targets_forget_earlier_loads(monkeypatch):
    """Negative control: targets that restart from zero let the second load's events fire on the first's counts."""
    def forgetful(self, layers, transfer):
        self.targets = [0] * len(self.targets)
        original(self, layers, transfer)

    original = LayerSignals.arm
    monkeypatch.setattr(LayerSignals, "arm", forgetful)
    assert any(_stale_layer_reads(seed, "layer_first") for seed in SEEDS)
    assert any(_stale_layer_reads(seed, "layer_first", "staged") for seed in SEEDS)


@pytest.mark.parametrize("backend", ["kernel", "staged"])
@pytest.mark.parametrize("signals", [None, False])
def test_a_per_layer_load_is_one_launch_with_signals_and_one_per_layer_without(runtime, monkeypatch, signals,
                                                                              backend):
    """(staged: the relayout of the one batch, the only launches.)"""
    with engine_on(runtime, G, "page_first_direct", device_pages=4, host_pages=4, layer_signals=signals,
                   backend=backend) as (dev, host, engine):
        fill_host(host)
        names = launch_names(runtime, monkeypatch)
        transfer = engine.load([1, 3], [0, 2])
        transfer.wait()
        assert len(names) == (1 if signals is None else G.layers)
        assert sorted(transfer.layer_events) == list(range(G.layers))
        names.clear()
        engine.load([1, 3], [0, 2], layers=[3, 0, 1]).wait()  # runs of consecutive layers: [3], [0, 1]
        assert len(names) == (2 if signals is None else 3)


def test_layer_signals_need_a_runtime_that_waits_on_memory(split, monkeypatch):
    monkeypatch.setattr(split, "supports_wait_value", lambda device: False)
    with pytest.raises(InvalidArgument, match="cannot wait on a memory value"):
        with engine_on(split, G, "layer_first", layer_signals=True):
            pass
    with engine_on(split, G, "layer_first") as (_, _, engine):
        assert engine._backend.signals is None  # automatic: falls back to a launch and an event per layer
    with pytest.raises(InvalidArgument, match="layer_signals must be"):
        with engine_on(split, G, "layer_first", layer_signals="yes"):
            pass


def test_wait_value_refuses_what_a_gpu_would_not_take(split):
    stream = split.create_stream(0)
    with DeviceBuffer(64, 0, runtime=split) as counter, HostBuffer.allocate(64, HostKind.PINNED,
                                                                            runtime=split) as host:
        with pytest.raises(AddressDomainError, match="not a DeviceAddress"):
            split.wait_value(stream, host.cpu_address, 1)
        with pytest.raises(InvalidArgument, match="8-byte aligned"):
            split.wait_value(stream, counter.address + 4, 1)
        for value in (-1, 1 << 63, 1.5, True):
            with pytest.raises(InvalidArgument, match="value must be"):
                split.wait_value(stream, counter.address, value)
        with pytest.raises(InvalidArgument, match="not a stream"):
            split.wait_value(None, counter.address, 1)
        counter.upload(np.array([7], np.uint64))
        split.wait_value(stream, counter.address, np.uint64(7))  # numpy integers are integers
        stream.synchronize()
    stream.close()


def test_wait_value_holds_a_stream_until_another_writes_the_value(runtime):
    waiter, writer = runtime.create_stream(0), runtime.create_stream(0)
    with DeviceBuffer(8, 0, runtime=runtime) as counter, HostBuffer.allocate(16, HostKind.PINNED,
                                                                             runtime=runtime) as host:
        counter.upload(np.array([3], np.uint64))
        view = host.as_tensor().numpy().view(np.uint64)
        view[:] = [9, 0]
        runtime.wait_value(waiter, counter.address, 9)
        runtime.memcpy_async(host.cpu_address + 8, counter.address, 8, stream=waiter)  # reads the counter after
        runtime.memcpy_async(counter.address, host.cpu_address, 8, stream=writer)      # the write of 9
        waiter.synchronize()
        assert int(view[1]) == 9
        del view
    waiter.close(), writer.close()


def test_a_wait_nothing_will_satisfy_is_reported_not_hung():
    runtime = EmulatedRuntime("split", seed=0)
    stream = runtime.create_stream(0)
    with DeviceBuffer(8, 0, runtime=runtime) as counter:
        counter.upload(np.array([0], np.uint64))
        runtime.wait_value(stream, counter.address, 1)
        with pytest.raises(KvtierError, match="memory value nothing writes"):
            stream.synchronize()
        counter.upload(np.array([1], np.uint64))
        stream.synchronize()


# (tensors, table layers, first layer, layers, units, pieces, chunk bytes)
SHAPES = [(2, 5, 1, 3, 7, 1, 9216), (1, 4, 0, 4, 33, 3, 64), (2, 3, 2, 1, 5, 2, 48)]


@pytest.mark.parametrize("absent", [False, True], ids=["all", "absent-units"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"shape{i}" for i in range(len(SHAPES))])
def test_each_layer_counter_grows_by_the_layers_chunk_count(runtime, shape, absent):
    """The counters of the launched layers grow by ``chunks_per_layer`` (chunks after the 4 KiB cut), the others
    not at all, and the bytes are copied as without counters. Units marked absent (a negative index on either side)
    are skipped but still counted, so a waiter on the layer is released."""
    tensors, table_layers, first, layers, units, pieces, chunk = shape
    rng = np.random.default_rng()
    unit_bytes = pieces * chunk
    layer_bytes = units * unit_bytes
    memories = [DeviceBuffer(tensors * table_layers * layer_bytes, 0, runtime=runtime) for _ in range(2)]
    tables = [build_pointer_table(runtime, 0, [m.address + r * layer_bytes for r in range(tensors * table_layers)])
              for m in memories]
    source = rng.integers(1, 256, memories[0].nbytes, dtype=np.uint8)
    memories[0].upload(source)
    memories[1].upload(np.zeros(memories[1].nbytes, np.uint8))
    order = rng.permutation(units)
    marked = [order.copy(), order.copy()]
    if absent:
        marked[0][0] = -1                       # absent on the source side
        marked[1][units // 2] = -3              # absent on the destination side (any negative value)
    index_buffers = []
    for values in marked:
        index_buffers.append(DeviceBuffer(8 * units, 0, runtime=runtime))
        index_buffers[-1].upload(values.astype(np.int64))
    start = rng.integers(0, 1 << 40, table_layers).astype(np.uint64)
    counters = DeviceBuffer(8 * table_layers, 0, runtime=runtime)
    counters.upload(start)
    sides = [ChunkSide(t, 0, unit_bytes, chunk, 1 << 20) for t in tables]
    call = ChunkCopy(src=sides[0], dst=sides[1], src_index=index_buffers[0], dst_index=index_buffers[1], index_bytes=8,
                     n_units=units, layer_begin=first, n_layers=layers, n_pieces=pieces, chunk_bytes=chunk,
                     n_tensors=tensors, table_layers=table_layers, layer_done=counters)
    stream = runtime.create_stream(0)
    prepared = KernelLauncher(runtime).copy_chunks(call, device=0, stream=stream)
    stream.synchronize()
    expected = start.copy()
    expected[first:first + layers] += np.uint64(prepared.chunks_per_layer)
    np.testing.assert_array_equal(np.frombuffer(counters.download(), np.uint64), expected)
    assert prepared.chunks_per_layer >= tensors * units * pieces
    got, want = np.frombuffer(memories[1].download(), np.uint8), np.zeros(memories[1].nbytes, np.uint8)
    for row in [t * table_layers + first + layer for t in range(tensors) for layer in range(layers)]:
        base = row * layer_bytes
        for src_unit, dst_unit in zip(*marked, strict=True):
            if src_unit >= 0 and dst_unit >= 0:
                want[base + unit_bytes * dst_unit:base + unit_bytes * (dst_unit + 1)] = \
                    source[base + unit_bytes * src_unit:base + unit_bytes * (src_unit + 1)]
    np.testing.assert_array_equal(got, want)
    stream.close()
    for handle in (*index_buffers, counters, *tables, *memories):
        handle.close()


def test_layer_counters_are_refused_where_they_cannot_work(split):
    with DeviceBuffer(64, 0, runtime=split) as table, DeviceBuffer(8, 0, runtime=split) as small:
        side = ChunkSide(table, 1024, 0)
        base = dict(src=side, dst=side, src_index=table, dst_index=table, index_bytes=8, n_units=1, layer_begin=0,
                    n_layers=2, n_pieces=1, chunk_bytes=1024)
        with pytest.raises(KvtierError, match="layer-major"):
            ChunkCopy(**base, unit_major=True, layer_done=small).validate()
        with pytest.raises(KvtierError, match="cannot hold 2"):
            ChunkCopy(**base, layer_done=small).validate()
        for bad in (0, -1, 2.0, True, None):
            with pytest.raises(KvtierError, match="layer_group"):
                ChunkCopy(**base, layer_group=bad).validate()


def test_engines_close_with_layer_events_still_queued(runtime):
    """Closing drains the signal stream too: no event is left recorded on a destroyed stream."""
    with engine_on(runtime, G, "layer_first", device_pages=4, host_pages=4) as (dev, host, engine):
        fill_host(host)
        transfers = [engine.load([0, 1], [2, 3]) for _ in range(3)]
    for transfer in transfers:
        assert transfer.done()
        transfer.wait_layer(G.layers - 1)


def test_a_transfer_orders_a_later_one_and_layerless_transfers_say_so(split):
    with engine_on(split, G, "layer_first", device_pages=4, host_pages=4) as (dev, host, engine):
        fill_host(host)
        backup = engine.backup([0, 1], [2, 3])
        load = engine.load([2, 3], [1, 0], after=backup)   # a Transfer is a valid `after`
        load.wait()
        with pytest.raises(InvalidArgument, match="no layer events"):
            backup.wait_layer(0)
        with pytest.raises(InvalidArgument, match="no layer events"):
            engine.load([2], [3], per_layer=False).stream_wait(layer=1)


def test_the_check_fails_when_a_layer_waits_on_the_layer_before(monkeypatch):
    """Negative control for mid-launch signals: the emulator runs a signalled copy a layer at a time, so an event
    that waits on layer l-1's counter fires while layer l is still being copied (with all counters bumped at the
    end of the launch, as the emulator did first, this bug went unseen)."""
    def off_by_one(self, layers, transfer):
        for layer, adds in layers:
            for block, position, chunks in adds:
                at = self.offsets[block] + position
                self.targets[at] += chunks
                seen = at - 1 if position else at           # the bug: the layer before's counter and target
                self.runtime.wait_value(self.stream, self.counters.address + 8 * seen, self.targets[seen])
            event = self.runtime.create_event(self.device)
            event.record(self.stream)
            transfer.layer_events[layer] = event

    monkeypatch.setattr(LayerSignals, "arm", off_by_one)
    assert any(_stale_layer_reads(seed, "layer_first") for seed in SEEDS)


@pytest.mark.parametrize("signals", [None, False])
def test_transfer_events_are_timed_so_a_trace_can_place_each_layer(runtime, signals):
    """Events handed to the caller carry timestamps (bench/e2e.py's trace reads when each layer landed)."""
    with engine_on(runtime, G, "layer_first", device_pages=4, host_pages=4, layer_signals=signals) as (
            dev, host, engine):
        fill_host(host)
        start = runtime.create_event(0, timing=True)
        start.record(runtime.current_stream(0))
        transfer = engine.load([0, 1], [2, 3])
        transfer.wait()
        for layer in range(G.layers):
            transfer.wait_layer(layer)
            assert start.elapsed_ms(transfer.layer_events[layer]) >= 0
        assert start.elapsed_ms(transfer.finished) >= 0


def test_staged_honours_layer_signals_true(split):
    with engine_on(split, G, "layer_first", backend="staged", layer_signals=True) as (_, _, engine):
        assert engine._backend.signals is not None


@pytest.mark.parametrize("backend", ["direct", "batch"])
def test_layer_signals_true_is_not_silently_ignored_by_other_backends(split, backend):
    """``layer_signals=True`` is a demand: the kernel backend raises InvalidArgument where it cannot honour it
    ("layer_signals=True: ... cannot wait on a memory value"). The other backends took the setting in ``**_`` and
    dropped it, building an engine whose layer events were plain events with no word to the caller. A backend that
    does not signal refuses it with InvalidArgument naming the setting (only None/False make sense there).
    (Found adversarially, issue #13.)"""
    with pytest.raises(InvalidArgument, match="layer_signals"):
        with engine_on(split, G, "layer_first", backend=backend, layer_signals=True):
            pass


@pytest.mark.parametrize("schedule", ["eager", "lazy"])
@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_layer_events_of_back_to_back_loads_behind_busy_streams(schedule, layout):
    """Eight loads into disjoint device pages, most behind a busy model stream, with layer subsets in odd orders and
    a tiny index ring; a consumer waits for each (load, layer) event in a shuffled order and reads that layer's pages
    at once. No read may be stale. (Checked: with ``LayerSignals.arm`` patched to restart its targets from zero, the
    lazy runs report stale reads at seed 0; the eager runs, whose consumer rarely gets a step between a premature
    event and the kernel, do not.)"""
    g = KVGeometry.mla(5, latent_bytes=96, page_size=4)
    for seed in range(6):
        runtime = EmulatedRuntime("split", seed=seed, schedule=schedule)
        rng = np.random.default_rng(seed)
        with engine_on(runtime, g, layout, device_pages=16, host_pages=8, index_ring_bytes=256,
                       index_bytes=4 if seed % 2 else 8) as (dev, host, engine), \
                HostBuffer.allocate(g.page_bytes * 2 * g.layers * 8, HostKind.PINNED, runtime=runtime) as out:
            snapshot = fill_host(host)
            model = runtime.create_stream(0)
            loads = []
            for i in range(8):
                pages, slots = [2 * i + 1, 2 * i], rng.integers(0, 8, 2).tolist()
                layers = rng.permutation(g.layers)[:rng.integers(1, g.layers + 1)].tolist()
                runtime.busy(model, int(rng.integers(1, 200)))
                loads.append((engine.load(slots, pages, layers=layers, after=model), pages, slots, layers))
            consumer = runtime.create_stream(0)
            reads, offset = [], 0
            order = [(i, layer) for i in range(8) for layer in loads[i][3]]
            rng.shuffle(order)
            for i, layer in order:
                transfer, pages, slots, _ = loads[i]
                transfer.stream_wait(consumer, layer=layer)
                base = dev.layer_device_addresses(0)[layer]
                for page, slot in zip(pages, slots, strict=True):
                    runtime.memcpy_async(out.cpu_address + offset, base + page * g.page_bytes, g.page_bytes,
                                         stream=consumer)
                    reads.append((offset, host_page_offsets(host, 0, layer, slot), (i, layer, page)))
                    offset += g.page_bytes
            consumer.synchronize()
            view = out.as_tensor().numpy()
            stale = [info for at, index, info in reads
                     if not np.array_equal(view[at:at + g.page_bytes], snapshot[index])]
            del view
            for transfer, *_ in loads:
                transfer.wait()
            assert not stale, f"seed {seed}: stale reads {stale[:4]}"
