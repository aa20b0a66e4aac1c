"""``Runtime.memcpy_runs_async`` on CUDA's copy paths: strided groups never take a pitch above the device's limit
(``cudaMemcpy2DAsync`` refuses one), batches on the legacy default stream go through a side stream joined both ways,
and for distinct destinations the result is the in-order one; ``strided_groups`` / ``split_groups`` against their
contract. The CUDA tests drive ``CudaRuntime`` on a machine without a GPU: its driver is replaced by a fake
(``helpers.cuda_fakes``) that performs every copy when it is queued, in issue order, and refuses what the CUDA
documentation says the real call refuses; the ``gpu``-marked twin runs on a real GPU. Data is fresh random bytes,
destinations poisoned and checked byte for byte against the in-order reference."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.cuda_fakes import MAX_PITCH, FakeCudart, fake_runtime
from helpers.operands import POISON, fresh_rng
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.runtime.cuda as cuda_module
from kvtier.address import CpuAddress, DeviceAddress
from kvtier.errors import KvtierError
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind
from kvtier.runtime.base import split_groups, strided_groups


def in_order(dst: np.ndarray, src: np.ndarray, dst_offsets, src_offsets, sizes) -> np.ndarray:
    """The reference: the copies one after another (what SGLang's loop of copy_ calls on one stream does)."""
    out = dst.copy()
    for d, s, n in zip(dst_offsets, src_offsets, sizes, strict=True):
        out[d:d + n] = src[s:s + n]
    return out


def test_cuda_memcpy_runs_never_issues_a_2d_copy_with_a_pitch_above_the_limit(fake_cuda):
    """A layer-first host layer of more than 2 GiB (half a million 4 KiB tokens), loaded to the device: two single
    tokens 3 GiB apart (transfer_kv_direct with src_indices [0, 786432], dst [0, 1]; or any two host pages that far
    apart in a page-first pool). Since ac64184, host-to-device copies under 32 KiB stay out of the batch, so any two
    of them with one spacing form a strided group (split_groups' bound is 2 for them): kvtier issues one
    cudaMemcpy2DAsync with spitch = 3 GiB. CUDA documents that cudaMemcpy2DAsync "returns an error if dpitch or
    spitch is greater than the maximum allowed" (cudaDevAttrMaxPitch, 2**31 - 1 bytes): the load fails with
    RuntimeCallError (cudaErrorInvalidPitchValue), after the other copies of the call (and any earlier layer's) were
    queued. strided_groups bounds neither pitch, and the emulator's 2D copy accepts any pitch, so CI cannot see it.
    Expected: no strided group with a pitch above the device's limit (those copies go one by one or batched), and
    both tokens land. (found adversarially, issue #15)"""
    runtime, stream, fake = fake_cuda
    rng, seed = fresh_rng()
    row, far = 4096, 3 << 30
    src = np.zeros(far + row, np.uint8)          # calloc: only the two touched pages are ever backed
    src[:row], src[far:] = rng.integers(1, 256, row, dtype=np.uint8), rng.integers(1, 256, row, dtype=np.uint8)
    dst = np.full(2 * row, POISON, np.uint8)
    try:
        runtime.memcpy_runs_async(DeviceAddress(dst.ctypes.data, 0), [0, row], CpuAddress(src.ctypes.data),
                                  [0, far], [row, row], stream=stream, batched=True)
    except KvtierError as error:
        pytest.fail(f"seed {seed}: a valid load was refused by the driver: {error}; calls {fake.calls}")
    assert not [c for c in fake.calls if c[0] == "2d" and max(c[1], c[2]) > MAX_PITCH], fake.calls
    assert np.array_equal(dst[:row], src[:row]) and np.array_equal(dst[row:], src[far:])


@pytest.mark.gpu
def test_gpu_two_small_loads_three_gib_apart_land(cuda):
    """The previous test on a real GPU: two 4 KiB host-to-device copies 3 GiB apart in one pinned buffer, batched.
    Expected: both land (no cudaErrorInvalidPitchValue from a 2D copy of pitch 3 GiB).
    (found adversarially, issue #15)"""
    row, far = 4096, 3 << 30
    rng = np.random.default_rng()
    with HostBuffer.allocate(far + row, HostKind.PINNED, runtime=cuda) as host, \
            DeviceBuffer(2 * row, 0, runtime=cuda) as dev:
        view = host.as_tensor().numpy()
        view[:row], view[far:] = rng.integers(1, 256, row, dtype=np.uint8), rng.integers(1, 256, row, dtype=np.uint8)
        dev.upload(np.full(2 * row, POISON, np.uint8))
        stream = cuda.create_stream(0)
        cuda.memcpy_runs_async(dev.address, [0, row], host.cpu_address, [0, far], [row, row], stream=stream,
                               batched=True)
        stream.synchronize()
        got = np.frombuffer(dev.download(), np.uint8)
        assert np.array_equal(got[:row], view[:row]) and np.array_equal(got[row:], view[far:])
        del view
        stream.close()


def test_ok_cuda_memcpy_runs_with_distinct_destinations_matches_the_in_order_reference(fake_cuda):
    """CudaRuntime.memcpy_runs_async over the fake driver, random mixes of strided groups (8+ rows and short ones),
    lone copies of odd sizes, empty copies, small (< 32 KiB) and large, both directions, batched or not, in random
    order, every destination byte distinct: the result is the in-order one."""
    runtime, stream, _ = fake_cuda
    rng, seed = fresh_rng()
    for _ in range(300):
        dst_at, src_at, sizes, cursor = [], [], [], 0
        for _ in range(int(rng.integers(0, 8))):
            if rng.random() < 0.5:
                count, width = int(rng.integers(2, 12)), int(rng.choice([16, 64, 40000]))
                dst_pitch, src_pitch = width + int(rng.integers(0, 3)) * 8, width + int(rng.integers(0, 3)) * 8
                src0 = int(rng.integers(0, 2000))
                for i in range(count):
                    dst_at.append(cursor + i * dst_pitch)
                    src_at.append(src0 + i * src_pitch)
                    sizes.append(width)
                cursor += count * dst_pitch
            else:
                width = int(rng.choice([0, 1, 16, 40000]))
                dst_at.append(cursor)
                src_at.append(int(rng.integers(0, 4000)))
                sizes.append(width)
                cursor += width
        order = rng.permutation(len(sizes))
        dst_at, src_at, sizes = (np.array(a, np.int64)[order] for a in (dst_at, src_at, sizes))
        span = int(max((dst_at + sizes).max(initial=1), (src_at + sizes).max(initial=1)))
        src = rng.integers(1, 256, span, dtype=np.uint8)
        dst = np.full(span, POISON, np.uint8)
        want = in_order(dst, src, dst_at, src_at, sizes)
        h2d = bool(rng.random() < 0.5)
        to_dst = DeviceAddress(dst.ctypes.data, 0) if h2d else CpuAddress(dst.ctypes.data)
        from_src = CpuAddress(src.ctypes.data) if h2d else DeviceAddress(src.ctypes.data, 0)
        runtime.memcpy_runs_async(to_dst, dst_at, from_src, src_at, sizes, stream=stream,
                                  batched=bool(rng.random() < 0.7))
        assert np.array_equal(dst, want), f"seed {seed}"


@pytest.mark.slow
@settings(max_examples=1500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40), st.sampled_from([0, 1, 2, 3, 8]),
                          st.integers(0, 2), st.integers(0, 2)), max_size=20),
       st.booleans(), st.booleans(), st.data())
