"""Adversarial tests for kvtier.compat (SGLang kvcacheio, DeviceArray) and HostBuffer lifetime (issue 15, third round).

Each ``test_`` test fails against the code it was written for; its docstring says what is wrong and what is expected.
The ``test_ok_`` tests at the end are attacks that held, kept as regression guards.
Every test makes its own emulated runtime (a fault poisons a runtime, as a CUDA context).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
import threading
import weakref

import pytest
import torch
from helpers.compat import Engine, all_poison, buffer_with_closing_cleanup, index_overwrite
from helpers.compat import byte_operands as Mem

from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio
from kvtier.errors import BufferClosed, BufferInUse, InvalidArgument, KvtierError
from kvtier.memory import HostBuffer, get_device_accessible_ptr, register_chunks, unregister_chunks
from kvtier.runtime import create

POISON = 0x5A
PAGE = 4096                  # OS page: registration granularity
ITEM = 64                    # item_size: bytes of one token of one layer (uint8 elements)


# ======================================================================================================================
# Defects
# ======================================================================================================================

# -- *_direct over a host buffer registered in chunks, unified addressing ------------------------------------------
def test_direct_lf_pf_into_a_chunk_registered_host_in_unified_mode_is_all_or_nothing():
    """Unified addressing (H200), page_first_direct K and V hosts for 2 pages of one layer; V's HostBuffer is
    registered in two chunks of one page each (register_chunk_bytes, boundary between the pages, as the docs
    allow), K's in one. transfer_kv_all_layer_direct_lf_pf resolves V whole (its chunks' aliases continue each
    other, so the tensor is accepted), then groups V's two equally spaced pages into one strided copy whose extent
    crosses the registration boundary; the copy API refuses it (RuntimeCallError cudaMemcpy2DAsync
    cudaErrorInvalidValue, naming no operand) AFTER K's copy was queued: K is overwritten, V is not.
    docs/sglang.md: '*_direct functions check everything first ... a refusal leaves every tensor as it was'.
    Expected: both pages of K and V land (a strided copy must not cross a registration boundary: split it, as
    Runtime.groups does for CPU bases), or a refusal before anything is queued."""
    runtime = create("emulated:unified")
    m = Mem(runtime)
    page_size, item = 4, PAGE // 4                      # one page of one layer = one OS page
    k_buf = m._own(HostBuffer.allocate(2 * PAGE, runtime=runtime))
    v_buf = m._own(HostBuffer.allocate(2 * PAGE, runtime=runtime, granularity=PAGE, register_chunk_bytes=PAGE))
    assert len(v_buf.chunks) == 2
    k_host, v_host = (b.as_tensor(torch.uint8).view(2, 1, page_size, item) for b in (k_buf, v_buf))
    k_host.fill_(POISON)
    v_host.fill_(POISON)
    k_src, v_src = m.device((8, item)), m.device((8, item))
    indices = torch.arange(8)
    try:
        kvcacheio.transfer_kv_all_layer_direct_lf_pf([k_src, v_src], [k_host, v_host], indices, indices, page_size)
    except KvtierError:
        runtime.synchronize(0)
        assert all_poison(k_host) and all_poison(v_host), "a refused direct call already copied K"
        return
    runtime.synchronize(0)
    assert torch.equal(k_host.reshape(8, item), k_src.cpu())
    assert torch.equal(v_host.reshape(8, item), v_src.cpu())


# -- pointer-table bounds next to registrations: a registration given back in part -----------------------------------
def _partly_given_back(runtime):
    """A pageable buffer of 2 pages registered as one registration of two chunks, whose second chunk is then given
    back with unregister_chunks (the first stays registered)."""
    buffer = HostBuffer.allocate(2 * PAGE, "pageable", runtime=runtime)
    base = buffer.cpu_address.value
    chunks = register_chunks(runtime, base, 2 * PAGE, chunk_bytes=PAGE)
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
    neighbour = register_chunks(runtime, base + PAGE, PAGE)
    host = buffer.as_tensor(torch.uint8)
    host.fill_(POISON)
    src = m.device((8, ITEM))
    table = torch.tensor([base + PAGE - ITEM], dtype=torch.uint64)
    try:
        with pytest.raises(InvalidArgument):
            kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.pinned_indices([0, 1]),
                                                m.pinned_indices([0, 1]), ITEM, 1)
        runtime.synchronize(0)
        assert all_poison(host[PAGE:]), "a token was written into the neighbouring registration"
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
    src = m.device((8, ITEM))
    table = torch.tensor([base + PAGE - ITEM], dtype=torch.uint64)
    try:
        kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.pinned_indices([3]), m.pinned_indices([0]),
                                            ITEM, 1)
        rt.synchronize(0)
        assert torch.equal(host[PAGE - ITEM:PAGE], src.cpu()[3])
        assert all_poison(host[:PAGE - ITEM])
    finally:
        del host
        unregister_chunks(rt, first)


# -- KVTIER_COMPAT_CHECKS=1 and pinned indices still being written -------------------------------------------------
def test_compat_checks_check_the_pinned_indices_the_kernel_will_read(monkeypatch):
    """KVTIER_COMPAT_CHECKS=1 ('check them too (each call then synchronizes)'), lazy schedule. The engine computes
    indices on the device and copies them into a pinned index tensor on the current stream (a queued DMA), then
    passes the pinned tensor: host_indices reads the pinned tensor at once, without waiting for the stream, so it
    checks the OLD values [0, 1]; the kernel, queued behind the DMA, reads the new ones [0, 300] and writes past
    the 8-token destination: IllegalAddress, device poisoned (in unified mode it writes into whatever memory lies
    there). Expected: with checks on, the values checked are the values the kernel reads (wait for the stream
    before reading pinned indices): InvalidArgument, destination untouched, device alive."""
    monkeypatch.setenv("KVTIER_COMPAT_CHECKS", "1")
    runtime = create("emulated:split:2:lazy")
    m, dst, src, src_idx, dst_idx, computed, index_buffer = index_overwrite(runtime)
    runtime.memcpy_async(get_device_accessible_ptr(index_buffer, 0, runtime=runtime), computed.address, 16,
                         stream=runtime.current_stream(0))
    with contextlib.suppress(InvalidArgument):
        kvcacheio.transfer_kv_per_layer_mla(src, dst, src_idx, dst_idx, 16)
    runtime.synchronize(0)                               # IllegalAddress here: the kernel ran with index 300
    assert all_poison(dst)


# -- HostBuffer lifetime -------------------------------------------------------------------------------------------
def test_as_tensor_racing_close_never_hands_out_a_view_of_a_closed_buffer():
    """Thread A calls buffer.as_tensor() while thread B calls buffer.close(). as_tensor checks the buffer is open,
    then does more work (dtype, item size) before torch.frombuffer takes its reference; close() counts views
    (none yet), unregisters and unmaps with no lock between the two. If B runs in that window (forced here with a
    line trace on as_tensor, a thread switch the interpreter may make at any line), A gets a tensor over unmapped
    memory while buffer.closed is True: its next read or write crashes the process. Expected: as_tensor raises
    BufferClosed, or close() raises BufferInUse; never a live view of a closed buffer."""
    runtime = create("emulated:split")
    buffer = HostBuffer.allocate(1 << 16, runtime=runtime)
    lines, first = inspect.getsourcelines(HostBuffer.as_tensor)
    window = first + next(i for i, text in enumerate(lines) if "itemsize =" in text)
    outcome: dict = {}

    def closer():
        try:
            buffer.close()
            outcome["close"] = "closed"
        except BufferInUse:
            outcome["close"] = "in use"

    def trace(frame, event, arg):
        if frame.f_code is not HostBuffer.as_tensor.__code__:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == window and "close" not in outcome:
                thread = threading.Thread(target=closer)
                thread.start()
                thread.join()
            return local
        return local

    view = None
    sys.settrace(trace)
    try:
        view = buffer.as_tensor()
    except BufferClosed:
        pass
    finally:
        sys.settrace(None)
    dangling = view is not None and buffer.closed
    if dangling:
        _leaked.append(view)    # never touch (or repr) it: its memory is unmapped
    view = None
    if not buffer.closed:
        buffer.close()
    assert not dangling, "as_tensor returned a live view of a buffer close() has unmapped"


_leaked: list = []


def test_close_from_a_finalizer_of_the_cycle_holding_the_last_view_closes_the_buffer():
    """An engine object holds a view of its host buffer and is in a reference cycle; weakref.finalize(obj,
    buffer.close) is its cleanup. gc collects the cycle and runs the finalizer while the cycle's objects (the view)
    still exist; close() sees a live view, its own gc.collect() is a no-op inside a collection, and it raises
    BufferInUse, which the finalizer machinery swallows. After the collection the view is gone but the buffer stays
    open, registered and pinned (leaked until the HostBuffer itself dies). HostBuffer.close: 'views only garbage
    holds (a reference cycle ...) are collected first and do not count' — here only garbage holds the view.
    Expected: after gc.collect() the buffer is closed (e.g. a close refused during a collection completes when
    its last view goes)."""
    buffer, errors, cleanup = buffer_with_closing_cleanup()

    engine = Engine()
    weakref.finalize(engine, cleanup)
    engine.kv = buffer.as_tensor()
    engine.kv.copy_(torch.randint(0, 256, engine.kv.shape, dtype=torch.uint8))
    engine.me = engine
    del engine
    gc.collect()
    try:
        assert buffer.live_views() == 0 if not buffer.closed else True
        assert buffer.closed, f"the buffer stayed open after its last view was collected ({errors})"
    finally:
        buffer.close()


# -- *_direct: a page_size that is not the host's -------------------------------------------------------------------
def test_direct_pf_lf_refuses_a_page_size_larger_than_the_host_page():
    """page_first_direct host [pages=4, layers=2, page_size=4, item]; transfer_kv_per_layer_direct_pf_lf called
    with page_size=8. Each copy is 8 tokens of bytes from (page, layer 0): the 4 tokens of layer 0 then the 4 of
    LAYER 1 of the same page, which land as tokens 4..7 of the destination's layer 0: wrong KV, silently (only
    the whole tensor's extent is checked). SGLang's copy_ of a [4, item] page slice into [8, item] fails its shape
    check. Expected: InvalidArgument (page_size does not match the host's pages), destination untouched."""
    runtime = create("emulated:split")
    m = Mem(runtime)
    host = m.host((4, 2, 4, ITEM))
    dst = [m.device((16, ITEM), data=False) for _ in range(2)]
    with pytest.raises(InvalidArgument):
        kvcacheio.transfer_kv_per_layer_direct_pf_lf([host], dst, torch.arange(8), torch.arange(8), 0, 8)
    runtime.synchronize(0)
    assert all(m.poisoned(d) for d in dst), "layer 1's KV was copied as layer 0's tokens 4..7"


def test_direct_lf_pf_with_a_page_size_larger_than_the_host_page_does_not_overwrite_other_pages():
    """transfer_kv_all_layer_direct_lf_pf into a page_first_direct host [pages=4, layers=2, page_size=4, item] with
    page_size=8 and destination tokens 0..7 (page 0): each layer's 8-token copy overruns its 4-token slot, so layer
    0 writes page 0's layer-1 slot and layer 1 writes page 1's layer-0 slot, a page the call never addressed (KV of
    another request). Expected: InvalidArgument, host untouched."""
    runtime = create("emulated:split")
    m = Mem(runtime)
    host = m.host((4, 2, 4, ITEM), data=False)
    src = [m.device((16, ITEM)) for _ in range(2)]
    with pytest.raises(InvalidArgument):
        kvcacheio.transfer_kv_all_layer_direct_lf_pf(src, [host], torch.arange(8), torch.arange(8), 8)
    runtime.synchronize(0)
    assert all_poison(host[1:]), "a page outside the destination indices was overwritten"


# -- DeviceArray ------------------------------------------------------------------------------------------------------
def test_device_array_copy_from_another_runtimes_array_is_refused():
    """Two emulated runtimes (two processes' contexts, or two test runtimes): their first allocations have the same
    address value. a.copy_(b) with b a DeviceArray of the other runtime passes b's address to a's runtime, which
    copies a's OWN array at that address: the destination silently gets [0..15] (another array of its runtime)
    instead of b's [100..115]. The compat calls refuse DeviceArrays of different runtimes (WrongRuntime);
    DeviceArray.copy_ does not. Expected: a KvtierError (WrongRuntime), destination untouched, or b's bytes."""
    one, two = create("emulated:split"), create("emulated:split")
    mine = DeviceArray.from_tensor(torch.arange(16, dtype=torch.int64), runtime=one)
    target = DeviceArray.from_tensor(torch.full((16,), -7, dtype=torch.int64), runtime=one)
    theirs = DeviceArray.from_tensor(torch.arange(100, 116, dtype=torch.int64), runtime=two)
    assert mine.data_ptr() != target.data_ptr()
    try:
        target.copy_(theirs)
    except KvtierError:
        assert torch.equal(target.cpu(), torch.full((16,), -7, dtype=torch.int64))
        return
    assert torch.equal(target.cpu(), theirs.cpu()), "copied another array of the destination's runtime"


# ======================================================================================================================
# Attacks that held (regression guards)
# ======================================================================================================================
@pytest.mark.parametrize("checks", [False, True])
def test_ok_a_table_entry_cannot_run_into_a_touching_separate_registration(rt, monkeypatch, checks):
    """Two separate registrations side by side in one pageable buffer; an entry at the last item of the first with
    pinned CPU indices (or device indices under KVTIER_COMPAT_CHECKS=1) reaching into the second is refused."""
    if checks:
        monkeypatch.setenv("KVTIER_COMPAT_CHECKS", "1")
    m = Mem(rt)
    buffer = m._own(HostBuffer.allocate(4 * PAGE, "pageable", runtime=rt))
    base = buffer.cpu_address.value
    first, second = register_chunks(rt, base, 2 * PAGE), register_chunks(rt, base + 2 * PAGE, 2 * PAGE)
    host = buffer.as_tensor(torch.uint8)
    host.fill_(POISON)
    src = m.device((8, ITEM))
    table = torch.tensor([base + 2 * PAGE - ITEM], dtype=torch.uint64)
    idx = m.indices([0, 1]) if checks else m.pinned_indices([0, 1])
    try:
        with pytest.raises(InvalidArgument, match="dst_layers"):
            kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, idx, idx, ITEM, 1)
        rt.synchronize(0)
        assert all_poison(host)
        # in range: lands
        kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.pinned_indices([5]), m.pinned_indices([0]),
                                            ITEM, 1)
        rt.synchronize(0)
        assert torch.equal(host[2 * PAGE - ITEM:2 * PAGE], src.cpu()[5])
    finally:
        del host
        unregister_chunks(rt, second)
        unregister_chunks(rt, first)


