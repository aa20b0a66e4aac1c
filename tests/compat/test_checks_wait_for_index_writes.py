"""KVTIER_COMPAT_CHECKS=1 checks the index values the kernel will read: pinned indices still being written by a
copy queued on the current stream (or on another stream the current one waits for) are read only after that write,
so an out-of-range value is refused before the kernel runs. (Found adversarially, issue #15.)
"""

from __future__ import annotations

import contextlib

import pytest
from helpers.compat import index_overwrite
from helpers.operands import all_poison

from kvtier.compat.sglang import kvcacheio
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.memory import get_device_accessible_ptr
from kvtier.runtime import create


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



def test_ok_compat_checks_wait_for_index_writes_ordered_from_another_stream(monkeypatch):
    """KVTIER_COMPAT_CHECKS=1, lazy: the pinned dst indices are written by a DMA on a second stream that the current
    stream waits for (an event); the new value 300 is out of range and is caught, the device stays alive."""
    monkeypatch.setenv("KVTIER_COMPAT_CHECKS", "1")
    runtime = create("emulated:split:2:lazy")
    m, dst, src, src_idx, dst_idx, computed, index_buffer = index_overwrite(runtime)
    side = runtime.create_stream(0)
    runtime.memcpy_async(get_device_accessible_ptr(index_buffer, 0, runtime=runtime), computed.address, 16,
                         stream=side)
    event = runtime.create_event(0)
    event.record(side)
    runtime.current_stream(0).wait(event)
    with pytest.raises(KvtierError):
        kvcacheio.transfer_kv_per_layer_mla(src, dst, src_idx, dst_idx, 16)
    runtime.synchronize(0)
    assert all_poison(dst)
