"""Adversarial tests for the one-plan-per-layer ``*_direct`` copies (runs of mixed lengths as copies of different
sizes), ``Runtime.memcpy_runs_async`` and ``kvtier.runtime.base.strided_groups`` / ``split_groups`` (issue 15, fifth
round).

The ``test_`` tests in the first part failed against the code they were written for (fixed since); each docstring
says what was wrong and what is expected. The CUDA ones drive ``CudaRuntime.memcpy_runs_async`` on a machine without a
GPU: its driver (cuda-bindings' runtime module) is replaced by a fake that performs every copy when it is queued, in
issue order, and refuses what the CUDA documentation says the real call refuses. The ``gpu``-marked twin runs the same
attack on a real GPU. The ``test_ok_`` tests at the end are attacks that held, kept as regression guards. All data
is fresh random bytes, every destination is poisoned first and checked byte for byte against a numpy/torch reference.
"""

from __future__ import annotations

import gc
import secrets

import numpy as np
import pytest
import torch
from helpers.compat import all_poison
from helpers.compat import byte_operands as Mem
from helpers.cuda_fakes import MAX_PITCH, FakeCudart, fake_runtime
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.runtime.cuda as cuda_module
from kvtier.address import CpuAddress, DeviceAddress
from kvtier.compat import DeviceArray
from kvtier.compat.operands import LIMIT
from kvtier.compat.sglang import kvcacheio
from kvtier.errors import InvalidArgument, KvtierError, NotDeviceAccessible
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind
from kvtier.runtime import create
from kvtier.runtime.base import split_groups, strided_groups

POISON = 0x5A


def fresh_rng() -> tuple[np.random.Generator, int]:
    seed = secrets.randbits(32)
    return np.random.default_rng(seed), seed


def in_order(dst: np.ndarray, src: np.ndarray, dst_offsets, src_offsets, sizes) -> np.ndarray:
    """The reference: the copies one after another (what SGLang's loop of copy_ calls on one stream does)."""
    out = dst.copy()
    for d, s, n in zip(dst_offsets, src_offsets, sizes, strict=True):
        out[d:d + n] = src[s:s + n]
    return out


# ======================================================================================================================
# Defects
# ======================================================================================================================
def test_direct_repeated_destination_tokens_are_refused_untouched(rt):
    """transfer_kv_direct with a repeated destination token (dst_indices [100, 100, 102, ..., 114]) once handed
    memcpy_runs_async two copies writing the same row: CUDA queues strided groups, lone copies and a batch (which
    orders nothing) in its own order, so which source landed depended on the runtime (on CUDA source token 5, on the
    emulators 0). Repeated or overlapping destinations are refused now, by name, with nothing copied."""
    m = Mem(rt)
    src, dst = m.device((128, 64)), m.host((128, 64), data=False)
    s = torch.tensor([5] + [10 * i for i in range(8)])
    d = torch.tensor([100] + [100 + 2 * i for i in range(8)])
    with pytest.raises(InvalidArgument, match=r"dst_layers\[0\].*same bytes"):
        kvcacheio.transfer_kv_direct([src], [dst], s, d, 1)
    other = m.host((128, 64), data=False)
    with pytest.raises(InvalidArgument, match=r"dst_layers\[0\].*same bytes"):   # a run [3, 6) and token 4 again
        kvcacheio.transfer_kv_direct([src, m.device((128, 64))], [other, m.host((128, 64), data=False)],
                                     torch.tensor([7, 8, 9, 20]), torch.tensor([3, 4, 5, 4]), 1)
    rt.synchronize(0)
    assert all_poison(dst) and all_poison(other)


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
    both tokens land."""
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
    Expected: both land (no cudaErrorInvalidPitchValue from a 2D copy of pitch 3 GiB)."""
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


