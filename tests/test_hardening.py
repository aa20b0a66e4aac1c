"""Defects found by trying kvtier adversarially, each pinned by a test that failed before its fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.device_kernels import TOUCH
from helpers.pools import engine_on, fill_device, fill_host, host_bytes, poison_device, read_device
from helpers.runtimes import is_split

from kvtier.errors import IllegalAddress, InvalidArgument, KvtierError, MisalignedAddress, RegistrationError
from kvtier.memory import DeviceBuffer, HostBuffer, get_device_accessible_ptr, tensor_extent
from kvtier.pools import DevicePool, HostLayout, HostPool, KVGeometry, build_pointer_table
from kvtier.runtime.emulated import EmulatedRuntime
from kvtier.transfer import BACKENDS, TransferEngine

G = KVGeometry.mha(2, kv_heads=2, head_dim=32, itemsize=2, page_size=16)
LAYOUTS = [layout.value for layout in HostLayout]


# -- 1. strided tensors resolve their whole extent ------------------------------------------------------------------
def test_tensor_extent_follows_strides():
    base = torch.zeros(4, 1024, dtype=torch.int32)
    assert tensor_extent(base) == (0, 4 * 1024 * 4)
    assert tensor_extent(base[:, :4]) == (0, 3 * 4096 + 16)
    assert tensor_extent(base.t()) == (0, 4 * 1024 * 4)
    assert tensor_extent(base[0:1, 0:1].expand(8, 8)) == (0, 4)
    assert tensor_extent(base[:0]) == (0, 0)


def test_strided_rows_across_a_registration_chunk(runtime):
    """Rows 4096 bytes apart, 16 bytes each: the old numel*itemsize measure saw 32 bytes inside chunk 0."""
    with HostBuffer.allocate(8192, runtime=runtime, granularity=4096, register_chunk_bytes=4096) as buf:
        rows = buf.as_tensor().view(2, 4096)[:, :16]
        if is_split(runtime):
            with pytest.raises(RegistrationError, match="not contiguous"):
                get_device_accessible_ptr(rows, 0, runtime=runtime)
        else:
            assert get_device_accessible_ptr(rows, 0, runtime=runtime) == get_device_accessible_ptr(buf, 0)
        del rows


def test_strided_view_past_the_buffer_end_is_refused(runtime):
    """Two 16-byte rows 8 KiB apart from the start of an 8 KiB buffer: 32 bytes by numel, 8208 by extent."""
    import ctypes

    with HostBuffer.allocate(8192, runtime=runtime) as buf:
        wider = torch.frombuffer((ctypes.c_uint8 * 16384).from_address(buf.cpu_address.value), dtype=torch.uint8)
        past = wider.view(2, 8192)[:, :16]
        with pytest.raises(RegistrationError, match="runs past"):
            get_device_accessible_ptr(past, 0, runtime=runtime)
        inside = wider.view(4, 4096)[:2, :16]
        assert get_device_accessible_ptr(inside, 0, runtime=runtime) == get_device_accessible_ptr(buf, 0)
        del wider, past, inside


# -- 5. duplicate destination pages -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_duplicate_destinations_are_refused_and_nothing_moves(runtime, backend):
    with engine_on(runtime, G, "page_first", backend=backend) as (dev, host, engine):
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


# -- 6. DMA over host pools registered in several chunks ----------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_round_trip_through_a_host_pool_of_many_registrations(runtime, backend, layout):
    """Merged runs crossed registration boundaries: direct/batch on layer_first and staged on every layout failed
    with cudaErrorInvalidValue (on the H200 too, past 64 GiB)."""
    if backend == "kernel" and is_split(runtime):
        pytest.skip("split aliases of separate registrations are not contiguous: the kernel backend refuses them")
    rng = np.random.default_rng()
    pages = 12
    granule = G.page_bytes if layout == "layer_first" else G.layers * G.page_bytes
    dev = DevicePool.allocate(G, pages, 0, runtime=runtime)
    host = HostPool.allocate(G, layout, pages=pages, runtime=runtime, register_chunk_bytes=3 * granule)
    engine = TransferEngine(dev, host, backend=backend, staging_bytes=5 * G.bytes_per_page)
    try:
        assert len(host.buffer.chunks) > 4
        data = fill_device(dev)
        slots = np.arange(pages)
        sources = rng.permutation(pages)
        engine.backup(sources, slots).wait()
        poison_device(dev)
        targets = rng.permutation(pages)
        engine.load(slots, targets).wait()
        for tensor in range(G.tensors):
            for layer in range(G.layers):
                np.testing.assert_array_equal(read_device(dev, tensor, layer)[targets], data[(tensor, layer)][sources])
    finally:
        engine.close(), host.close(), dev.close()


# -- 7. faults are sticky --------------------------------------------------------------------------------------------
def test_a_fault_poisons_later_transfers_on_the_device():
    runtime = EmulatedRuntime("split", schedule="lazy")
    dev = DevicePool.allocate(G, 4, 0, runtime=runtime)
    host = HostPool.allocate(G, "page_first", pages=4, runtime=runtime)
    engine = TransferEngine(dev, host, backend="kernel")
    from kvtier.memory import DeviceAddress
    from kvtier.runtime import i64
    runtime.launch(runtime.load_program(TOUCH, 0), "touch", grid=1, block=32, stream=engine.streams["h2d"],
                   args=[DeviceAddress(host.buffer.cpu_address.value, 0), i64(16)])
    behind = engine.load([0], [1])
    with pytest.raises(IllegalAddress, match="not mapped"):
        behind.wait()
    for call in (behind.done, behind.wait, lambda: engine.backup([0], [1])):
        with pytest.raises(IllegalAddress, match="poisoned"):
            call()
    with pytest.raises(IllegalAddress):
        engine.close()
    host.close(), dev.close()


# -- 11. alignment, hot-path allocation, int32 indices, one module ---------------------------------------------------
def test_misaligned_layer_bases_are_refused_at_the_pool(runtime):
    with DeviceBuffer(4 * G.page_bytes + 64, 0, runtime=runtime) as memory:
        shifted = [[memory.region(8, 4 * G.page_bytes)] * G.layers for _ in range(G.tensors)]
        with pytest.raises(MisalignedAddress, match="not 16-byte aligned"):
            DevicePool(G, 4, 0, runtime, shifted)


def test_the_reference_kernel_faults_on_a_misaligned_vector_access(split):
    """A GPU dies with cudaErrorMisalignedAddress; the emulator must fault too, not copy."""
    from kvtier.kernels import ChunkCopy, ChunkSide, KernelLauncher

    src, dst, table, index = (DeviceBuffer(n, 0, runtime=split) for n in (4096, 4096, 16, 16))
    table.upload(np.array([src.address.value + 8, dst.address.value], np.uint64))
    index.upload(np.zeros(2, np.int64))
    stream = split.create_stream(0)
    call = ChunkCopy(ChunkSide(table.region(0, 8), 1024, 0), ChunkSide(table.region(8, 8), 1024, 0), index, index,
                     8, 1, 0, 1, 1, 1024)
    KernelLauncher(split).copy_chunks(call, device=0, stream=stream)
    with pytest.raises(MisalignedAddress, match="misaligned"):
        stream.synchronize()


def test_table_entries_decide_the_access_width_at_the_boundary(split):
    """A base 8 bytes off a 16-byte boundary is copied with 8-byte accesses (a 16-byte access there faults the
    emulated device as it would a GPU), and every byte lands."""
    from kvtier.kernels import ChunkCopy, ChunkSide, KernelLauncher

    with DeviceBuffer(4096, 0, runtime=split) as memory, DeviceBuffer(4096, 0, runtime=split) as out, \
            DeviceBuffer(16, 0, runtime=split) as index:
        data = np.random.default_rng().integers(1, 256, 4096, dtype=np.uint8)
        memory.upload(data)
        out.upload(np.full(4096, 0xEE, np.uint8))
        index.upload(np.array([0, 0], np.int64))
        table = build_pointer_table(split, 0, [memory.region(8, 1024)])
        good = build_pointer_table(split, 0, [out.region(0, 1024)])
        call = ChunkCopy(ChunkSide(table, 1024, 0), ChunkSide(good, 1024, 0), index, index, 8, 1, 0, 1, 1, 1024)
        stream = split.create_stream(0)
        KernelLauncher(split).copy_chunks(call, device=0, stream=stream)
        stream.synchronize()
        got = np.frombuffer(out.download(), np.uint8)
        np.testing.assert_array_equal(got[:1024], data[8:1032])
        assert (got[1024:] == 0xEE).all()


@pytest.mark.parametrize("backend", ["kernel", "staged"])
def test_no_allocation_on_the_hot_path(runtime, backend, monkeypatch):
    """cudaHostAlloc/cudaMalloc/cudaFree wait for every stream: a load beside 95 ms of compute returned after 95 ms."""
    pages = 64
    with engine_on(runtime, G, "page_first", device_pages=pages, host_pages=pages, backend=backend,
                   staging_bytes=32 * G.bytes_per_page) as (dev, host, engine):
        calls = []
        for name in ("device_alloc", "device_free", "host_alloc", "host_free", "host_register", "synchronize"):
            original = getattr(runtime, name)
            monkeypatch.setattr(runtime, name, lambda *a, _n=name, _o=original, **k: (calls.append(_n), _o(*a, **k))[1])
        for _ in range(4):
            engine.backup(np.arange(pages), np.arange(pages))
            engine.load(np.arange(pages), np.arange(pages)[::-1])
        assert calls == []
        monkeypatch.undo()
        engine.synchronize()


def test_tables_are_on_the_device_before_the_first_transfer():
    """Tables went up with a pageable cudaMemcpy on the legacy stream, which may return before the bytes land,
    while the engine's streams do not wait for that stream."""
    for seed in range(6):
        runtime = EmulatedRuntime("unified", schedule="lazy", seed=seed)
        with engine_on(runtime, G, "layer_first", engine=False) as (dev, host, _):
            data = fill_device(dev)
            engine = TransferEngine(dev, host, backend="kernel")
            engine.backup([2], [3], after=None).wait()
            engine.close()
            start = 3 * G.page_bytes
            np.testing.assert_array_equal(host_bytes(host)[start:start + G.page_bytes], data[(0, 0)][2])


