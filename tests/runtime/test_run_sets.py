"""``Runtime.memcpy_run_sets_async``: several pairs of bases in one call, their batchable copies in one batch.

The CUDA paths run over a fake driver (``cuda_fakes``) that performs each copy when it is queued and records every
driver call; the emulated runtimes run the same sets for real. Data is fresh random bytes, destinations poisoned.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.address import CpuAddress, DeviceAddress
from kvtier.errors import AddressDomainError, InvalidArgument
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind

POISON = 0x5A
PAGE = 32 << 10


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
