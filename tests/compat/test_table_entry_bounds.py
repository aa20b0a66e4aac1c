"""A raw pointer-table entry into host memory is bounded by the registration it lies in now: indices that run past
it into a touching, separate registration (or into a chunk given back with unregister_chunks, or past a chunk on
split aliases) are refused by name with nothing written, and indices that stay inside it land. (Found
adversarially, issue #15.)
"""

from __future__ import annotations

import pytest
import torch
from helpers.compat import BYTE_ITEM, OS_PAGE
from helpers.compat import byte_operands as Mem
from helpers.operands import POISON, all_poison

from kvtier.compat.sglang import kvcacheio
from kvtier.errors import InvalidArgument
from kvtier.memory import HostBuffer, register_chunks, unregister_chunks
from kvtier.runtime import create


def _partly_given_back(runtime):
    """A pageable buffer of 2 pages registered as one registration of two chunks, whose second chunk is then given
    back with unregister_chunks (the first stays registered)."""
    buffer = HostBuffer.allocate(2 * OS_PAGE, "pageable", runtime=runtime)
    base = buffer.cpu_address.value
    chunks = register_chunks(runtime, base, 2 * OS_PAGE, chunk_bytes=OS_PAGE)
    assert len(chunks) == 2
    first, second = [chunks[0]], [chunks[1]]
    unregister_chunks(runtime, second)
    return buffer, base, first


def test_a_table_entry_in_a_partly_unregistered_registration_cannot_run_into_a_new_neighbour():
    """Unified addressing. Registration A (two chunks, [base, +2 pages)) has its second chunk given back with
    unregister_chunks, and a separate registration B is made in its place. A table entry at the last item of A's
    first chunk with pinned CPU dst indices [0, 1]: index 1 runs into B, another registration. unregister_chunks
    drops the span record only for the chunks it was given, so A's first chunk still claims the whole old span,
    table_room walks on into B (its aliases continue in unified addressing) and the kernel writes a token into B.
    A fresh registration touching another is refused the same way (its own span), so this is a stale record.
    Expected: InvalidArgument (index out of range of dst_layers[0]), B untouched."""
    runtime = create("emulated:unified")
    m = Mem(runtime)
    buffer, base, first = _partly_given_back(runtime)
    m.keep.append(buffer)
    neighbour = register_chunks(runtime, base + OS_PAGE, OS_PAGE)
    host = buffer.as_tensor(torch.uint8)
    host.fill_(POISON)
    src = m.device((8, BYTE_ITEM))
    table = torch.tensor([base + OS_PAGE - BYTE_ITEM], dtype=torch.uint64)
    try:
        with pytest.raises(InvalidArgument):
            kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.pinned_indices([0, 1]),
                                                m.pinned_indices([0, 1]), BYTE_ITEM, 1)
        runtime.synchronize(0)
        assert all_poison(host[OS_PAGE:]), "a token was written into the neighbouring registration"
    finally:
        del host
        unregister_chunks(runtime, neighbour)
        unregister_chunks(runtime, first)


def test_a_table_entry_in_the_registered_part_of_a_partly_unregistered_registration_still_works(rt):
    """Registration A (two chunks) has its second chunk given back with unregister_chunks; the first stays
    registered. A table entry in the first chunk with pinned CPU indices that stay inside it is a valid call, but
    table_room still reads the stale span record (the whole old registration), walks to the given-back chunk and
    resolve_foreign_address refuses THAT address: NotDeviceAccessible '0x7f.. is pageable (or unmapped) host
    memory', naming neither the operand nor the table entry. Expected: the token lands; an entry is bounded by the
    registration it lies in now."""
    m = Mem(rt)
    buffer, base, first = _partly_given_back(rt)
    m.keep.append(buffer)
    host = buffer.as_tensor(torch.uint8)
    host.fill_(POISON)
    src = m.device((8, BYTE_ITEM))
    table = torch.tensor([base + OS_PAGE - BYTE_ITEM], dtype=torch.uint64)
    try:
        kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.pinned_indices([3]), m.pinned_indices([0]),
                                            BYTE_ITEM, 1)
        rt.synchronize(0)
        assert torch.equal(host[OS_PAGE - BYTE_ITEM:OS_PAGE], src.cpu()[3])
        assert all_poison(host[:OS_PAGE - BYTE_ITEM])
    finally:
        del host
        unregister_chunks(rt, first)


@pytest.mark.parametrize("checks", [False, True])
def test_ok_a_table_entry_cannot_run_into_a_touching_separate_registration(rt, monkeypatch, checks):
    """Two separate registrations side by side in one pageable buffer; an entry at the last item of the first with
    pinned CPU indices (or device indices under KVTIER_COMPAT_CHECKS=1) reaching into the second is refused."""
    if checks:
        monkeypatch.setenv("KVTIER_COMPAT_CHECKS", "1")
    m = Mem(rt)
    buffer = m._own(HostBuffer.allocate(4 * OS_PAGE, "pageable", runtime=rt))
    base = buffer.cpu_address.value
    first, second = register_chunks(rt, base, 2 * OS_PAGE), register_chunks(rt, base + 2 * OS_PAGE, 2 * OS_PAGE)
    host = buffer.as_tensor(torch.uint8)
    host.fill_(POISON)
    src = m.device((8, BYTE_ITEM))
    table = torch.tensor([base + 2 * OS_PAGE - BYTE_ITEM], dtype=torch.uint64)
    idx = m.indices([0, 1]) if checks else m.pinned_indices([0, 1])
    try:
        with pytest.raises(InvalidArgument, match="dst_layers"):
            kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, idx, idx, BYTE_ITEM, 1)
        rt.synchronize(0)
        assert all_poison(host)
        # in range: lands
        kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.pinned_indices([5]), m.pinned_indices([0]),
                                            BYTE_ITEM, 1)
        rt.synchronize(0)
        assert torch.equal(host[2 * OS_PAGE - BYTE_ITEM:2 * OS_PAGE], src.cpu()[5])
    finally:
        del host
        unregister_chunks(rt, second)
        unregister_chunks(rt, first)


def test_ok_split_chunked_host_table_entry_device_indices_refused_pinned_in_chunk_accepted():
    runtime = create("emulated:split")
    m = Mem(runtime)
    buffer = m._own(HostBuffer.allocate(2 * OS_PAGE, runtime=runtime, granularity=OS_PAGE,
                                        register_chunk_bytes=OS_PAGE))
    host = buffer.as_tensor(torch.uint8)
    host.fill_(POISON)
    src = m.device((8, BYTE_ITEM))
    table = torch.tensor([host.data_ptr() + OS_PAGE - 2 * BYTE_ITEM], dtype=torch.uint64)
    with pytest.raises(InvalidArgument, match="chunks"):
        kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.indices([0]), m.indices([0]), BYTE_ITEM, 1)
    with pytest.raises(InvalidArgument):
        kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.pinned_indices([0]), m.pinned_indices([2]),
                                            BYTE_ITEM, 1)
    runtime.synchronize(0)
    assert all_poison(host)
    kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.pinned_indices([4, -1]),
                                        m.pinned_indices([1, 9]), BYTE_ITEM, 1)
    runtime.synchronize(0)
    assert torch.equal(host[OS_PAGE - BYTE_ITEM:OS_PAGE], src.cpu()[4])
    assert all_poison(host[:OS_PAGE - BYTE_ITEM]) and all_poison(host[OS_PAGE:])
