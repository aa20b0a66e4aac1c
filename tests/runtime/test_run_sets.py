"""``Runtime.memcpy_run_sets_async``: several pairs of bases in one call, their batchable copies in one batch; every
set checked (types, bounds, registration spans) before any copy is queued; mixed directions, overlapping sources,
empty sets and host buffers registered in chunks; the legacy default stream's detour through a side stream.

The CUDA paths run over a fake driver (``cuda_fakes``) that performs each copy when it is queued and records every
driver call; the emulated runtimes run the same sets for real. Data is fresh random bytes, destinations poisoned.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvtier.address import CpuAddress, DeviceAddress
from kvtier.errors import AddressDomainError, InvalidArgument, KvtierError
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind
from kvtier.runtime import create

POISON = 0x5A
PAGE = 32 << 10
CHUNK = 16 << 10


def rnd_np(n):
    return np.random.default_rng().integers(1, 256, n, dtype=np.uint8)


def _scattered(rng: np.random.Generator, pages: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets of ``pages`` pages taken from ``slots`` in random order on both sides (few evenly spaced runs)."""
    return (rng.permutation(slots)[:pages] * PAGE).astype(np.int64), (rng.permutation(slots)[:pages] * PAGE).astype(
        np.int64)


def test_a_call_over_several_sets_puts_every_batchable_copy_in_one_batch(fake_cuda):
    runtime, stream, fake = fake_cuda
    rng = np.random.default_rng()
    slots, pages, tensors = 64, 40, 3
    sources = [rng.integers(1, 256, slots * PAGE, dtype=np.uint8) for _ in range(tensors)]
    targets = [np.full(slots * PAGE, POISON, np.uint8) for _ in range(tensors)]
    sets, wants = [], []
    for src, dst in zip(sources, targets, strict=True):
        dst_at, src_at = _scattered(rng, pages, slots)
        want = dst.copy()
        for d, s in zip(dst_at, src_at, strict=True):
            want[d:d + PAGE] = src[s:s + PAGE]
        wants.append(want)
        sets.append((DeviceAddress(dst.ctypes.data, 0), dst_at, CpuAddress(src.ctypes.data), src_at,
                     np.full(pages, PAGE, np.int64)))
    runtime.memcpy_run_sets_async(sets, stream=stream, batched=True)
    for dst, want in zip(targets, wants, strict=True):
        assert np.array_equal(dst, want)
    batches = [call for call in fake.calls if call[0] == "batch"]
    lone = sum(1 for call in fake.calls if call[0] == "1d")
    strided_rows = sum(call[4] for call in fake.calls if call[0] == "2d")
    assert len(batches) == 1, fake.calls
    assert batches[0][1] + lone + strided_rows == tensors * pages


def test_one_set_per_call_costs_one_batch_each(fake_cuda):
    """The baseline the call above improves on: the same sets one call each give a batch each."""
    runtime, stream, fake = fake_cuda
    rng = np.random.default_rng()
    src = rng.integers(1, 256, 64 * PAGE, dtype=np.uint8)
    dst = np.full(64 * PAGE, POISON, np.uint8)
    for _ in range(2):
        dst_at, src_at = _scattered(rng, 20, 64)
        runtime.memcpy_runs_async(DeviceAddress(dst.ctypes.data, 0), dst_at, CpuAddress(src.ctypes.data), src_at,
                                  np.full(20, PAGE, np.int64), stream=stream, batched=True)
    assert sum(1 for call in fake.calls if call[0] == "batch") == 2


@pytest.mark.parametrize("bad", ["negative", "lengths", "floats", "raw address"])
def test_a_bad_set_refuses_the_whole_call_before_anything_is_queued(fake_cuda, bad):
    runtime, stream, fake = fake_cuda
    rng = np.random.default_rng()
    src = rng.integers(1, 256, 8 * PAGE, dtype=np.uint8)
    dst = np.full(8 * PAGE, POISON, np.uint8)
    good = (DeviceAddress(dst.ctypes.data, 0), np.arange(4) * PAGE, CpuAddress(src.ctypes.data),
            np.arange(4)[::-1] * PAGE, np.full(4, PAGE))
    wrong = {"negative": good[:3] + (np.array([-PAGE, 0, PAGE, 2 * PAGE]), good[4]),
             "lengths": good[:4] + (np.full(3, PAGE),),
             "floats": good[:4] + (np.full(4, float(PAGE)),),
             "raw address": (dst.ctypes.data,) + good[1:]}[bad]
    error = AddressDomainError if bad == "raw address" else InvalidArgument
    with pytest.raises(error, match="memcpy_runs_async"):
        runtime.memcpy_run_sets_async([good, wrong], stream=stream, batched=True)
    assert fake.calls == [] and (dst == POISON).all()