# ======================================================================================================================
# Attacks that held (regression guards)
# ======================================================================================================================
def _runs(rng: np.random.Generator, n_tokens: int, count: int) -> np.ndarray:
    """``count`` token indices made of runs of consecutive tokens of mixed lengths (1-5), at random starts."""
    out: list[int] = []
    while len(out) < count:
        length = int(rng.integers(1, 6))
        start = int(rng.integers(0, n_tokens - length + 1))
        out += range(start, start + length)
    return np.array(out[:count], np.int64)


def _cpu(x):
    return x.cpu() if isinstance(x, DeviceArray) else x.detach().clone()


@pytest.mark.parametrize("mode", ["split", "unified"])
def test_ok_direct_mixed_length_runs_per_layer_land_exactly(mode):
    """Random calls of transfer_kv_direct: runs of mixed lengths on both sides (so copies of different sizes in one
    plan), layers of different row sizes, device / pinned / chunk-registered (offset views) operands on either side,
    int32 and int64 indices, CPU or device-resident: every destination byte is its source token's or its poison; a
    split-mode refusal (a tensor across chunks whose aliases do not continue) leaves every byte as it was."""
    rng, seed = fresh_rng()
    runtime = create(f"emulated:{mode}")
    m = Mem(runtime)

    def make(kind, n_tokens, row, data):
        if kind == "dev":
            return m.device((n_tokens, row), data=data)
        if kind == "host":
            return m.host((n_tokens, row), data=data)
        offset = int(rng.choice([0, 8, 100]))
        buffer = m._own(HostBuffer.allocate(-(-(n_tokens * row + offset) // 4096) * 4096, runtime=runtime,
                                            register_chunk_bytes=4096))
        t = buffer.as_tensor(torch.uint8)[offset:offset + n_tokens * row]
        t.copy_(m.values(t.shape, data))
        return t.view(n_tokens, row)

    for _ in range(40):
        n_tokens, layers = int(rng.integers(8, 64)), int(rng.integers(1, 4))
        count = int(rng.integers(1, n_tokens))
        rows = [int(rng.choice([8, 24, 64, 100, 256])) for _ in range(layers)]
        kinds = [str(rng.choice(["dev", "host", "chunk"])) for _ in range(2 * layers)]
        kinds[int(rng.integers(0, 2 * layers))] = "dev"      # the call's runtime is that of its DeviceArrays
        srcs = [make(kinds[i], n_tokens, rows[i], True) for i in range(layers)]
        dsts = [make(kinds[layers + i], n_tokens, rows[i], False) for i in range(layers)]
        src_idx = _runs(rng, n_tokens, count)
        dst_idx = _runs(rng, n_tokens, count) if rng.random() < 0.7 else rng.permutation(n_tokens)[:count]
        _, first = np.unique(dst_idx, return_index=True)      # one source per destination token
        keep = np.sort(first)
        src_idx, dst_idx = src_idx[keep], dst_idx[keep]
        dtype = torch.int32 if rng.random() < 0.3 else torch.int64
        s, d = torch.tensor(src_idx, dtype=dtype), torch.tensor(dst_idx, dtype=dtype)
        if rng.random() < 0.3:
            s = m._own(DeviceArray.from_tensor(s, runtime=runtime))
            d = m._own(DeviceArray.from_tensor(d, runtime=runtime))
        before_src, before_dst = [_cpu(x) for x in srcs], [_cpu(x) for x in dsts]
        try:
            kvcacheio.transfer_kv_direct(srcs, dsts, s, d, 1)
        except KvtierError as error:
            runtime.synchronize(0)
            assert mode == "split" and "chunk" in kinds, f"seed {seed}: {error}"
            assert all(torch.equal(_cpu(x), b) for x, b in zip(dsts, before_dst, strict=True)), f"seed {seed}"
            continue
        runtime.synchronize(0)
        for layer in range(layers):
            want = before_dst[layer].clone()
            want[dst_idx] = before_src[layer][src_idx]
            assert torch.equal(_cpu(dsts[layer]), want), (f"seed {seed}: layer {layer} rows {rows} kinds {kinds} "
                                                          f"src {src_idx.tolist()} dst {dst_idx.tolist()}")
        srcs = dsts = None
        gc.collect()


def test_ok_direct_runs_touching_both_ends_land_and_one_past_the_end_is_refused_untouched(rt):
    """Runs of lengths 1, 3 and 2 (a copy of each size) where the last run ends on the last token of the source and
    of the destination: accepted and exact. The same call with the last run one token longer, in a later layer only
    (its tensors are one token shorter), is refused naming that layer, and no layer of it was copied."""
    m = Mem(rt)
    n, rows = 16, [8, 40, 24]
    src_idx = torch.tensor([0, 5, 6, 7, 14, 15])
    dst_idx = torch.tensor([3, 9, 10, 11, 14, 15])
    srcs = [m.device((n, r)) for r in rows]
    dsts = [m.host((n, r), data=False) for r in rows]
    kvcacheio.transfer_kv_direct(srcs, dsts, src_idx, dst_idx, 2)
    rt.synchronize(0)
    for s, d in zip(srcs, dsts, strict=True):
        want = torch.full_like(d, POISON)
        want[dst_idx] = s.cpu()[src_idx]
        assert torch.equal(d, want)

    short = [m.device((n, r)) for r in rows[:2]] + [m.device((n - 1, rows[2]))]
    dsts = [m.host((n, r), data=False) for r in rows]
    with pytest.raises(InvalidArgument, match=r"src_layers\[2\].*out of range"):
        kvcacheio.transfer_kv_direct(short, dsts, src_idx, dst_idx, 2)
    short_dst = [m.host((n, r), data=False) for r in rows[:2]] + [m.host((n - 1, rows[2]), data=False)]
    with pytest.raises(InvalidArgument, match=r"dst_layers\[2\].*out of range"):
        kvcacheio.transfer_kv_direct(srcs, short_dst, src_idx, dst_idx, 2)
    rt.synchronize(0)
    assert all(all_poison(d) for d in dsts + short_dst)


def test_ok_direct_refusals_of_bad_indices_and_page_sizes_leave_everything_untouched(rt):
    """Huge indices (the bound LIMIT // 1024 and one past it, int32 2**31 - 1), negative ones, a page_size that does
    not divide the count, zero, a bool, mixed index dtypes, int16: InvalidArgument each time, nothing copied; empty
    indices are a no-op; a pageable host layer is refused by name before any layer is copied."""
    m = Mem(rt)
    srcs = [m.device((16, 8)) for _ in range(2)]
    dsts = [m.host((16, 8), data=False) for _ in range(2)]
    t = torch.tensor
    bad = [
        (t([0, LIMIT // 1024]), t([0, 1]), 1), (t([0, LIMIT // 1024 + 1]), t([0, 1]), 1),
        (t([2**31 - 1], dtype=torch.int32), t([0], dtype=torch.int32), 1), (t([0, -1]), t([0, 1]), 1),
        (t([0, 1, 2]), t([0, 1, 2]), 2), (t([0, 1]), t([0, 1]), 0), (t([0, 1]), t([0, 1]), True),
        (t([0, 1], dtype=torch.int32), t([0, 1]), 1), (t([0, 1], dtype=torch.int16), t([0, 1], dtype=torch.int16), 1),
        (t([15, 16]), t([0, 1]), 1), (t([0, 1]), t([15, 16]), 1), (t([0]), t([0, 1]), 1),
    ]
    for s, d, page_size in bad:
        with pytest.raises(InvalidArgument):
            kvcacheio.transfer_kv_direct(srcs, dsts, s, d, page_size)
    kvcacheio.transfer_kv_direct(srcs, dsts, t([], dtype=torch.int64), t([], dtype=torch.int64), 4)
    pageable = m._own(HostBuffer.allocate(4096, "pageable", runtime=rt)).as_tensor(torch.uint8)[:128].view(16, 8)
    pageable.fill_(POISON)
    with pytest.raises(NotDeviceAccessible, match=r"dst_layers\[1\]"):
        kvcacheio.transfer_kv_direct(srcs, [dsts[0], pageable], t([0, 1, 2]), t([4, 5, 9]), 1)
    rt.synchronize(0)
    assert all(all_poison(d) for d in dsts) and all_poison(pageable)
    del pageable


@pytest.mark.parametrize("mode", ["split", "unified"])
def test_ok_direct_page_first_both_ways_with_repeats_unaligned_and_edge_pages(mode):
    """Random pf_lf / lf_pf calls, K/V and MLA, page_size below the host page, pages touching the tensor ends,
    repeated pages (refused where they are destinations), host indices not starting a page (SGLang takes the page of
    the first token), a page or token one past the end: every byte as the SGLang loop's reference, or refused with
    every byte as it was."""
    rng, seed = fresh_rng()
    runtime = create(f"emulated:{mode}")
    m = Mem(runtime)
    for _ in range(120):
        pages, layers, page_size = int(rng.integers(1, 8)), int(rng.integers(1, 4)), int(rng.choice([1, 2, 4]))
        host_page, item = page_size + int(rng.integers(0, 2)), int(rng.choice([8, 16, 48]))
        n_tokens, tensors = int(rng.integers(page_size, 40)), int(rng.choice([1, 2]))
        count = int(rng.integers(1, pages + 2))
        host_pages = rng.integers(0, pages + (rng.random() < 0.15), count)
        starts = rng.integers(0, n_tokens - page_size + 1 + (rng.random() < 0.15), count)
        h_idx = np.array([p * page_size + i for p in host_pages for i in range(page_size)], np.int64)
        if rng.random() < 0.2:
            h_idx += int(rng.integers(0, page_size))
        d_idx = np.array([s + i for s in starts for i in range(page_size)], np.int64)
        to_lf = rng.random() < 0.5
        first = int(rng.integers(0, layers)) if to_lf else 0
        n_lf = layers - first
        hosts = [m.host((pages, layers, host_page, item), data=to_lf) for _ in range(tensors)]
        lf = [m.device((n_tokens, item), data=not to_lf) for _ in range(tensors * n_lf)]
        hosts_before, lf_before = [h.clone() for h in hosts], [x.cpu() for x in lf]
        want_hosts, want_lf, valid = [h.clone() for h in hosts_before], [x.clone() for x in lf_before], True
        written = set()
        for k in range(count):
            page, token = int(h_idx[k * page_size]) // page_size, int(d_idx[k * page_size])
            if page >= pages or token + page_size > n_tokens:
                valid = False
                break
            rows = set(range(token, token + page_size)) if to_lf else {page}
            if rows & written:          # two copies writing the same bytes are refused
                valid = False
                break
            written |= rows
            for t in range(tensors):
                for j in range(n_lf):
                    if to_lf:
                        want_lf[t * n_lf + j][token:token + page_size] = hosts_before[t][page, first + j, :page_size]
                    else:
                        want_hosts[t][page, j, :page_size] = lf_before[t * n_lf + j][token:token + page_size]
        try:
            if to_lf:
                kvcacheio.transfer_kv_per_layer_direct_pf_lf(hosts, lf, torch.tensor(h_idx), torch.tensor(d_idx),
                                                             first, page_size)
            else:
                kvcacheio.transfer_kv_all_layer_direct_lf_pf(lf, hosts, torch.tensor(d_idx), torch.tensor(h_idx),
                                                             page_size)
            refused = False
        except InvalidArgument:
            refused = True
        runtime.synchronize(0)
        assert refused == (not valid), f"seed {seed}"
        if refused:
            want_hosts, want_lf = hosts_before, lf_before
        assert all(torch.equal(a, b) for a, b in zip(hosts, want_hosts, strict=True)), f"seed {seed}"
        assert all(torch.equal(a.cpu(), b) for a, b in zip(lf, want_lf, strict=True)), f"seed {seed}"


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
