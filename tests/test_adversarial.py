"""Regressions found by trying to break kvtier through its public API: each test reproduced a real defect (numpy
integers kept raw, settings checked only at first use, raw OSErrors, a close racing a submission, ...).

Only public API is used (kvtier, kvtier.memory, kvtier.pools, kvtier.transfer, kvtier.runtime); data is checked
byte-for-byte with fresh random bytes against poisoned destinations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.pools import fill_device, poison_device, read_device

from kvtier.errors import BufferClosed, InvalidArgument, KvtierError, WrongRuntime
from kvtier.memory import DeviceBuffer, HostBuffer, get_device_accessible_ptr
from kvtier.pools import DevicePool, HostPool, KVGeometry, PageSlotAllocator
from kvtier.runtime import create
from kvtier.transfer import TransferEngine

G = KVGeometry.mha(2, kv_heads=2, head_dim=32, itemsize=2, page_size=4)


def _round_trip(engine: TransferEngine, dev: DevicePool) -> None:
    data = fill_device(dev)
    engine.backup([0, 1], [2, 3]).wait()
    poison_device(dev)
    engine.load([2, 3], [1, 0]).wait()
    for tensor in range(G.tensors):
        for layer in range(G.layers):
            np.testing.assert_array_equal(read_device(dev, tensor, layer)[[1, 0]], data[(tensor, layer)][[0, 1]])


# -- numpy integers: accepted by the argument checks, then mishandled ------------------------------------------------
def test_numpy_sized_host_buffer_does_not_break_later_buffers():
    """HostBuffer.allocate(np.int64(n)) succeeds, but in split mode it turns the runtime's alias counter into an
    np.int64, so every *later* registered buffer of that (process-shared) runtime fails to resolve."""
    rt = create("emulated:split")
    with HostBuffer.allocate(np.int64(8192), runtime=rt) as first:
        get_device_accessible_ptr(first, 0)
    with HostBuffer.allocate(8192, runtime=rt) as later:
        get_device_accessible_ptr(later, 0)  # AddressDomainError: DeviceAddress needs a non-negative int, np.int64


@pytest.mark.parametrize("spec", ["emulated:split", "emulated:unified"])
def test_numpy_region_offsets_resolve(spec):
    """region() accepts numpy integers (its checks allow them) but stores them raw: resolving the region, or asking its
    CPU address, then fails with AddressDomainError instead of giving the address."""
    rt = create(spec)
    with HostBuffer.allocate(8192, runtime=rt) as host, DeviceBuffer(8192, 0, runtime=rt) as device:
        host_region = host.region(np.int64(16), np.int64(16))
        assert get_device_accessible_ptr(host_region, 0) == get_device_accessible_ptr(host.region(16, 16), 0)
        assert host_region.cpu_address == host.cpu_address + 16
        assert get_device_accessible_ptr(device.region(np.int64(32), np.int64(16)), 0) == device.address + 32


@pytest.mark.parametrize("make", [
    pytest.param(lambda rt: DeviceBuffer(np.int64(4096), 0, runtime=rt), id="DeviceBuffer-size"),
    pytest.param(lambda rt: DeviceBuffer(4096, np.int64(0), runtime=rt), id="DeviceBuffer-device"),
    pytest.param(lambda rt: DevicePool.allocate(G, np.int64(4), 0, runtime=rt), id="DevicePool-pages"),
    pytest.param(lambda rt: HostBuffer.allocate(np.int64(8192), "pinned", runtime=rt), id="pinned-size"),
])
def test_numpy_sizes_are_accepted_like_ints(make):
    """The shared checks accept numpy integers (HostPool pages=np.int64 works), but these constructors pass the raw
    value on and the runtime refuses it: 'device_alloc: size must be a positive int, got np.int64(4096)' /
    'no device np.int64(0)'."""
    rt = create("emulated:unified")
    make(rt).close()


def test_staged_engine_accepts_numpy_staging_bytes():
    rt = create("emulated:unified")
    with DevicePool.allocate(G, 4, 0, runtime=rt) as dev, \
            HostPool.allocate(G, "page_first", pages=4, runtime=rt) as host:
        with TransferEngine(dev, host, backend="staged", staging_bytes=np.int64(1 << 20)) as engine:
            _round_trip(engine, dev)


def test_numpy_device_index_resolves():
    rt = create("emulated:split")
    with HostBuffer.allocate(8192, runtime=rt) as host:
        assert get_device_accessible_ptr(host, np.int64(1)) == get_device_accessible_ptr(host, 1)


# -- engine settings validated only at the first transfer ------------------------------------------------------------
@pytest.mark.parametrize("options", [
    pytest.param(dict(backend="staged", relayout_blocks=-1), id="relayout_blocks=-1"),
    pytest.param(dict(backend="staged", relayout_blocks=0.5), id="relayout_blocks=0.5"),
    pytest.param(dict(backend="kernel", threads=33), id="threads=33"),
    pytest.param(dict(backend="kernel", index_bytes=4.0), id="index_bytes=4.0"),
])
def test_bad_engine_settings_are_refused_at_construction(options):
    """These build an engine; the first backup() then dies in the launch boundary with a bare KvtierError ('launch of
    -1 blocks x 1024 threads'), after part of the transfer was queued. Construction should raise InvalidArgument."""
    rt = create("emulated:unified")
    with DevicePool.allocate(G, 4, 0, runtime=rt) as dev, \
            HostPool.allocate(G, "page_first", pages=4, runtime=rt) as host:
        with pytest.raises(InvalidArgument):
            TransferEngine(dev, host, **options).close()


# -- error types ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["registered", "pinned", "shm", "pageable"])
def test_an_impossible_host_buffer_raises_a_kvtier_error(kind, tmp_path, monkeypatch):
    """A buffer the machine cannot map escapes as a raw OSError ('mmap of ... bytes failed' / 'File too large')."""
    monkeypatch.setenv("KVTIER_SHM_DIR", str(tmp_path))
    with pytest.raises(KvtierError):
        HostBuffer.allocate(1 << 60, kind, runtime=create("emulated:split"))


def test_an_impossible_index_ring_raises_a_kvtier_error():
    rt = create("emulated:unified")
    with DevicePool.allocate(G, 4, 0, runtime=rt) as dev, \
            HostPool.allocate(G, "page_first", pages=4, runtime=rt) as host:
        with pytest.raises(KvtierError):
            TransferEngine(dev, host, index_ring_bytes=1 << 60)


def test_unknown_host_kind_is_an_invalid_argument():
    """HostLayout and PoolKind name the choices with InvalidArgument; HostKind raises a bare ValueError."""
    with pytest.raises(InvalidArgument):
        HostBuffer.allocate(4096, "bogus", runtime=create("emulated:split"))


def test_buffer_of_another_runtime_is_a_wrong_runtime_error():
    """The message reads 'buffer belongs to <EmulatedRuntime emulated:split>, not <EmulatedRuntime emulated:split>'
    (a plain KvtierError); streams and events of another runtime raise WrongRuntime."""
    owner, other = create("emulated:split"), create("emulated:split")
    with HostBuffer.allocate(4096, runtime=owner) as host:
        with pytest.raises(WrongRuntime):
            get_device_accessible_ptr(host, 0, runtime=other)


def test_empty_view_of_a_registered_buffer_is_not_called_pageable():
    """An empty slice of a registered buffer is refused as '0x0 is pageable host memory'."""
    rt = create("emulated:split")
    with HostBuffer.allocate(8192, runtime=rt) as host:
        view = host.as_tensor()[100:100]
        try:
            get_device_accessible_ptr(view, 0, runtime=rt)
        except KvtierError as exc:
            assert "pageable" not in str(exc)
        finally:
            del view


def test_layers_accept_a_tensor_like_pages_do():
    """Page lists take torch tensors; layers=torch.tensor([1]) is refused ('layers[0] must be an integer, got
    Tensor')."""
    rt = create("emulated:unified")
    with DevicePool.allocate(G, 4, 0, runtime=rt) as dev, \
            HostPool.allocate(G, "page_first", pages=4, runtime=rt) as host, TransferEngine(dev, host) as engine:
        engine.load(torch.tensor([0]), torch.tensor([1]), layers=torch.tensor([1])).wait()


# -- page slots ------------------------------------------------------------------------------------------------------
def test_slot_free_of_a_float_page_changes_nothing():
    """free([1.7]) silently frees page 1 (int() truncation): a caller's bad index releases a live slot."""
    slots = PageSlotAllocator(8)
    assert slots.allocate(3) == [0, 1, 2]
    with pytest.raises(KvtierError):
        slots.free([1.7])
    assert slots.free_pages == 5


def test_slot_allocator_refuses_non_integer_counts():
    """PageSlotAllocator(2.5) is built; allocate(2.5) dies with a bare TypeError; allocate(True) takes a page."""
    with pytest.raises(KvtierError):
        PageSlotAllocator(2.5)
    slots = PageSlotAllocator(8)
    for count in (2.5, True):
        with pytest.raises(KvtierError):
            slots.allocate(count)
    assert slots.free_pages == 8


# -- closing a host pool while another thread submits ----------------------------------------------------------------
class _Engine(TransferEngine):
    drained = False

    def drain(self) -> None:
        super().drain()
        self.drained = True


@pytest.mark.parametrize("backend", ["kernel", "direct", "staged", "batch"])
def test_host_pool_close_refuses_or_waits_for_a_concurrent_backup(backend):
    """HostPool.close() drains its engines one by one, then unregisters and unmaps the buffer without holding them
    off: a backup another thread submits after its engine was drained passes the open check, is queued, and runs
    against unregistered memory (device fault; on a GPU a DMA into unmapped memory). The hook below is that other
    thread: a second user of the pool (a second engine, say) being drained when the submission arrives."""
    for _ in range(50):
        rt = create("emulated:split:1:lazy")
        dev = DevicePool.allocate(G, 6, 0, runtime=rt)
        host = HostPool.allocate(G, "page_first", pages=8, runtime=rt)
        engine = _Engine(dev, host, backend=backend)
        fill_device(dev)
        submitted = []

        class OtherUser:
            def __init__(self, engine: _Engine, submitted: list) -> None:
                self.engine, self.submitted = engine, submitted

            def drain(self) -> None:
                if self.engine.drained:  # our engine was drained already: this is the window
                    try:
                        self.submitted.append(self.engine.backup([0, 1], [2, 3]))
                    except BufferClosed:
                        self.submitted.append(None)

        other = OtherUser(engine, submitted)
        host.add_user(other)
        host.close()
        if not submitted:
            engine.close(), dev.close()
            continue
        try:
            engine.close()  # waits for the late backup: IllegalAddress (its host memory was unregistered)
            rt.synchronize(0)
        finally:
            dev.close()
        return
    pytest.skip("drain order never put the engine first")
