"""Adversary round 10 (issue #15): the round-9 fixes and ``Runtime.memcpy_run_sets_async`` under attack: several
sets in one call (overlapping sources, mixed directions, empty sets, registration boundaries inside a set, a refusal
in a later set), the legacy default stream's detour on CUDA's copy paths (a fake driver that records which native
stream every call went to), host buffer lifetime (close and collection from other threads while work is queued or
running, close from a finalizer inside a kernel, interpreter exit, fork children), and the compat ``*_direct``
functions with their one-batch submission (many layers, mixed memory kinds, buffers registered in chunks, refusals).
Tests not named ``test_ok_*`` fail on a defect (each docstring says what goes wrong, why it matters and a fix);
``test_ok_*`` tests document attacks that held. Races are forced with trace functions and events that pick the moment
they happen (never with sleeps); every destination is poisoned first and checked byte for byte against fresh random
data."""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.operands import (
    MODES,
    POISON,
    at_line,
    close_when_collected,
    cpu,
    device,
    no_automatic_collection,
    poison,
    rnd,
)

import kvtier
from kvtier.address import CpuAddress, DeviceAddress
from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.kernels import reference
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind
from kvtier.runtime import create
from kvtier.runtime.emulated_scheduler import Scheduler

CHUNK = 16 << 10
_keep: list = []




def rnd_np(n):
    return np.random.default_rng().integers(1, 256, n, dtype=np.uint8)


def host(rt, shape, kind=HostKind.PINNED, data=True, chunk=None, offset=0):
    """A host tensor over a kvtier HostBuffer (``chunk``: registered in chunks of that size, the view starting
    ``offset`` bytes in, so it can straddle a registration boundary)."""
    nbytes = int(np.prod(shape))
    extra = {} if chunk is None else {"register_chunk_bytes": chunk}
    buffer = HostBuffer.allocate(nbytes + offset, kind, runtime=rt, **extra)
    _keep.append(buffer)
    tensor = buffer.as_tensor(torch.uint8)[offset:offset + nbytes].view(shape)
    tensor.copy_(rnd(shape) if data else torch.full(shape, POISON, dtype=torch.uint8))
    return tensor




def dev_idx(rt, values):
    return DeviceArray.from_tensor(torch.tensor(values, dtype=torch.int64), runtime=rt)










