"""Adversarial tests for kvtier.compat.sglang.kvcacheio (issue 15, second round).

Each test fails against the code it was written for; its docstring says what is wrong and what is expected.
Every test makes its own emulated runtime (a fault poisons a runtime, as a CUDA context).
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from helpers.compat import all_poison
from helpers.compat import byte_operands as Mem

import kvtier.compat.operands as operands
from kvtier.compat.sglang import kvcacheio
from kvtier.errors import (
    BufferInUse,
    InvalidArgument,
    NotDeviceAccessible,
    RegistrationError,
)
from kvtier.memory import HostBuffer, HostKind
from kvtier.runtime import create

POISON = 0x5A
TOKENS, ITEM = 8, 16         # tokens of a tensor, bytes of one token of one layer (uint8 elements)


# -- *_direct: byte offsets overflow int64 -----------------------------------------------------------------------
def test_direct_an_index_whose_byte_offset_overflows_int64_is_refused(rt):
    """transfer_kv_direct computes each run's byte offset as index * row in int64 numpy arithmetic without a bound:
    src index 2**60 with 16-byte rows is 2**64 bytes, which wraps to 0, passes the extent check and copies token 0
    into dst token 1 without a word. (2**60 + 3 copies token 3; 2**59 wraps negative and is refused only by
    memcpy_runs_async, without naming the operand.) The kernel functions were fixed for this (round 1, LIMIT);
    the direct ones were not. Expected: InvalidArgument naming the index / operand, nothing copied."""
    m = Mem(rt)
    src, dst = [m.device((TOKENS, ITEM))], [m.host((TOKENS, ITEM), data=False)]
    with pytest.raises(InvalidArgument):
        kvcacheio.transfer_kv_direct(src, dst, m.pinned_indices([2 ** 60]), m.pinned_indices([1]), 1)
    rt.synchronize(0)
    assert all_poison(dst[0]), "an out-of-range index silently copied a token"


def test_direct_lf_pf_a_page_whose_byte_offset_overflows_int64_is_refused(rt):
    """transfer_kv_all_layer_direct_lf_pf: destination token 2**62 is page 2**60 of a page_first_direct host whose
    pages are 64 bytes; 2**60 * 64 wraps to 0 in int64, passes the extent check, and page 0 of the host is
    overwritten. Expected: InvalidArgument, the host tensor untouched."""
    m = Mem(rt)
    layer = [m.device((TOKENS, ITEM))]
    host = m.host((2, 1, 4, ITEM), data=False)          # [pages, layers, page_size, item]
    with pytest.raises(InvalidArgument):
        kvcacheio.transfer_kv_all_layer_direct_lf_pf(layer, [host], m.pinned_indices([0, 1, 2, 3]),
                                                     m.pinned_indices([2 ** 62 + i for i in range(4)]), 4)
    rt.synchronize(0)
    assert all_poison(host), "an out-of-range page silently overwrote host page 0"


# -- lifetime: a host buffer closed under queued compat work -------------------------------------------------------
@pytest.mark.parametrize("mode", ["emulated:split:2:lazy", "emulated:unified:2:lazy"])
def test_closing_a_registered_host_buffer_does_not_unmap_it_under_a_queued_compat_copy(mode):
    """A compat call queues a kernel writing into a view of a 'registered' HostBuffer (kvtier's default kind); the
    caller drops its view and closes the buffer. close() waits for its engine users, but the compat call never
    registered as one, so close() unregisters the memory at once and the still-queued kernel faults
    (IllegalAddress: 'not mapped on this device'; the device is poisoned). A 'pinned' buffer is fine only because
    cudaFreeHost drains the device. Expected: close() waits for the queued compat work (or refuses with
    BufferInUse); the device never faults."""
    runtime = create(mode)
    m = Mem(runtime)
    src = m.device((TOKENS, ITEM))
    buffer = HostBuffer.allocate(TOKENS * ITEM, HostKind.REGISTERED, runtime=runtime)
    view = buffer.as_tensor(torch.uint8).view(TOKENS, ITEM)
    view.fill_(POISON)
    kvcacheio.transfer_kv_per_layer_mla(src, view, m.indices(list(range(TOKENS))), m.indices(list(range(TOKENS))), ITEM)
    del view
    gc.collect()
    with contextlib.suppress(BufferInUse):
        buffer.close()
    runtime.synchronize(0)          # faults: the kernel ran on memory close() had already unregistered


# -- a table entry in a host buffer registered in several chunks ------------------------------------------------
def test_a_table_entry_in_a_multi_chunk_host_buffer_is_not_misaddressed():
    """Split mode, a 'registered' HostBuffer of 8 tokens registered in two chunks of 4 (register_chunk_bytes), whose
    device aliases are not contiguous. Used as a layer through a uint64 table with device-resident indices, the
    entry is resolved to the alias of the first chunk and the kernel adds token 5's offset to it: IllegalAddress,
    device poisoned. The tensor path refuses the same memory by name (RegistrationError: 'spans two registration
    chunks whose aliases ... are not contiguous') and the kernel engine refuses such a pool. docs/sglang.md:
    'Alias-correct on every platform ... Host memory registered by anyone works: ... kvtier's HostBuffer'.
    Expected: the copy lands right, or it is refused by name before the launch; never a device fault."""
    runtime = create("emulated:split")
    m = Mem(runtime)
    page = 4096
    buffer = HostBuffer.allocate(TOKENS * page, HostKind.REGISTERED, runtime=runtime, granularity=page,
                                 register_chunk_bytes=4 * page)
    m.keep.append(buffer)
    host = buffer.as_tensor(torch.uint8).view(TOKENS, page)
    host.fill_(POISON)
    src = m.device((TOKENS, page))
    table = torch.tensor([host.data_ptr()], dtype=torch.uint64)
    try:
        kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.indices([0, 1, 2]), m.indices([0, 5, 7]), page, 1)
    except (InvalidArgument, NotDeviceAccessible, RegistrationError):
        assert all_poison(host)
        return
    runtime.synchronize(0)
    got = src.cpu()
    for s, d in ((0, 0), (1, 5), (2, 7)):
        assert torch.equal(host[d], got[s])


# -- kernel pointer tables: eviction under a call -----------------------------------------------------------------
def test_an_evicted_kernel_table_is_not_closed_under_a_call_about_to_launch_with_it(monkeypatch):
    """pointer_table() hands a cached kernel table to a call, then releases the lock; the launch comes later. If
    another thread's call adds a table meanwhile and the cache is full (4,096 per runtime), the first call's table is
    evicted and closed, and the first call's launch raises BufferClosed ('<DeviceBuffer 8 bytes ...> is closed',
    naming no operand) — seen with 4 threads calling per-layer functions on fresh tensors. Reproduced here
    deterministically with a cache of 1 table and the other thread's call run between the first call's table
    lookup and its launch (now inside the preparation of a's first call: a later call binds its indices to a kept
    plan, which holds its tables). Expected: both calls copy their bytes; no exception."""
    runtime = create("emulated:split")
    m = Mem(runtime)
    monkeypatch.setattr(operands, "TABLES_KEPT", 1)
    a_src, a_dst = m.device((TOKENS, ITEM)), m.device((TOKENS, ITEM), data=False)
    b_src, b_dst = m.device((TOKENS, ITEM)), m.device((TOKENS, ITEM), data=False)
    launcher = operands._per_runtime(runtime).launcher
    real = launcher.prepare
    interleaved = []

    def prepare(*args, **kwargs):
        if not interleaved:         # another thread's call, between this call's table lookup and its launch
            interleaved.append(True)
            kvcacheio.transfer_kv_per_layer_mla(b_src, b_dst, m.indices([2]), m.indices([3]), ITEM)
        return real(*args, **kwargs)

    monkeypatch.setattr(launcher, "prepare", prepare)
    kvcacheio.transfer_kv_per_layer_mla(a_src, a_dst, m.indices([1]), m.indices([4]), ITEM)
    runtime.synchronize(0)
    assert torch.equal(a_dst.cpu()[4], a_src.cpu()[1])
    assert torch.equal(b_dst.cpu()[3], b_src.cpu()[2])


# -- error classes --------------------------------------------------------------------------------------------------
def test_too_many_warps_per_block_is_an_invalid_argument_naming_it(rt):
    """num_warps_per_block=33 (1,056 threads; docs/sglang.md: 'up to 32') raises a bare KvtierError from the launcher
    ('launch of 2 blocks x 1056 threads: this launcher needs ...'), which is not a ValueError and does not name the
    argument, while block_quota=0 raises InvalidArgument naming block_quota. docs/sglang.md: bad sizes raise
    InvalidArgument, also a ValueError. Expected: InvalidArgument mentioning num_warps_per_block."""
    m = Mem(rt)
    with pytest.raises(InvalidArgument, match="num_warps_per_block"):
        kvcacheio.transfer_kv_per_layer_mla(m.device((TOKENS, ITEM)), m.device((TOKENS, ITEM), data=False),
                                            m.indices([1]), m.indices([2]), ITEM, 2, 33)
