"""The ``*_direct`` compat functions keep what a call over a set of tensors checked and resolved (each layer's two
ends: base, bytes, registration edges) apart from the indices, so a new request over the same pools costs a bounds
check per side. These tests hold that reuse to the same answers a fresh call gives: new indices checked in full,
registrations changed since followed (also when they change while another thread is planning), bad operands refused
even when there is nothing to copy; copies kept with index values belong to the call's runtime and to how its tensors
split into page-first and layer-first lists."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from helpers.operands import MODES, POISON, device, host, host_buffer, no_automatic_collection, poison, rnd

from kvtier.compat.sglang import direct
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.memory import HostBuffer, HostKind
from kvtier.pause_points import armed
from kvtier.runtime import create

PAGES, LAYERS, PAGE, ROW = 8, 3, 4, 32


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