def in_thread(tracer, call):
    """``call()`` in a new thread traced by ``tracer``; returns (thread, errors)."""
    errors: list = []

    def run():
        sys.settrace(tracer)
        try:
            call()
        except BaseException as error:  # noqa: BLE001 (reported by the test)
            errors.append(error)
        finally:
            sys.settrace(None)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def child_env():
    root = str(Path(kvtier.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}, root


@pytest.fixture(autouse=True)
def _collections_only_when_asked():
    """No automatic collection: cyclic garbage goes exactly where a test calls ``gc.collect()``."""
    with no_automatic_collection():
        yield


# -- defects -----------------------------------------------------------------------------------------------------
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


def test_a_release_deferred_from_another_thread_as_the_running_op_ends_is_not_stranded():
    """Thread A runs an emulated kernel; thread B closes a viewed registered HostBuffer meanwhile.
    ``EmulatedRuntime.after_device_work`` (emulated.py:143-151) calls ``Scheduler.after_running`` without taking the
    runtime lock, and ``after_running`` (emulated_scheduler.py:86-97, the append at 95) reads ``_depth``, which
    counts operations running in *any* thread, then appends to ``_deferred``. If A's operation ends between B's
    check and B's append (forced here by holding B at the append), A's ``_release_deferred`` has already run and
    nothing runs the release again until some later operation steps: the buffer stays registered and mapped after
    both threads are done and the device is idle (a leak; a pool re-allocated in a loop leaks each time), and it is
    finally unregistered at an arbitrary later step of unrelated work (here: the next download). Fix: take the
    scheduler lock in ``after_running`` (or in ``after_device_work``) before reading ``_depth``; only the thread
    running the operation holds the lock inside it, so any other thread then waits for the operation's end and
    releases at once. (Since the fix B cannot reach the append while A's operation runs: B is held where it takes
    the lock instead.)"""
    rt = create("emulated:split:lazy")
    n, row = 8, 64
    buffer = HostBuffer.allocate(n * row, HostKind.REGISTERED, runtime=rt)
    address = buffer.cpu_address.value
    view = buffer.as_tensor(torch.uint8)
    view.copy_(rnd((n * row,)))
    del view
    a, b, si = device(rt, (n, row)), device(rt, (n, row), data=False), dev_idx(rt, list(range(n)))
    io.transfer_kv_per_layer_mla(a, b, si, si, row)
    in_op, proceed, checked, a_done = (threading.Event() for _ in range(4))

    def hold_a():
        in_op.set()
        assert proceed.wait(60)

    def hold_b():   # B is about to ask whether an op runs; with the fix it waits there for A's op to end
        checked.set()

    tracer_a, done_a = at_line(reference._copy, "source = memory.view", hold_a)
    tracer_b, done_b = at_line(Scheduler.after_running, "with self.lock:", hold_b)
    thread_a, errors_a = in_thread(tracer_a, lambda: rt.synchronize(0))
    assert in_op.wait(60)
    thread_b, errors_b = in_thread(tracer_b, buffer.close)
    assert checked.wait(60)
    proceed.set()
    thread_a.join(60)
    a_done.set()
    thread_b.join(60)
    assert not errors_a and not errors_b, (errors_a, errors_b)
    rt.synchronize(0)   # nothing queued: runs nothing
    assert buffer.closed
    assert rt.host_range(address) is None, "the closed buffer is still registered: its release was stranded"
    assert torch.equal(b.cpu(), a.cpu())


@pytest.mark.parametrize("which", ["transfer_kv_direct", "transfer_kv_all_layer_direct_lf_pf"])
@pytest.mark.parametrize("spec", MODES)
def test_direct_calls_refuse_a_destination_two_layers_share(spec, which):
    """docs/sglang.md: 'Repeated or overlapping destinations are refused: one call's copies land in no defined order
    (a batched copy orders nothing)'. The check runs on the destination *indices* of one layer only
    (``_token_runs`` / ``_page_overlap`` name ``dst_layers[0]`` / ``dst_ptrs[0]``, direct.py:298-303, 325-330), never
    on the destination *tensors*: the same tensor given for two layers (or K and V as one ``page_first_direct``
    tensor) is accepted, and since the one-batch submission (``_submit``, direct.py:256-261) all layers' copies go in
    one ``cudaMemcpyBatchAsync``, so which layer's bytes end up there is undefined on CUDA (SGLang's loop of
    ``copy_`` keeps the last layer; before this change each layer was its own batch, ordered on the stream). Fix:
    refuse destination tensors whose byte spans overlap (compare each plan's destination base + [lo, hi) span across
    layers, once per plan)."""
    rt = create(spec)
    n, row, layers = 16, 64, 2
    si, di = torch.tensor([3, 4, 5, 9]), torch.tensor([0, 1, 2, 7])
    if which == "transfer_kv_direct":
        shared = host(rt, (n, row), data=False)
        srcs = [device(rt, (n, row)) for _ in range(2)]
        call = lambda: io.transfer_kv_direct(srcs, [shared, shared], si, di, 1)  # noqa: E731
    else:
        shared = host(rt, (4, layers, 2, row), data=False)
        srcs = [device(rt, (n, row)) for _ in range(2 * layers)]
        call = lambda: io.transfer_kv_all_layer_direct_lf_pf(srcs, [shared, shared], torch.tensor([2, 3, 8, 9]),  # noqa: E731
                                                             torch.tensor([0, 1, 4, 5]), 2)
    with pytest.raises(InvalidArgument):
        call()
    rt.synchronize(0)
    assert (shared == POISON).all()


# -- attacks that held -----------------------------------------------------------------------------------------------
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


def _page_first_round_trip(rt):
    """Every layer of K and V backed up into a ``page_first_direct`` host pool registered in 4 KiB chunks whose
    boundaries fall inside pages (granularity 1), then loaded back layer by layer; every byte checked."""
    page, pl, pages, row = 4, 8, 12, 64
    k = [device(rt, (pages * page, row)) for _ in range(pl)]
    v = [device(rt, (pages * page, row)) for _ in range(pl)]
    hk = host(rt, (pages, pl, page, row), HostKind.REGISTERED, False, chunk=4096)
    hv = host(rt, (pages, pl, page, row), HostKind.REGISTERED, False, chunk=4096)
    assert (pl * page * row) % 4096 and hk.untyped_storage().nbytes() > 4096
    token_src = torch.tensor(np.concatenate([np.arange(p * page, (p + 1) * page) for p in (5, 0, 9)]))
    token_dst = torch.tensor(np.concatenate([np.arange(p * page, (p + 1) * page) for p in (2, 11, 7)]))
    io.transfer_kv_all_layer_direct_lf_pf([*k, *v], [hk, hv], token_src, token_dst, page)
    rt.synchronize(0)
    for layer in range(pl):
        for lf, pf in ((k, hk), (v, hv)):
            for sp, dp in ((5, 2), (0, 11), (9, 7)):
                assert torch.equal(pf[dp, layer], cpu(lf[layer])[sp * page:(sp + 1) * page]), (layer, dp)
    back_k = [device(rt, (pages * page, row), False) for _ in range(pl)]
    back_v = [device(rt, (pages * page, row), False) for _ in range(pl)]
    for layer in range(pl):
        io.transfer_kv_per_layer_direct_pf_lf([hk, hv], [back_k[layer], back_v[layer]], token_dst, token_src,
                                              layer, page)
    rt.synchronize(0)
    for layer in range(pl):
        for orig, back in ((k, back_k), (v, back_v)):
            want = torch.full((pages * page, row), POISON, dtype=torch.uint8)
            want[token_src] = cpu(orig[layer])[token_src]
            assert torch.equal(cpu(back[layer]), want), layer


def test_direct_calls_take_a_host_pool_registered_in_chunks_on_split_aliases():
    """docs/sglang.md promises for the ``*_direct`` functions: 'Host-side copies are cut where two kvtier
    registrations meet (a buffer registered in chunks), since no single DMA may cross one', and direct.py's
    ``_plan`` does cut them (direct.py:212-221, with CPU addresses: DMA needs no alias). But before that, ``_base``
    (direct.py:232) resolves the whole host tensor as a *kernel* operand (``operands.address`` ->
    ``get_device_accessible_ptr``, operands.py:122), which refuses a span over two chunks whose device aliases do not
    continue each other (memory/alias.py:29, RegistrationError '... spans two registration chunks whose aliases on
    device 0 are not contiguous'). On split aliases (MI355X, WSL2) every ``page_first_direct`` host pool larger
    than one registration chunk (default 64 GiB: a normal HiCache host pool) is refused by
    ``transfer_kv_all_layer_direct_lf_pf`` / ``transfer_kv_per_layer_direct_pf_lf``, the very case the cutting code
    exists for; it works only on unified aliases (``test_ok_direct_many_layers...``). Fix: for a host side of a DMA,
    check each registration the copies touch resolves for the device (``host_range`` per chunk, as
    ``split_at_boundaries`` already walks them) instead of resolving the whole tensor as one kernel operand."""
    _page_first_round_trip(create("emulated:split"))


@pytest.mark.parametrize("spec", MODES)
def test_ok_direct_many_layers_mixed_kinds_and_buffers_registered_in_chunks(spec):
    """``transfer_kv_direct`` over 40 layers whose operands cycle through device arrays, pinned host tensors and
    views of registered buffers (on unified aliases straddling 16 KiB chunk boundaries; split ones refuse those,
    see the test above), in every pairing (D2D, H2D, D2H), random indices with runs, called twice (kept plans).
    On unified aliases also the ``page_first_direct`` round trip through a pool in chunks split inside pages."""
    rt = create(spec)
    n, row, layers = 96, 256, 40
    chunk = CHUNK if spec == "emulated:unified" else None
    pairs = [("device", "pinned"), ("chunked", "device"), ("device", "device"), ("pinned", "device"),
             ("device", "chunked")]

    def make(kind, data):
        if kind == "device":
            return device(rt, (n, row), data)
        if kind == "pinned":
            return host(rt, (n, row), data=data)
        return host(rt, (n, row), HostKind.REGISTERED, data, chunk=chunk, offset=CHUNK // 2)

    srcs = [make(pairs[i % len(pairs)][0], True) for i in range(layers)]
    dsts = [make(pairs[i % len(pairs)][1], False) for i in range(layers)]
    rng = np.random.default_rng()
    picks = np.sort(rng.permutation(n)[:48])
    si = torch.tensor(np.concatenate([np.arange(10, 26), picks[:32]]))
    di = torch.tensor(rng.permutation(n)[:48])
    for _ in range(2):
        for d in dsts:
            poison(d)
        io.transfer_kv_direct(srcs, dsts, si, di, 1)
        rt.synchronize(0)
        for layer, (s, d) in enumerate(zip(srcs, dsts, strict=True)):
            want = torch.full((n, row), POISON, dtype=torch.uint8)
            want[di] = cpu(s)[si]
            assert torch.equal(cpu(d), want), layer
    if chunk:
        _page_first_round_trip(rt)


@pytest.mark.parametrize("spec", MODES)
def test_ok_a_refusal_in_the_last_of_many_layers_leaves_every_layer_untouched(spec):
    """A ``transfer_kv_direct`` of 24 layers whose last destination is short (index out of range there only), whose
    last layer's rows differ, or whose last layer is pageable memory: refused before anything is queued (no layer
    written), and the valid call right after (same index tensors, kept values) lands exactly."""
    rt = create(spec)
    n, row, layers = 32, 128, 24
    srcs = [device(rt, (n, row)) for _ in range(layers)]
    dsts = [host(rt, (n, row), data=False) for _ in range(layers)]
    si, di = torch.tensor([0, 1, 2, 3, 17, 30]), torch.tensor([5, 6, 7, 8, 31, 0])
    wrong = {"short": host(rt, (n - 1, row), data=False), "rows": host(rt, (n, row // 2), data=False),
             "pageable": torch.full((n, row), POISON, dtype=torch.uint8)}
    for name, last in wrong.items():
        for d in dsts:
            poison(d)
        with pytest.raises(KvtierError):
            io.transfer_kv_direct(srcs, [*dsts[:-1], last], si, di, 1)
        rt.synchronize(0)
        assert all(bool((d == POISON).all()) for d in dsts), name
        assert bool((last == POISON).all()), name
        io.transfer_kv_direct(srcs, dsts, si, di, 1)
        rt.synchronize(0)
        for s, d in zip(srcs, dsts, strict=True):
            want = torch.full((n, row), POISON, dtype=torch.uint8)
            want[di] = cpu(s)[si]
            assert torch.equal(d, want), name


def _filled(rt, kind, n, row):
    """(a host buffer of ``kind``, a view of it holding fresh random rows, a copy of them, a poisoned device
    destination, the row indices)."""
    buffer = HostBuffer.allocate(n * row, kind, runtime=rt)
    view = buffer.as_tensor(torch.uint8).view(n, row)
    view.copy_(rnd((n, row)))
    return buffer, view, view.clone(), device(rt, (n, row), data=False), dev_idx(rt, list(range(n)))


@pytest.mark.parametrize("how", ["close", "collect"])
@pytest.mark.parametrize("kind", [HostKind.REGISTERED, HostKind.SHM, HostKind.PINNED])
def test_ok_a_buffer_closed_or_collected_in_another_thread_while_its_copy_is_queued(kind, how):
    """Lazy schedule: a compat kernel reading a view of the buffer is queued; another thread closes the buffer (or
    drops the last reference and collects it). The release waits for the device: the copy lands, and afterwards the
    registration (or pinned allocation) is gone and an shm file removed."""
    rt = create("emulated:split:lazy")
    n, row = 8, 64
    buffer, view, want, dst, si = _filled(rt, kind, n, row)
    address, path = buffer.cpu_address.value, buffer.path
    io.transfer_kv_per_layer_mla(view, dst, si, si, row)
    del view
    holder = [buffer]
    del buffer

    def drop():
        if how == "close":
            holder[0].close()
        else:
            holder.clear()
            assert gc.collect() > 0
    thread, errors = in_thread(None, drop)
    thread.join(60)
    assert not errors, errors
    assert rt.host_range(address) is None
    assert path is None or not os.path.exists(path)
    assert torch.equal(dst.cpu(), want)


@pytest.mark.parametrize("kind", [HostKind.SHM, HostKind.PINNED])
def test_ok_close_from_a_finalizer_inside_the_kernel_reading_the_buffer(kind):
    """The kernel reading an shm (or pinned) buffer's view runs; inside it, a collection runs an owner's
    ``__del__`` that closes the buffer. The release is deferred past the kernel: it reads every byte, the kernel
    queued behind it (into the same buffer) runs after it, and then the memory is given back."""
    rt = create("emulated:split:lazy")
    n, row = 8, 64
    buffer, view, want, dst, si = _filled(rt, kind, n, row)
    address, path = buffer.cpu_address.value, buffer.path
    back, other = device(rt, (n, row), data=False), device(rt, (n, row))
    io.transfer_kv_per_layer_mla(view, dst, si, si, row)       # K1 reads the buffer
    io.transfer_kv_per_layer_mla(other, view, si, si, row)     # K2 writes it
    io.transfer_kv_per_layer_mla(view, back, si, si, row)      # K3 reads K2's bytes
    del view

    close_when_collected(buffer)
    del buffer
    tracer, done = at_line(reference._copy, "source = memory.view", gc.collect)
    sys.settrace(tracer)
    try:
        rt.synchronize(0)
    finally:
        sys.settrace(None)
    assert done and done[0] > 0
    assert torch.equal(dst.cpu(), want)
    assert torch.equal(back.cpu(), other.cpu())
    assert rt.host_range(address) is None
    assert path is None or not os.path.exists(path)


_EXIT_CHILD = """
import atexit, sys
results = {}
def report():   # registered first: runs last, after the finalizers' atexit hook
    print("REPORT", results.get("rt") is not None and not results["rt"].scheduler._faults,
          results.get("rt") is not None and results["rt"].host_range(results["address"]) is None, flush=True)
atexit.register(report)
import torch
from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.memory import HostBuffer
from kvtier.runtime import create
rt = create("emulated:split:lazy")
n, row = 8, 256
buffer = HostBuffer.allocate(n * row, "registered", runtime=rt)
view = buffer.as_tensor(torch.uint8).view(n, row)
view.copy_(torch.randint(1, 255, (n, row), dtype=torch.uint8))
dst = DeviceArray.from_tensor(torch.full((n, row), 0x5A, dtype=torch.uint8), runtime=rt)
si = DeviceArray.from_tensor(torch.arange(n), runtime=rt)
io.transfer_kv_per_layer_mla(view, dst, si, si, row)    # queued, never waited for
del view
shm = HostBuffer.allocate(4096, "shm", runtime=rt)
alive = shm.as_tensor()                                 # a view alive at exit
alive.fill_(7)
print("PATH", shm.path, flush=True)
results.update(rt=rt, address=buffer.cpu_address.value)
atexit.register(lambda: print("ATEXIT", int(alive.sum()) == 7 * 4096, flush=True))
"""


def test_ok_interpreter_exit_with_queued_work_and_a_live_view():
    """A process exits with a copy still queued over a viewed registered buffer and an shm buffer whose view is
    alive (and read by an atexit hook). Exit is clean (status 0, nothing on stderr), the live view reads its bytes,
    the queued copy runs without a fault before the registration goes, and the shm file is removed."""
    env, root = child_env()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXIT_CHILD)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines.get("ATEXIT") == "True", done.stdout
    assert lines.get("REPORT") == "True True", done.stdout
    assert not os.path.exists(lines["PATH"])


_FORK_CHILD = """
import gc, os, sys, torch
from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.memory import HostBuffer
from kvtier.runtime import create
rt = create("emulated:split")
n, row = 8, 256
buffers = {kind: HostBuffer.allocate(n * row, kind, runtime=rt) for kind in ("registered", "shm", "pinned")}
data = {}
for kind, buffer in buffers.items():
    view = buffer.as_tensor(torch.uint8).view(n, row)
    view.copy_(torch.randint(1, 255, (n, row), dtype=torch.uint8))
    data[kind] = view.clone()
    del view
pid = os.fork()
if pid == 0:
    for buffer in buffers.values():
        buffer.close()                     # the child's copies: marked closed, nothing given back
    del buffers
    gc.collect()
    sys.exit(0)                            # normal exit: atexit and finalizers run in the child
_, status = os.waitpid(pid, 0)
ok = [os.waitstatus_to_exitcode(status) == 0, os.path.exists(buffers["shm"].path)]
si = DeviceArray.from_tensor(torch.arange(n), runtime=rt)
for kind, buffer in buffers.items():
    ok.append(rt.host_range(buffer.cpu_address.value) is not None)
    dst = DeviceArray.from_tensor(torch.full((n, row), 0x5A, dtype=torch.uint8), runtime=rt)
    view = buffer.as_tensor(torch.uint8).view(n, row)
    io.transfer_kv_per_layer_mla(view, dst, si, si, row)
    rt.synchronize(0)
    ok.append(bool(torch.equal(dst.cpu(), data[kind])))
    del view
    buffer.close()
print("FORK", all(ok), ok)
"""


def test_ok_a_fork_child_closing_and_exiting_leaves_the_parents_buffers_alone():
    """A fork child closes its copies of the parent's registered, shm and pinned buffers (all viewed) and exits
    normally: the parent's registrations, the shm file and every byte are intact, and kernels read them after."""
    env, root = child_env()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_FORK_CHILD)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FORK True" in done.stdout, done.stdout + done.stderr[-3000:]