@pytest.mark.parametrize("batched", [False, True])
def test_sets_between_host_and_device_land_on_the_emulators(rt, batched):
    rng = np.random.default_rng()
    slots, pages = 16, 10
    host = HostBuffer.allocate(2 * slots * PAGE, HostKind.PINNED, runtime=rt)
    device = DeviceBuffer(2 * slots * PAGE, 0, runtime=rt)
    try:
        data = rng.integers(1, 256, 2 * slots * PAGE, dtype=np.uint8)
        host.as_tensor().numpy()[:] = data
        device.upload(np.full(2 * slots * PAGE, POISON, np.uint8))
        sets, want = [], np.full(2 * slots * PAGE, POISON, np.uint8)
        for t in range(2):
            dst_at, src_at = (a + t * slots * PAGE for a in _scattered(rng, pages, slots))
            for d, s in zip(dst_at, src_at, strict=True):
                want[d:d + PAGE] = data[s:s + PAGE]
            sets.append((device.address, dst_at, host.cpu_address, src_at, np.full(pages, PAGE, np.int64)))
        stream = rt.create_stream(0)
        rt.memcpy_run_sets_async(sets, stream=stream, batched=batched)
        rt.synchronize(0)
        assert np.array_equal(np.frombuffer(device.download(), np.uint8), want)
    finally:
        device.close()
        host.close()


@pytest.mark.parametrize("bad", ["past the end of device memory", "across a host registration boundary"])
@pytest.mark.parametrize("spec", ["emulated:split:lazy", "emulated:unified:lazy"])
def test_a_run_set_refused_by_the_runtime_leaves_the_earlier_sets_unqueued(spec, bad):
    """``memcpy_run_sets_async`` promises 'Every set is checked before any copy is queued' (base.py:342-349), but
    the up-front check (``_run_set``, base.py:351-364) only looks at types, lengths and signs. Whether a copy lies in
    mapped memory and inside one registration is checked per copy while queuing (``_locate``, emulated.py:271, from
    ``memcpy_async`` / ``_memcpy_2d_async``; on CUDA the driver call itself), set after set (base.py:366-368), so a
    second set that runs past a device allocation or across a registration boundary raises only after the first
    set's copies are queued: the refused call still writes the first destination (seen here after a synchronize),
    and on CUDA the 2D and single copies of earlier sets are already queued when a later one fails. A caller that
    catches the error and retries or reports 'nothing copied' is wrong. Fix: locate every copy's extent on both
    sides (bounds and registration span, per strided group) for all sets before queuing the first, or document the
    call as non-atomic and have the compat layer rely only on its own checks."""
    rt = create(spec)
    n = 4096
    good_dst = DeviceBuffer(n, 0, runtime=rt)
    good_dst.upload(np.full(n, POISON, np.uint8))
    src = DeviceBuffer(n, 0, runtime=rt)
    src.upload(rnd_np(n))
    chunked = HostBuffer.allocate(2 * CHUNK, HostKind.REGISTERED, runtime=rt, register_chunk_bytes=CHUNK)
    try:
        assert chunked.registration_boundaries == (CHUNK,)
        good = (good_dst.address, [0], src.address, [0], [n])
        if bad == "past the end of device memory":
            wrong = (src.address, [n - 64], good_dst.address, [0], [128])
        else:
            wrong = (chunked.cpu_address, [CHUNK - 64], src.address, [0], [128])
        with pytest.raises(KvtierError):
            rt.memcpy_run_sets_async([good, wrong], stream=rt.create_stream(0), batched=True)
        rt.synchronize(0)
        landed = np.frombuffer(good_dst.download(), np.uint8)
        assert (landed == POISON).all(), "the refused call copied its first set"
    finally:
        good_dst.close()
        src.close()
        chunked.close()


