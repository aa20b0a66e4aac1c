"""Runtime contracts every backend keeps: devices, copies (typed addresses only), streams and events, registration
bookkeeping."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from helpers.device_kernels import TOUCH, random_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import RegistrationError, RuntimeCallError
from kvtier.memory import CpuAddress, DeviceAddress, DeviceBuffer, HostBuffer, HostKind, get_device_accessible_ptr
from kvtier.runtime import MemoryType


def test_device_attributes(runtime):
    assert runtime.device_count() >= 1
    attrs = runtime.device_attributes(0)
    assert attrs.unified_addressing and attrs.can_map_host_memory and attrs.host_register_supported
    assert attrs.total_memory > 0 and attrs.multiprocessors >= 1


@contextlib.contextmanager
def round_trip_buffers(runtime, n):
    """A pinned host buffer of 2n bytes (random data, then poison) and n bytes of device 0 memory.

    Yields the two addresses, a function that copies out the second (poisoned) half, and the data.
    """
    data = random_bytes(n)
    with HostBuffer.allocate(2 * n, HostKind.PINNED, runtime=runtime) as host, \
            DeviceBuffer(n, 0, runtime=runtime) as dev:
        view = host.as_tensor().numpy()
        view[:n], view[n:] = data, 0x3C
        del view
        yield host.cpu_address, dev.address, lambda: host.as_tensor().numpy()[n:].copy(), data


def test_async_copies_complete_in_stream_order(runtime):
    n = 1 << 20
    with round_trip_buffers(runtime, n) as (host, dev, second_half, data):
        stream, done = runtime.create_stream(0), runtime.create_event(0, timing=True)
        start, untimed = runtime.create_event(0, timing=True), runtime.create_event(0)
        start.record(stream)
        runtime.memcpy_async(dev, host, n, stream=stream)
        runtime.memcpy_async(host + n, dev, n, stream=stream)
        done.record(stream)
        done.synchronize()
        assert done.query()
        assert start.elapsed_ms(done) >= 0
        untimed.record(stream)
        untimed.synchronize()
        with pytest.raises(RuntimeCallError, match="cudaEventElapsedTime"):
            start.elapsed_ms(untimed)  # events only order unless made with timing=True (cheaper on CUDA)
        np.testing.assert_array_equal(second_half(), data)
        for handle in (stream, done, start, untimed):
            handle.close()


def test_stream_waits_on_an_event_of_another_stream(runtime):
    n = 1 << 16
    with round_trip_buffers(runtime, n) as (host, dev, second_half, data):
        upload, download, uploaded = runtime.create_stream(0), runtime.create_stream(0), runtime.create_event(0)
        runtime.memcpy_async(dev, host, n, stream=upload)
        uploaded.record(upload)
        download.wait(uploaded)
        runtime.memcpy_async(host + n, dev, n, stream=download)
        download.synchronize()
        np.testing.assert_array_equal(second_half(), data)


def test_pointer_attributes(runtime):
    with HostBuffer.allocate(4096, runtime=runtime) as reg, DeviceBuffer(4096, 0, runtime=runtime) as dev, \
            HostBuffer.allocate(4096, HostKind.PAGEABLE, runtime=runtime) as page:
        host = runtime.pointer_attributes(reg.cpu_address.value)
        assert host.type is MemoryType.HOST and host.host_pointer == reg.cpu_address.value
        assert host.device_pointer == get_device_accessible_ptr(reg, runtime.current_device()).value
        device = runtime.pointer_attributes(dev.address.value)
        assert device.type is MemoryType.DEVICE and device.device == 0
        assert runtime.pointer_attributes(page.cpu_address.value).type is MemoryType.UNREGISTERED


def test_double_registration_is_refused_and_changes_nothing(runtime):
    with HostBuffer.allocate(1 << 16, runtime=runtime) as buf:
        before = get_device_accessible_ptr(buf, 0)
        for start, size in [(0, 4096), (8192, 4096), (0, 1 << 16)]:
            with pytest.raises(RegistrationError, match="already registered"):
                runtime.host_register(buf.cpu_address.value + start, size)
        assert get_device_accessible_ptr(buf, 0) == before
        assert runtime.host_range(buf.cpu_address.value).nbytes == 1 << 16


def test_unregister_needs_the_cpu_address_it_was_registered_with(runtime):
    with HostBuffer.allocate(1 << 16, runtime=runtime) as buf:
        alias = get_device_accessible_ptr(buf, 0).value
        with pytest.raises(RegistrationError, match="inside"):
            runtime.host_unregister(buf.cpu_address.value + 4096)
        if alias != buf.cpu_address.value:
            with pytest.raises(RegistrationError, match="not a range kvtier knows"):
                runtime.host_unregister(alias)
        assert runtime.host_range(buf.cpu_address.value) is not None
    assert runtime.host_range(buf.chunks[0][0].value) is None if buf.chunks else True


def test_device_free_of_unknown_address_is_an_error(runtime):
    with DeviceBuffer(4096, 0, runtime=runtime) as dev:
        with pytest.raises(RuntimeCallError):
            runtime.device_free(dev.address.value + 4096 * 1024 * 1024)


def test_registration_without_portable_is_for_the_current_device_only(runtime):
    from kvtier import osmem
    from kvtier.runtime import HostRegisterFlags

    device = runtime.device_count() - 1
    address = osmem.map_memory(1 << 16)
    try:
        with runtime.using_device(device):
            runtime.host_register(address, 1 << 16, HostRegisterFlags.MAPPED)
        try:
            assert runtime.host_get_device_pointer(address + 64, device) >= 64
            if runtime.name.startswith("emulated") and runtime.device_count() > 1:
                with pytest.raises(RuntimeCallError, match="without PORTABLE"):
                    runtime.host_get_device_pointer(address, 0)
        finally:
            runtime.host_unregister(address)
    finally:
        osmem.unmap_memory(address, 1 << 16)


@pytest.mark.gpu
def test_cuda_shares_current_device_and_streams_with_torch(cuda):
    import torch

    assert cuda.current_device() == torch.cuda.current_device()
    n = 1 << 20
    data = torch.randint(1, 256, (n,), dtype=torch.uint8).pin_memory()
    target = torch.full((n,), 9, dtype=torch.uint8, device="cuda:0")
    torch_stream = torch.cuda.Stream(device=0)
    stream = cuda.wrap_stream(torch_stream.cuda_stream, 0)
    cuda.memcpy_async(DeviceAddress(target.data_ptr(), 0), CpuAddress(data.data_ptr()), n, stream=stream)
    torch_stream.synchronize()
    assert torch.equal(target.cpu(), data)
    stream.close()
    torch_stream.synchronize()


@pytest.mark.parametrize("direction", ["load", "backup"])
def test_evenly_spaced_runs_go_as_strided_copies_and_land_exactly(runtime, direction):
    """One layer of a run of pages in a page-major host layout (32 KiB pieces 1 MiB apart), then a mixed list whose
    spacing changes midway, in both directions: every byte lands where the runs say, nothing else is touched."""
    layers, width, pages = 8, 4096, 24
    with HostBuffer.allocate(pages * layers * width, HostKind.PINNED, runtime=runtime) as host, \
            DeviceBuffer(pages * layers * width, 0, runtime=runtime) as dev:
        view = host.as_tensor().numpy()
        layer = 5
        host_offsets = np.arange(pages) * layers * width + layer * width
        dev_offsets = np.arange(pages) * width
        host_offsets[16:] += width // 2                 # the spacing changes after 16 pages: two groups and a lone one
        dev_offsets[16:] += 3 * width
        sizes = np.full(pages, width)
        sizes[-1] = width // 4
        source = random_bytes(pages * layers * width)
        stream = runtime.create_stream(0)
        if direction == "load":
            view[:] = source
            dev.upload(np.full(pages * layers * width, 0xEE, np.uint8))
            runtime.memcpy_runs_async(dev.address, dev_offsets, host.cpu_address, host_offsets, sizes, stream=stream)
            stream.synchronize()
            got, want = np.frombuffer(dev.download(), np.uint8), np.full(pages * layers * width, 0xEE, np.uint8)
        else:
            dev.upload(source)
            view[:] = 0xEE
            runtime.memcpy_runs_async(host.cpu_address, host_offsets, dev.address, dev_offsets, sizes, stream=stream)
            stream.synchronize()
            got, want = view.copy(), np.full(pages * layers * width, 0xEE, np.uint8)
        for d, h, n in zip(dev_offsets, host_offsets, sizes, strict=True):
            if direction == "load":
                want[d:d + n] = source[h:h + n]
            else:
                want[h:h + n] = source[d:d + n]
        np.testing.assert_array_equal(got, want)
        del view
        stream.close()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.sampled_from([0, 1, 2, 4])), max_size=16))
def test_strided_groups_cover_every_copy_once_with_exact_spacing(steps):
    from kvtier.runtime.base import strided_groups

    dst = np.cumsum([2 * a for a, _, _ in steps], dtype=np.int64)
    src = np.cumsum([2 * b for _, b, _ in steps], dtype=np.int64)
    sizes = np.array([n for _, _, n in steps], dtype=np.int64)
    covered: list[int] = []
    for first, count, dst_pitch, src_pitch in strided_groups(dst, src, sizes).tolist():
        members = range(first, first + count)
        covered += members
        if count > 1:
            assert sizes[first] > 0 and dst_pitch >= sizes[first] and src_pitch >= sizes[first]
            for i in members:
                assert sizes[i] == sizes[first]
                assert dst[i] == dst[first] + (i - first) * dst_pitch
                assert src[i] == src[first] + (i - first) * src_pitch
    assert covered == list(range(len(steps)))
    layer = strided_groups(np.arange(64) * 32768, np.arange(64) * 1 << 20, np.full(64, 32768))
    assert layer.tolist() == [[0, 64, 32768, 1 << 20]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 12), max_size=20), st.integers(0, 10))
def test_split_groups_sends_short_groups_to_the_batch_in_order(counts, min_rows):
    """Groups below ``min_rows`` copies (and always groups of one) become single copies, in their order; the rest stay
    strided; every copy is in exactly one of the two."""
    from kvtier.runtime.base import split_groups

    first = np.concatenate(([0], np.cumsum(counts)[:-1])) if counts else np.zeros(0, np.int64)
    groups = np.array([[f, c, 7, 9] for f, c in zip(first.tolist(), counts, strict=True)], np.int64).reshape(-1, 4)
    strided, single = split_groups(groups, min_rows)
    assert all(c >= max(min_rows, 2) for c in strided[:, 1].tolist())
    assert single.tolist() == [f + i for f, c in zip(first.tolist(), counts, strict=True) if c < max(min_rows, 2)
                               for i in range(c)]
    members = sorted(single.tolist() + [f + i for f, c in strided[:, :2].tolist() for i in range(c)])
    assert members == list(range(sum(counts)))


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("direction", ["H2D", "D2H"])
def test_runs_mixing_strided_groups_singles_and_empty_copies(runtime, batched, direction):
    """One call whose copies form strided groups (equal size, evenly spaced), singles of other sizes, and empty
    copies: with ``batched`` the singles go in one batched call beside the groups' strided copies; every byte of the
    destination is checked, the bytes no copy names keep their poison."""
    rng = np.random.default_rng()
    plan = []  # (dst, src, size)
    at_dst, at_src = 0, 0
    for _ in range(12):
        kind = rng.integers(0, 3)
        if kind == 0:  # a strided group
            size, count, gap = int(rng.integers(1, 9)) * 64, int(rng.integers(2, 6)), int(rng.integers(0, 4)) * 64
            plan += [(at_dst + i * (size + gap), at_src + i * (size + 2 * gap), size) for i in range(count)]
            at_dst, at_src = at_dst + count * (size + gap), at_src + count * (size + 2 * gap)
        elif kind == 1:  # a single of an odd size
            size = int(rng.integers(1, 700))
            plan.append((at_dst, at_src, size))
            at_dst, at_src = at_dst + size + 8, at_src + size + 24
        else:
            plan.append((at_dst, at_src, 0))
    order = rng.permutation(len(plan)) if rng.integers(0, 2) else np.arange(len(plan))
    dst_at, src_at, sizes = (np.array([plan[i][k] for i in order], np.int64) for k in range(3))
    span_dst, span_src = max(at_dst, 1), max(at_src, 1)
    with HostBuffer.allocate(max(span_dst, span_src), HostKind.PINNED, runtime=runtime) as host, \
            DeviceBuffer(max(span_dst, span_src), 0, runtime=runtime) as dev:
        source = random_bytes(max(span_dst, span_src))
        poison = np.full(max(span_dst, span_src), 0xA5, np.uint8)
        view = host.as_tensor().numpy()
        if direction == "H2D":
            view[:], (dst, src) = source, (dev.address, host.cpu_address)
            dev.upload(poison)
        else:
            view[:], (dst, src) = poison, (host.cpu_address, dev.address)
            dev.upload(source)
        stream = runtime.create_stream(0)
        runtime.memcpy_runs_async(dst, dst_at, src, src_at, sizes, stream=stream, batched=batched)
        stream.synchronize()
        stream.close()
        got = np.frombuffer(dev.download(), np.uint8) if direction == "H2D" else view.copy()
        del view
    expected = poison.copy()
    for d, s_, n in zip(dst_at, src_at, sizes, strict=True):
        expected[d:d + n] = source[s_:s_ + n]
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("pieces", [4, 64])
def test_batched_runs_on_the_legacy_stream_keep_its_order(runtime, pieces):
    """Batched copies queued on the legacy default stream (torch's default, which cudaMemcpyBatchAsync refuses: a
    batch goes on a side stream there) start after the long copy queued before them and finish before the overwrite
    queued after them: each gathered piece holds the long copy's bytes, not the old ones nor the overwrite's."""
    piece = 4096
    n = (256 << 20) if runtime.name == "cuda" else (1 << 20)
    rng = np.random.default_rng()
    with HostBuffer.allocate(3 * n, HostKind.PINNED, runtime=runtime) as host, \
            DeviceBuffer(n, 0, runtime=runtime) as dev:
        view = host.as_tensor().numpy()
        fresh, overwrite = random_bytes(n), random_bytes(n)
        view[:n], view[n:2 * n], view[2 * n:] = fresh, overwrite, 0x5A
        dev.upload(random_bytes(n))
        chosen = np.sort(rng.choice(n // piece, pieces, replace=False))[::-1].copy()
        legacy = runtime.legacy_stream(0)
        runtime.memcpy_async(dev.address, host.cpu_address, n, stream=legacy)
        runtime.memcpy_runs_async(host.cpu_address, 2 * n + np.arange(pieces) * piece, dev.address, chosen * piece,
                                  np.full(pieces, piece), stream=legacy, batched=True)
        runtime.memcpy_async(dev.address, host.cpu_address + n, n, stream=legacy)
        legacy.synchronize()
        got = view[2 * n:2 * n + pieces * piece].reshape(pieces, piece).copy()
        del view
    np.testing.assert_array_equal(got, fresh.reshape(-1, piece)[chosen])


@pytest.mark.parametrize("batched", [False, True])
def test_copies_farther_apart_than_the_maximum_pitch_still_land(runtime, batched):
    """Three equal 4 KiB copies 3 GiB apart in the host (evenly spaced: one strided copy of pitch 3 GiB): a 2D copy
    refuses a pitch above 2 GiB - 1 (cudaErrorInvalidPitchValue, and so does the emulator), so they must go one by
    one or batched, and every byte lands."""
    from kvtier.runtime.base import MAX_PITCH

    row, far = 4096, 3 << 30
    assert far > MAX_PITCH
    rng = np.random.default_rng()
    with HostBuffer.allocate(2 * far + row, HostKind.PINNED, runtime=runtime) as host, \
            DeviceBuffer(3 * row, 0, runtime=runtime) as dev:
        view = host.as_tensor().numpy()
        rows = [rng.integers(1, 256, row, dtype=np.uint8) for _ in range(3)]
        for i, data in enumerate(rows):
            view[i * far:i * far + row] = data
        dev.upload(np.full(3 * row, 0xA5, np.uint8))
        stream = runtime.create_stream(0)
        runtime.memcpy_runs_async(dev.address, np.arange(3) * row, host.cpu_address, np.arange(3) * far,
                                  np.full(3, row), stream=stream, batched=batched)
        stream.synchronize()
        stream.close()
        del view
        np.testing.assert_array_equal(np.frombuffer(dev.download(), np.uint8), np.concatenate(rows))


@pytest.mark.parametrize("batched", [False, True])
def test_runs_between_typed_bases_scatter_and_gather(runtime, batched):
    n, piece = 64, 1024
    rng = np.random.default_rng()
    with HostBuffer.allocate(2 * n * piece, HostKind.PINNED, runtime=runtime) as host, \
            DeviceBuffer(n * piece, 0, runtime=runtime) as dev:
        view = host.as_tensor().numpy()
        view[:] = random_bytes(view.size)
        dev.upload(np.full(n * piece, 0xEE, np.uint8))
        chosen = rng.choice(2 * n, n, replace=False)
        stream = runtime.create_stream(0)
        runtime.memcpy_runs_async(dev.address, np.arange(n) * piece, host.cpu_address, chosen * piece,
                                  np.full(n, piece), stream=stream, batched=batched)
        stream.synchronize()
        got = np.frombuffer(dev.download(), np.uint8).reshape(n, piece)
        np.testing.assert_array_equal(got, view.reshape(2 * n, piece)[chosen])
        del view
        from kvtier.errors import AddressDomainError, InvalidArgument

        with pytest.raises(AddressDomainError):
            runtime.memcpy_runs_async(dev.address.value, [0], host.cpu_address, [0], [16], stream=stream)
        with pytest.raises(InvalidArgument, match="sizes"):
            runtime.memcpy_runs_async(dev.address, [0, 16], host.cpu_address, [0], [16], stream=stream)
        for bad in ({"sizes": [16.7]}, {"dst_offsets": [0.9]}, {"sizes": [True]}, {"sizes": ["16"]}):
            args = {"dst_offsets": [0], "src_offsets": [0], "sizes": [16], **bad}   # were truncated and copied
            with pytest.raises(InvalidArgument, match="must be integers"):
                runtime.memcpy_runs_async(dev.address, args["dst_offsets"], host.cpu_address, args["src_offsets"],
                                          args["sizes"], stream=stream)
        stream.close()


def test_raw_integers_are_refused_by_the_copy_and_launch_apis(split):
    from kvtier.errors import AddressDomainError

    with DeviceBuffer(64, 0, runtime=split) as dev:
        with pytest.raises(AddressDomainError, match="CpuAddress or DeviceAddress"):
            split.memcpy(dev.address, dev.address.value, 64)
        stream = split.create_stream(0)
        with pytest.raises(AddressDomainError, match="raw integers"):
                    split.launch(split.load_program(TOUCH, 0), "touch", grid=1, block=32, stream=stream,
                         args=[dev.address.value, 16])
