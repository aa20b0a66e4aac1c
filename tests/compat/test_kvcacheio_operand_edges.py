"""kvtier.compat.sglang.kvcacheio at the edges of what an SGLang caller passes: every refusal (index dtypes,
lengths, devices, runtimes, strides, pageable memory, layouts, reach) leaves every destination untouched and the valid
call right after lands; empty and negative indices across the kernel, table and direct functions; offset views and
mixed memory kinds (pinned, registered, DeviceArray views) in one call. Destinations poisoned, checked byte for byte.
(Found adversarially, issue #15.)"""

from __future__ import annotations

import pytest
import torch
from helpers.operands import MODES, all_poison, dev_idx, device, fresh, host, pin_idx, poison, rnd

from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import KvtierError
from kvtier.memory import HostKind
from kvtier.runtime import create


@pytest.mark.parametrize("spec", MODES)
def test_ok_kvcacheio_refusals_leave_every_destination_untouched(spec):
    """One call at a time, each refused with a KvtierError before anything is queued, then the valid call right
    after it lands exactly: index dtypes int16/uint8/float/bool, int32 against int64, lengths that differ, a
    non-contiguous index view, pageable CPU indices, indices on device 1 with operands on device 0, a destination
    on device 1, a DeviceArray of another runtime, a strided operand, item_size 12, a bool layer_id, a host tensor
    that is not kvtier memory, a page-first layer past its layout, and a pinned index past the destination."""
    rt = create(spec)
    n, row, layers = 16, 32, 2
    src, dst = device(rt, (n, row)), device(rt, (n, row), data=False)
    paged = host(rt, (n, layers, row))
    other_rt = create(spec)
    si, di = [3, 0, 9, 15], [1, 14, 6, 2]
    good_s, good_d = dev_idx(rt, si), dev_idx(rt, di)
    pageable = rnd((n, row))

    def valid():
        poison(dst)
        io.transfer_kv_per_layer_mla(src, dst, good_s, good_d, row)
        rt.synchronize(0)
        want = fresh((n, row))
        want[di] = src.cpu()[si]
        assert torch.equal(dst.cpu(), want)

    refusals = {
        "int16": lambda: io.transfer_kv_per_layer_mla(src, dst, torch.tensor(si, dtype=torch.int16),
                                                      torch.tensor(di, dtype=torch.int16), row),
        "uint8": lambda: io.transfer_kv_per_layer_mla(src, dst, pin_idx(rt, si).to(torch.uint8),
                                                      pin_idx(rt, di).to(torch.uint8), row),
        "float": lambda: io.transfer_kv_per_layer_mla(src, dst, torch.tensor(si, dtype=torch.float64),
                                                      torch.tensor(di, dtype=torch.float64), row),
        "bool": lambda: io.transfer_kv_per_layer_mla(src, dst, torch.ones(4, dtype=torch.bool),
                                                     torch.ones(4, dtype=torch.bool), row),
        "dtypes": lambda: io.transfer_kv_per_layer_mla(src, dst, dev_idx(rt, si, torch.int32), good_d, row),
        "lengths": lambda: io.transfer_kv_per_layer_mla(src, dst, dev_idx(rt, si[:3]), good_d, row),
        "strided index": lambda: io.transfer_kv_per_layer_mla(src, dst, pin_idx(rt, si * 2)[::2],
                                                              pin_idx(rt, di), row),
        "pageable index": lambda: io.transfer_kv_per_layer_mla(src, dst, torch.tensor(si), torch.tensor(di), row),
        "index device": lambda: io.transfer_kv_per_layer_mla(src, dst, dev_idx(rt, si, dev=1),
                                                             dev_idx(rt, di, dev=1), row),
        "dst device": lambda: io.transfer_kv_per_layer_mla(
            src, DeviceArray.from_tensor(fresh((n, row)), 1, runtime=rt), good_s, good_d, row),
        "runtime": lambda: io.transfer_kv_per_layer_mla(src, device(other_rt, (n, row), False), good_s, good_d,
                                                        row),
        "strided operand": lambda: io.transfer_kv_per_layer_pf_lf(paged[:, 0], dst, paged[:, 1], dst,
                                                                  pin_idx(rt, si), pin_idx(rt, di), 0, row, row),
        "item_size": lambda: io.transfer_kv_per_layer_mla(src, dst, good_s, good_d, 12),
        "layer bool": lambda: io.transfer_kv_per_layer_mla_pf_lf(paged, dst, good_s, good_d, True, row,
                                                                 layers * row),
        "pageable operand": lambda: io.transfer_kv_per_layer_mla(pageable, dst, pin_idx(rt, si), pin_idx(rt, di),
                                                                 row),
        "layout": lambda: io.transfer_kv_per_layer_mla_pf_lf(paged, dst, good_s, good_d, layers, row,
                                                             layers * row),
        "reach": lambda: io.transfer_kv_per_layer_mla(src, dst, pin_idx(rt, si), pin_idx(rt, [1, 14, 6, n]), row),
    }
    valid()
    for name, call in refusals.items():
        poison(dst)
        with pytest.raises(KvtierError):
            call()
        rt.synchronize(0)
        assert all_poison(dst), name
        valid()


