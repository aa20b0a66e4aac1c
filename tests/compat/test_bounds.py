"""What a kvcacheio kernel call reaches is checked before anything is launched: pinned (host-readable) indices
against the tensors and table entries they index, byte offsets that would pass int64, table entries whose first item
already leaves its memory; index tensors of a dtype, shape or device the kernel cannot read are refused by name. A
refused call writes nothing and leaves the device usable; an accepted one lands exactly its pairs."""

from __future__ import annotations

import pytest
import torch
from helpers.compat import Operands
from helpers.operands import MODES, POISON, cpu, dev_idx, device, host, no_automatic_collection, pin_idx, poison

from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.runtime import create


def test_pinned_src_indices_are_bounds_checked_when_dst_indices_are_on_the_device(rt):
    """docs/sglang.md: "Indices the host can read without waiting (a pinned CPU tensor) are checked against the
    tensors they index. An out-of-range index raises InvalidArgument and nothing is copied." The check only runs
    when *both* index tensors are host-readable: a pinned src_indices holding an out-of-range token, paired with
    device dst_indices, is not checked and the kernel faults (IllegalAddress, device poisoned). Expected:
    InvalidArgument naming the out-of-range source index, before any launch. (found adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row, item = 8, 16, 32        # int16 elements of a token; item_size: bytes of one token of one layer
    src, dst = m.host((tokens, row)), m.device((tokens, row), data=False)
    with pytest.raises(InvalidArgument, match="out of range"):
        io.transfer_kv_per_layer_mla(src, dst, m.pinned_indices([0, 100]), m.indices([0, 1]), item)
        rt.synchronize(0)
    assert m.poisoned(dst)


def test_pinned_indices_through_pointer_tables_are_bounds_checked(rt):
    """The same promise for the all-layer (table) functions: with pinned CPU indices, an index far past the end of
    the registered host buffer a table entry points into is not checked at all (Side.check_bounds returns early for
    tables), so the call returns and the kernel faults with IllegalAddress. kvtier resolves every table entry
    through its resolver and knows the span of the buffer each entry lies in. Expected: InvalidArgument before the
    launch, nothing copied. (found adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row, item = 8, 16, 32
    dev_layers = [m.device((tokens, row)) for _ in range(2)]
    host = m.host((2, tokens, row), data=False)
    with pytest.raises(InvalidArgument, match="out of range"):
        io.transfer_kv_all_layer_mla(m.table(dev_layers), m.table([host[0], host[1]]), m.pinned_indices([0, 1]),
                                     m.pinned_indices([0, 10**6]), item, 2)
        rt.synchronize(0)
    assert m.poisoned(host)


def test_an_index_whose_byte_offset_overflows_int64_is_not_let_through(rt):
    """check_bounds computes index * stride in numpy int64, which wraps silently: pinned index 2**59 + 1 with a
    32-byte item reaches byte 2**64 + 32, seen as byte 32, so the bounds check passes and the kernel faults here
    (on a GPU, 64-bit wrap-around would read token 1 instead). Expected: InvalidArgument (out of range). (found
    adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row, item = 8, 16, 32
    src, dst = m.host((tokens, row)), m.device((tokens, row), data=False)
    with pytest.raises(InvalidArgument, match="out of range"):
        io.transfer_kv_per_layer_mla(src, dst, m.pinned_indices([0, 2**59 + 1]), m.pinned_indices([0, 1]), item)
        rt.synchronize(0)
    assert m.poisoned(dst)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("side", ["src", "dst"])
@no_automatic_collection()
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
    ``allocation_end`` as for host ones (keep the result per entry, as ``rooms`` does).
    (found adversarially, issue #15)"""
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
@no_automatic_collection()
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
@no_automatic_collection()
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
