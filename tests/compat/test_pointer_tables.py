"""Raw ``uint64`` pointer tables (SGLang's all-layer calls) are read on every call and each entry resolved and bounded
anew: views sharing a ``data_ptr``, a table rebuilt at a freed table's address, tables made under inference mode or
rewritten through ``.data``, host buffers closed or reallocated under an unchanged table, entries into host buffers
registered in chunks. kvtier's own kernel tables, cached per runtime, live as long as a call about to launch with
them. Destinations are poisoned and checked byte for byte."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers.compat import Operands, byte_operands
from helpers.operands import MODES, POISON, all_poison, device

import kvtier.compat.operands as operands
from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument, NotDeviceAccessible, RegistrationError
from kvtier.memory import HostBuffer, HostKind
from kvtier.runtime import create


def test_two_table_views_with_one_data_ptr_are_not_confused(rt):
    """The resolved-table cache is keyed on (device, data_ptr, numel, device, _version). Two views of one uint64
    tensor, base[0:2] = [A0, B0] and base[::2] = [A0, A1], share data_ptr, numel and version counter but hold
    different entries: the second call reuses the first view's entries and writes layer 1 into B0 instead of A1.
    Expected: each table's own entries (A1 written, B0 untouched). (found adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row, item = 8, 16, 32        # int16 elements of a token; item_size: bytes of one token of one layer
    src = [m.device((tokens, row)) for _ in range(2)]
    a = [m.device((tokens, row), data=False) for _ in range(2)]
    b = [m.device((tokens, row), data=False) for _ in range(2)]
    base = torch.tensor([a[0].data_ptr(), b[0].data_ptr(), a[1].data_ptr(), b[1].data_ptr()], dtype=torch.uint64)
    io.transfer_kv_all_layer_mla(m.table(src), base[0:2], m.indices([0]), m.indices([0]), item, 2)
    io.transfer_kv_all_layer_mla(m.table(src), base[::2], m.indices([1]), m.indices([1]), item, 2)
    assert torch.equal(a[1].cpu()[1], src[1].cpu()[1]), "layer 1 of the [A0, A1] table was not written to A1"
    assert m.poisoned(b[0].cpu()[1:]), "B0 (not in the second table) was written"


@pytest.mark.slow
def test_a_table_rebuilt_at_a_freed_tables_address_is_read_again(rt):
    """docs: "Change a table in place with torch ops, or build a new one". A new table tensor that torch's
    allocator places at the address of a freed one (same numel, version 0) hits the old cache entry, and the copy
    goes to the freed table's layers. A loop that builds a fresh table per call (new host buffers each time) shows
    it within a few iterations. Expected: every call copies into the layers of the table it was given.
    (found adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row, item = 8, 16, 32        # int16 elements of a token; item_size: bytes of one token of one layer
    layers = 3
    seen, reused = set(), False
    for _ in range(40):
        src = [m.device((tokens, row)) for _ in range(layers)]
        host = m.host((layers, tokens, row), data=False)
        table = torch.tensor([host[layer].data_ptr() for layer in range(layers)], dtype=torch.uint64)
        reused |= table.data_ptr() in seen
        seen.add(table.data_ptr())
        io.transfer_kv_all_layer_mla(m.table(src), table, m.indices(list(range(tokens))),
                                     m.indices(list(range(tokens))), item, layers)
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
    it differently). (found adversarially, issue #15)"""
    m = Operands(rt)
    tokens, row, item = 8, 16, 32        # int16 elements of a token; item_size: bytes of one token of one layer
    src = [m.device((tokens, row)) for _ in range(2)]
    dst = [m.device((tokens, row), data=False) for _ in range(2)]
    with torch.inference_mode():
        table = torch.tensor([d.data_ptr() for d in dst], dtype=torch.uint64)
    io.transfer_kv_all_layer_mla(m.table(src), table, m.indices([0]), m.indices([0]), item, 2)
    assert torch.equal(dst[1].cpu()[0], src[1].cpu()[0])


