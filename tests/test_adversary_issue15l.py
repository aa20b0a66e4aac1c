"""Adversary round 12 (issue #15): the ``kvcacheio`` KERNEL functions (not ``*_direct``) against a byte model of
SGLang's offset formulas: contiguous host tensors whose size-1 dimensions carry odd strides (permuted views torch
calls contiguous), one-page and one-layer pools, ``item_size`` / ``*_layout_dim`` / ``page_size`` / ``head_num`` /
``layer_id`` arguments inconsistent with the tensors or of odd Python and numpy types, page-head strides past int64;
raw ``uint64`` pointer tables with duplicate entries, entries into the middle of a registration or at the very end of
an allocation, tables on another device, strided, int64 or uint64; a captured call whose pinned pointer table is
rewritten in place before replay; the ``TransferEngine`` DMA backends (``direct``, ``batch``, ``staged``) over host
pools registered in small chunks on split aliases (per-layer loads, layer subsets) against the kernel engine; and an
engine closed in the middle of a transfer, from another thread and from the queuing thread itself.
Tests not named ``test_ok_*`` fail on a defect (each docstring says what goes wrong, why it matters and a fix);
``test_ok_*`` tests document attacks that held. Races are forced with hooks, trace functions and events that pick the
moment they happen (never with sleeps); every destination is poisoned first and checked byte for byte against fresh
random data."""

from __future__ import annotations

import gc
import sys
import threading

import numpy as np
import pytest
import torch
from helpers.operands import MODES, POISON, cpu, dev_idx, device, pin_idx, poison
from helpers.pools import fill_device, fill_host, host_bytes, poison_device, read_device

from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import BufferClosed, InvalidArgument, KvtierError
from kvtier.memory import HostBuffer, HostKind
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.runtime import create
from kvtier.runtime import get as get_runtime
from kvtier.transfer import TransferEngine
from kvtier.transfer.lifetime import PoolUser

_keep: list = []


def rnd(shape):
    return torch.randint(1, 255, shape, dtype=torch.uint8)


def host(rt, shape, kind=HostKind.PINNED, data=True, **extra):
    """A uint8 host tensor over a kvtier HostBuffer of its own (``extra``: register_chunk_bytes, granularity)."""
    nbytes = int(np.prod(shape))
    buffer = HostBuffer.allocate(nbytes, kind, runtime=rt, **extra)
    _keep.append(buffer)
    tensor = buffer.as_tensor(torch.uint8)[:nbytes].view(shape)
    tensor.copy_(rnd(shape) if data else torch.full(shape, POISON, dtype=torch.uint8))
    return tensor


def odd(rt, shape, data=True):
    """A contiguous uint8 host tensor of ``shape`` whose size-1 dimensions carry odd strides (7, 20, 33, ...: torch
    ignores a size-1 dimension's stride for ``is_contiguous``, as in a permuted or transposed view)."""
    base = host(rt, shape, data=data)
    pairs = enumerate(zip(shape, base.stride(), strict=True))
    strides = [7 + 13 * i if size == 1 else stride for i, (size, stride) in pairs]
    tensor = base.as_strided(shape, strides, base.storage_offset())
    assert tensor.is_contiguous() and tensor.data_ptr() == base.data_ptr()
    return tensor










def flat(x):
    """A tensor's bytes in memory order (a contiguous tensor's logical order is its memory order)."""
    return cpu(x).reshape(-1).numpy().view(np.uint8).copy()




class OutOfRange(Exception):
    """SGLang's offsets for the call reach outside a tensor: it must be refused."""


def put(dst, dst_offset, src, src_offset, nbytes):
    if min(src_offset, dst_offset) < 0 or src_offset + nbytes > src.size or dst_offset + nbytes > dst.size:
        raise OutOfRange
    dst[dst_offset:dst_offset + nbytes] = src[src_offset:src_offset + nbytes]


def lands_as_modelled(rt, function, args, dsts, model, device_indices):
    """Run ``function(*args)``: it either writes exactly what ``model`` (SGLang's offsets applied to the
    destinations' bytes) writes, or, where SGLang's offsets leave a tensor, is refused by a KvtierError with every
    destination untouched. Returns whether it was accepted. Out-of-range calls with device-resident indices are not
    made (not checked, as in SGLang: the emulated kernel faults)."""
    before = [flat(d) for d in dsts]
    want = [b.copy() for b in before]
    try:
        model(want)
        out_of_range = False
    except OutOfRange:
        out_of_range = True
    if out_of_range and device_indices:
        return False
    try:
        function(*args)
        rt.synchronize(0)
    except KvtierError:
        for d, was in zip(dsts, before, strict=True):
            assert np.array_equal(flat(d), was), "a refused call wrote a destination"
        return False
    assert not out_of_range, "a call whose offsets leave a tensor was accepted"
    for d, expected in zip(dsts, want, strict=True):
        got = flat(d)
        assert np.array_equal(got, expected), f"bytes differ from SGLang's at {np.flatnonzero(got != expected)[:8]}"
    return True


