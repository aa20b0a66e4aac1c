"""The ``*_direct`` functions check every layer's operands, indices and pages before queuing any copy: a pageable
layer, a layer on another device, a layer or host tensor too short for the indices, an index or page whose byte offset
would pass int64, a page past a one-page host whose page stride means nothing, bad index dtypes and page sizes are
refused by name (InvalidArgument, NotDeviceAccessible, WrongDeviceError) with every destination untouched; runs that
end exactly on the last token land."""

from __future__ import annotations

import pytest
import torch
from helpers.compat import Operands, byte_operands
from helpers.operands import MODES, POISON, all_poison, cpu, device, host, no_automatic_collection

from kvtier.compat.operands import LIMIT
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument, NotDeviceAccessible, WrongDeviceError
from kvtier.memory import HostBuffer
from kvtier.runtime import create


def test_direct_refuses_a_pageable_layer_before_copying_the_others(rt):
    """docs: "a pageable or foreign-device address is refused by name before anything is copied". transfer_kv_direct
    resolves and queues layer by layer, so with src_layers[2] pageable it raises NotDeviceAccessible only after
    layers 0 and 1 were already copied into their destinations. Expected: the error, and every destination
    untouched. (found adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row = 8, 16                  # int16 elements of a token
    src = [m.host((tokens, row)), m.host((tokens, row)), torch.zeros((tokens, row), dtype=torch.int16)]
    dst = [m.device((tokens, row), data=False) for _ in range(3)]
    with pytest.raises(NotDeviceAccessible, match=r"src_layers\[2\]"):
        io.transfer_kv_direct(src, dst, m.indices([0, 1]), m.indices([0, 1]), 1)
    assert [m.poisoned(d) for d in dst] == [True, True, True]


def test_direct_refuses_an_out_of_range_layer_before_copying_the_others(rt):
    """Same for bounds: dst_layers[2] is shorter than the others, the index is out of range for it only, and
    InvalidArgument is raised after layers 0 and 1 were copied. Expected: nothing copied.
    (found adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row = 8, 16                  # int16 elements of a token
    src = [m.host((tokens, row)) for _ in range(3)]
    dst = [m.device((tokens, row), data=False), m.device((tokens, row), data=False), m.device((2, row), data=False)]
    with pytest.raises(InvalidArgument):
        io.transfer_kv_direct(src, dst, m.indices([4, 5]), m.indices([4, 5]), 1)
    assert [m.poisoned(d) for d in dst] == [True, True, True]


def test_direct_lf_pf_refuses_a_pageable_v_host_before_copying_k(rt):
    """transfer_kv_all_layer_direct_lf_pf with a pinned K host tensor and a pageable V host tensor: K's pages are
    copied, then NotDeviceAccessible is raised for dst_ptrs[1]. Expected: the error and K's host tensor untouched.
    (found adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row = 8, 16                  # int16 elements of a token
    layers = [m.device((tokens, row)) for _ in range(4)]                 # K's 2 layers, then V's
    k_host = m.host((4, 2, 2, row), data=False)
    v_host = torch.full((4, 2, 2, row), m.poison, dtype=torch.int16)  # pageable
    with pytest.raises(NotDeviceAccessible, match=r"dst_ptrs\[1\]"):
        io.transfer_kv_all_layer_direct_lf_pf(layers, [k_host, v_host], m.indices([0, 1]), m.indices([2, 3]), 2)
    assert m.poisoned(k_host)


def test_direct_pf_lf_checks_every_host_tensor_before_copying(rt):
    """transfer_kv_per_layer_direct_pf_lf with a V host tensor holding fewer layers than K's: K's pages are copied,
    then InvalidArgument ("layers [2, 3) exceed the 2 of src_ptrs[1]"). Expected: nothing copied.
    (found adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row = 8, 16                  # int16 elements of a token
    pf = [m.host((4, 3, 2, row)), m.host((4, 2, 2, row))]
    lf = [m.device((tokens, row), data=False) for _ in range(2)]
    with pytest.raises(InvalidArgument):
        io.transfer_kv_per_layer_direct_pf_lf(pf, lf, m.indices([2, 3]), m.indices([0, 1]), 2, 2)
    assert [m.poisoned(x) for x in lf] == [True, True]


def test_direct_names_a_layer_on_another_device(rt):
    """A dst layer on device 1 (indices and the other layers on device 0) is reported as "the index tensors are on
    different devices ([0, 1])": the index tensors are both on device 0 (direct.py passes the layer lists to
    call_for as the indices). Expected: WrongDeviceError naming dst_layers[1], as for every other operand.
    (found adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row = 8, 16                  # int16 elements of a token
    src = [m.host((tokens, row)) for _ in range(2)]
    dst = [m.device((tokens, row), data=False), m.device((tokens, row), data=False, device=1)]
    with pytest.raises(WrongDeviceError, match=r"dst_layers\[1\]"):
        io.transfer_kv_direct(src, dst, m.indices([0, 1]), m.indices([0, 1]), 1)


def test_direct_an_index_whose_byte_offset_overflows_int64_is_refused(rt):
    """transfer_kv_direct computes each run's byte offset as index * row in int64 numpy arithmetic without a bound:
    src index 2**60 with 16-byte rows is 2**64 bytes, which wraps to 0, passes the extent check and copies token 0
    into dst token 1 without a word. (2**60 + 3 copies token 3; 2**59 wraps negative and is refused only by
    memcpy_runs_async, without naming the operand.) The kernel functions were fixed for this first (LIMIT); the
    direct ones were not. Expected: InvalidArgument naming the index / operand, nothing copied.
    (found adversarially, issue #15)"""
    m = byte_operands(rt)
    tokens, item = 8, 16                 # bytes of a token
    src, dst = [m.device((tokens, item))], [m.host((tokens, item), data=False)]
    with pytest.raises(InvalidArgument):
        io.transfer_kv_direct(src, dst, m.pinned_indices([2 ** 60]), m.pinned_indices([1]), 1)
    rt.synchronize(0)
    assert all_poison(dst[0]), "an out-of-range index silently copied a token"


def test_direct_lf_pf_a_page_whose_byte_offset_overflows_int64_is_refused(rt):
    """transfer_kv_all_layer_direct_lf_pf: destination token 2**62 is page 2**60 of a page_first_direct host whose
    pages are 64 bytes; 2**60 * 64 wraps to 0 in int64, passes the extent check, and page 0 of the host is
    overwritten. Expected: InvalidArgument, the host tensor untouched. (found adversarially, issue #15)"""
    m = byte_operands(rt)
    tokens, item = 8, 16                 # bytes of a token
    layer = [m.device((tokens, item))]
    host = m.host((2, 1, 4, item), data=False)          # [pages, layers, page_size, item]
    with pytest.raises(InvalidArgument):
        io.transfer_kv_all_layer_direct_lf_pf(layer, [host], m.pinned_indices([0, 1, 2, 3]),
                                              m.pinned_indices([2 ** 62 + i for i in range(4)]), 4)
    rt.synchronize(0)
    assert all_poison(host), "an out-of-range page silently overwrote host page 0"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("direction", ["pf_lf", "lf_pf"])
@no_automatic_collection()
def test_direct_refuses_a_page_past_a_one_page_host_whose_page_stride_means_nothing(mode, direction):
    """A one-page ``page_first_direct`` host tensor ``[1, layers, page_size, D]`` made by a permute has
    ``stride(0) == 1`` (torch ignores a size-1 dimension's stride). Page 1 does not exist, yet kvtier computes its
    offset as ``1 * stride(0)`` = 1 byte (kvtier/compat/sglang/direct.py:416 ``strides = (_bytes(host, 0), ...)``,
    then ``_runs``/``_plan`` bound it only by the tensor's extent, which page 1 of layer 0 fits): the load copies
    layer 0 of page 0 shifted by one byte into the destination, the backup overwrites page 0 from its second byte.
    SGLang's ``select(0, 1)`` raises IndexError. Silent corruption of a host page through an out-of-range index.
    Fix: check each page index against ``shape[0]`` (and use contiguous strides for size-1 dimensions).
    (found adversarially, issue #15)"""
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


def test_ok_direct_runs_touching_both_ends_land_and_one_past_the_end_is_refused_untouched(rt):
    """Runs of lengths 1, 3 and 2 (a copy of each size) where the last run ends on the last token of the source and
    of the destination: accepted and exact. The same call with the last run one token longer, in a later layer only
    (its tensors are one token shorter), is refused naming that layer, and no layer of it was copied."""
    m = byte_operands(rt)
    n, rows = 16, [8, 40, 24]
    src_idx = torch.tensor([0, 5, 6, 7, 14, 15])
    dst_idx = torch.tensor([3, 9, 10, 11, 14, 15])
    srcs = [m.device((n, r)) for r in rows]
    dsts = [m.host((n, r), data=False) for r in rows]
    io.transfer_kv_direct(srcs, dsts, src_idx, dst_idx, 2)
    rt.synchronize(0)
    for s, d in zip(srcs, dsts, strict=True):
        want = torch.full_like(d, POISON)
        want[dst_idx] = s.cpu()[src_idx]
        assert torch.equal(d, want)

    short = [m.device((n, r)) for r in rows[:2]] + [m.device((n - 1, rows[2]))]
    dsts = [m.host((n, r), data=False) for r in rows]
    with pytest.raises(InvalidArgument, match=r"src_layers\[2\].*out of range"):
        io.transfer_kv_direct(short, dsts, src_idx, dst_idx, 2)
    short_dst = [m.host((n, r), data=False) for r in rows[:2]] + [m.host((n - 1, rows[2]), data=False)]
    with pytest.raises(InvalidArgument, match=r"dst_layers\[2\].*out of range"):
        io.transfer_kv_direct(srcs, short_dst, src_idx, dst_idx, 2)
    rt.synchronize(0)
    assert all(all_poison(d) for d in dsts + short_dst)


def test_ok_direct_refusals_of_bad_indices_and_page_sizes_leave_everything_untouched(rt):
    """Huge indices (the bound LIMIT // 1024 and one past it, int32 2**31 - 1), negative ones, a page_size that does
    not divide the count, zero, a bool, mixed index dtypes, int16: InvalidArgument each time, nothing copied; empty
    indices are a no-op; a pageable host layer is refused by name before any layer is copied."""
    m = byte_operands(rt)
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
            io.transfer_kv_direct(srcs, dsts, s, d, page_size)
    io.transfer_kv_direct(srcs, dsts, t([], dtype=torch.int64), t([], dtype=torch.int64), 4)
    pageable = m._own(HostBuffer.allocate(4096, "pageable", runtime=rt)).as_tensor(torch.uint8)[:128].view(16, 8)
    pageable.fill_(POISON)
    with pytest.raises(NotDeviceAccessible, match=r"dst_layers\[1\]"):
        io.transfer_kv_direct(srcs, [dsts[0], pageable], t([0, 1, 2]), t([4, 5, 9]), 1)
    rt.synchronize(0)
    assert all(all_poison(d) for d in dsts) and all_poison(pageable)
    del pageable