def test_ok_split_chunked_host_table_entry_device_indices_refused_pinned_in_chunk_accepted():
    runtime = create("emulated:split")
    m = Mem(runtime)
    buffer = m._own(HostBuffer.allocate(2 * PAGE, runtime=runtime, granularity=PAGE, register_chunk_bytes=PAGE))
    host = buffer.as_tensor(torch.uint8)
    host.fill_(POISON)
    src = m.device((8, ITEM))
    table = torch.tensor([host.data_ptr() + PAGE - 2 * ITEM], dtype=torch.uint64)
    with pytest.raises(InvalidArgument, match="chunks"):
        kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.indices([0]), m.indices([0]), ITEM, 1)
    with pytest.raises(InvalidArgument):
        kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.pinned_indices([0]), m.pinned_indices([2]),
                                            ITEM, 1)
    runtime.synchronize(0)
    assert all_poison(host)
    kvcacheio.transfer_kv_all_layer_mla(m.table([src]), table, m.pinned_indices([4, -1]),
                                        m.pinned_indices([1, 9]), ITEM, 1)
    runtime.synchronize(0)
    assert torch.equal(host[PAGE - ITEM:PAGE], src.cpu()[4])
    assert all_poison(host[:PAGE - ITEM]) and all_poison(host[PAGE:])


