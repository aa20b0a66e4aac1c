"""The kvcacheio kernel functions (not ``*_direct``) write exactly the bytes SGLang's offset formulas name, or refuse
with a KvtierError (InvalidArgument for bad sizes) and write nothing: host views whose size-1 dimensions carry odd
strides (one-page, one-layer, one-head pools made by permutes), raw pointer tables of every form, sizes of every odd
type and range, size products past int64, non-contiguous operands, more warps than a block holds. The byte model
(``lands_as_modelled``) applies SGLang's offsets to the destinations' bytes; destinations start as fresh random bytes
or the poison and are checked whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.compat import Operands, byte_operands
from helpers.operands import MODES, POISON, cpu, dev_idx, device, host, no_automatic_collection, pin_idx, poison

from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.runtime import create
from kvtier.runtime import get as get_runtime


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


def test_a_layout_dim_too_large_for_int64_is_refused_by_kvtier(rt):
    """src_layout_dim = 2**64 with pinned indices crashes with a bare OverflowError ("Python int too large to
    convert to C long") from numpy inside check_bounds. Expected: a KvtierError (InvalidArgument) naming the
    argument. (found adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row, item = 8, 16, 32        # int16 elements of a token; item_size: bytes of one token of one layer
    src, dst = m.host((tokens, 2, row)), m.device((tokens, row), data=False)
    with pytest.raises(KvtierError):
        io.transfer_kv_per_layer_mla_pf_lf(src, dst, m.pinned_indices([0, 4]), m.pinned_indices([0, 1]), 0, item,
                                           2**64)


def test_a_non_contiguous_operand_is_not_silently_misread(rt):
    """A strided view (every other token row of a pinned buffer) is accepted as a layer-first operand, but the
    kernel reads token i at data_ptr + i * item_size, i.e. from the rows the view skips: wrong bytes, no error.
    Index tensors are refused when non-contiguous, operands are not. Expected: InvalidArgument, or the right
    bytes. (found adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row, item = 8, 16, 32        # int16 elements of a token; item_size: bytes of one token of one layer
    backing = m.host((tokens, 2, row))
    src = backing[:, 0]                      # shape (8, 16), stride (32, 1): not contiguous
    dst = m.device((tokens, row), data=False)
    try:
        io.transfer_kv_per_layer_mla(src, dst, m.indices([0, 1, 2, 3]), m.indices([0, 1, 2, 3]), item)
    except InvalidArgument:
        assert m.poisoned(dst)
        return
    got = dst.cpu()
    assert torch.equal(got[:4], src[:4]), "tokens 1..3 were read from the rows the strided view skips"
    assert m.poisoned(got[4:])


def test_too_many_warps_per_block_is_an_invalid_argument_naming_it(rt):
    """num_warps_per_block=33 (1,056 threads; docs/sglang.md: 'up to 32') raises a bare KvtierError from the launcher
    ('launch of 2 blocks x 1056 threads: this launcher needs ...'), which is not a ValueError and does not name the
    argument, while block_quota=0 raises InvalidArgument naming block_quota. docs/sglang.md: bad sizes raise
    InvalidArgument, also a ValueError. Expected: InvalidArgument mentioning num_warps_per_block. (found
    adversarially, issue #15)"""
    m = byte_operands(rt)
    tokens, item = 8, 16
    with pytest.raises(InvalidArgument, match="num_warps_per_block"):
        io.transfer_kv_per_layer_mla(m.device((tokens, item)), m.device((tokens, item), data=False),
                                     m.indices([1]), m.indices([2]), item, 2, 33)


@pytest.mark.parametrize("indices", ["pinned", "device"])
@pytest.mark.parametrize("function", ["ph_lf", "lf_ph"])
@no_automatic_collection()
def test_a_page_head_call_whose_page_stride_passes_int64_is_refused_by_kvtier(indices, function):
    """``page_size`` and ``*_layout_dim`` are each checked against 2**62 (kvcacheio.py:147 ``_positive``), but their
    product, the ``page_head`` page stride, is not: ``_page_head`` (kvcacheio.py:262) builds a Side with
    ``page_size * layout_dim`` (and ``per_head * page_size``) well past int64. With pinned indices ``check_reach``
    multiplies an int64 numpy array by it (kvcacheio.py:113) and raises a bare ``OverflowError``; with device indices
    nothing checks it until the launch packs the kernel arguments (runtime/program.py:42) and raises
    ``struct.error: argument out of range``. Neither is a KvtierError (docs/sglang.md: 'Bad sizes raise
    InvalidArgument', 'Every kvtier error is a KvtierError'), so a caller catching kvtier's errors crashes, and a kept
    plan whose launch can never be packed is stored first (kvcacheio.py:232). Fix: in ``_page_head`` refuse
    ``page_size * layout_dim > LIMIT`` with InvalidArgument (as ``_layout_holds`` does for layers). (found
    adversarially, issue #15)"""
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


PER_LAYER_SHAPES = [(8, 1, 32), (1, 8, 32), (8, 32, 1), (1, 256), (1, 1, 256)]


@pytest.mark.parametrize("mode", MODES)
@no_automatic_collection()
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
@no_automatic_collection()
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
@no_automatic_collection()
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
