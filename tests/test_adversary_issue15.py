"""Adversarial tests for kvtier.compat.sglang.kvcacheio and kvtier.compat.DeviceArray (issue 15).

Each test fails against the code it was written for; its docstring says what is wrong and what is expected.
Every test makes its own emulated runtime (a fault poisons a runtime, as a CUDA context).
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers.compat import Operands

from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio
from kvtier.errors import InvalidArgument, KvtierError, NotDeviceAccessible, WrongDeviceError
from kvtier.memory import HostBuffer, HostKind
from kvtier.runtime import create

POISON = 0x5A5A
TOKENS, ROW = 8, 16          # tokens of a tensor, int16 elements of a token
ITEM = ROW * 2               # item_size: bytes of one token of one layer


def Mem(runtime):  # noqa: N802 (a class in spirit)
    return Operands(runtime, dtype=torch.int16, poison=POISON)


def poisoned(x):
    data = x.cpu() if isinstance(x, DeviceArray) else x
    return torch.equal(data, torch.full(tuple(data.shape), POISON, dtype=torch.int16))


# -- index bounds ------------------------------------------------------------------------------------------------
def test_pinned_src_indices_are_bounds_checked_when_dst_indices_are_on_the_device(rt):
    """docs/sglang.md: "Indices the host can read without waiting (a pinned CPU tensor) are checked against the
    tensors they index. An out-of-range index raises InvalidArgument and nothing is copied." The check only runs
    when *both* index tensors are host-readable: a pinned src_indices holding an out-of-range token, paired with
    device dst_indices, is not checked and the kernel faults (IllegalAddress, device poisoned). Expected:
    InvalidArgument naming the out-of-range source index, before any launch."""
    m = Mem(rt)
    src, dst = m.host((TOKENS, ROW)), m.device((TOKENS, ROW), data=False)
    with pytest.raises(InvalidArgument, match="out of range"):
        kvcacheio.transfer_kv_per_layer_mla(src, dst, m.pinned_indices([0, 100]), m.indices([0, 1]), ITEM)
        rt.synchronize(0)
    assert poisoned(dst)


def test_pinned_indices_through_pointer_tables_are_bounds_checked(rt):
    """The same promise for the all-layer (table) functions: with pinned CPU indices, an index far past the end of
    the registered host buffer a table entry points into is not checked at all (Side.check_bounds returns early for
    tables), so the call returns and the kernel faults with IllegalAddress. kvtier resolves every table entry
    through its resolver and knows the span of the buffer each entry lies in. Expected: InvalidArgument before the
    launch, nothing copied."""
    m = Mem(rt)
    dev_layers = [m.device((TOKENS, ROW)) for _ in range(2)]
    host = m.host((2, TOKENS, ROW), data=False)
    with pytest.raises(InvalidArgument, match="out of range"):
        kvcacheio.transfer_kv_all_layer_mla(m.table(dev_layers), m.table([host[0], host[1]]), m.pinned_indices([0, 1]),
                                            m.pinned_indices([0, 10**6]), ITEM, 2)
        rt.synchronize(0)
    assert poisoned(host)


def test_an_index_whose_byte_offset_overflows_int64_is_not_let_through(rt):
    """check_bounds computes index * stride in numpy int64, which wraps silently: pinned index 2**59 + 1 with a
    32-byte item reaches byte 2**64 + 32, seen as byte 32, so the bounds check passes and the kernel faults here
    (on a GPU, 64-bit wrap-around would read token 1 instead). Expected: InvalidArgument (out of range)."""
    m = Mem(rt)
    src, dst = m.host((TOKENS, ROW)), m.device((TOKENS, ROW), data=False)
    with pytest.raises(InvalidArgument, match="out of range"):
        kvcacheio.transfer_kv_per_layer_mla(src, dst, m.pinned_indices([0, 2**59 + 1]), m.pinned_indices([0, 1]), ITEM)
        rt.synchronize(0)
    assert poisoned(dst)


def test_a_layout_dim_too_large_for_int64_is_refused_by_kvtier(rt):
    """src_layout_dim = 2**64 with pinned indices crashes with a bare OverflowError ("Python int too large to
    convert to C long") from numpy inside check_bounds. Expected: a KvtierError (InvalidArgument) naming the
    argument."""
    m = Mem(rt)
    src, dst = m.host((TOKENS, 2, ROW)), m.device((TOKENS, ROW), data=False)
    with pytest.raises(KvtierError):
        kvcacheio.transfer_kv_per_layer_mla_pf_lf(src, dst, m.pinned_indices([0, 4]), m.pinned_indices([0, 1]), 0, ITEM,
                                                  2**64)


# -- operand layout ----------------------------------------------------------------------------------------------
def test_a_non_contiguous_operand_is_not_silently_misread(rt):
    """A strided view (every other token row of a pinned buffer) is accepted as a layer-first operand, but the
    kernel reads token i at data_ptr + i * item_size, i.e. from the rows the view skips: wrong bytes, no error.
    Index tensors are refused when non-contiguous, operands are not. Expected: InvalidArgument, or the right
    bytes."""
    m = Mem(rt)
    backing = m.host((TOKENS, 2, ROW))
    src = backing[:, 0]                      # shape (8, 16), stride (32, 1): not contiguous
    dst = m.device((TOKENS, ROW), data=False)
    try:
        kvcacheio.transfer_kv_per_layer_mla(src, dst, m.indices([0, 1, 2, 3]), m.indices([0, 1, 2, 3]), ITEM)
    except InvalidArgument:
        assert poisoned(dst)
        return
    got = dst.cpu()
    assert torch.equal(got[:4], src[:4]), "tokens 1..3 were read from the rows the strided view skips"
    assert poisoned(got[4:])


# -- *_direct: refusals must come before any copy ----------------------------------------------------------------
def test_direct_refuses_a_pageable_layer_before_copying_the_others(rt):
    """docs: "a pageable or foreign-device address is refused by name before anything is copied". transfer_kv_direct
    resolves and queues layer by layer, so with src_layers[2] pageable it raises NotDeviceAccessible only after
    layers 0 and 1 were already copied into their destinations. Expected: the error, and every destination
    untouched."""
    m = Mem(rt)
    src = [m.host((TOKENS, ROW)), m.host((TOKENS, ROW)), torch.zeros((TOKENS, ROW), dtype=torch.int16)]
    dst = [m.device((TOKENS, ROW), data=False) for _ in range(3)]
    with pytest.raises(NotDeviceAccessible, match=r"src_layers\[2\]"):
        kvcacheio.transfer_kv_direct(src, dst, m.indices([0, 1]), m.indices([0, 1]), 1)
    assert [poisoned(d) for d in dst] == [True, True, True]


def test_direct_refuses_an_out_of_range_layer_before_copying_the_others(rt):
    """Same for bounds: dst_layers[2] is shorter than the others, the index is out of range for it only, and
    InvalidArgument is raised after layers 0 and 1 were copied. Expected: nothing copied."""
    m = Mem(rt)
    src = [m.host((TOKENS, ROW)) for _ in range(3)]
    dst = [m.device((TOKENS, ROW), data=False), m.device((TOKENS, ROW), data=False), m.device((2, ROW), data=False)]
    with pytest.raises(InvalidArgument):
        kvcacheio.transfer_kv_direct(src, dst, m.indices([4, 5]), m.indices([4, 5]), 1)
    assert [poisoned(d) for d in dst] == [True, True, True]


def test_direct_lf_pf_refuses_a_pageable_v_host_before_copying_k(rt):
    """transfer_kv_all_layer_direct_lf_pf with a pinned K host tensor and a pageable V host tensor: K's pages are
    copied, then NotDeviceAccessible is raised for dst_ptrs[1]. Expected: the error and K's host tensor untouched."""
    m = Mem(rt)
    layers = [m.device((TOKENS, ROW)) for _ in range(4)]                 # K's 2 layers, then V's
    k_host = m.host((4, 2, 2, ROW), data=False)
    v_host = torch.full((4, 2, 2, ROW), POISON, dtype=torch.int16)    # pageable
    with pytest.raises(NotDeviceAccessible, match=r"dst_ptrs\[1\]"):
        kvcacheio.transfer_kv_all_layer_direct_lf_pf(layers, [k_host, v_host], m.indices([0, 1]), m.indices([2, 3]), 2)
    assert poisoned(k_host)


def test_direct_pf_lf_checks_every_host_tensor_before_copying(rt):
    """transfer_kv_per_layer_direct_pf_lf with a V host tensor holding fewer layers than K's: K's pages are copied,
    then InvalidArgument ("layers [2, 3) exceed the 2 of src_ptrs[1]"). Expected: nothing copied."""
    m = Mem(rt)
    pf = [m.host((4, 3, 2, ROW)), m.host((4, 2, 2, ROW))]
    lf = [m.device((TOKENS, ROW), data=False) for _ in range(2)]
    with pytest.raises(InvalidArgument):
        kvcacheio.transfer_kv_per_layer_direct_pf_lf(pf, lf, m.indices([2, 3]), m.indices([0, 1]), 2, 2)
    assert [poisoned(x) for x in lf] == [True, True]


def test_direct_names_a_layer_on_another_device(rt):
    """A dst layer on device 1 (indices and the other layers on device 0) is reported as "the index tensors are on
    different devices ([0, 1])": the index tensors are both on device 0 (direct.py passes the layer lists to
    call_for as the indices). Expected: WrongDeviceError naming dst_layers[1], as for every other operand."""
    m = Mem(rt)
    src = [m.host((TOKENS, ROW)) for _ in range(2)]
    dst = [m.device((TOKENS, ROW), data=False), m.device((TOKENS, ROW), data=False, device=1)]
    with pytest.raises(WrongDeviceError, match=r"dst_layers\[1\]"):
        kvcacheio.transfer_kv_direct(src, dst, m.indices([0, 1]), m.indices([0, 1]), 1)


# -- raw uint64 tables: the per-version cache --------------------------------------------------------------------
def test_two_table_views_with_one_data_ptr_are_not_confused(rt):
    """The resolved-table cache is keyed on (device, data_ptr, numel, device, _version). Two views of one uint64
    tensor, base[0:2] = [A0, B0] and base[::2] = [A0, A1], share data_ptr, numel and version counter but hold
    different entries: the second call reuses the first view's entries and writes layer 1 into B0 instead of A1.
    Expected: each table's own entries (A1 written, B0 untouched)."""
    m = Mem(rt)
    src = [m.device((TOKENS, ROW)) for _ in range(2)]
    a = [m.device((TOKENS, ROW), data=False) for _ in range(2)]
    b = [m.device((TOKENS, ROW), data=False) for _ in range(2)]
    base = torch.tensor([a[0].data_ptr(), b[0].data_ptr(), a[1].data_ptr(), b[1].data_ptr()], dtype=torch.uint64)
    kvcacheio.transfer_kv_all_layer_mla(m.table(src), base[0:2], m.indices([0]), m.indices([0]), ITEM, 2)
    kvcacheio.transfer_kv_all_layer_mla(m.table(src), base[::2], m.indices([1]), m.indices([1]), ITEM, 2)
    assert torch.equal(a[1].cpu()[1], src[1].cpu()[1]), "layer 1 of the [A0, A1] table was not written to A1"
    assert poisoned(b[0].cpu()[1:]), "B0 (not in the second table) was written"


def test_a_table_rebuilt_at_a_freed_tables_address_is_read_again(rt):
    """docs: "Change a table in place with torch ops, or build a new one". A new table tensor that torch's
    allocator places at the address of a freed one (same numel, version 0) hits the old cache entry, and the copy
    goes to the freed table's layers. A loop that builds a fresh table per call (new host buffers each time) shows
    it within a few iterations. Expected: every call copies into the layers of the table it was given."""
    m = Mem(rt)
    layers = 3
    seen, reused = set(), False
    for _ in range(40):
        src = [m.device((TOKENS, ROW)) for _ in range(layers)]
        host = m.host((layers, TOKENS, ROW), data=False)
        table = torch.tensor([host[layer].data_ptr() for layer in range(layers)], dtype=torch.uint64)
        reused |= table.data_ptr() in seen
        seen.add(table.data_ptr())
        kvcacheio.transfer_kv_all_layer_mla(m.table(src), table, m.indices(list(range(TOKENS))),
                                            m.indices(list(range(TOKENS))), ITEM, layers)
        for layer in range(layers):
            assert torch.equal(host[layer], src[layer].cpu()), f"reused table address: {reused}"
        del table
        gc.collect()
    if not reused:
        pytest.skip("torch never reused a table address here")


def test_a_table_made_under_inference_mode_is_accepted(rt):
    """A uint64 table created inside torch.inference_mode() (where serving engines build things) is an inference
    tensor without a version counter: table_entries reads table._version and crashes with torch's RuntimeError
    "Inference tensors do not track version counter". Expected: the copy works (read the table every call, or key
    it differently)."""
    m = Mem(rt)
    src = [m.device((TOKENS, ROW)) for _ in range(2)]
    dst = [m.device((TOKENS, ROW), data=False) for _ in range(2)]
    with torch.inference_mode():
        table = torch.tensor([d.data_ptr() for d in dst], dtype=torch.uint64)
    kvcacheio.transfer_kv_all_layer_mla(m.table(src), table, m.indices([0]), m.indices([0]), ITEM, 2)
    assert torch.equal(dst[1].cpu()[0], src[1].cpu()[0])


def _host_layers(m, layers):
    buffers = [HostBuffer.allocate(TOKENS * ITEM, HostKind.PINNED, runtime=m.runtime) for _ in range(layers)]
    tensors = [b.as_tensor(torch.int16).view(TOKENS, ROW) for b in buffers]
    for t in tensors:
        t.fill_(POISON)
    return buffers, tensors


def _used_table(m, rt):
    """Two device layers and a raw CPU table of two pinned host layers, used once (resolved and cached)."""
    src = [m.device((TOKENS, ROW)) for _ in range(2)]
    buffers, tensors = _host_layers(m, 2)
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)
    kvcacheio.transfer_kv_all_layer_mla(m.table(src), table, m.indices([0]), m.indices([0]), ITEM, 2)
    rt.synchronize(0)
    return src, buffers, tensors, table