def test_ok_a_view_held_only_by_a_caught_exceptions_traceback_cycle_does_not_block_close():
    runtime = create("emulated:split")
    buffer = HostBuffer.allocate(1 << 16, runtime=runtime)

    def work():
        view = buffer.as_tensor()[100:200].view(torch.int16)    # a view of a view
        view.fill_(3)
        raise ValueError("boom")

    try:
        work()
    except ValueError as error:
        box = [error]
        box.append(box)                                         # garbage in a cycle: box -> error -> traceback
    del box                                                     # -> work's frame -> the view
    assert buffer.live_views() == 1
    gc.disable()
    try:
        buffer.close()
    finally:
        gc.enable()
    assert buffer.closed


def test_ok_a_view_alive_in_another_thread_blocks_close_and_the_buffer_stays_usable():
    runtime = create("emulated:split")
    m = Mem(runtime)
    buffer = m._own(HostBuffer.allocate(8 * ITEM, runtime=runtime))
    hold, release = threading.Event(), threading.Event()

    def holder():
        view = buffer.as_tensor()[ITEM:].view(-1, ITEM)[2:]    # views of views
        hold.set()
        release.wait()
        del view

    thread = threading.Thread(target=holder)
    thread.start()
    hold.wait()
    try:
        with pytest.raises(BufferInUse):
            buffer.close()
        assert not buffer.closed
        dst = buffer.as_tensor().view(8, ITEM)
        dst.fill_(POISON)
        src = m.device((8, ITEM))
        kvcacheio.transfer_kv_per_layer_mla(src, dst, m.indices([1, 6]), m.indices([7, 0]), ITEM)
        runtime.synchronize(0)
        assert torch.equal(dst[7], src.cpu()[1]) and torch.equal(dst[0], src.cpu()[6])
        del dst
    finally:
        release.set()
        thread.join()
    buffer.close()
    assert buffer.closed


