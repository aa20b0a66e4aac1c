"""The kernel functions keep a call's checked plan for the next call over the same operands and numbers
(``Plan.bind`` / ``KernelLauncher.rebind`` bind each call's own index tensors to it). A kept plan copies exactly what
a fresh one copies: index tensors of every kind, dtype, length and storage offset; threads binding at once; out of
range indices refused after in-range calls; host operands closed, replaced or re-pointed in place (``set_``,
``resize_``, ``as_strided``) followed or refused by name. Destinations are poisoned and checked byte for byte."""

from __future__ import annotations

import ctypes
import gc
import random
import sys
import threading

import numpy as np
import pytest
import torch
from helpers.compat import two_paused_mla_loads
from helpers.operands import (
    MODES,
    POISON,
    cpu,
    dev_idx,
    device,
    host,
    host_buffer,
    no_automatic_collection,
    pin_idx,
    poison,
    rnd,
)

from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.memory import HostBuffer, HostKind
from kvtier.runtime import create


@pytest.mark.parametrize("spec", MODES)
def test_two_threads_preparing_one_kept_plan_each_launch_their_own_indices(spec):
    """A plan kept by a call with no index pairs has nothing prepared. Two threads then calling with the same operands
    and their own indices both reach ``Plan.bind``'s prepare; ``self.prepared = prepare(...)`` followed by
    ``return self.prepared`` re-reads the shared attribute, so a thread whose store is overwritten by the other's
    before its return launched the OTHER thread's indices: its destination rows stayed poison and the other's pairs
    were copied twice. (The interleaving is forced at two pause points that only order the two threads, before
    and after the store of the prepared copy; a GIL switch there gives the same.) Fixed: bind returns the copy it
    prepared. (found adversarially, issue #15)"""
    rt = create(spec)
    n, row = 32, 16
    src, dst = device(rt, (n, row)), device(rt, (n, row), data=False)
    io.transfer_kv_per_layer_mla(src, dst, dev_idx(rt, []), dev_idx(rt, []), row)   # a plan, nothing prepared
    both, a_stored, b_stored = threading.Barrier(2, timeout=60), threading.Event(), threading.Event()

    def storing():
        both.wait()                     # both threads found nothing prepared
        if threading.current_thread().name == "B":
            a_stored.wait(60)

    def returning():
        if threading.current_thread().name == "A":
            a_stored.set()
            b_stored.wait(60)
        else:
            b_stored.set()

    two_paused_mla_loads(rt, src, dst, row, {"kvcacheio.bind_store": storing, "kvcacheio.bind_return": returning})


@pytest.mark.parametrize("spec", MODES)
def test_ok_one_plan_bound_to_index_tensors_of_every_kind_dtype_and_length(spec):
    """Same operands, calls alternating int64/int32, DeviceArray/pinned indices, 0/1/few/all pairs, absent (-1,
    -7) units and block shapes: every call copies exactly its own pairs."""
    rng = random.Random(7)
    rt = create(spec)
    n, row = 64, 32
    sk, sv = device(rt, (n, row)), device(rt, (n, row))
    dk, dv = device(rt, (n, row), data=False), device(rt, (n, row), data=False)
    makers = [dev_idx, pin_idx, lambda r, v: dev_idx(r, v, torch.int32), lambda r, v: pin_idx(r, v, torch.int32)]
    for step in range(24):
        count = rng.choice([0, 1, 2, 5, n])
        si, di = rng.sample(range(n), count), rng.sample(range(n), count)
        if count > 2 and step % 3 == 0:
            si[0], di[1] = -1, -7
        make = makers[step % 4] if step < 12 else rng.choice(makers)
        quota, warps = rng.choice([(2, 32), (1, 1), (5, 3)])
        poison(dk), poison(dv)
        io.transfer_kv_per_layer(sk, dk, sv, dv, make(rt, si), make(rt, di), row, quota, warps)
        rt.synchronize(0)
        for s, d in ((sk, dk), (sv, dv)):
            want = torch.full((n, row), POISON, dtype=torch.uint8)
            for x, y in zip(si, di, strict=True):
                if x >= 0 and y >= 0:
                    want[y] = s.cpu()[x]
            assert torch.equal(d.cpu(), want), (step, count)