class LegacyFake:
    """The fake driver of ``cuda_fakes`` plus what the legacy stream's detour needs (a side stream, events), every
    queued call recording the native stream it went to."""

    cudaStreamNonBlocking = 1  # noqa: N815 (the driver's names)
    cudaEventDisableTiming = 2  # noqa: N815

    def __init__(self):
        import helpers.cuda_fakes as cuda_fakes

        self.base = cuda_fakes.FakeCudart()
        self._handles = itertools.count(0x7000)
        self.log: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self.base, name)

    def cudaGetDevice(self):  # noqa: N802
        return 0, 0

    def cudaSetDevice(self, device):  # noqa: N802
        return (0,)

    def cudaStreamCreateWithFlags(self, flags):  # noqa: N802
        handle = next(self._handles)
        self.log.append(("create stream", handle))
        return 0, handle

    def cudaStreamDestroy(self, handle):  # noqa: N802
        return (0,)

    def cudaEventCreateWithFlags(self, flags):  # noqa: N802
        return 0, next(self._handles)

    def cudaEventDestroy(self, handle):  # noqa: N802
        return (0,)

    def cudaEventRecord(self, event, native):  # noqa: N802
        self.log.append(("record", event, native))
        return (0,)

    def cudaStreamWaitEvent(self, native, event, flags):  # noqa: N802
        self.log.append(("wait", native, event))
        return (0,)

    def cudaMemcpyAsync(self, dst, src, n, kind, native):  # noqa: N802
        self.log.append(("1d", native))
        return self.base.cudaMemcpyAsync(dst, src, n, kind, native)

    def cudaMemcpy2DAsync(self, dst, dp, src, sp, width, height, kind, native):  # noqa: N802
        self.log.append(("2d", native, height))
        return self.base.cudaMemcpy2DAsync(dst, dp, src, sp, width, height, kind, native)

    def cudaMemcpyBatchAsync(self, dsts, srcs, counts, n, attrs, index, n_attrs, native):  # noqa: N802
        self.log.append(("batch", native, n))
        return self.base.cudaMemcpyBatchAsync(dsts, srcs, counts, n, attrs, index, n_attrs, native)