@pytest.mark.parametrize("spec", MODES)
def test_a_cpu_table_rewritten_through_data_is_read_again(spec):
    """A CPU uint64 pointer table changed in place with a torch op (``table.data[1] = ...``) keeps the same tensor
    object and torch version (``.data`` has its own version counter), so ``table_entries`` returns the values read on
    the first call: layer 1 was copied from the OLD source tensor (stale KV; pre-existing, it failed the same way at
    1abeb26). A CPU table is now read on every call, so the copy comes from the new source.
    (found adversarially, issue #15)"""
    rt = create(spec)
    N, D, L = 16, 16, 2
    srcs = [device(rt, (N, D)) for _ in range(L)]
    other = device(rt, (N, D))
    dsts = [device(rt, (N, D), data=False) for _ in range(L)]
    src_table = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.uint64)
    dst_table = torch.tensor([t.data_ptr() for t in dsts], dtype=torch.uint64)
    si, di = torch.tensor([1, 4, 9]), torch.tensor([0, 5, 15])
    sit, dit = DeviceArray.from_tensor(si, runtime=rt), DeviceArray.from_tensor(di, runtime=rt)
    io.transfer_kv_all_layer_mla(src_table, dst_table, sit, dit, D, L)
    rt.synchronize(0)
    src_table.data[1] = other.data_ptr()          # a torch in-place op on the table
    for t in dsts:
        t.copy_(torch.full((N, D), POISON, dtype=torch.uint8))
    io.transfer_kv_all_layer_mla(src_table, dst_table, sit, dit, D, L)
    rt.synchronize(0)
    for layer, source in enumerate([srcs[0], other]):
        expected = torch.full((N, D), POISON, dtype=torch.uint8)
        expected[di] = source.cpu()[si]
        assert torch.equal(dsts[layer].cpu(), expected), f"layer {layer} copied from a stale table entry"


@pytest.mark.parametrize("spec", MODES)
def test_a_cpu_table_rewritten_through_data_to_pageable_memory_is_refused(spec):
    """Same kept table values: after ``table.data[0] = <pageable CPU address>`` the stale entry (the old, valid
    device array) was used and the copy went into memory the caller no longer names. Now refused with
    NotDeviceAccessible naming ``dst_layers[0]``. (found adversarially, issue #15)"""
    rt = create(spec)
    N, D = 16, 16
    src = device(rt, (N, D))
    dst = device(rt, (N, D), data=False)
    pageable = torch.full((N, D), POISON, dtype=torch.uint8)
    src_table = torch.tensor([src.data_ptr()], dtype=torch.uint64)
    dst_table = torch.tensor([dst.data_ptr()], dtype=torch.uint64)
    sit = DeviceArray.from_tensor(torch.tensor([1, 2]), runtime=rt)
    dit = DeviceArray.from_tensor(torch.tensor([3, 4]), runtime=rt)
    io.transfer_kv_all_layer_mla(src_table, dst_table, sit, dit, D, 1)
    rt.synchronize(0)
    dst_table.data[0] = pageable.data_ptr()
    with pytest.raises(NotDeviceAccessible, match=r"dst_layers\[0\]"):
        io.transfer_kv_all_layer_mla(src_table, dst_table, sit, dit, D, 1)


def _host_layers(m, layers, tokens=8, row=16):
    """``layers`` pinned host buffers, each viewed as ``tokens`` rows of ``row`` int16 elements holding the poison."""
    buffers = [HostBuffer.allocate(tokens * row * 2, HostKind.PINNED, runtime=m.runtime) for _ in range(layers)]
    tensors = [b.as_tensor(torch.int16).view(tokens, row) for b in buffers]
    for t in tensors:
        t.fill_(m.poison)
    return buffers, tensors


def _used_table(m, rt, tokens=8, row=16):
    """Two device layers and a raw CPU table of two pinned host layers, used once (resolved and cached)."""
    src = [m.device((tokens, row)) for _ in range(2)]
    buffers, tensors = _host_layers(m, 2, tokens, row)
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)
    io.transfer_kv_all_layer_mla(m.table(src), table, m.indices([0]), m.indices([0]), row * 2, 2)
    rt.synchronize(0)
    return src, buffers, tensors, table


def test_a_closed_host_buffer_in_an_unchanged_table_is_refused_by_name(rt):
    """A CPU table of pinned host layers is used once (resolved and cached), then the host buffers are closed.
    The next call with the same, unchanged table reuses the cached aliases of unregistered memory and the kernel
    faults (IllegalAddress; in split mode the stale alias, in unified mode the unmapped CPU address). Expected: the
    refusal the docs promise for memory the device cannot reach, NotDeviceAccessible naming dst_layers[0], before
    anything is launched. (found adversarially, issue #15)"""
    m = Operands(rt)
    item = 32
    src, buffers, tensors, table = _used_table(m, rt)
    del tensors
    for b in buffers:
        b.close()
    with pytest.raises(NotDeviceAccessible, match=r"dst_layers\[0\]"):
        io.transfer_kv_all_layer_mla(m.table(src), table, m.indices([0]), m.indices([0]), item, 2)
        rt.synchronize(0)