def test_ok_strided_and_split_groups_cover_every_copy_once_evenly_spaced(rows, cumulative, segmented, data):
    """strided_groups over random offsets (cumulative small steps, so many link, or arbitrary large ones), sizes with
    zeros and segment ids: every copy in exactly one group, in order; a group of two or more is one size (non-zero),
    evenly spaced by its pitches on both sides, pitches at least the size, within one segment on each side.
    split_groups with one bound for all or one per group (negative, 0, 1 included): the strided groups are exactly
    those with at least max(bound, 2) copies, and every other copy is listed once, in order."""
    if cumulative:
        dst = np.cumsum([r[0] % 17 for r in rows], dtype=np.int64)
        src = np.cumsum([r[1] % 13 for r in rows], dtype=np.int64)
    else:
        dst, src = np.array([r[0] for r in rows], np.int64), np.array([r[1] for r in rows], np.int64)
    sizes = np.array([r[2] for r in rows], np.int64)
    dst_seg = np.array([r[3] for r in rows], np.int64) if segmented else None
    src_seg = np.array([r[4] for r in rows], np.int64) if segmented else None
    groups = strided_groups(dst, src, sizes, dst_seg, src_seg)
    assert groups.dtype == np.int64 and groups.shape == (groups.shape[0], 4)
    covered: list[int] = []
    for first, count, dst_pitch, src_pitch in groups.tolist():
        assert count >= 1
        covered += range(first, first + count)
        if count > 1:
            assert sizes[first] > 0 and dst_pitch >= sizes[first] and src_pitch >= sizes[first]
            assert max(dst_pitch, src_pitch) <= MAX_PITCH
            for i in range(first, first + count):
                assert sizes[i] == sizes[first]
                assert dst[i] == dst[first] + (i - first) * dst_pitch
                assert src[i] == src[first] + (i - first) * src_pitch
                if segmented:
                    assert dst_seg[i] == dst_seg[first] and src_seg[i] == src_seg[first]
    assert covered == list(range(len(rows)))

    per_group = data.draw(st.booleans())
    bound = (np.array(data.draw(st.lists(st.integers(-3, 9), min_size=len(groups), max_size=len(groups))), np.int64)
             if per_group else data.draw(st.integers(-3, 9)))
    strided, single = split_groups(groups, bound)
    least = np.broadcast_to(np.maximum(bound, 2), (len(groups),)).tolist()
    assert strided.tolist() == [g for g, low in zip(groups.tolist(), least, strict=True) if g[1] >= low]
    assert single.tolist() == [g[0] + i for g, low in zip(groups.tolist(), least, strict=True) if g[1] < low
                               for i in range(g[1])]