@pytest.mark.parametrize("legacy", [0, 1])
def test_ok_legacy_stream_detour_with_mixed_directions_overlapping_sources_and_empty_sets(monkeypatch, legacy):
    """On the legacy stream (NULL and cudaStreamLegacy) one call of sets H2D (large, batched; small, one call each),
    D2H and D2D (small, batched), a strided group (2D), empty sets and sets reading overlapping sources: every 2D and
    single copy goes to the legacy stream before the fork event is recorded there, the one batch (all batchable
    copies of all sets) goes to the side stream after it waits for the fork, and the legacy stream waits for the
    join recorded after the batch. A second call below the detour threshold stays on the legacy stream, unbatched.
    Every byte lands."""
    import helpers.cuda_fakes as cuda_fakes

    import kvtier.runtime.cuda as cuda_module

    fake = LegacyFake()
    runtime = cuda_fakes.fake_runtime(monkeypatch, fake)
    stream = cuda_module.CudaStream(fake, 0, legacy, owned=False)
    rng = np.random.default_rng(10)   # positions only (no evenly spaced group of 2+ by chance); data is fresh
    big, small = 32 << 10, 4 << 10
    source = rnd_np(64 * big)
    targets = {name: np.full(64 * big, POISON, np.uint8) for name in ("h2d big", "h2d small", "d2h", "d2d", "2d")}
    want = {name: t.copy() for name, t in targets.items()}
    plans = {"h2d big": (big, 12, CpuAddress, DeviceAddress), "h2d small": (small, 6, CpuAddress, DeviceAddress),
             "d2h": (small, 10, DeviceAddress, CpuAddress), "d2d": (small, 9, DeviceAddress, DeviceAddress)}
    sets = []
    for name, (size, count, src_kind, dst_kind) in plans.items():
        slots = 64 * big // size
        dst_at = rng.permutation(slots)[:count].astype(np.int64) * size
        src_at = rng.permutation(min(slots, 16))[:count].astype(np.int64) * size   # sources overlap across sets
        for d, s in zip(dst_at, src_at, strict=True):
            want[name][d:d + size] = source[s:s + size]
        src_base, dst_base = (CpuAddress(at) if kind is CpuAddress else DeviceAddress(at, 0)
                              for kind, at in ((src_kind, source.ctypes.data), (dst_kind, targets[name].ctypes.data)))
        sets.append((dst_base, dst_at, src_base, src_at, np.full(count, size, np.int64)))
        sets.append((dst_base, [], src_base, [], []))
    rows = np.arange(10, dtype=np.int64)
    sets.append((DeviceAddress(targets["2d"].ctypes.data, 0), rows * 3 * small, CpuAddress(source.ctypes.data),
                 rows * 2 * small, np.full(10, small, np.int64)))
    for r in rows:
        want["2d"][r * 3 * small:r * 3 * small + small] = source[r * 2 * small:r * 2 * small + small]
    runtime.memcpy_run_sets_async(sets, stream=stream, batched=True)
    for name in targets:
        assert np.array_equal(targets[name], want[name]), name
    log = [entry for entry in fake.log if entry[0] != "create stream"]
    side = next(entry[1] for entry in fake.log if entry[0] == "create stream")
    kinds = [entry[0] for entry in log]
    fork_at = kinds.index("record")
    assert all(entry[1] == legacy for entry in log[:fork_at]), log
    assert kinds[:fork_at].count("1d") + sum(entry[2] for entry in log[:fork_at] if entry[0] == "2d") == 6 + 10, log
    fork = log[fork_at]
    assert fork[2] == legacy
    assert log[fork_at + 1] == ("wait", side, fork[1])
    assert log[fork_at + 2] == ("batch", side, 12 + 10 + 9)
    join = log[fork_at + 3]
    assert join[0] == "record" and join[2] == side and join[1] != fork[1]
    assert log[fork_at + 4:] == [("wait", legacy, join[1])]
    fake.log.clear()
    few = np.full(64 * big, POISON, np.uint8)
    at = np.arange(5, dtype=np.int64)[::-1] * 2 * small
    runtime.memcpy_run_sets_async([(CpuAddress(few.ctypes.data), at, DeviceAddress(source.ctypes.data, 0),
                                    at[::-1].copy(), np.full(5, small, np.int64))], stream=stream, batched=True)
    assert fake.log == [("1d", legacy)] * 5
    for d, s in zip(at, at[::-1], strict=True):
        assert np.array_equal(few[d:d + small], source[s:s + small])


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("spec", ["emulated:split", "emulated:unified", "emulated:split:lazy"])
def test_ok_run_sets_over_chunk_boundaries_mixed_directions_and_empty_sets(spec, batched):
    """One call: H2D strided runs over a host buffer registered in 16 KiB chunks (groups that would cross a chunk
    boundary are cut there), D2H scattered runs into another chunk of it, D2D runs, sets with no copies and sets
    with zero-size copies; sources overlap across sets. Every byte lands; nothing else is written."""
    rt = create(spec)
    total = 8 * CHUNK
    buffer = HostBuffer.allocate(total, HostKind.REGISTERED, runtime=rt, register_chunk_bytes=CHUNK)
    dev = DeviceBuffer(total, 0, runtime=rt)
    dev2 = DeviceBuffer(total, 0, runtime=rt)
    try:
        assert len(buffer.registration_boundaries) == 7
        host_view = buffer.as_tensor().numpy()
        host_data, dev_data = rnd_np(total), rnd_np(total)
        host_view[:] = host_data
        dev.upload(dev_data)
        dev2.upload(np.full(total, POISON, np.uint8))
        want_host, want_dev2 = host_data.copy(), np.full(total, POISON, np.uint8)
        want_dev = dev_data.copy()
        # H2D: rows of 1 KiB every 2 KiB over the first 4 chunks of the host buffer -> first half of dev
        rows = np.arange(32, dtype=np.int64)
        h2d = (dev.address, rows * 1024, buffer.cpu_address, rows * 2048, np.full(32, 1024, np.int64))
        for r in rows:
            want_dev[r * 1024:(r + 1) * 1024] = host_data[r * 2048:r * 2048 + 1024]
        # D2H: scattered 512-byte runs from dev's second half into the host's last 2 chunks
        rng = np.random.default_rng()
        d_at = 6 * CHUNK + rng.permutation(64)[:20].astype(np.int64) * 512
        s_at = total // 2 + rng.permutation(64)[:20].astype(np.int64) * 512
        d2h = (buffer.cpu_address, d_at, dev.address, s_at, np.full(20, 512, np.int64))
        for d, s in zip(d_at, s_at, strict=True):
            want_host[d:d + 512] = dev_data[s:s + 512]
        # D2D: runs of the same source dev rows (overlapping the D2H sources) into dev2
        d2d = (dev2.address, np.arange(20, dtype=np.int64) * 512, dev.address, s_at, np.full(20, 512, np.int64))
        for i, s in enumerate(s_at):
            want_dev2[i * 512:(i + 1) * 512] = dev_data[s:s + 512]
        empty = (dev2.address, np.zeros(0, np.int64), buffer.cpu_address, [], np.zeros(0, np.int32))
        zero = (dev2.address, [total - 8, 0], dev.address, [0, total - 8], [0, 0])
        rt.memcpy_run_sets_async([empty, h2d, zero, d2h, empty, d2d], stream=rt.create_stream(0), batched=batched)
        rt.synchronize(0)
        assert np.array_equal(np.frombuffer(dev.download(), np.uint8), want_dev)
        assert np.array_equal(np.frombuffer(dev2.download(), np.uint8), want_dev2)
        assert np.array_equal(host_view, want_host)
        rt.memcpy_run_sets_async([], stream=rt.create_stream(0), batched=batched)
        del host_view
    finally:
        dev.close()
        dev2.close()
        buffer.close()
    assert rt.host_range(buffer._resources.memory.address) is None
