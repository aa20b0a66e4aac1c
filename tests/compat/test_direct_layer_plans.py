"""The ``*_direct`` compat functions keep what a call over a set of tensors checked and resolved (each layer's two
ends: base, bytes, registration edges) apart from the indices, so a new request over the same pools costs a bounds
check per side. These tests hold that reuse to the same answers a fresh call gives: new indices checked in full,
registrations changed since followed (also when they change while another thread is planning), bad operands refused
even when there is nothing to copy; copies kept with index values belong to the call's runtime and to how its tensors
split into page-first and layer-first lists. Also attacked (found adversarially, issue #15): operands that keep their
``data_ptr()`` but change shape, dtype or storage, host memory unregistered under a kept plan, MLA and K/V lists, other
layers and page sizes over one tensor set, another thread's requests while a call is paused holding its plan (a pause
point), index tensors rewritten in place, more operand sets and index pairs than are kept, host buffers in small
registration chunks, DeviceArrays closed since."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
from helpers.operands import (
    MODES,
    POISON,
    at_point,
    cpu,
    device,
    host,
    host_buffer,
    in_thread,
    no_automatic_collection,
    poison,
    rnd,
)

from kvtier.compat.operands import TABLES_KEPT
from kvtier.compat.sglang import direct
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.memory import HostBuffer, HostKind
from kvtier.pause_points import armed
from kvtier.runtime import create

PAGES, LAYERS, PAGE, ROW = 8, 3, 4, 32
EMPTY = torch.tensor([], dtype=torch.int64)


def _page_first(rt, keep):
    """K and V as ``page_first_direct`` host tensors [pages, layers, page_size, row] over one pinned HostBuffer."""
    shape = (PAGES, LAYERS, PAGE, ROW)
    n = int(np.prod(shape))
    buffer = HostBuffer.allocate(2 * n, HostKind.PINNED, runtime=rt)
    keep.append(buffer)
    flat = buffer.as_tensor(torch.uint8)
    flat.copy_(rnd((2 * n,)))
    return [flat[:n].view(shape), flat[n:].view(shape)]


def _tokens(pages) -> torch.Tensor:
    return torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)])


def _load(hd, dev, src_pages, dst_pages) -> None:
    si, di = _tokens(src_pages), _tokens(dst_pages)
    for layer in range(LAYERS):
        io.transfer_kv_per_layer_direct_pf_lf(hd, [dev[0][layer], dev[1][layer]], si, di, layer, PAGE)


def _check(hd, dev, src_pages, dst_pages) -> None:
    for t in range(2):
        for layer in range(LAYERS):
            want = torch.full((PAGES * PAGE, ROW), POISON, dtype=torch.uint8)
            for s, d in zip(src_pages, dst_pages, strict=True):
                want[d * PAGE:(d + 1) * PAGE] = hd[t][s, layer]
            assert torch.equal(dev[t][layer].cpu(), want), f"tensor {t} layer {layer}"


def _counted(monkeypatch, name: str) -> list:
    calls: list = []
    made = getattr(direct, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return made(*args, **kwargs)
    monkeypatch.setattr(direct, name, counting)
    return calls


@pytest.mark.parametrize("spec", MODES)
def test_a_request_with_new_indices_reuses_each_layers_plan_and_lands_its_own_pages(spec, monkeypatch):
    rt, keep = create(spec), []
    hd = _page_first(rt, keep)
    dev = [[device(rt, (PAGES * PAGE, ROW), data=False) for _ in range(LAYERS)] for _ in range(2)]
    built = _counted(monkeypatch, "_page_ends")
    rng = np.random.default_rng()
    for request in range(3):
        src_pages, dst_pages = rng.permutation(PAGES)[:5].tolist(), rng.permutation(PAGES)[:5].tolist()
        for row in dev:
            for x in row:
                poison(x)
        _load(hd, dev, src_pages, dst_pages)
        rt.synchronize(0)
        _check(hd, dev, src_pages, dst_pages)
        assert len(built) == LAYERS, f"request {request} planned its layers again"


@pytest.mark.parametrize("spec", MODES)
def test_new_indices_under_a_kept_plan_are_checked_in_full(spec):
    rt, keep = create(spec), []
    hd = _page_first(rt, keep)
    dev = [[device(rt, (PAGES * PAGE, ROW), data=False) for _ in range(LAYERS)] for _ in range(2)]
    _load(hd, dev, [1, 2], [3, 4])
    rt.synchronize(0)
    for row in dev:
        for x in row:
            poison(x)
    bad = [(_tokens([1, PAGES]), _tokens([0, 1])),               # a host page past the end
           (_tokens([1, 2]), _tokens([0, PAGES])),               # a device token past the end
           (_tokens([1, 2]), _tokens([0, 0])),                   # one destination twice
           (_tokens([1, 2]) - 2 * PAGE, _tokens([0, 1]))]        # a negative page
    for si, di in bad:
        with pytest.raises(InvalidArgument):
            io.transfer_kv_per_layer_direct_pf_lf(hd, [dev[0][1], dev[1][1]], si, di, 1, PAGE)
    rt.synchronize(0)
    assert all(bool((x.cpu() == POISON).all()) for row in dev for x in row)


@pytest.mark.parametrize("spec", MODES)
def test_a_kept_plan_follows_host_memory_registered_again_in_two_pieces(spec):
    """Warm over one registration, then the same memory registered as two meeting inside a page: the next call's
    copies are cut at the new edge (the emulator refuses a copy across two registrations, as CUDA's driver does)."""
    rt = create(spec)
    shape = (PAGES, 1, PAGE, ROW)
    n = int(np.prod(shape))
    memory = rnd((n,)).numpy()
    address = memory.ctypes.data
    rt.host_register(address, n)
    hd = [torch.from_numpy(memory).view(shape)]
    dev = [device(rt, (PAGES * PAGE, ROW), data=False)]
    io.transfer_kv_per_layer_direct_pf_lf(hd, dev, _tokens([0]), _tokens([0]), 0, PAGE)
    rt.synchronize(0)
    edge = 5 * PAGE * ROW + ROW // 2                     # inside host page 5
    rt.host_unregister(address)
    rt.host_register(address, edge)
    rt.host_register(address + edge, n - edge)
    try:
        poison(dev[0])
        io.transfer_kv_per_layer_direct_pf_lf(hd, dev, _tokens([5, 2]), _tokens([1, 6]), 0, PAGE)
        rt.synchronize(0)
        want = torch.full((PAGES * PAGE, ROW), POISON, dtype=torch.uint8)
        want[PAGE:2 * PAGE] = hd[0][5, 0]
        want[6 * PAGE:7 * PAGE] = hd[0][2, 0]
        assert torch.equal(dev[0].cpu(), want)
    finally:
        rt.host_unregister(address + edge)
        rt.host_unregister(address)


@pytest.mark.parametrize("spec", MODES)
def test_a_call_with_no_indices_still_refuses_bad_operands(spec):
    """Nothing to copy is no licence for operands no copy could use: a pageable host tensor is refused by name."""
    rt = create(spec)
    empty = torch.tensor([], dtype=torch.int64)
    pageable = torch.zeros((PAGES, LAYERS, PAGE, ROW), dtype=torch.uint8)
    dev = [device(rt, (PAGES * PAGE, ROW), data=False) for _ in range(2)]
    with pytest.raises(KvtierError, match=r"src_ptrs\[0\]"):
        io.transfer_kv_per_layer_direct_pf_lf([pageable, pageable.clone()], dev, empty, empty, 0, PAGE)
    with pytest.raises(KvtierError, match=r"src_layers\[0\]"):
        io.transfer_kv_direct([pageable[:, 0].reshape(-1, ROW)], [dev[0]], empty, empty, PAGE)
    rt.synchronize(0)
    assert all(bool((x.cpu() == POISON).all()) for x in dev)


@pytest.mark.parametrize("spec", MODES)
def test_token_runs_of_new_requests_reuse_each_layers_ends(spec, monkeypatch):
    rt, keep = create(spec), []
    buffer = HostBuffer.allocate(LAYERS * PAGES * PAGE * ROW, HostKind.PINNED, runtime=rt)
    keep.append(buffer)
    flat = buffer.as_tensor(torch.uint8)
    flat.copy_(rnd(flat.shape))
    src = [flat.view(LAYERS, PAGES * PAGE, ROW)[layer] for layer in range(LAYERS)]
    dst = [device(rt, (PAGES * PAGE, ROW), data=False) for _ in range(LAYERS)]
    ends = _counted(monkeypatch, "_end")
    rng = np.random.default_rng()
    for _ in range(3):
        si = torch.tensor(rng.permutation(PAGES * PAGE)[:10])
        di = torch.tensor(rng.permutation(PAGES * PAGE)[:10])
        for x in dst:
            poison(x)
        io.transfer_kv_direct(src, dst, si, di, 1)
        rt.synchronize(0)
        for s, d in zip(src, dst, strict=True):
            want = torch.full((PAGES * PAGE, ROW), POISON, dtype=torch.uint8)
            want[di] = s[si]
            assert torch.equal(d.cpu(), want)
    assert len(ends) == 2 * LAYERS


def tokens(pages, page):
    return torch.tensor([p * page + i for p in pages for i in range(page)], dtype=torch.int64)


def want_load(pf, layer, lf_rows, src_pages, dst_pages, page, before=None):
    """What a ``page_first_direct`` load of ``layer`` gives a destination of ``lf_rows`` rows (SGLang's model)."""
    row = int(np.prod(pf.shape[3:]))
    out = before.clone() if before is not None else torch.full((lf_rows, row), POISON, dtype=torch.uint8)
    flat = pf.reshape(pf.shape[0], pf.shape[1], pf.shape[2], -1)
    for s, d in zip(src_pages, dst_pages, strict=True):
        out[d * page:(d + 1) * page] = flat[s, layer, :page]
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("function", ["transfer_kv_direct", "per_layer_pf_lf", "all_layer_lf_pf"])
def test_direct_refuses_a_device_array_closed_since_the_plan_was_kept_by_name(mode, function):
    """A DeviceArray closed after a call over it was planned is refused, but not by name: ``BufferClosed:
    <DeviceBuffer 256 bytes on device 0 of emulated:split> is closed``, which says neither which operand nor which
    list. ``_operand_key`` (kvtier/compat/operands.py:150-155) gives a closed DeviceArray no key "so the full path
    refuses it by name", and ``_kept`` (kvtier/compat/sglang/direct.py:220-224) promises "a closed one is refused by
    name"; but the full path's first step, ``_refuse_shared`` (direct.py:247-252, reached from ``build`` at :327 and
    ``_page_ends`` at :417/:419), calls ``x.data_ptr()`` on every operand with no ``about(error, name)`` around it, so
    the bare error escapes before ``_end`` could name it. The kernel functions name the same operand (``src: ... is
    closed``), and docs/sglang.md lists "refusals by name" as what kvtier adds. It matters for a serving engine that
    frees a pool of one layer while requests still run: the report must say which of 60 layers' tensors it was.
    Fix: resolve (``address(call, x, name)``) every DeviceArray operand before ``_refuse_shared``, or wrap its
    ``data_ptr()``/``extent()`` reads in ``about(error, f"{name}[{i}]")``."""
    rt = create(mode)
    page, d = 2, 32
    pf = [host(rt, (4, 2, page, d)) for _ in range(2)]
    lf = [device(rt, (4 * page, d), data=function == "all_layer_lf_pf") for _ in range(4)]
    si, di = tokens([1], page), tokens([2], page)

    def call():
        if function == "transfer_kv_direct":
            io.transfer_kv_direct([lf[0], lf[1]], [lf[2], lf[3]], si, di, page)
        elif function == "per_layer_pf_lf":
            io.transfer_kv_per_layer_direct_pf_lf(pf, [lf[2], lf[3]], si, di, 1, page)
        else:
            io.transfer_kv_all_layer_direct_lf_pf(lf, pf, si, di, page)
    call()
    rt.synchronize(0)
    poison(lf[2])
    before = [h.clone() for h in pf]
    lf[3].close()
    with pytest.raises(KvtierError) as refused:
        call()
    rt.synchronize(0)
    assert bool((lf[2].cpu() == POISON).all()) and all(torch.equal(h, b) for h, b in zip(pf, before, strict=True))
    assert any(f"{name}[{i}]" in str(refused.value) for name in ("dst_layers", "dst_ptrs", "src_ptrs")
               for i in (1, 3)), f"the refusal names no operand: {refused.value}"


@pytest.mark.parametrize("mode", MODES)
def test_ok_host_memory_unregistered_under_a_kept_plan_is_refused_then_followed_in_new_pieces(mode):
    """numpy memory registered with ``host_register``, a plan kept over it, then unregistered: the emulator would copy
    the (still mapped) CPU memory as pageable, so a stale plan would land silently; the host generation in the key
    makes the next call resolve again and refuse it, new indices and empty ones alike. Registered again at the same
    address in two pieces meeting inside a page, the next call lands with its pages cut at the new edge."""
    rt = create(mode)
    pages, page, d = 6, 4, 32
    shape = (pages, 1, page, d)
    n = int(np.prod(shape))
    memory = rnd((n,)).numpy()
    address = memory.ctypes.data
    pf = [torch.from_numpy(memory).view(shape)]
    lf = [device(rt, (pages * page, d), data=False)]
    rt.host_register(address, n)
    io.transfer_kv_per_layer_direct_pf_lf(pf, lf, tokens([0], page), tokens([0], page), 0, page)
    rt.synchronize(0)
    rt.host_unregister(address)
    poison(lf[0])
    for si, di in ((tokens([3, 1], page), tokens([0, 5], page)), (EMPTY, EMPTY)):
        with pytest.raises(KvtierError, match=r"src_ptrs\[0\]"):
            io.transfer_kv_per_layer_direct_pf_lf(pf, lf, si, di, 0, page)
    rt.synchronize(0)
    assert bool((lf[0].cpu() == POISON).all()), "a refused call wrote"
    edge = 3 * page * d + d // 2 + 8
    rt.host_register(address, edge)
    rt.host_register(address + edge, n - edge)
    try:
        io.transfer_kv_per_layer_direct_pf_lf(pf, lf, tokens([3, 1], page), tokens([0, 5], page), 0, page)
        rt.synchronize(0)
        assert torch.equal(lf[0].cpu(), want_load(pf[0], 0, pages * page, [3, 1], [0, 5], page))
    finally:
        rt.host_unregister(address + edge)
        rt.host_unregister(address)


@pytest.mark.parametrize("mode", MODES)
def test_ok_views_sharing_one_data_ptr_and_a_tensor_set_away_and_back_get_plans_of_their_own(mode):
    """One host address seen as rows of 32 bytes, rows of 64, int16 rows of 16 elements, and a tensor ``set_`` onto
    other memory and back: each has its own operand key (shape, stride, dtype are in it), so each call copies the rows
    its own shape says, never those of the plan kept for another view of the same address."""
    rt = create(mode)
    n = 16
    flat = host(rt, (n * 64,))
    other = host(rt, (n * 64,))
    views = [("u8x32", lambda: flat.view(2 * n, 32)), ("u8x64", lambda: flat.view(n, 64)),
             ("i16x16", lambda: flat.view(torch.int16).view(2 * n, 16))]
    moved = flat.view(2 * n, 32).clone()          # a torch-owned twin: set_ away to `other` and back below
    moved.set_(flat.untyped_storage(), 0, (2 * n, 32), (32, 1))
    rng = np.random.default_rng(15)
    for round_ in range(3):
        for name, make in views:
            src = make()
            rows, width = src.shape[0], src.shape[1] * src.element_size()
            dst = device(rt, (rows, width), data=False)
            si = torch.tensor(rng.permutation(rows)[:5])
            di = torch.tensor(rng.permutation(rows)[:5])
            io.transfer_kv_direct([src], [dst], si, di, 1)
            rt.synchronize(0)
            want = torch.full((rows, width), POISON, dtype=torch.uint8)
            want[di] = src.view(torch.uint8).view(rows, width)[si]
            assert torch.equal(dst.cpu(), want), f"round {round_} view {name}"
        for storage, src_bytes in ((other.untyped_storage(), other), (flat.untyped_storage(), flat)):
            moved.set_(storage, 0, (2 * n, 32), (32, 1))
            dst = device(rt, (2 * n, 32), data=False)
            si, di = torch.tensor([7, 1, 30]), torch.tensor([0, 31, 4])
            io.transfer_kv_direct([moved], [dst], si, di, 1)
            rt.synchronize(0)
            want = torch.full((2 * n, 32), POISON, dtype=torch.uint8)
            want[di] = src_bytes.view(2 * n, 32)[si]
            assert torch.equal(dst.cpu(), want), f"round {round_}: set_ onto another storage"


@pytest.mark.parametrize("mode", MODES)
def test_ok_mla_and_kv_lists_layer_ids_and_page_sizes_over_one_tensor_set_land_their_own_bytes(mode):
    """The same host and device tensors taken as an MLA list and as K/V lists, at every ``layer_id`` and at page sizes
    1, 2 and 4 (the host's pages hold 4 tokens), interleaved: each shape has its own kept ends, so the layer shift and
    the page bytes are never those of another shape's plan."""
    rt = create(mode)
    pages, layers, page, d = 5, 3, 4, 16
    hk, hv = host(rt, (pages, layers, page, d)), host(rt, (pages, layers, page, d))
    dk = [device(rt, (pages * page, d), data=False) for _ in range(layers)]
    dv = [device(rt, (pages * page, d), data=False) for _ in range(layers)]
    rng = np.random.default_rng(150)
    for _ in range(2):
        for ps in (4, 1, 2):
            for layer in (2, 0, 1):
                sp, dp = rng.permutation(pages)[:3].tolist(), rng.permutation(pages * page // ps)[:3].tolist()
                si = torch.tensor([p * ps + i for p in sp for i in range(ps)])
                di = torch.tensor([p * ps + i for p in dp for i in range(ps)])
                for mla in (True, False):
                    for x in (dk[layer], dv[layer]):
                        poison(x)
                    if mla:
                        io.transfer_kv_per_layer_direct_pf_lf([hk], [dk[layer]], si, di, layer, ps)
                    else:
                        io.transfer_kv_per_layer_direct_pf_lf([hk, hv], [dk[layer], dv[layer]], si, di, layer, ps)
                    rt.synchronize(0)
                    for h, x, written in ((hk, dk[layer], True), (hv, dv[layer], not mla)):
                        want = torch.full((pages * page, d), POISON, dtype=torch.uint8)
                        if written:
                            for s, t in zip(sp, dp, strict=True):
                                want[t * ps:(t + 1) * ps] = h[s, layer, :ps]
                        assert torch.equal(x.cpu(), want), f"ps={ps} layer={layer} mla={mla}"


@contextlib.contextmanager
def _paused_in(point, body):
    """Run ``body()`` in a thread stopped at pause point ``point`` while the block runs (it yields the thread and the
    errors it raised); the thread is resumed and joined as the block ends."""
    paused, resume = threading.Event(), threading.Event()
    with at_point(point, lambda: (paused.set(), resume.wait(60)), thread="paused"):
        thread, errors = in_thread(body, name="paused")
        try:
            assert paused.wait(60), "the paused thread never reached its point"
            yield thread, errors
        finally:
            resume.set()
            thread.join(60)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("function", ["transfer_kv_direct", "per_layer_pf_lf"])
def test_ok_another_threads_requests_meanwhile_leave_a_paused_calls_plan_and_indices_intact(mode, function):
    """Thread A stops holding its kept plan and its index values, right before its copies are derived. Meanwhile
    another thread rewrites A's index tensors in place (after A read them), makes a call with them (a new index set
    under A's key), a refused call with overlapping destinations, and a call over the same tensors with indices of
    its own. A then resumes: it lands the rows its values said when it was called, the others theirs, nothing else."""
    rt = create(mode)
    pages, page, d = 8, 2, 32
    pf = [host(rt, (pages, 2, page, d)) for _ in range(2)]
    src = [pf[t].view(-1, d)[:pages * page] for t in range(2)]     # layer-first sources for transfer_kv_direct
    lf = [device(rt, (pages * page, d), data=False) for _ in range(2)]

    def call(si, di):
        if function == "transfer_kv_direct":
            io.transfer_kv_direct(src, lf, si, di, page)
        else:
            io.transfer_kv_per_layer_direct_pf_lf(pf, lf, si, di, 1, page)

    def model(si, di, out):
        for t in range(2):
            for s, dd in zip(si.tolist(), di.tolist(), strict=True):
                out[t][dd] = src[t][s] if function == "transfer_kv_direct" else pf[t][s // page, 1, s % page]

    call(tokens([0], page), tokens([0], page))          # the plan is kept
    rt.synchronize(0)
    for x in lf:
        poison(x)
    a_si, a_di = tokens([5, 2], page), tokens([1, 6], page)
    a_values = (a_si.clone(), a_di.clone())
    with _paused_in("direct.before_copies", lambda: call(a_si, a_di)) as (thread, errors):
        a_si.numpy()[:] = tokens([7, 3], page).numpy()   # A read its values already
        a_di.numpy()[:] = tokens([0, 4], page).numpy()
        call(a_si, a_di)
        with pytest.raises(InvalidArgument):
            call(tokens([1, 4], page), tokens([3, 3], page))
        b_si, b_di = tokens([6], page), tokens([7], page)
        call(b_si, b_di)
    assert not thread.is_alive() and not errors, errors
    rt.synchronize(0)
    want = [torch.full((pages * page, d), POISON, dtype=torch.uint8) for _ in range(2)]
    for si, di in (a_values, (a_si, a_di), (b_si, b_di)):
        model(si, di, want)
    for t in range(2):
        assert torch.equal(lf[t].cpu(), want[t]), f"tensor {t}"


@pytest.mark.parametrize("mode", MODES)
def test_ok_index_tensors_accepted_then_rewritten_in_place_into_overlaps_are_refused(mode):
    """The same index tensor objects (the kept index set's key is their ids) accepted once, then rewritten in place
    through ``.numpy()`` into a repeated destination token, a repeated destination page, a page past the host's end
    and a negative page: every call compares the values, so each is refused and nothing is written; rewritten back,
    they land again."""
    rt = create(mode)
    pages, page, d = 6, 2, 16
    pf = [host(rt, (pages, 1, page, d)) for _ in range(2)]
    lf = [device(rt, (pages * page, d), data=False) for _ in range(2)]
    src = [pf[t].view(-1, d) for t in range(2)]
    si, di = tokens([1, 4], page), tokens([0, 3], page)
    good = (si.clone(), di.clone())
    calls = {"direct": lambda: io.transfer_kv_direct(src, lf, si, di, page),
             "pf_lf": lambda: io.transfer_kv_per_layer_direct_pf_lf(pf, lf, si, di, 0, page),
             "lf_pf": lambda: io.transfer_kv_all_layer_direct_lf_pf(lf, pf, di, si, page)}
    for name, call in calls.items():
        call()
        rt.synchronize(0)
        page_first_written = name == "lf_pf"       # which side the overlaps must be on
        bad = [(tokens([1, 1], page), tokens([0, 3], page)) if page_first_written
               else (tokens([1, 4], page), tokens([3, 3], page)),                # one destination page twice
               (tokens([1, pages], page), tokens([0, 3], page)),                 # a host page past the end
               (torch.tensor([0, 1, 1, 2]), tokens([0, 3], page)) if page_first_written
               else (tokens([1, 4], page), torch.tensor([0, 1, 1, 2])),          # overlapping destination pages
               (tokens([1, 4], page) - 2 * page, tokens([0, 3], page))]          # a negative index
        for x in lf:
            poison(x)
        before = [h.clone() for h in pf]
        for bad_si, bad_di in bad:
            si.numpy()[:] = bad_si.numpy()
            di.numpy()[:] = bad_di.numpy()
            with pytest.raises(InvalidArgument):
                call()
        rt.synchronize(0)
        assert all(bool((x.cpu() == POISON).all()) for x in lf), f"{name}: a refused call wrote a device tensor"
        assert all(torch.equal(h, b) for h, b in zip(pf, before, strict=True)), f"{name}: a refused call wrote host"
        si.numpy()[:], di.numpy()[:] = good[0].numpy(), good[1].numpy()
        if page_first_written:
            for x in lf:
                x.copy_(rnd((pages * page, d)))
            before = [h.clone() for h in pf]
        call()
        rt.synchronize(0)
        for t in range(2):
            if page_first_written:
                want = before[t]
                want[1, 0], want[4, 0] = cpu(lf[t])[0:page], cpu(lf[t])[3 * page:4 * page]
                assert torch.equal(pf[t], want), f"{name}: tensor {t}"
            else:
                assert torch.equal(lf[t].cpu(), want_load(pf[t], 0, pages * page, [1, 4], [0, 3], page)), name


@pytest.mark.parametrize("mode", MODES)
def test_ok_past_the_kept_plan_and_index_set_limits_every_call_lands_its_own_bytes(mode):
    """More operand sets than the 4,096 plans kept (each call a new slice of one host buffer, so a new key; each also
    keeps per-tensor ends), interleaved with more index pairs than the 4 kept: the earliest sets, long dropped, are
    planned again and land their own rows, and so do the latest, still kept."""
    rt = create(mode)
    row, sets = 16, TABLES_KEPT + 64
    flat = host(rt, ((sets + 8) * row,))
    dst = device(rt, (8, row), data=False)
    pairs = [(torch.tensor([i % 3, 3 + i % 2]), torch.tensor([(2 * i) % 8, (2 * i + 1) % 8])) for i in range(6)]
    for first in range(sets):
        si, di = pairs[first % len(pairs)]
        io.transfer_kv_direct([flat[first * row:(first + 8) * row].view(8, row)], [dst], si, di, 1)
    for first in (0, 1, 2, sets - 2, sets - 1, 5, 0):
        si, di = pairs[(first + 1) % len(pairs)]
        rt.synchronize(0)
        poison(dst)
        src = flat[first * row:(first + 8) * row].view(8, row)
        io.transfer_kv_direct([src], [dst], si, di, 1)
        rt.synchronize(0)
        want = torch.full((8, row), POISON, dtype=torch.uint8)
        want[di] = src[si]
        assert torch.equal(dst.cpu(), want), f"operand set {first}"


@pytest.mark.parametrize("mode", MODES)
def test_ok_empty_calls_after_a_kept_plan_still_refuse_bad_operands_untouched(mode):
    """A plan kept over good operands, then calls with no indices over bad ones: a layer past the host's layers, a
    page size above the host's page, one tensor as both destinations, a pageable destination, a DeviceArray closed
    since, host memory unregistered since, one host tensor as both backup destinations. Each is refused (nothing to
    copy is no licence), and the good call still lands afterwards."""
    rt = create(mode)
    pages, layers, page, d = 4, 2, 2, 32
    pf = [host(rt, (pages, layers, page, d)) for _ in range(2)]
    lf = [device(rt, (pages * page, d), data=False) for _ in range(2)]
    io.transfer_kv_per_layer_direct_pf_lf(pf, lf, tokens([1], page), tokens([2], page), 1, page)
    rt.synchronize(0)
    poison(lf[0])
    poison(lf[1])
    memory = rnd((pages * layers * page * d,)).numpy()
    rt.host_register(memory.ctypes.data, memory.nbytes)
    gone = torch.from_numpy(memory).view(pages, layers, page, d)
    io.transfer_kv_per_layer_direct_pf_lf([gone, pf[1]], lf, EMPTY, EMPTY, 1, page)
    rt.host_unregister(memory.ctypes.data)
    closed = device(rt, (pages * page, d), data=False)
    io.transfer_kv_per_layer_direct_pf_lf(pf, [lf[0], closed], EMPTY, EMPTY, 1, page)
    closed.close()
    bad = [lambda: io.transfer_kv_per_layer_direct_pf_lf(pf, lf, EMPTY, EMPTY, layers, page),
           lambda: io.transfer_kv_per_layer_direct_pf_lf(pf, lf, EMPTY, EMPTY, 1, 2 * page),
           lambda: io.transfer_kv_per_layer_direct_pf_lf(pf, [lf[0], lf[0]], EMPTY, EMPTY, 1, page),
           lambda: io.transfer_kv_per_layer_direct_pf_lf(pf, [lf[0], torch.zeros(pages * page, d, dtype=torch.uint8)],
                                                         EMPTY, EMPTY, 1, page),
           lambda: io.transfer_kv_per_layer_direct_pf_lf(pf, [lf[0], closed], EMPTY, EMPTY, 1, page),
           lambda: io.transfer_kv_per_layer_direct_pf_lf([gone, pf[1]], lf, EMPTY, EMPTY, 1, page),
           lambda: io.transfer_kv_all_layer_direct_lf_pf([*lf, *lf], [pf[0], pf[0]], EMPTY, EMPTY, page)]
    for call in bad:
        with pytest.raises(KvtierError):
            call()
    rt.synchronize(0)
    assert all(bool((x.cpu() == POISON).all()) for x in lf)
    io.transfer_kv_per_layer_direct_pf_lf(pf, lf, tokens([3], page), tokens([0], page), 1, page)
    rt.synchronize(0)
    for t in range(2):
        assert torch.equal(lf[t].cpu(), want_load(pf[t], 1, pages * page, [3], [0], page))


@pytest.mark.parametrize("mode", MODES)
def test_ok_small_registration_chunks_cut_every_new_requests_pages_both_ways(mode):
    """A ``page_first_direct`` host buffer registered in 4 KiB chunks whose edges fall inside pages (pages of 2 x 520
    bytes, no granularity): the kept ends say only that edges lie inside; each request's pages are cut where they
    cross one (the emulator refuses a copy across two registrations, as CUDA does), loads and backups alike, request
    after request over one kept plan."""
    rt = create(mode)
    pages, layers, page, d = 12, 2, 2, 520
    n = pages * layers * page * d
    flat = host(rt, (2 * n,), kind=HostKind.REGISTERED, chunk=4096)
    pf = [flat[t * n:(t + 1) * n].view(pages, layers, page, d) for t in range(2)]
    lf = [device(rt, (pages * page, d), data=False) for _ in range(2 * layers)]
    rng = np.random.default_rng(1515)
    for request in range(6):
        sp, dp = rng.permutation(pages)[:7].tolist(), rng.permutation(pages)[:7].tolist()
        si, di = tokens(sp, page), tokens(dp, page)
        for x in lf:
            poison(x)
        for layer in range(layers):
            io.transfer_kv_per_layer_direct_pf_lf(pf, [lf[layer], lf[layers + layer]], si, di, layer, page)
        rt.synchronize(0)
        for t in range(2):
            for layer in range(layers):
                assert torch.equal(lf[t * layers + layer].cpu(), want_load(pf[t], layer, pages * page, sp, dp, page)), \
                    f"request {request} load tensor {t} layer {layer}"
        for x in lf:
            x.copy_(rnd((pages * page, d)))
        before = [h.clone() for h in pf]
        io.transfer_kv_all_layer_direct_lf_pf(lf, pf, di, si, page)
        rt.synchronize(0)
        for t in range(2):
            want = before[t]
            for s, dd in zip(sp, dp, strict=True):
                for layer in range(layers):
                    want[s, layer] = cpu(lf[t * layers + layer])[dd * page:(dd + 1) * page]
            assert torch.equal(pf[t], want), f"request {request} backup tensor {t}"


@pytest.mark.parametrize("spec", MODES)
def test_a_direct_pf_lf_mla_call_does_not_reuse_the_copies_of_a_kv_call_over_the_same_tensors(spec):
    """``Indexed.call_plans`` keys a ``_page_copies`` call's kept copies by ``(device, "pages", first_layer,
    to_page_first, *operand keys of page_first + layer_first)``: the split between the page-first list and the
    layer-first list is not in the key. A K/V call ``pf=[A, B], lf=[C, D]`` and an MLA call ``pf=[A], lf=[B, C, D]``
    (same index tensors) flatten to the same key, so the MLA call replays the K/V call's copies: B is left as it was,
    C gets A's layer 0 (should be layer 1) and D gets B's page (should be A's layer 2). The MLA call should copy
    A's layers 0, 1, 2 into B, C, D, as it does on a fresh runtime. Fixed: the key holds both lists' lengths.
    (found adversarially, issue #15)"""
    rt = create(spec)
    pages, tokens, row = 4, 4, 16
    a = host(rt, (pages, 3, 1, row))          # page_first_direct, 3 layers, page_size 1
    b = host(rt, (tokens, 1, 1, row))         # page-first (1 layer) here, layer-first [tokens, row] there
    c, d = device(rt, (tokens, row), data=False), device(rt, (tokens, row), data=False)
    src_idx, dst_idx = torch.tensor([2, 0]), torch.tensor([1, 3])
    io.transfer_kv_per_layer_direct_pf_lf([a, b], [c, d], src_idx, dst_idx, 0, 1)      # K/V
    rt.synchronize(0)
    b_before = b.clone()
    poison(c), poison(d)
    io.transfer_kv_per_layer_direct_pf_lf([a], [b, c, d], src_idx, dst_idx, 0, 1)      # MLA, 3 layers
    rt.synchronize(0)
    want_b, want_c = b_before.clone(), torch.full((tokens, row), POISON, dtype=torch.uint8)
    want_d = want_c.clone()
    for s, t in zip(src_idx.tolist(), dst_idx.tolist(), strict=True):
        want_b[t, 0, 0] = a[s, 0, 0]
        want_c[t] = a[s, 1, 0]
        want_d[t] = a[s, 2, 0]
    assert torch.equal(b, want_b), "dst layer 0 (b) did not get A's layer 0"
    assert torch.equal(c.cpu(), want_c), "dst layer 1 (c) did not get A's layer 1"
    assert torch.equal(d.cpu(), want_d), "dst layer 2 (d) did not get A's layer 2"


@pytest.mark.parametrize("spec", MODES)
def test_ok_direct_indices_rewritten_through_numpy(spec):
    """*_direct: CPU index tensors rewritten through .numpy() between calls are compared by value, not trusted."""
    rt = create(spec)
    N, D = 32, 16
    buffer, src = host_buffer(rt, (N, D))
    dst = device(rt, (N, D), data=False)
    si, di = torch.tensor([1, 2, 3, 9]), torch.tensor([4, 5, 6, 20])
    io.transfer_kv_direct([src], [dst], si, di, 1)
    si.numpy()[:] = [10, 11, 12, 30]
    di.numpy()[:] = [0, 7, 8, 21]
    io.transfer_kv_direct([src], [dst], si, di, 1)
    expected = torch.full((N, D), POISON, dtype=torch.uint8)
    for s, d in [(1, 4), (2, 5), (3, 6), (9, 20), (10, 0), (11, 7), (12, 8), (30, 21)]:
        expected[d] = src[s]
    assert torch.equal(dst.cpu(), expected)


@pytest.mark.parametrize("spec", MODES)
def test_ok_direct_same_index_objects_other_function_and_page_size(spec):
    """The same index tensors through transfer_kv_direct (page_size 1) then the pf_lf direct load (page_size 4)."""
    rt = create(spec)
    P, L, PS, D = 8, 2, 4, 8
    buffer, pf = host_buffer(rt, (P, L, PS, D))
    lf = [device(rt, (P * PS, D), data=False) for _ in range(L)]
    si, di = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23]), torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    flat_buffer, flat = host_buffer(rt, (P * PS, D))
    io.transfer_kv_direct([flat], [lf[0]], si, di, 1)
    for layer in range(L):
        io.transfer_kv_per_layer_direct_pf_lf([pf], [lf[layer]], si, di, layer, PS)
    for layer in range(L):
        expected = torch.full((P * PS, D), POISON, dtype=torch.uint8)
        for s, d in zip(si.tolist(), di.tolist(), strict=True):
            expected[d] = pf[s // PS, layer, s % PS]
        assert torch.equal(lf[layer].cpu(), expected)


def test_ok_direct_index_tensors_shared_by_two_runtimes():
    """The same CPU index tensors drive per-layer direct loads on a split and a unified runtime in turn: the copies
    kept with the index values belong to the runtime they were planned on, and each runtime's load lands right."""
    P, PS, L, D = 6, 4, 2, 16
    si = torch.tensor([p * PS + i for p in (4, 1, 5) for i in range(PS)])
    di = torch.tensor([p * PS + i for p in (0, 3, 2) for i in range(PS)])
    sides = []
    for spec in MODES:
        rt = create(spec)
        buffer, pf = host_buffer(rt, (P, L, PS, D))
        lf = [device(rt, (P * PS, D), data=False) for _ in range(L)]
        sides.append((rt, buffer, pf, lf))
    for _ in range(2):
        for rt, _, pf, lf in sides:
            for layer in range(L):
                io.transfer_kv_per_layer_direct_pf_lf([pf], [lf[layer]], si, di, layer, PS)
            rt.synchronize(0)
            for layer in range(L):
                expected = torch.full((P * PS, D), POISON, dtype=torch.uint8)
                for s, d in zip(si.tolist(), di.tolist(), strict=True):
                    expected[d] = pf[s // PS, layer, s % PS]
                assert torch.equal(lf[layer].cpu(), expected)


@no_automatic_collection()
def test_direct_plans_kept_after_a_registration_change_are_those_of_the_new_registrations():
    """``Indexed.call_plans`` (kvtier/compat/sglang/direct.py:76-95, the store at :90; now ``_kept``) read the
    host-range generation, emptied its plans if it changed, then ran ``build()`` and stored the result,
    ``self.plans[full] = build()``, with no generation attached to the plan itself. A thread whose ``build()``
    resolved the copies before a registration change and stores them after another thread emptied the plans for the
    new generation puts a plan of the old registrations into the new generation's dict, and every later call over
    the same tensors reuses it. Forced here: thread 1 plans a layer over host memory registered as one range and is
    held at the end of ``build`` (the pause point between the build and its store); the memory is registered again
    as two ranges; the main thread's call plans with the copy cut at the new boundary; thread 1 stores its uncut
    plan. The next call on the main thread, same tensors and indices, queues a copy across two
    registrations and is refused (the emulator: cudaErrorInvalidValue; CUDA's driver refuses it likewise, possibly
    after queuing the batch entries before it), and so is every later call until some buffer is registered or
    closed. Fix: keep the generation with each plan (``self.plans[full] = (generation, plans)``, reused only when it
    still matches), or store only if ``self.plans_at`` is still the generation read before ``build()``.
    (found adversarially, issue #15)"""
    rt = create("emulated:split")
    n, row = 8, 64
    memory = np.random.default_rng().integers(1, 256, n * row, dtype=np.uint8)
    address = memory.ctypes.data
    rt.host_register(address, n * row)
    src = torch.from_numpy(memory).view(n, row)
    dst = device(rt, (n, row), data=False)
    si, di = torch.tensor([2, 3, 4, 5]), torch.tensor([0, 1, 2, 3])   # one run over tokens 2..5 of the host
    paused, resume = threading.Event(), threading.Event()
    errors: list = []

    def hold_the_first_build():
        if threading.current_thread() is thread and not paused.is_set():
            paused.set()
            resume.wait(60)

    def first():
        try:
            io.transfer_kv_direct([src], [dst], si, di, 1)
        except KvtierError as error:   # its registration changed under it: a refusal is fair here
            errors.append(error)
    thread = threading.Thread(target=first, daemon=True)
    with armed("direct.plan_built", hold_the_first_build):
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