def test_int32_indices_refuse_values_they_cannot_hold():
    from kvtier.transfer.plan import index_values

    assert index_values(np.array([0, (1 << 31) - 1]), 4).dtype == np.int32
    with pytest.raises(InvalidArgument, match="int32"):
        index_values(np.array([5, 1 << 31]), 4)
    assert index_values(np.array([1 << 40]), 8)[0] == 1 << 40


def test_engines_share_one_loaded_program_per_device(runtime):
    with engine_on(runtime, G, "page_first", engine=False) as (dev, host, _):
        before = len(runtime._programs)
        engines = [TransferEngine(dev, host) for _ in range(3)]
        for engine in engines:
            engine.backup([0], [1]).wait()
        assert len(runtime._programs) <= before + 1
        for engine in engines:
            engine.close()


# -- 12. loose checks ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers, match", [([0.5], "layers must hold integers"),
                                           (["1"], "layers must hold integers"),
                                           ([True], "layers must hold integers"),
                                           ([1, 1], "repeat"), (3, "sequence of layer indices")])
def test_bad_layers_name_the_argument(split, layers, match):
    with engine_on(split, G, "page_first") as (dev, host, engine):
        with pytest.raises(InvalidArgument, match=match):
            engine.load([0], [1], layers=layers)


@pytest.mark.parametrize("pages, match", [([[0, 1], [2]], "device_pages must be a flat sequence"),
                                          ([0.0, 1.0], "device_pages must hold integers"),
                                          ([True, False], "device_pages must hold integers"),
                                          ("01", "device_pages must be a sequence"),
                                          (np.zeros((1, 2), np.int64), "flat")])
