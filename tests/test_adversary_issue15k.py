"""Adversary round 11 (issue #15): the kept-plan caches and the ``*_direct`` overlap checks under attack: operands
whose identity changes under a kept plan (``set_``, ``resize_``, ``as_strided`` views, host memory registered again
in other pieces while another thread is planning), destinations that another copy of the same call reads, contiguous
tensors whose size-1 dimensions carry strides that mean nothing (torch ignores them for ``is_contiguous``), index
tensors of every shape (0-d, non-contiguous, int32, dtype changed under one object), host buffers registered in small
chunks with a page granularity on split aliases, and graph capture on the emulator (a per-layer call replayed after
its indices changed; host synchronisation inside a capture, which CUDA refuses).
Tests not named ``test_ok_*`` fail on a defect (each docstring says what goes wrong, why it matters and a fix);
``test_ok_*`` tests document attacks that held. Races are forced with trace functions and events that pick the moment
they happen (never with sleeps); every destination is poisoned first and checked byte for byte against fresh random
data."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch
from helpers.operands import MODES, POISON, cpu, dev_idx, device, no_automatic_collection, pin_idx, poison, rnd

from kvtier.compat.sglang import direct as direct_module
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.memory import HostBuffer, HostKind
from kvtier.runtime import create

_keep: list = []




def host(rt, shape, kind=HostKind.PINNED, data=True, **extra):
    """A uint8 host tensor over a kvtier HostBuffer of its own (``extra``: register_chunk_bytes, granularity)."""
    nbytes = int(np.prod(shape))
    buffer = HostBuffer.allocate(nbytes, kind, runtime=rt, **extra)
    _keep.append(buffer)
    tensor = buffer.as_tensor(torch.uint8)[:nbytes].view(shape)
    tensor.copy_(rnd(shape) if data else torch.full(shape, POISON, dtype=torch.uint8))
    return tensor












@pytest.fixture(autouse=True)
def _collections_only_when_asked():
    """No automatic collection: cyclic garbage goes exactly where a test calls ``gc.collect()``."""
    with no_automatic_collection():
        yield


# -- defects -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_direct_refuses_a_destination_that_another_layers_copy_reads(mode):
    """``transfer_kv_direct([a0, a1], [a1, b1], ...)``: layer 0 writes ``a1``, which layer 1 reads. SGLang's loop runs
    run by run, each run's layers in order (run 0 layer 0, run 0 layer 1, run 1 layer 0, ...); kvtier queues every
    layer's runs as one batch, layer by layer, so here layer 1 of run 0 reads the token run 1 of layer 0 has already
    overwritten: the call is accepted and ``b1`` ends up with other bytes than SGLang gives (on a GPU the batch orders
    nothing at all, so it is undefined). The overlap checks look only at destinations against destinations
    (kvtier/compat/sglang/direct.py:246 ``_refuse_shared`` and :257 ``_refuse_overlap``, called from :318 and
    :337); a destination that is another copy's source passes both, although the reason they give (one call's copies
    land in no defined order) applies to it in full. It matters for in-place moves (compaction, a pool shifted by a
    layer), which SGLang's loop defines and kvtier silently reorders. Fix: in ``_refuse_shared`` also refuse a
    destination tensor whose span overlaps any source tensor of another layer (and, within a layer, a destination
    run overlapping a source run of another copy), or order the copies as SGLang's loop does when they do."""
    rt = create(mode)
    n, row = 8, 32
    a0, a1, b1 = device(rt, (n, row)), device(rt, (n, row)), device(rt, (n, row))
    before = [cpu(x) for x in (a0, a1, b1)]
    src, dst = torch.tensor([0, 5]), torch.tensor([3, 0])     # two runs: 0 -> 3, then 5 -> 0
    want = [x.clone() for x in before]                        # SGLang: for each run, for each layer, copy_
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        want[1][d] = want[0][s]
        want[2][d] = want[1][s]
    try:
        io.transfer_kv_direct([a0, a1], [a1, b1], src, dst, 1)
    except InvalidArgument:
        for x, was in zip((a0, a1, b1), before, strict=True):
            assert torch.equal(cpu(x), was), "a refused call changed a tensor"
        return
    for name, x, expected in zip(("a0", "a1", "b1"), (a0, a1, b1), want, strict=True):
        assert torch.equal(cpu(x), expected), f"{name} differs from SGLang's run-by-run loop"