class OrderingCudart(FakeCudart):
    """FakeCudart that also keeps streams, events and devices, and logs every call that orders work, so a test can
    read back on which stream each copy was queued and what it waited for."""

    def __init__(self) -> None:
        super().__init__()
        self.cudaStreamNonBlocking, self.cudaEventDisableTiming = 1, 2
        self.log: list[tuple] = []
        self._next = 0x9000

    def _handle(self) -> int:
        self._next += 1
        return self._next

    def cudaGetDevice(self):  # noqa: N802
        return 0, 0

    def cudaSetDevice(self, device):  # noqa: N802
        return (0,)

    def cudaStreamCreateWithFlags(self, flags):  # noqa: N802
        handle = self._handle()
        self.log.append(("create stream", handle))
        return 0, handle

    def cudaStreamDestroy(self, handle):  # noqa: N802
        return (0,)

    def cudaEventCreateWithFlags(self, flags):  # noqa: N802
        return 0, self._handle()

    def cudaEventDestroy(self, handle):  # noqa: N802
        return (0,)

    def cudaEventRecord(self, event, stream):  # noqa: N802
        self.log.append(("record", event, int(stream)))
        return (0,)

    def cudaStreamWaitEvent(self, stream, event, flags):  # noqa: N802
        self.log.append(("wait", int(stream), event))
        return (0,)

    def cudaMemcpyAsync(self, dst, src, n, kind, native):  # noqa: N802
        self.log.append(("copy", int(native)))
        return super().cudaMemcpyAsync(dst, src, n, kind, native)

    def cudaMemcpyBatchAsync(self, dsts, srcs, counts, n, attrs, attr_index, n_attrs, native):  # noqa: N802
        self.log.append(("batch", int(native), n))
        return super().cudaMemcpyBatchAsync(dsts, srcs, counts, n, attrs, attr_index, n_attrs, native)


@pytest.mark.parametrize("copies, stream_handle", [(64, 0), (64, 1), (4, 0), (64, 0x1234)])
def test_cuda_batches_on_the_legacy_stream_go_through_a_joined_side_stream(monkeypatch, copies, stream_handle):
    """cudaMemcpyBatchAsync refuses the legacy default stream (handle 0, or cudaStreamLegacy = 1): a batch queued
    there goes on a side stream that first waits for an event recorded on the legacy stream, and the legacy stream
    then waits for an event recorded on the side stream after the batch, so nothing queued before or after on the
    legacy stream can overlap it. A batch too small to pay for that goes one copy per call on the legacy stream; any
    other stream gets the batch itself. Every byte lands either way."""
    fake = OrderingCudart()
    runtime = fake_runtime(monkeypatch, fake)
    stream = cuda_module.CudaStream(fake, 0, stream_handle, owned=False)
    rng = np.random.default_rng()
    row = 64 << 10
    src = rng.integers(1, 256, copies * row, dtype=np.uint8)
    dst = np.full(copies * row, POISON, np.uint8)
    order = rng.permutation(copies)     # scattered: no strided groups
    runtime.memcpy_runs_async(DeviceAddress(dst.ctypes.data, 0), order * row, CpuAddress(src.ctypes.data),
                              np.arange(copies) * row, np.full(copies, row), stream=stream, batched=True)
    want = np.empty_like(dst).reshape(copies, row)
    want[order] = src.reshape(copies, row)
    assert np.array_equal(dst.reshape(copies, row), want)
    work = [entry for entry in fake.log if entry[0] != "create stream"]
    if stream_handle not in (0, 1):
        assert work == [("batch", stream_handle, copies)]
    elif copies < cuda_module.DETOUR_MIN_COPIES:
        assert work == [("copy", stream_handle)] * copies
    else:
        side = next(entry[1] for entry in fake.log if entry[0] == "create stream")
        (_, fork, on), (_, waiter, waited), batch, (_, join, on_side), (_, last, joined) = work
        assert (on, waiter, waited) == (stream_handle, side, fork)
        assert batch == ("batch", side, copies)
        assert (on_side, last, joined) == (side, stream_handle, join) and join != fork