def test_bad_page_lists_name_the_argument(split, pages, match):
    with engine_on(split, G, "page_first") as (dev, host, engine):
        with pytest.raises(InvalidArgument, match=match):
            engine.backup(pages, [0, 1])


def test_torch_index_tensors_are_accepted(split):
    with engine_on(split, G, "page_first") as (dev, host, engine):
        engine.backup(torch.tensor([0, 1]), torch.tensor([3, 2], dtype=torch.int32)).wait()


def test_bools_and_floats_are_not_offsets(runtime):
    with HostBuffer.allocate(8192, runtime=runtime) as buf, DeviceBuffer(4096, 0, runtime=runtime) as dev:
        for offset in (True, 1.0, "16"):
            with pytest.raises(InvalidArgument, match="offset must be an integer"):
                buf.region(offset, 16)
            with pytest.raises(InvalidArgument, match="offset must be an integer"):
                dev.upload(b"\x01" * 16, offset)
        with pytest.raises(KvtierError):
            buf.cpu_address + True


def test_unknown_layout_lists_the_choices(runtime):
    with pytest.raises(InvalidArgument, match="'layer_first', 'page_first', 'page_first_direct', 'page_head'"):
        HostPool.allocate(G, "page-first", pages=2, runtime=runtime)


def test_raw_integers_are_refused_by_the_copy_and_launch_apis(split):
    from kvtier.errors import AddressDomainError

    with DeviceBuffer(64, 0, runtime=split) as dev:
        with pytest.raises(AddressDomainError, match="CpuAddress or DeviceAddress"):
            split.memcpy(dev.address, dev.address.value, 64)
        stream = split.create_stream(0)
        with pytest.raises(AddressDomainError, match="raw integers"):
                    split.launch(split.load_program(TOUCH, 0), "touch", grid=1, block=32, stream=stream,
                         args=[dev.address.value, 16])