@pytest.fixture(autouse=True)
def _collections_only_when_asked():
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# -- defects -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("indices", ["pinned", "device"])
@pytest.mark.parametrize("function", ["ph_lf", "lf_ph"])
def test_a_page_head_call_whose_page_stride_passes_int64_is_refused_by_kvtier(indices, function):
    """``page_size`` and ``*_layout_dim`` are each checked against 2**62 (kvcacheio.py:147 ``_positive``), but their
    product, the ``page_head`` page stride, is not: ``_page_head`` (kvcacheio.py:262) builds a Side with
    ``page_size * layout_dim`` (and ``per_head * page_size``) well past int64. With pinned indices ``check_reach``
    multiplies an int64 numpy array by it (kvcacheio.py:113) and raises a bare ``OverflowError``; with device indices
    nothing checks it until the launch packs the kernel arguments (runtime/program.py:42) and raises
    ``struct.error: argument out of range``. Neither is a KvtierError (docs/sglang.md: 'Bad sizes raise
    InvalidArgument', 'Every kvtier error is a KvtierError'), so a caller catching kvtier's errors crashes, and a kept
    plan whose launch can never be packed is stored first (kvcacheio.py:232). Fix: in ``_page_head`` refuse
    ``page_size * layout_dim > LIMIT`` with InvalidArgument (as ``_layout_holds`` does for layers)."""
    rt = create("emulated:split")
    row, page_size, layout_dim = 16, 1 << 30, 1 << 40
    hk, hv = host(rt, (8, row), data=False), host(rt, (8, row), data=False)
    dk, dv = device(rt, (8, row)), device(rt, (8, row))
    si, di = (pin_idx(rt, [0]), pin_idx(rt, [1])) if indices == "pinned" else (dev_idx(rt, [0]), dev_idx(rt, [1]))
    before = [cpu(x) for x in (hk, hv, dk, dv)]
    error = None
    try:
        if function == "ph_lf":
            io.transfer_kv_per_layer_ph_lf(hk, dk, hv, dv, si, di, 0, row, layout_dim, page_size, 1)
        else:
            tk, tv = dev_idx(rt, [dk.data_ptr()]), dev_idx(rt, [dv.data_ptr()])
            io.transfer_kv_all_layer_lf_ph(tk, hk, tv, hv, si, di, row, layout_dim, 1, page_size, 1)
        rt.synchronize(0)
    except Exception as caught:   # noqa: BLE001 - the test is about which error
        error = caught
    for x, was in zip((hk, hv, dk, dv), before, strict=True):
        assert torch.equal(cpu(x), was), "a refused call changed a tensor"
    assert isinstance(error, InvalidArgument), f"refused with {error!r}, not by kvtier"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("side", ["src", "dst"])
def test_a_device_table_entry_whose_item_0_runs_past_its_allocation_is_refused_without_indices(mode, side):
    """A raw table entry 8 bytes before the end of a device allocation, ``item_size`` 16, device-resident indices.
    With pinned indices kvtier refuses it ('reaches 16 bytes into src_layers[0], which holds 8'), and with device
    indices it still checks item 0 of a tensor operand and of a *host* table entry (kvcacheio.py:102-141); but for an
    entry in device memory ``check_reach`` skips the check outright (kvcacheio.py:120-121: ``if units is None and
    host_range(raw) is None: continue``) although ``table_room`` asks the runtime for the allocation's end
    (operands.py:290 ``allocation_end``, which the emulator and CUDA answer). So the kernel is launched, runs 8 bytes
    past the allocation, the emulator faults and the whole device is poisoned (every later call raises; on a GPU the
    bytes past the allocation are read or overwritten). Any non-negative index reaches past the end, so the call
    cannot be right. Fix: drop the ``host_range`` condition and check item 0 of device entries against
    ``allocation_end`` as for host ones (keep the result per entry, as ``rooms`` does)."""
    rt = create(mode)
    n, row = 8, 32
    a, b = device(rt, (n, row)), device(rt, (n, row), data=False)
    h = host(rt, (n, row))
    end = a.data_ptr() + n * row - 8
    table = dev_idx
    src, dst = (table(rt, [end]), table(rt, [b.data_ptr()])) if side == "src" else \
        (table(rt, [h.data_ptr()]), table(rt, [end]))
    before = [cpu(x) for x in (a, b, h)]
    with pytest.raises(KvtierError):
        io.transfer_kv_all_layer_mla(src, dst, dev_idx(rt, [0]), dev_idx(rt, [0]), 16, 1)
        rt.synchronize(0)
    rt.synchronize(0)    # the device must still be usable: refused, not faulted
    for x, was in zip((a, b, h), before, strict=True):
        assert torch.equal(cpu(x), was)