@pytest.mark.parametrize("spec", MODES)
def test_ok_out_of_range_indices_after_in_range_calls_are_refused_untouched(spec, monkeypatch):
    """pf_lf over a pinned page_first host: in-range calls, then pinned indices past either end (refused, nothing
    copied), an out-of-range index paired with -1 (skipped), and with KVTIER_COMPAT_CHECKS=1 toggled on after
    checks-off calls, device indices past the end (refused, nothing copied)."""
    rt = create(spec)
    n, layers, row = 16, 3, 32
    hk, hv = host(rt, (n, layers, row)), host(rt, (n, layers, row))
    dk, dv = device(rt, (n, row), data=False), device(rt, (n, row), data=False)

    def call(si, di, layer=1):
        io.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, si, di, layer, row, layers * row)
        rt.synchronize(0)

    call(pin_idx(rt, [1, 2]), pin_idx(rt, [3, 4]))
    call(dev_idx(rt, [1, 2]), dev_idx(rt, [3, 4]))
    poison(dk), poison(dv)
    for si, di in (([1, n], [3, 5]), ([1, 2], [3, n])):
        with pytest.raises(InvalidArgument):
            call(pin_idx(rt, si), pin_idx(rt, di))
    assert all(bool((x.cpu() == POISON).all()) for x in (dk, dv))
    call(pin_idx(rt, [n + 5, 2]), pin_idx(rt, [-1, 6]))
    want = torch.full((n, row), POISON, dtype=torch.uint8)
    want[6] = hk[2, 1]
    assert torch.equal(dk.cpu(), want)
    poison(dk), poison(dv)
    monkeypatch.setenv("KVTIER_COMPAT_CHECKS", "1")
    for _ in range(2):
        with pytest.raises(InvalidArgument):
            call(dev_idx(rt, [1, 2]), dev_idx(rt, [3, n + 1]))
        assert all(bool((x.cpu() == POISON).all()) for x in (dk, dv))
        call(dev_idx(rt, [1, 2]), dev_idx(rt, [3, 4]))
        poison(dk), poison(dv)


@pytest.mark.parametrize("spec", MODES)
def test_ok_index_views_with_a_storage_offset_bind_their_own_address(spec):
    """Pinned int64/int32 index views at element offsets into one buffer, DeviceArray rows of a 2-D index array and
    a whole 2-D index array, all on one plan: each copy reads its own view. A strided index view is refused."""
    rt = create(spec)
    n, layers, row = 16, 3, 32
    hk, hv = host(rt, (n, layers, row)), host(rt, (n, layers, row))
    dk, dv = device(rt, (n, row), data=False), device(rt, (n, row), data=False)
    cases, keep = [], []
    for dtype in (torch.int64, torch.int32):
        size = torch.empty((), dtype=dtype).element_size()
        b1 = HostBuffer.allocate(64 * size, HostKind.PINNED, runtime=rt)
        b2 = HostBuffer.allocate(64 * size, HostKind.PINNED, runtime=rt)
        keep.extend([b1, b2])
        s_all, d_all = b1.as_tensor(dtype), b2.as_tensor(dtype)
        s_all.copy_((torch.arange(64) % n).to(dtype))
        d_all.copy_(((torch.arange(64) * 7 + 3) % n).to(dtype))
        cases += [(s_all[o:o + c], d_all[o:o + c]) for o, c in ((0, 3), (5, 4), (17, 1), (33, 9))]
    s2 = DeviceArray.from_tensor(torch.tensor([[0, 1, 2], [5, 6, 7]]), runtime=rt)
    d2 = DeviceArray.from_tensor(torch.tensor([[9, 8, 7], [1, 2, 3]]), runtime=rt)
    cases += [(s2[0], d2[0]), (s2[1], d2[1]), (s2, d2)]
    for si, di in cases:
        poison(dk)
        io.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, si, di, 2, row, layers * row)
        rt.synchronize(0)
        want = torch.full((n, row), POISON, dtype=torch.uint8)
        for x, y in zip(cpu(si).reshape(-1).tolist(), cpu(di).reshape(-1).tolist(), strict=True):
            want[y] = hk[x, 2]
        assert torch.equal(dk.cpu(), want)
    with pytest.raises(InvalidArgument):
        io.transfer_kv_per_layer_pf_lf(hk, dk, hv, dv, cases[3][0][0:8:2], cases[3][1][0:8:2], 0, row, layers * row)