@pytest.mark.parametrize("mode", MODES)
def test_direct_takes_a_page_size_1_page_first_host_whose_size_1_dim_has_any_stride(mode):
    """A ``page_first_direct`` host tensor ``[pages, layers, 1, D]`` (page_size 1, SGLang's default) made by a
    transpose is contiguous for torch (a size-1 dimension's stride is ignored), but its ``stride(2)`` is 1, not D.
    kvtier reads the token bytes of the page from that stride (kvtier/compat/sglang/direct.py:139 ``_bytes``, used at
    :415 ``size = page_size * _bytes(host, 2)``) and refuses the legitimate call: "1 bytes on the source side but 16
    on the destination side". SGLang's ``select``/``slice``/``copy_`` take it. Fix: for a size-1 dimension use the
    contiguous stride (``prod(shape[dim + 1:]) * element_size``), e.g. ``torch.empty(0).new_empty(x.shape).stride()``,
    everywhere ``_bytes`` is read."""
    rt = create(mode)
    pages, layers, d = 4, 2, 16
    made = host(rt, (pages, layers, d, 1))
    hk = made.transpose(2, 3)                                 # (pages, layers, 1, d), strides (32, 16, 1, 1)
    assert hk.is_contiguous() and hk.stride(2) == 1
    dk = device(rt, (8, d), data=False)
    io.transfer_kv_per_layer_direct_pf_lf([hk], [dk], torch.tensor([2, 0]), torch.tensor([5, 1]), 1, 1)
    want = torch.full((8, d), POISON, dtype=torch.uint8)
    want[5], want[1] = hk[2, 1, 0], hk[0, 1, 0]
    assert torch.equal(dk.cpu(), want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("direction", ["pf_lf", "lf_pf"])
def test_direct_refuses_a_page_past_a_one_page_host_whose_page_stride_means_nothing(mode, direction):
    """A one-page ``page_first_direct`` host tensor ``[1, layers, page_size, D]`` made by a permute has
    ``stride(0) == 1`` (torch ignores a size-1 dimension's stride). Page 1 does not exist, yet kvtier computes its
    offset as ``1 * stride(0)`` = 1 byte (kvtier/compat/sglang/direct.py:416 ``strides = (_bytes(host, 0), ...)``,
    then ``_runs``/``_plan`` bound it only by the tensor's extent, which page 1 of layer 0 fits): the load copies
    layer 0 of page 0 shifted by one byte into the destination, the backup overwrites page 0 from its second byte.
    SGLang's ``select(0, 1)`` raises IndexError. Silent corruption of a host page through an out-of-range index.
    Fix: check each page index against ``shape[0]`` (and use contiguous strides for size-1 dimensions)."""
    rt = create(mode)
    layers, page, d = 2, 2, 16
    made = host(rt, (layers, page, d, 1))
    pf = made.permute(3, 0, 1, 2)                             # (1, layers, page, d), strides (1, 32, 16, 1)
    assert pf.is_contiguous() and pf.stride(0) == 1
    lf = device(rt, (8, d), data=direction == "lf_pf")
    before_pf, before_lf = cpu(pf), cpu(lf)
    with pytest.raises(InvalidArgument):
        if direction == "pf_lf":   # page 1 (tokens 2, 3) of the host into tokens 4, 5
            io.transfer_kv_per_layer_direct_pf_lf([pf], [lf], torch.tensor([2, 3]), torch.tensor([4, 5]), 0, page)
        else:                      # tokens 0, 1 into page 1 of the host
            io.transfer_kv_all_layer_direct_lf_pf([lf], [pf], torch.tensor([0, 1]), torch.tensor([2, 3]), page)
    assert torch.equal(cpu(pf), before_pf) and torch.equal(cpu(lf), before_lf)


@pytest.mark.parametrize("what", ["stream", "device", "compat-checks", "direct-device-indices"])
def test_the_emulator_refuses_a_host_synchronise_inside_a_stream_capture_as_cuda_does(what, monkeypatch):
    """CUDA refuses to synchronise a stream that is capturing, and a device synchronise while any stream captures
    (cudaErrorStreamCaptureUnsupported, and the capture is invalidated); torch's ``.to("cpu")`` of a CUDA index tensor
    inside a capture raises the same way. The emulator returns at once: ``EmulatedStream.synchronize``
    (kvtier/runtime/emulated_device.py:240) and ``EmulatedRuntime.synchronize`` (kvtier/runtime/emulated.py:122)
    never look at ``capturing``. So on CI a compat call that cannot be captured on a GPU is captured without a word:
    one with ``KVTIER_COMPAT_CHECKS=1`` (kvcacheio.py:215 synchronises the stream; docs/sglang.md says such a call
    cannot be captured), a ``*_direct`` call over device-resident indices (direct.py:45 reads them back with
    ``DeviceArray.cpu()``; the graph then replays the capture-time indices forever). The emulator claims to be at
    least as hostile as a GPU (docs/design.md "The emulated runtime"). Fix: raise ``RuntimeCallError(...,
    "cudaErrorStreamCaptureUnsupported")`` from both synchronise paths (and ``Event.synchronize``/``query`` on a
    captured event) while the stream, or for a device synchronise any stream of the device, is capturing."""
    rt = create("emulated:split")
    n, row = 8, 32
    hk, hv = host(rt, (n, row)), host(rt, (n, row))
    dk, dv = device(rt, (n, row), data=False), device(rt, (n, row), data=False)
    si, di = dev_idx(rt, [1, 2]), dev_idx(rt, [3, 4])
    io.transfer_kv_per_layer(hk, dk, hv, dv, si, di, row)   # warmed up: the capture itself allocates nothing
    rt.synchronize(0)
    if what == "compat-checks":
        monkeypatch.setenv("KVTIER_COMPAT_CHECKS", "1")
    stream = rt.create_stream(0)
    actions = {
        "stream": stream.synchronize,
        "device": lambda: rt.synchronize(0),
        "compat-checks": lambda: io.transfer_kv_per_layer(hk, dk, hv, dv, si, di, row),
        "direct-device-indices": lambda: io.transfer_kv_direct([hk, hv], [dk, dv], si, di, 1),
    }
    with rt.use_stream(stream):
        stream.begin_capture()
        try:
            with pytest.raises(KvtierError):
                actions[what]()
        finally:
            stream.end_capture()


def _pause_build(code, paused: threading.Event, resume: threading.Event):
    """A trace function that stops the first run of ``code`` at its ``return`` until ``resume`` is set."""
    done: list = []

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def local(frame, event, arg):
            if event == "return" and not done:
                done.append(True)
                paused.set()
                resume.wait(60)
            return local
        return local
    return tracer


def test_direct_plans_kept_after_a_registration_change_are_those_of_the_new_registrations():
    """``Indexed.call_plans`` (kvtier/compat/sglang/direct.py:76-95, the store at :90) reads the host-range
    generation, empties its plans if it changed, then runs ``build()`` and stores the result, ``self.plans[full] =
    build()``, with no generation attached to the plan itself. A thread whose ``build()`` resolved the copies
    before a registration change and stores them after another thread emptied the plans for the new generation puts
    a plan of the old registrations into the new generation's dict, and every later call over the same tensors
    reuses it. Forced here: thread 1
    plans a layer over host memory registered as one range and is held at the end of ``build``; the memory is
    registered again as two ranges; the main thread's call plans with the copy cut at the new boundary; thread 1
    stores its uncut plan. The next call on the main thread, same tensors and indices, queues a copy across two
    registrations and is refused (the emulator: cudaErrorInvalidValue; CUDA's driver refuses it likewise, possibly
    after queuing the batch entries before it), and so is every later call until some buffer is registered or
    closed. Fix: keep the generation with each plan (``self.plans[full] = (generation, plans)``, reused only when it
    still matches), or store only if ``self.plans_at`` is still the generation read before ``build()``."""
    rt = create("emulated:split")
    n, row = 8, 64
    memory = np.random.default_rng().integers(1, 256, n * row, dtype=np.uint8)
    address = memory.ctypes.data
    rt.host_register(address, n * row)
    src = torch.from_numpy(memory).view(n, row)
    dst = device(rt, (n, row), data=False)
    si, di = torch.tensor([2, 3, 4, 5]), torch.tensor([0, 1, 2, 3])   # one run over tokens 2..5 of the host
    build = next(c for c in direct_module.transfer_kv_direct.__code__.co_consts
                 if getattr(c, "co_name", "") == "build")
    paused, resume = threading.Event(), threading.Event()
    errors: list = []

    def first():
        sys.settrace(_pause_build(build, paused, resume))
        try:
            io.transfer_kv_direct([src], [dst], si, di, 1)
        except KvtierError as error:   # its registration changed under it: a refusal is fair here
            errors.append(error)
        finally:
            sys.settrace(None)
    thread = threading.Thread(target=first, daemon=True)
    thread.start()
    assert paused.wait(60)
    try:
        rt.host_unregister(address)                         # the same memory, now two registrations meeting at
        rt.host_register(address, 4 * row)                  # token 4: a copy over tokens 2..5 must be cut there
        rt.host_register(address + 4 * row, 4 * row)
        io.transfer_kv_direct([src], [dst], si, di, 1)
        rt.synchronize(0)
    finally:
        resume.set()
        thread.join(60)
    poison(dst)
    io.transfer_kv_direct([src], [dst], si, di, 1)          # same tensors, same indices, no registration change
    want = torch.full((n, row), POISON, dtype=torch.uint8)
    want[di] = src[si]
    assert torch.equal(dst.cpu(), want)
    rt.host_unregister(address + 4 * row)
    rt.host_unregister(address)


# -- attacks that held ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["emulated:split", "emulated:unified:lazy"])
def test_ok_a_captured_per_layer_call_replays_with_the_index_values_of_replay_time(spec):
    """A warmed per-layer call captured on a side stream (K and V, pinned host → device, device-resident int64 and
    pinned int32 indices) and replayed after the index tensors were rewritten in place: every replay copies the
    pairs the indices hold at replay time, nothing else; the capture itself ran nothing."""
    rt = create(spec)
    n, row = 16, 64
    hk, hv = host(rt, (n, row)), host(rt, (n, row))
    dk, dv = device(rt, (n, row), data=False), device(rt, (n, row), data=False)
    cases = [(dev_idx(rt, [1, 2, 3]), dev_idx(rt, [4, 5, 6])),
             (pin_idx(rt, [1, 2, 3], torch.int32), pin_idx(rt, [4, 5, 6], torch.int32))]
    stream = rt.create_stream(0)
    for si, di in cases:
        io.transfer_kv_per_layer(hk, dk, hv, dv, si, di, row)
        rt.synchronize(0)
        poison(dk)
        poison(dv)
        with rt.use_stream(stream):
            stream.begin_capture()
            io.transfer_kv_per_layer(hk, dk, hv, dv, si, di, row)
            graph = stream.end_capture()
        rt.synchronize(0)
        assert (dk.cpu() == POISON).all() and (dv.cpu() == POISON).all(), "the capture ran the copy"
        for src_values, dst_values in (([7, 8, 9], [10, 0, 15]), ([15, -1, 0], [1, 2, 14])):
            for x, values in ((si, src_values), (di, dst_values)):
                x.copy_(torch.tensor(values, dtype=x.dtype))
            poison(dk)
            poison(dv)
            graph.launch(stream)
            stream.synchronize()
            for h, d in ((hk, dk), (hv, dv)):
                want = torch.full((n, row), POISON, dtype=torch.uint8)
                for s, t in zip(src_values, dst_values, strict=True):
                    if s >= 0 and t >= 0:
                        want[t] = h[s]
                assert torch.equal(d.cpu(), want)
        graph.close()


@pytest.mark.parametrize("mode", MODES)
def test_ok_host_operands_changed_in_place_under_kept_plans_are_followed(mode):
    """The same host tensor object re-pointed between calls that would reuse a kept plan: ``set_`` onto another
    HostBuffer's storage, ``resize_`` to fewer tokens (an index past the new end then refused untouched), an
    ``as_strided`` view of the kept operand with its ``data_ptr`` but a smaller shape; for the kernel path
    (``transfer_kv_per_layer_mla``) and the direct path (``transfer_kv_direct``). Each call copies from or to the
    memory the tensor names at that call."""
    rt = create(mode)
    n, row = 8, 32
    for direct in (False, True):
        src, other = host(rt, (n, row)), host(rt, (n, row))
        dst = device(rt, (n, row), data=False)
        si, di = pin_idx(rt, [1, 6]), pin_idx(rt, [0, 7])

        def call(s, d, a=si, b=di, direct=direct):
            if direct:   # the same index objects every call: their kept plans are the ones attacked
                io.transfer_kv_direct([s], [d], a, b, 1)
            else:
                io.transfer_kv_per_layer_mla(s, d, a, b, row)

        def check(s, pairs, dst=dst):
            rt.synchronize(0)
            want = torch.full((n, row), POISON, dtype=torch.uint8)
            for a, b in pairs:
                want[b] = s[a]
            assert torch.equal(dst.cpu(), want)
        moving = src.view(n, row)
        call(moving, dst)
        check(src, [(1, 0), (6, 7)])
        poison(dst)
        moving.set_(other.untyped_storage(), other.storage_offset(), other.shape, other.stride())
        call(moving, dst)
        check(other, [(1, 0), (6, 7)])
        poison(dst)
        moving.resize_(4, row)                                # now 4 tokens of ``other``: token 6 is gone
        with pytest.raises(InvalidArgument):
            call(moving, dst)
        rt.synchronize(0)
        assert (dst.cpu() == POISON).all()
        view = src.as_strided((4, row), (row, 1))            # src's data_ptr, a smaller shape than the kept plan's
        with pytest.raises(InvalidArgument):
            call(view, dst)
        call(view, dst, pin_idx(rt, [3, 1]), pin_idx(rt, [2, 5]))
        check(src, [(3, 2), (1, 5)])


@pytest.mark.parametrize("mode", MODES)
def test_ok_direct_over_small_chunks_with_a_page_granularity_both_ways_land_exactly(mode):
    """K and V ``page_first_direct`` hosts as adjacent, non-overlapping halves of one HostBuffer registered in chunks
    of 3 pages (``granularity`` one page, so boundaries fall between pages; split aliases are not contiguous across
    chunks), layer-first device tensors K's layers then V's; int32 CPU indices, non-contiguous (every other entry of a
    longer tensor); random pages in random order, both directions, every layer. Every destination byte is its source
    byte or the poison, no copy crosses a chunk (the emulator refuses one at queue time); and the adjacent K and V
    halves are not taken for overlapping destinations."""
    rt = create(mode)
    pages, layers, page, d = 12, 2, 4, 512      # a host page (all its layers) is 4096 bytes: a whole OS page
    page_bytes = layers * page * d
    whole = host(rt, (2, pages, layers, page, d), kind=HostKind.REGISTERED, register_chunk_bytes=3 * page_bytes,
                 granularity=page_bytes)
    hk, hv = whole[0], whole[1]
    tokens = 32
    lf = [device(rt, (tokens, d)) for _ in range(2 * layers)]
    rng = np.random.default_rng()
    host_pages = rng.permutation(pages)[:5]
    dev_pages = rng.permutation(tokens // page)[:5]

    def indices(first_pages):
        values = np.concatenate([np.arange(p * page, (p + 1) * page) for p in first_pages])
        spread = torch.zeros(2 * values.size, dtype=torch.int32)
        spread[::2] = torch.from_numpy(values.astype(np.int32))
        return spread[::2]
    h_idx, d_idx = indices(host_pages), indices(dev_pages)
    assert not h_idx.is_contiguous()
    # backup: device pages -> host pages
    hk_before, hv_before = hk.clone(), hv.clone()
    io.transfer_kv_all_layer_direct_lf_pf(lf, [hk, hv], d_idx, h_idx, page)
    rt.synchronize(0)
    want_k, want_v = hk_before.clone(), hv_before.clone()
    for hp, dp in zip(host_pages, dev_pages, strict=True):
        for j in range(layers):
            want_k[hp, j] = lf[j].cpu()[dp * page:(dp + 1) * page]
            want_v[hp, j] = lf[layers + j].cpu()[dp * page:(dp + 1) * page]
    assert torch.equal(hk, want_k) and torch.equal(hv, want_v)
    # load: host pages -> device pages, one layer per call
    hk.copy_(rnd(hk.shape))
    hv.copy_(rnd(hv.shape))
    for x in lf:
        poison(x)
    for layer in range(layers):
        io.transfer_kv_per_layer_direct_pf_lf([hk, hv], [lf[layer], lf[layers + layer]], h_idx, d_idx, layer, page)
    rt.synchronize(0)
    for j in range(layers):
        for t, h in ((0, hk), (1, hv)):
            want = torch.full((tokens, d), POISON, dtype=torch.uint8)
            for hp, dp in zip(host_pages, dev_pages, strict=True):
                want[dp * page:(dp + 1) * page] = h[hp, j]
            assert torch.equal(lf[t * layers + j].cpu(), want)


@pytest.mark.parametrize("mode", MODES)
def test_ok_index_tensor_shapes_dtypes_and_devices(mode):
    """0-d index tensors (kernel path pinned, direct path CPU), an index object whose dtype changes under it between
    direct calls (``x.data = ...``), and the refusals: bool and uint8 indices, int32 against int64, a device-resident
    index on another device than the operands (named, nothing copied); each accepted call lands exactly."""
    rt = create(mode)
    n, row = 8, 32
    src, dst = device(rt, (n, row)), device(rt, (n, row), data=False)

    def expect(pairs):
        rt.synchronize(0)
        want = torch.full((n, row), POISON, dtype=torch.uint8)
        for a, b in pairs:
            want[b] = src.cpu()[a]
        assert torch.equal(dst.cpu(), want)
        poison(dst)
    both = pin_idx(rt, [3, 6])
    io.transfer_kv_per_layer_mla(src, dst, both[0], both[1], row)
    expect([(3, 6)])
    io.transfer_kv_direct([src], [dst], torch.tensor(5), torch.tensor(2), 1)
    expect([(5, 2)])
    a, b = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([4, 5], dtype=torch.int32)
    io.transfer_kv_direct([src], [dst], a, b, 1)
    expect([(0, 4), (1, 5)])
    a.data, b.data = torch.tensor([7, 1]), torch.tensor([0, 3])           # same objects, now int64, new values
    io.transfer_kv_direct([src], [dst], a, b, 1)
    expect([(7, 0), (1, 3)])
    bad = [
        lambda: io.transfer_kv_per_layer_mla(src, dst, pin_idx(rt, [1], torch.uint8), pin_idx(rt, [2], torch.uint8),
                                             row),
        lambda: io.transfer_kv_direct([src], [dst], torch.tensor([True]), torch.tensor([False]), 1),
        lambda: io.transfer_kv_direct([src], [dst], torch.tensor([1], dtype=torch.int32), torch.tensor([2]), 1),
        lambda: io.transfer_kv_per_layer_mla(src, dst, dev_idx(rt, [1], dev=1), dev_idx(rt, [2], dev=1), row),
    ]
    for call in bad:
        with pytest.raises(KvtierError):
            call()
        rt.synchronize(0)
        assert (dst.cpu() == POISON).all()