@pytest.mark.parametrize("mode", MODES)
def test_a_captured_call_follows_a_pointer_table_rewritten_before_replay_or_is_refused(mode):
    """``transfer_kv_all_layer_mla`` captured on a side stream with pinned CPU ``uint64`` tables (device-resident
    indices), then the destination table's entry 0 rewritten in place to another device tensor before replay. In
    SGLang the kernel dereferences the caller's table when it runs, so a replay writes the new destination (as kvtier
    follows index tensors rewritten before replay, round 11's test_ok_a_captured_per_layer_call...). kvtier reads the
    table when the call is made (operands.py:205 ``table_entries``) into a kernel table of its own
    (operands.py:255 ``pointer_table``), which the graph captured: the replay writes the capture-time destination,
    which the caller has re-pointed away from (it may be freed or reused by then), and leaves the new one untouched.
    Nothing says so: docs/sglang.md says 'A CPU table is read on every call', and of captures only that kvtier's own
    tables keep their address. Fix: refuse a call with raw tables while its stream is capturing (InvalidArgument:
    'raw pointer tables are read when the call is made; a graph would replay the capture-time entries'), or, where
    entries need no translation (unified aliases, device memory), copy the caller's table into the kernel table on the
    stream inside the capture; at least document it."""
    rt = create(mode)
    n, row, layers = 8, 32, 2
    src = [host(rt, (n, row)) for _ in range(layers)]
    dst = [device(rt, (n, row), data=False) for _ in range(layers)]
    other = device(rt, (n, row), data=False)
    src_table = pin_idx(rt, [x.data_ptr() for x in src])
    dst_table = pin_idx(rt, [x.data_ptr() for x in dst])
    si, di = dev_idx(rt, [1, 2]), dev_idx(rt, [3, 4])
    io.transfer_kv_all_layer_mla(src_table, dst_table, si, di, row, layers)    # warm: tables built
    rt.synchronize(0)
    for x in dst:
        poison(x)
    stream = rt.create_stream(0)
    with rt.use_stream(stream):
        stream.begin_capture()
        try:
            io.transfer_kv_all_layer_mla(src_table, dst_table, si, di, row, layers)
        except KvtierError:
            stream.end_capture().close()
            rt.synchronize(0)
            assert all((x.cpu() == POISON).all() for x in (*dst, other)), "a refused capture wrote"
            return
        graph = stream.end_capture()
    dst_table[0] = other.data_ptr()
    graph.launch(stream)
    stream.synchronize()
    want = torch.full((n, row), POISON, dtype=torch.uint8)
    want[[3, 4]] = src[0][[1, 2]]
    assert (dst[0].cpu() == POISON).all(), "the replay wrote the tensor the table no longer names"
    assert torch.equal(other.cpu(), want), "the replay did not write the tensor the table names"
    graph.close()


def _engine(rt, layout, backend, chunk=None, heads=1, pages=10, device_pages=8):
    g = KVGeometry("mha", 3, 4, 128, heads)
    dev = DevicePool.allocate(g, device_pages, 0, runtime=rt)
    extra = {} if chunk is None else {"register_chunk_bytes": chunk}
    host_pool = HostPool.allocate(g, layout, pages=pages, runtime=rt, **extra)
    engine = TransferEngine(dev, host_pool, backend=backend, staging_bytes=3 * g.bytes_per_page)
    return g, dev, host_pool, engine