@pytest.mark.parametrize("spec", MODES)
def test_ok_page_head_and_cut_chunks_rebound_across_index_counts(spec):
    """ph_lf (head pieces) and 12 KiB items (cut into pieces by the launcher) kept plans bound to 0/1/3/all pairs,
    both index kinds and dtypes, random layers: exact bytes every time. Also 40,000 pairs then 1 on one plan."""
    rng = random.Random(3)
    rt = create(spec)
    pages, heads, page_size, layers, head_dim = 4, 2, 4, 3, 16
    item, n = heads * head_dim, pages * page_size
    hk = host(rt, (pages, heads, page_size, layers, head_dim))
    hv = host(rt, (pages, heads, page_size, layers, head_dim))
    dk, dv = device(rt, (n, item), data=False), device(rt, (n, item), data=False)
    makers = [dev_idx, pin_idx, lambda r, v: dev_idx(r, v, torch.int32), lambda r, v: pin_idx(r, v, torch.int32)]
    for step in range(12):
        count = rng.choice([0, 1, 3, n])
        si, di = rng.sample(range(n), count), rng.sample(range(n), count)
        if step % 3 == 0 and count:
            si[0] = -1
        make, layer = rng.choice(makers), rng.randrange(layers)
        poison(dk), poison(dv)
        io.transfer_kv_per_layer_ph_lf(hk, dk, hv, dv, make(rt, si), make(rt, di), layer, item, layers * item,
                                       page_size, heads)
        rt.synchronize(0)
        for h, d in ((hk, dk), (hv, dv)):
            want = torch.full((n, item), POISON, dtype=torch.uint8)
            for x, y in zip(si, di, strict=True):
                if x >= 0 and y >= 0:
                    want[y] = h[x // page_size, :, x % page_size, layer, :].reshape(-1)
            assert torch.equal(d.cpu(), want)
    big, rows = 12288, 8
    src, dst = device(rt, (rows, big)), device(rt, (rows, big), data=False)
    for count in (1, 5, 2, 8):
        si, di = rng.sample(range(rows), count), rng.sample(range(rows), count)
        poison(dst)
        io.transfer_kv_per_layer_mla(src, dst, dev_idx(rt, si), dev_idx(rt, di), big)
        rt.synchronize(0)
        want = torch.full((rows, big), POISON, dtype=torch.uint8)
        want[di] = src.cpu()[si]
        assert torch.equal(dst.cpu(), want)
    many = 40000
    src, dst = device(rt, (50000, 16)), device(rt, (50000, 16), data=False)
    g = torch.Generator().manual_seed(0)
    si, di = torch.randperm(50000, generator=g)[:many], torch.randperm(50000, generator=g)[:many]
    io.transfer_kv_per_layer_mla(src, dst, DeviceArray.from_tensor(si, runtime=rt),
                                 DeviceArray.from_tensor(di, runtime=rt), 16)
    rt.synchronize(0)
    want = torch.full((50000, 16), POISON, dtype=torch.uint8)
    want[di] = src.cpu()[si]
    assert torch.equal(dst.cpu(), want)
    poison(dst)
    io.transfer_kv_per_layer_mla(src, dst, dev_idx(rt, [5]), dev_idx(rt, [6]), 16)
    rt.synchronize(0)
    want = torch.full((50000, 16), POISON, dtype=torch.uint8)
    want[6] = src.cpu()[5]
    assert torch.equal(dst.cpu(), want)


@pytest.mark.parametrize("spec", MODES)
def test_ok_threads_with_different_operands(spec):
    """Two threads repeating kept plans over different operands at once: each gets its own bytes."""
    rt = create(spec)
    N, D = 64, 16
    errors = []

    def worker(seed):
        try:
            src, dst = device(rt, (N, D)), device(rt, (N, D), data=False)
            perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
            si = DeviceArray.from_tensor(perm[:16].clone(), runtime=rt)
            di = DeviceArray.from_tensor(perm[16:32].clone(), runtime=rt)
            for _ in range(30):
                io.transfer_kv_per_layer_mla(src, dst, si, di, D)
            expected = torch.full((N, D), POISON, dtype=torch.uint8)
            expected[perm[16:32]] = src.cpu()[perm[:16]]
            assert torch.equal(dst.cpu(), expected)
        except BaseException as error:   # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("spec", MODES)
def test_ok_many_threads_binding_to_a_prepared_plan(spec):
    """A plan with a prepared launch; 8 threads each bind their own indices (device and pinned) many times at once
    (switch interval 1 µs): every pair lands, nothing else is written."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        rt = create(spec)
        n, row, workers = 256, 16, 8
        src, dst = device(rt, (n, row)), device(rt, (n, row), data=False)
        io.transfer_kv_per_layer_mla(src, dst, dev_idx(rt, [0]), dev_idx(rt, [0]), row)
        rt.synchronize(0)
        poison(dst)
        per = n // workers
        jobs = [([(k * 31 + j * 7) % n for j in range(per)], list(range(k * per, (k + 1) * per)))
                for k in range(workers)]
        barrier, errors = threading.Barrier(workers), []

        def work(k):
            try:
                barrier.wait()
                s, d = jobs[k]
                for j in range(0, per, 4):
                    make = pin_idx if j % 8 else dev_idx
                    io.transfer_kv_per_layer_mla(src, dst, make(rt, s[j:j + 4]), make(rt, d[j:j + 4]), row)
            except Exception as error:  # noqa: BLE001
                errors.append(error)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rt.synchronize(0)
        assert not errors
        want = torch.full((n, row), POISON, dtype=torch.uint8)
        source = src.cpu()
        for s, d in jobs:
            want[d] = source[s]
        assert torch.equal(dst.cpu(), want)
    finally:
        sys.setswitchinterval(old)


@pytest.mark.parametrize("spec", MODES)
def test_ok_a_host_buffer_replaced_by_a_smaller_one_at_the_same_address_is_refused_untouched(spec):
    """A pinned host tensor used by a kernel call (kept plan) and a *_direct call (kept base); its buffer closed and
    a smaller one allocated at the same address; a tensor of the old shape at that address (made through ctypes) is
    then refused by both, nothing copied. A closed DeviceArray operand is refused by name on the kept plan."""
    rt = create(spec)
    n, layers, row = 16, 2, 32
    dk, dv = device(rt, (n, row), data=False), device(rt, (n, row), data=False)
    buffer = HostBuffer.allocate(n * layers * row, HostKind.PINNED, runtime=rt)
    t = buffer.as_tensor(torch.uint8).view(n, layers, row)
    t.copy_(rnd((n, layers, row)))
    at = t.data_ptr()
    io.transfer_kv_per_layer_pf_lf(t, dk, t, dv, dev_idx(rt, [1, 15]), dev_idx(rt, [3, 4]), 1, row, layers * row)
    io.transfer_kv_per_layer_direct_pf_lf([t.view(n, layers, 1, row)], [dk, dv], pin_idx(rt, [1, 15]),
                                          pin_idx(rt, [3, 4]), 0, 1)
    rt.synchronize(0)
    del t
    buffer.close()
    smaller = HostBuffer.allocate(n * layers * row // 2, HostKind.PINNED, runtime=rt)
    if smaller.as_tensor(torch.uint8).data_ptr() != at:
        pytest.skip("the smaller buffer did not land at the same address")
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * (n * layers * row)).from_address(at))
    stale = torch.from_numpy(raw).view(n, layers, row)
    poison(dk), poison(dv)
    with pytest.raises(KvtierError):
        io.transfer_kv_per_layer_pf_lf(stale, dk, stale, dv, dev_idx(rt, [1, 15]), dev_idx(rt, [3, 4]), 1, row,
                                       layers * row)
    with pytest.raises(KvtierError):
        io.transfer_kv_per_layer_direct_pf_lf([stale.view(n, layers, 1, row)], [dk, dv], pin_idx(rt, [1, 15]),
                                              pin_idx(rt, [3, 4]), 0, 1)
    rt.synchronize(0)
    assert all(bool((x.cpu() == POISON).all()) for x in (dk, dv))
    src = device(rt, (n, row))
    io.transfer_kv_per_layer_mla(src, dk, dev_idx(rt, [1]), dev_idx(rt, [2]), row)
    src.close()
    with pytest.raises(KvtierError, match="src"):
        io.transfer_kv_per_layer_mla(src, dk, dev_idx(rt, [1]), dev_idx(rt, [2]), row)


@pytest.mark.parametrize("spec", MODES)
def test_ok_host_buffer_closed_and_replaced_under_a_kept_plan(spec):
    """A kept _copy plan over a host view: closing its buffer and allocating another (pinned/registered/shm) makes
    the next call plan again (host generation), so the new buffer gets the right bytes."""
    rt = create(spec)
    N, D = 32, 16
    dev = device(rt, (N, D))
    si = pin_idx(rt, [1, 3, 5, 7])
    di = pin_idx(rt, [2, 4, 6, 8])
    for kind in (HostKind.PINNED, HostKind.REGISTERED, HostKind.SHM):
        buffer, dst = host_buffer(rt, (N, D), kind, data=False)
        io.transfer_kv_per_layer_mla(dev, dst, si, di, D)
        rt.synchronize(0)
        expected = torch.full((N, D), POISON, dtype=torch.uint8)
        expected[[2, 4, 6, 8]] = dev.cpu()[[1, 3, 5, 7]]
        assert torch.equal(dst, expected)
        del dst
        gc.collect()
        buffer.close()


@pytest.mark.parametrize("spec", MODES)
def test_ok_device_array_closed_under_a_kept_plan_is_refused(spec):
    rt = create(spec)
    N, D = 16, 16
    src, dst = device(rt, (N, D)), device(rt, (N, D), data=False)
    si, di = DeviceArray.from_tensor(torch.tensor([1, 2]), runtime=rt), DeviceArray.from_tensor(torch.tensor([3, 4]),
                                                                                                 runtime=rt)
    io.transfer_kv_per_layer_mla(src, dst, si, di, D)
    dst.close()
    with pytest.raises(KvtierError, match="dst"):
        io.transfer_kv_per_layer_mla(src, dst, si, di, D)


@pytest.mark.parametrize("mode", MODES)
@no_automatic_collection()
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