def test_host_buffers_reallocated_at_the_same_address_are_resolved_again():
    """Split mode: host layers are closed and new pinned buffers land at the same CPU addresses, so the unchanged
    table again names valid, registered memory. The cache still holds the old device aliases, and the call faults
    (IllegalAddress) instead of writing the new buffers (unified mode works only because alias == CPU address).
    Expected: the copy lands in the new buffers. (found adversarially, issue #15)"""
    rt = create("emulated:split")
    m = Operands(rt)
    item = 32
    src, buffers, tensors, table = _used_table(m, rt)
    old = [t.data_ptr() for t in tensors]
    del tensors
    for b in buffers:
        b.close()
    buffers, tensors = _host_layers(m, 2)
    m.keep += buffers
    if [t.data_ptr() for t in tensors] != old:
        pytest.skip("the new host buffers did not land at the old addresses")
    io.transfer_kv_all_layer_mla(m.table(src), table, m.indices([1]), m.indices([1]), item, 2)
    rt.synchronize(0)
    for layer in range(2):
        assert torch.equal(tensors[layer][1], src[layer].cpu()[1])


def test_a_table_entry_in_a_multi_chunk_host_buffer_is_not_misaddressed():
    """Split mode, a 'registered' HostBuffer of 8 tokens registered in two chunks of 4 (register_chunk_bytes), whose
    device aliases are not contiguous. Used as a layer through a uint64 table with device-resident indices, the
    entry is resolved to the alias of the first chunk and the kernel adds token 5's offset to it: IllegalAddress,
    device poisoned. The tensor path refuses the same memory by name (RegistrationError: 'spans two registration
    chunks whose aliases ... are not contiguous') and the kernel engine refuses such a pool. docs/sglang.md:
    'Alias-correct on every platform ... Host memory registered by anyone works: ... kvtier's HostBuffer'.
    Expected: the copy lands right, or it is refused by name before the launch; never a device fault.
    (found adversarially, issue #15)"""
    runtime = create("emulated:split")
    m = byte_operands(runtime)
    tokens = 8
    page = 4096
    buffer = HostBuffer.allocate(tokens * page, HostKind.REGISTERED, runtime=runtime, granularity=page,
                                 register_chunk_bytes=4 * page)
    m.keep.append(buffer)
    host = buffer.as_tensor(torch.uint8).view(tokens, page)
    host.fill_(POISON)
    src = m.device((tokens, page))
    table = torch.tensor([host.data_ptr()], dtype=torch.uint64)
    try:
        io.transfer_kv_all_layer_mla(m.table([src]), table, m.indices([0, 1, 2]), m.indices([0, 5, 7]), page, 1)
    except (InvalidArgument, NotDeviceAccessible, RegistrationError):
        assert all_poison(host)
        return
    runtime.synchronize(0)
    got = src.cpu()
    for s, d in ((0, 0), (1, 5), (2, 7)):
        assert torch.equal(host[d], got[s])


def test_an_evicted_kernel_table_is_not_closed_under_a_call_about_to_launch_with_it(monkeypatch):
    """pointer_table() hands a cached kernel table to a call, then releases the lock; the launch comes later. If
    another thread's call adds a table meanwhile and the cache is full (4,096 per runtime), the first call's table is
    evicted and closed, and the first call's launch raises BufferClosed ('<DeviceBuffer 8 bytes ...> is closed',
    naming no operand) — seen with 4 threads calling per-layer functions on fresh tensors. Reproduced here
    deterministically with a cache of 1 table and the other thread's call run between the first call's table
    lookup and its launch (now inside the preparation of a's first call: a later call binds its indices to a kept
    plan, which holds its tables). Expected: both calls copy their bytes; no exception.
    (found adversarially, issue #15)"""
    runtime = create("emulated:split")
    m = byte_operands(runtime)
    tokens, item = 8, 16
    monkeypatch.setattr(operands, "TABLES_KEPT", 1)
    a_src, a_dst = m.device((tokens, item)), m.device((tokens, item), data=False)
    b_src, b_dst = m.device((tokens, item)), m.device((tokens, item), data=False)
    launcher = operands._per_runtime(runtime).launcher
    real = launcher.prepare
    interleaved = []

    def prepare(*args, **kwargs):
        if not interleaved:         # another thread's call, between this call's table lookup and its launch
            interleaved.append(True)
            io.transfer_kv_per_layer_mla(b_src, b_dst, m.indices([2]), m.indices([3]), item)
        return real(*args, **kwargs)

    monkeypatch.setattr(launcher, "prepare", prepare)
    io.transfer_kv_per_layer_mla(a_src, a_dst, m.indices([1]), m.indices([4]), item)
    runtime.synchronize(0)
    assert torch.equal(a_dst.cpu()[4], a_src.cpu()[1])
    assert torch.equal(b_dst.cpu()[3], b_src.cpu()[2])