@pytest.mark.parametrize("backend", ["direct", "batch", "staged"])
@pytest.mark.parametrize("direction", ["backup", "load"])
def test_an_engine_closed_from_its_own_queuing_thread_mid_transfer_is_not_used_after_close(backend, direction,
                                                                                            monkeypatch):
    """``engine.close()`` reached on the thread that is inside ``engine.backup``/``load`` (a SIGTERM handler doing a
    graceful shutdown, or a finalizer run by a collection inside the call: both run between bytecodes of the queuing
    thread), forced deterministically from the first ``memcpy_run_sets_async`` of the transfer. ``PoolUser`` guards
    both with one ``threading.RLock`` (transfer/job.py:238), so the close re-enters, drains, marks the engine closed
    and frees its streams and the staging area (job.py:286 ``_release``) under the transfer still queuing, which then
    carries on with them: the direct/batch backends queue on a destroyed stream (RuntimeCallError 'stream ... is
    destroyed'), the staged backend queues its DMA over the freed staging buffer (staged.py:174; refused here only
    because the emulator checks the address when queued: on CUDA a freed ``cudaMalloc`` block reused meanwhile is read
    or written), and where the close lands inside a relayout, the error is replaced by 'fence of a lease this ring did
    not hand out' from a ``finally`` (staged.py:124). kvtier's host buffers defer a close requested inside their own
    use (round 9); the engine does not. Fix: count the queuing calls in progress (under the lock) and let a close that
    finds one on its own thread mark the engine closing and return, the outermost call finishing the close once its
    work is queued (or raise BufferInUse); a transfer that is then refused raises BufferClosed before queuing
    anything."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = _engine(rt, "layer_first", backend)
    try:
        data = fill_device(dev)
        host_before = fill_host(host_pool)
        if direction == "load":
            poison_device(dev)
        queue = rt.memcpy_run_sets_async
        calls = []

        def hooked(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                engine.close()      # what a signal handler or a finalizer on this thread does
            return queue(*args, **kwargs)

        monkeypatch.setattr(rt, "memcpy_run_sets_async", hooked)
        pages = np.arange(6)
        try:
            transfer = engine.backup(pages, pages) if direction == "backup" else engine.load(pages, pages)
            transfer.wait()
        except BufferClosed:
            monkeypatch.undo()
            rt.synchronize(0)
            if direction == "backup":
                assert np.array_equal(host_bytes(host_pool), host_before), "a refused backup wrote the host pool"
            else:
                assert all((read_device(dev, t, layer) == 0xEE).all() for t in range(g.tensors)
                           for layer in range(g.layers)), "a refused load wrote the device pool"
            return
        monkeypatch.undo()
        rt.synchronize(0)
        assert engine.closed    # accepted: then it must have landed whole, and the engine be closed after it
        after = host_bytes(host_pool)
        for t in range(g.tensors):
            for layer in range(g.layers):
                pool_pages = read_device(dev, t, layer)
                for p in pages:
                    at = t * host_pool.tensor_bytes + layer * host_pool.strides.layer + p * host_pool.strides.page
                    expected = data[(t, layer)][p] if direction == "backup" else host_before[at:at + g.page_bytes]
                    got = after[at:at + g.page_bytes] if direction == "backup" else pool_pages[p]
                    assert np.array_equal(got, expected), (t, layer, p)
    finally:
        monkeypatch.undo()
        engine.close(), host_pool.close(), dev.close()


# -- attacks that held -------------------------------------------------------------------------------------------
PER_LAYER_SHAPES = [(8, 1, 32), (1, 8, 32), (8, 32, 1), (1, 256), (1, 1, 256)]


@pytest.mark.parametrize("mode", MODES)
def test_ok_kernel_functions_over_views_with_odd_size_1_strides_match_sglangs_offsets(mode):
    """``transfer_kv_per_layer``, ``_pf_lf`` and ``_ph_lf`` from pinned host tensors whose size-1 dimensions carry
    odd strides (one-row, one-page, one-layer, one-head pools made by permutes) into device tensors: ``item_size``
    half, equal, double or not dividing a row, layout dims with padding, numpy layer ids, ``head_num`` not dividing
    ``item_size``, ``page_size`` 1 to 4 against 1- or 3-page hosts, pinned and device indices (negative ones
    skipped). Every accepted call writes exactly SGLang's offsets; every call whose offsets leave a tensor is refused
    with nothing written."""
    rt = create(mode)
    accepted = 0
    for shape in PER_LAYER_SHAPES:
        for item in (16, 32, 64, 24, 40):
            for pairs, kind in (([0, 3], [2, 5]), "pinned"), (([7, -1], [1, 0]), "pinned"), (([3], [6]), "device"):
                hk, hv = odd(rt, shape), odd(rt, shape)
                dk, dv = device(rt, (8, 32), data=False), device(rt, (8, 32), data=False)
                make = pin_idx if kind == "pinned" else dev_idx
                si, di = make(rt, pairs[0]), make(rt, pairs[1])
                src = [flat(hk), flat(hv)]

                def model(w, src=src, item=item, pairs=pairs):
                    for s, d in zip(*pairs, strict=True):
                        if s >= 0 and d >= 0:
                            for t in range(2):
                                put(w[t], d * item, src[t], s * item, item)
                accepted += lands_as_modelled(rt, io.transfer_kv_per_layer, (hk, dk, hv, dv, si, di, item),
                                              [dk, dv], model, kind == "device")
    for layers, pad, layer, item, kind in [(1, 0, 0, 32, "pinned"), (1, 16, 0, 32, "device"), (3, 0, 2, 32, "pinned"),
                                           (3, 8, np.int64(1), 16, "pinned"), (3, 16, 2, 16, "device"),
                                           (1, 0, 1, 32, "pinned"), (3, 0, np.int32(2), 40, "pinned")]:
        layout_dim = layers * 32 + pad
        shape = (8, 1, layout_dim) if layers == 1 else (8, layout_dim, 1)
        hk, hv = odd(rt, shape), odd(rt, shape)
        dk, dv = device(rt, (8, 64), data=False), device(rt, (8, 64), data=False)
        make = pin_idx if kind == "pinned" else dev_idx
        pairs = ([0, 7], [4, 6])
        si, di = make(rt, pairs[0]), make(rt, pairs[1])
        src = [flat(hk), flat(hv)]

        def model(w, src=src, item=item, layer=int(layer), layout_dim=layout_dim, pairs=pairs):
            if (layer + 1) * item > layout_dim:
                raise OutOfRange
            for s, d in zip(*pairs, strict=True):
                for t in range(2):
                    put(w[t], d * item, src[t], s * layout_dim + layer * item, item)
        accepted += lands_as_modelled(
            rt, io.transfer_kv_per_layer_pf_lf, (hk, dk, hv, dv, si, di, layer, item, layout_dim),
            [dk, dv], model, kind == "device")
    for pages, heads, page_size, layers, layer, head_num, kind in [
            (1, 1, 1, 1, 0, 1, "pinned"), (1, 2, 4, 1, 0, 2, "pinned"), (3, 2, 2, 2, 1, 2, "pinned"),
            (3, 1, 2, 2, 1, 1, "device"), (3, 2, 1, 2, 0, 4, "pinned"), (3, 2, 2, 2, 0, 3, "pinned"),
            (1, 1, 4, 2, 1, 1, "pinned"), (3, 2, 4, 1, 0, 1, "pinned"), (1, 2, 1, 1, 0, 2, "device")]:
        head_dim = 16
        item = heads * head_dim
        layout_dim = layers * item
        hk, hv = (odd(rt, (pages, heads, page_size, layers, head_dim)) for _ in range(2))
        dk, dv = device(rt, (8, item), data=False), device(rt, (8, item), data=False)
        make = pin_idx if kind == "pinned" else dev_idx
        pairs = ([0, 3], [4, 6]) if pages * page_size > 3 or kind == "pinned" else ([0], [4])
        si, di = make(rt, pairs[0]), make(rt, pairs[1])
        src = [flat(hk), flat(hv)]

        def model(w, src=src, item=item, layer=layer, layout_dim=layout_dim, ps=page_size, hn=head_num, pairs=pairs):
            if item % hn or layout_dim % hn:
                raise OutOfRange
            for s, d in zip(*pairs, strict=True):
                for h in range(hn):       # SGLang's get_global_offset_per_head_ph / _lf
                    so = s // ps * ps * layout_dim + ps * layout_dim * h // hn + s % ps * layout_dim // hn \
                        + layer * item // hn
                    for t in range(2):
                        put(w[t], d * item + item // hn * h, src[t], so, item // hn)
        accepted += lands_as_modelled(
            rt, io.transfer_kv_per_layer_ph_lf, (hk, dk, hv, dv, si, di, layer, item, layout_dim, page_size,
                                                       head_num),
            [dk, dv], model, kind == "device")
    assert accepted > 40


@pytest.mark.parametrize("mode", MODES)
def test_ok_sizes_of_every_odd_type_and_range_are_refused_untouched(mode):
    """``item_size``, ``*_layout_dim``, ``layer_id``, ``page_size``, ``head_num``, ``num_layers``, ``block_quota``
    and ``num_warps_per_block`` given as 0, negative, bool, float, a 0-d tensor, numpy bool, 2**63 (and as numpy
    uint64), not a multiple of 8, a layout dim one byte short of the layer, a 2**62 layout dim with pinned indices, a
    layer past the layout, a table longer than ``num_layers``: each is an InvalidArgument (a KvtierError) with every
    tensor as it was; numpy int64/int32/uint64 values in range are taken and copy what SGLang copies."""
    rt = create(mode)
    n, row = 8, 32
    hk, hv = host(rt, (n, 2 * row)), host(rt, (n, 2 * row))
    dk, dv = device(rt, (n, row), data=False), device(rt, (n, row), data=False)
    si, di = pin_idx(rt, [1, 5]), pin_idx(rt, [2, 7])
    tk, tv = dev_idx(rt, [dk.data_ptr()]), dev_idx(rt, [dv.data_ptr()])
    before = [cpu(x) for x in (hk, hv, dk, dv)]
    bad = [0, -8, True, 16.0, torch.tensor(16), np.bool_(True), 1 << 63, np.uint64(1 << 63), 12, 1 << 62 << 1]

    def per_layer_pf(**kw):
        args = dict(layer_id=1, item_size=row, src_layout_dim=2 * row) | kw
        io.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, si, di, **args)

    def ph(**kw):
        args = dict(layer_id=0, item_size=row, src_layout_dim=2 * row, page_size=2, head_num=2) | kw
        io.transfer_kv_per_layer_ph_lf(hk, dk, hv, dv, si, di, **args)

    def lf_pf(**kw):
        args = dict(item_size=row, dst_layout_dim=2 * row, num_layers=1) | kw
        io.transfer_kv_all_layer_lf_pf(tk, hk, tv, hv, pin_idx(rt, [1, 5]), pin_idx(rt, [2, 7]), **args)

    cases = [(per_layer_pf, name, value) for name in ("item_size", "src_layout_dim", "layer_id", "block_quota",
                                                      "num_warps_per_block") for value in bad]
    cases += [(ph, name, value) for name in ("page_size", "head_num") for value in bad]
    cases += [(lf_pf, name, value) for name in ("item_size", "dst_layout_dim", "num_layers") for value in bad]
    cases += [(per_layer_pf, "src_layout_dim", 2 * row - 1), (per_layer_pf, "layer_id", 2),
              (per_layer_pf, "src_layout_dim", 1 << 62), (ph, "head_num", 3), (ph, "head_num", 64),
              (lf_pf, "num_layers", 2), (lf_pf, "dst_layout_dim", row - 8)]
    for function, name, value in cases:
        if (value == 12 and name not in ("item_size", "src_layout_dim", "dst_layout_dim")) or \
                (name == "layer_id" and value == 0 and type(value) is int):
            continue    # a valid block count, warp count, page size, table length or layer (checked below)
        with pytest.raises(KvtierError):
            function(**{name: value})
        rt.synchronize(0)
        for x, was in zip((hk, hv, dk, dv), before, strict=True):
            assert torch.equal(cpu(x), was), (function.__name__, name, value)
    for layer, item, layout in ((np.int64(1), np.int32(row), np.uint64(2 * row)), (np.uint8(0), np.int64(16), 64)):
        poison(dk)
        poison(dv)
        io.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, si, di, layer, item, layout)
        for h, d in ((hk, dk), (hv, dv)):
            want = torch.full((n * row,), POISON, dtype=torch.uint8)
            for s, t in ((1, 2), (5, 7)):
                want[t * int(item):(t + 1) * int(item)] = h.reshape(-1)[s * int(layout) + int(layer) * int(item):][
                    :int(item)]
            assert torch.equal(d.cpu().reshape(-1), want)


@pytest.mark.parametrize("mode", MODES)
def test_ok_raw_tables_of_every_form_copy_sglangs_bytes_or_are_refused(mode, monkeypatch):
    """``transfer_kv_all_layer_lf_pf`` (device layers → a padded ``page_first`` host) and ``transfer_kv_all_layer_mla``
    (host layers → device layers) through tables that are CPU int64, device int64, device uint64, on device 1 for a
    call on device 0, strided CPU views (read as their logical entries), with a duplicated source entry, and with
    entries 8 or 40 bytes into a tensor (the middle of its registration or allocation), pinned and device indices:
    each lands SGLang's bytes through the entries as given, or, where an entry's item would leave its memory, is
    refused untouched. (A call with no DeviceArray operand runs on kvtier's default runtime: made this one.)"""
    monkeypatch.setenv("KVTIER_RUNTIME", mode)
    rt = get_runtime(mode)

    def table(values, form):
        if form == "strided":
            t = torch.full((2 * len(values),), 12345, dtype=torch.int64)
            t[::2] = torch.tensor(values)
            return t[::2]
        if form == "cpu":
            return torch.tensor(values, dtype=torch.int64)
        t = torch.tensor(values, dtype=torch.int64)
        return DeviceArray.from_tensor(t.view(torch.uint64) if form == "uint64" else t, 1 if form == "dev1" else 0,
                                       runtime=rt)

    accepted = 0
    for layers, pad, item, form, kind, dup, mid in [
            (3, 16, 32, "cpu", "pinned", True, 0), (3, 0, 16, "dev", "pinned", False, 8),
            (1, 16, 32, "uint64", "device", False, 0), (3, 16, 16, "dev1", "pinned", True, 8),
            (3, 0, 32, "strided", "pinned", False, 0), (1, 0, 32, "dev", "pinned", False, 8),
            (3, 16, 32, "strided", "device", True, 0)]:
        layout_dim = layers * 32 + pad
        k_layers = [device(rt, (8, 32)) for _ in range(layers)]
        v_layers = [device(rt, (8, 32)) for _ in range(layers)]
        k_ptrs, v_ptrs = [x.data_ptr() + mid for x in k_layers], [x.data_ptr() + mid for x in v_layers]
        src = [[flat(x) for x in k_layers], [flat(x) for x in v_layers]]
        if dup and layers > 1:
            k_ptrs[1], src[0][1] = k_ptrs[0], src[0][0]
        hk, hv = host(rt, (8, layout_dim), data=False), host(rt, (8, layout_dim), data=False)
        make = pin_idx if kind == "pinned" else dev_idx
        pairs = ([0, 7], [4, 6])
        si, di = make(rt, pairs[0]), make(rt, pairs[1])
        tk, tv = table(k_ptrs, form), table(v_ptrs, form)

        def model(w, src=src, item=item, layout_dim=layout_dim, layers=layers, mid=mid, pairs=pairs):
            for s, d in zip(*pairs, strict=True):
                for t in range(2):
                    for layer in range(layers):
                        put(w[t], d * layout_dim + layer * item, src[t][layer], mid + s * item, item)
        r = lands_as_modelled(
            rt, io.transfer_kv_all_layer_lf_pf, (tk, hk, tv, hv, si, di, item, layout_dim, layers),
            [hk, hv], model, kind == "device")
        accepted += r
    for layers, item, form, kind, dup, mid in [
            (3, 32, "cpu", "pinned", True, 0), (3, 16, "strided", "pinned", False, 40), (1, 64, "dev", "pinned",
                                                                                         False, 8),
            (3, 32, "dev", "device", True, 8), (3, 32, "dev1", "pinned", False, 0)]:
        src_layers = [host(rt, (8, 32)) for _ in range(layers)]
        dst_layers = [device(rt, (8, 32), data=False) for _ in range(layers)]
        src_ptrs = [x.data_ptr() + mid for x in src_layers]
        src = [flat(x) for x in src_layers]
        if dup and layers > 2:
            src_ptrs[2], src[2] = src_ptrs[0], src[0]
        make = pin_idx if kind == "pinned" else dev_idx
        pairs = ([0, 3], [4, 6])
        si, di = make(rt, pairs[0]), make(rt, pairs[1])
        ts, td = table(src_ptrs, form), table([x.data_ptr() for x in dst_layers], form)

        def model(w, src=src, item=item, layers=layers, mid=mid, pairs=pairs):
            for s, d in zip(*pairs, strict=True):
                for layer in range(layers):
                    put(w[layer], d * item, src[layer], mid + s * item, item)
        r = lands_as_modelled(rt, io.transfer_kv_all_layer_mla, (ts, td, si, di, item, layers),
                                      dst_layers, model, kind == "device")
        accepted += r
    assert accepted >= 7


@pytest.mark.parametrize("mode", MODES)
def test_ok_table_entries_at_and_past_the_end_with_pinned_indices_are_refused_untouched(mode):
    """Entries 8 bytes before the end of a device allocation or a pinned host buffer with ``item_size`` 16 and pinned
    indices, and entries one past the end (unmapped), with pinned or device indices: each refused by name, nothing
    written, the device still usable."""
    rt = create(mode)
    n, row = 8, 32
    a, b = device(rt, (n, row)), device(rt, (n, row), data=False)
    h, hd = host(rt, (n, row)), host(rt, (n, row), data=False)
    before = [cpu(x) for x in (a, b, h, hd)]
    cases = []
    for off, kinds in ((8, (pin_idx,)), (0, (pin_idx, dev_idx))):
        for make in kinds:
            cases += [(a.data_ptr() + n * row - off, b.data_ptr(), make),
                      (h.data_ptr() + n * row - off, b.data_ptr(), make),
                      (h.data_ptr(), a.data_ptr() + n * row - off, make),
                      (a.data_ptr(), hd.data_ptr() + n * row - off, make)]
    for src, dst, make in cases:
        with pytest.raises(KvtierError):
            io.transfer_kv_all_layer_mla(dev_idx(rt, [src]), dev_idx(rt, [dst]), make(rt, [0]), make(rt, [0]), 16, 1)
        rt.synchronize(0)
        for x, was in zip((a, b, h, hd), before, strict=True):
            assert torch.equal(cpu(x), was)


@pytest.mark.parametrize("mode", MODES)
def test_ok_a_capture_over_a_device_table_is_refused_and_writes_nothing(mode):
    """A device-resident table (read back on every call on the emulator) captured: the read-back is a host wait
    during a capture, refused as CUDA does; the capture is ended, nothing is written, and the same call outside the
    capture still lands."""
    rt = create(mode)
    n, row = 8, 32
    src, dst = host(rt, (n, row)), device(rt, (n, row), data=False)
    ts, td = dev_idx(rt, [src.data_ptr()]), dev_idx(rt, [dst.data_ptr()])
    si, di = dev_idx(rt, [2]), dev_idx(rt, [5])
    io.transfer_kv_all_layer_mla(ts, td, si, di, row, 1)
    rt.synchronize(0)
    poison(dst)
    stream = rt.create_stream(0)
    with rt.use_stream(stream):
        stream.begin_capture()
        with pytest.raises(KvtierError, match="Capture"):
            io.transfer_kv_all_layer_mla(ts, td, si, di, row, 1)
        stream.end_capture().close()
    rt.synchronize(0)
    assert (dst.cpu() == POISON).all()
    io.transfer_kv_all_layer_mla(ts, td, si, di, row, 1)
    want = torch.full((n, row), POISON, dtype=torch.uint8)
    want[5] = src[2]
    assert torch.equal(dst.cpu(), want)


LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


@pytest.mark.parametrize("mode", ["emulated:split", "emulated:split:lazy", "emulated:unified"])
@pytest.mark.parametrize("backend", ["direct", "batch", "staged"])
def test_ok_dma_engines_over_host_pools_in_small_chunks_match_the_kernel_engine(mode, backend):
    """Host pools of every layout registered in chunks of one or two granules (so slot runs cross registration
    boundaries; on split aliases the chunks' aliases do not continue each other), one and two heads: a backup of 7
    pages into a run of consecutive slots over a boundary, then per-layer, whole and layer-subset loads back, each
    byte for byte equal to the kernel engine over an unchunked pool of the same layout and the same random bytes."""
    rt = create(mode)
    for layout in LAYOUTS:
        for chunk, heads in ((12288, 1), (24581, 2)):
            g, dev, host_pool, engine = _engine(rt, layout, backend, chunk, heads)
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


@pytest.mark.parametrize("backend", ["direct", "batch", "staged"])
def test_ok_an_engine_closed_from_another_thread_mid_transfer_closes_after_it_lands(backend, monkeypatch):
    """Thread A is held inside the first ``memcpy_run_sets_async`` of a per-layer load (an event in a hook); thread B
    calls ``engine.close()`` and is seen by a trace function entering it while A holds the engine's lock; A is then
    let go. The load lands whole, the close returns once it has, the engine is closed, and a later load raises
    BufferClosed."""
    rt = create("emulated:split:lazy")
    g, dev, host_pool, engine = _engine(rt, "page_first", backend, chunk=12288)
    try:
        fill_device(dev)
        host_data = fill_host(host_pool)
        poison_device(dev)
        queue = rt.memcpy_run_sets_async
        inside, go, closing = threading.Event(), threading.Event(), threading.Event()

        def hooked(*args, **kwargs):
            if threading.current_thread() is loader and not inside.is_set():
                inside.set()
                assert go.wait(60)
            return queue(*args, **kwargs)

        monkeypatch.setattr(rt, "memcpy_run_sets_async", hooked)
        out: dict = {}

        def load():
            try:
                out["transfer"] = engine.load(np.arange(8), np.arange(8))
                out["transfer"].wait()
            except BaseException as error:  # noqa: BLE001 - reported below
                out["load"] = error

        def tracer(frame, event, arg):
            if event == "call" and frame.f_code is PoolUser.close.__code__:
                closing.set()
            return None

        def close():
            sys.settrace(tracer)
            try:
                engine.close()
            except BaseException as error:  # noqa: BLE001 - reported below
                out["close"] = error
            finally:
                sys.settrace(None)

        loader = threading.Thread(target=load)
        loader.start()
        assert inside.wait(60)
        closer = threading.Thread(target=close)
        closer.start()
        assert closing.wait(60)
        go.set()
        loader.join(60)
        closer.join(60)
        assert not loader.is_alive() and not closer.is_alive()
        assert "load" not in out and "close" not in out, out
        assert engine.closed and out["transfer"].done()
        monkeypatch.undo()
        reference = HostPool.allocate(g, "page_first", pages=10, runtime=rt)
        reference.buffer.as_tensor().numpy()[:] = host_data
        fresh = DevicePool.allocate(g, 8, 0, runtime=rt)
        check = TransferEngine(fresh, reference, backend="kernel")
        check.load(np.arange(8), np.arange(8)).wait()
        for t in range(g.tensors):
            for layer in range(g.layers):
                assert np.array_equal(read_device(dev, t, layer), read_device(fresh, t, layer))
        check.close(), reference.close(), fresh.close()
        with pytest.raises(BufferClosed):
            engine.load([0], [0])
    finally:
        monkeypatch.undo()
        engine.close(), host_pool.close(), dev.close()