@pytest.mark.parametrize("spec", MODES)
def test_ok_empty_and_negative_indices_across_functions(spec):
    """Empty index tensors (device, pinned, int32 and int64) are a no-op for kernel, table and direct functions,
    and leave every destination as it was; negative indices (-1, int64 min) on either side skip their pair in the
    kernel functions and the rest lands; a negative index in a ``*_direct`` call is refused untouched."""
    rt = create(spec)
    n, row, layers = 16, 32, 2
    src, dst = device(rt, (n, row)), device(rt, (n, row), data=False)
    srcs = [device(rt, (n, row)) for _ in range(layers)]
    dsts = [device(rt, (n, row), data=False) for _ in range(layers)]
    out = host(rt, (n, layers, row), data=False)
    src_table = DeviceArray.from_tensor(torch.tensor([x.data_ptr() for x in srcs], dtype=torch.uint64), runtime=rt)
    for dtype in (torch.int64, torch.int32):
        for make in (dev_idx, pin_idx):
            empty = make(rt, [], dtype)
            io.transfer_kv_per_layer_mla(src, dst, empty, empty, row)
            io.transfer_kv_all_layer_mla_lf_pf(src_table, out, empty, empty, row, layers * row, layers)
        io.transfer_kv_direct(srcs, dsts, torch.tensor([], dtype=dtype), torch.tensor([], dtype=dtype), 1)
    rt.synchronize(0)
    assert all_poison(dst) and all_poison(out) and all(all_poison(d) for d in dsts)
    low = -(1 << 63)
    si, di = [2, -1, 7, 5, low], [4, 9, -1, low, 11]
    for make in (dev_idx, pin_idx):
        poison(dst), poison(out)
        io.transfer_kv_per_layer_mla(src, dst, make(rt, si), make(rt, di), row)
        io.transfer_kv_all_layer_mla_lf_pf(src_table, out, make(rt, si), make(rt, di), row, layers * row, layers)
        rt.synchronize(0)
        want, want_out = fresh((n, row)), fresh((n, layers, row))
        want[4] = src.cpu()[2]
        for layer in range(layers):
            want_out[4, layer] = srcs[layer].cpu()[2]
        assert torch.equal(dst.cpu(), want) and torch.equal(out, want_out)
    with pytest.raises(KvtierError):
        io.transfer_kv_direct(srcs, dsts, torch.tensor([2, -1]), torch.tensor([4, 9]), 1)
    rt.synchronize(0)
    assert all(all_poison(d) for d in dsts)


@pytest.mark.parametrize("spec", MODES)
def test_ok_offset_views_and_mixed_memory_kinds_in_one_call(spec):
    """K on pinned memory, V on registered memory, each a contiguous view starting mid-buffer (a storage offset);
    destinations a DeviceArray ``select`` view and a DeviceArray; indices int32 pinned at an offset. Both directions
    of ``transfer_kv_per_layer`` and ``transfer_kv_per_layer_pf_lf`` (a page-first registered host) land exactly,
    twice (the second call on the kept plan), and a pinned index reaching one item past the view (but inside its
    buffer) is refused untouched."""
    rt = create(spec)
    n, row, layers = 16, 64, 3
    hk_all = host(rt, (n + 5, row))
    hv_all = host(rt, (n + 3, row), kind=HostKind.REGISTERED)
    hk, hv = hk_all[5:], hv_all[3:]
    big = device(rt, (2, n, row), data=False)
    dk, dv = big.select(0, 1), device(rt, (n, row), data=False)
    paged = host(rt, (n, layers, row), kind=HostKind.REGISTERED)
    idx = pin_idx(rt, list(range(40)), torch.int32)
    for _ in range(2):
        si, di = idx[7:13], idx[21:27]
        si.copy_(torch.tensor([15, 0, 4, 9, 11, 2], dtype=torch.int32))
        di.copy_(torch.tensor([1, 3, 5, 7, 13, 15], dtype=torch.int32))
        poison(big), poison(dv)
        io.transfer_kv_per_layer(hk, dk, hv, dv, si, di, row)
        rt.synchronize(0)
        for s, d in ((hk, dk), (hv, dv)):
            want = fresh((n, row))
            want[di.long()] = s[si.long()]
            assert torch.equal(d.cpu(), want)
        assert torch.equal(big.cpu()[0], fresh((n, row)))
        back_k, back_v = hk_all.clone(), hv_all.clone()
        io.transfer_kv_per_layer(dk, hk, dv, hv, di, si, row)
        rt.synchronize(0)
        back_k[5:][si.long()] = dk.cpu()[di.long()]
        back_v[3:][si.long()] = dv.cpu()[di.long()]
        assert torch.equal(hk_all, back_k) and torch.equal(hv_all, back_v)
        poison(big), poison(dv)
        io.transfer_kv_per_layer_pf_lf(paged, dk, paged, dv, si, di, 2, row, layers * row)
        rt.synchronize(0)
        want = fresh((n, row))
        want[di.long()] = paged[si.long(), 2]
        assert torch.equal(dk.cpu(), want) and torch.equal(dv.cpu(), want)
    before_k, before_v = hk_all.clone(), hv_all.clone()
    with pytest.raises(KvtierError):
        io.transfer_kv_per_layer(dk, hk_all[5:-1], dv, hv, idx[0:1], pin_idx(rt, [n - 1], torch.int32), row)
    rt.synchronize(0)
    assert torch.equal(hk_all, before_k) and torch.equal(hv_all, before_v)