def test_a_closed_host_buffer_in_an_unchanged_table_is_refused_by_name(rt):
    """A CPU table of pinned host layers is used once (resolved and cached), then the host buffers are closed.
    The next call with the same, unchanged table reuses the cached aliases of unregistered memory and the kernel
    faults (IllegalAddress; in split mode the stale alias, in unified mode the unmapped CPU address). Expected: the
    refusal the docs promise for memory the device cannot reach, NotDeviceAccessible naming dst_layers[0], before
    anything is launched."""
    m = Mem(rt)
    src, buffers, tensors, table = _used_table(m, rt)
    del tensors
    for b in buffers:
        b.close()
    with pytest.raises(NotDeviceAccessible, match=r"dst_layers\[0\]"):
        kvcacheio.transfer_kv_all_layer_mla(m.table(src), table, m.indices([0]), m.indices([0]), ITEM, 2)
        rt.synchronize(0)


def test_host_buffers_reallocated_at_the_same_address_are_resolved_again():
    """Split mode: host layers are closed and new pinned buffers land at the same CPU addresses, so the unchanged
    table again names valid, registered memory. The cache still holds the old device aliases, and the call faults
    (IllegalAddress) instead of writing the new buffers (unified mode works only because alias == CPU address).
    Expected: the copy lands in the new buffers."""
    rt = create("emulated:split")
    m = Mem(rt)
    src, buffers, tensors, table = _used_table(m, rt)
    old = [t.data_ptr() for t in tensors]
    del tensors
    for b in buffers:
        b.close()
    buffers, tensors = _host_layers(m, 2)
    m.keep += buffers
    if [t.data_ptr() for t in tensors] != old:
        pytest.skip("the new host buffers did not land at the old addresses")
    kvcacheio.transfer_kv_all_layer_mla(m.table(src), table, m.indices([1]), m.indices([1]), ITEM, 2)
    rt.synchronize(0)
    for layer in range(2):
        assert torch.equal(tensors[layer][1], src[layer].cpu()[1])


# -- DeviceArray -------------------------------------------------------------------------------------------------
def test_device_array_from_a_zero_dim_tensor(rt):
    """DeviceArray.from_tensor(torch.tensor(5)) crashes inside copy_ with torch's RuntimeError ("self.dim() cannot
    be 0 to view Long as Byte"). Expected: a 0-d DeviceArray holding 5 (or a kvtier InvalidArgument)."""
    try:
        array = DeviceArray.from_tensor(torch.tensor(5), runtime=rt)
    except KvtierError:
        return
    assert array.cpu().item() == 5