def test_ok_direct_refusals_leave_destinations_untouched(rt):
    m = Mem(rt)
    src = [m.device((8, ITEM)) for _ in range(2)]
    dst = [m.host((8, ITEM), data=False) for _ in range(2)]
    cases = [
        (torch.arange(4, dtype=torch.int32), torch.arange(4)),                   # dtypes differ
        (torch.tensor([0, 1, 2, 2 ** 62]), torch.arange(4)),                     # huge
        (torch.tensor([0, 1, 2, 8]), torch.arange(4)),                           # one past the end
        (torch.arange(3), torch.arange(3)),                                      # not whole pages of 2
        (torch.arange(4, dtype=torch.float32), torch.arange(4, dtype=torch.float32)),
    ]
    for s, d in cases:
        with pytest.raises(InvalidArgument):
            kvcacheio.transfer_kv_direct(src, dst, s, d, 2)
    with pytest.raises(InvalidArgument):
        kvcacheio.transfer_kv_direct(src, dst, m.indices([0, 1, 2, 3]), m.indices([0, 1, 2, 9]), 2)
    rt.synchronize(0)
    assert all(all_poison(d) for d in dst)
    kvcacheio.transfer_kv_direct(src, dst, torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), 2)
    kvcacheio.transfer_kv_direct(src, dst, m.indices([6, 7, 0, 1]), m.pinned_indices([0, 1, 4, 5]), 2)
    rt.synchronize(0)
    for s, d in zip(src, dst, strict=True):
        got = s.cpu()
        assert torch.equal(d[[0, 1, 4, 5]], got[[6, 7, 0, 1]])
        assert all_poison(d[[2, 3, 6, 7]])
