"""DeviceArray.copy_ between arrays: across the devices of one runtime it copies; an array (or a slice of one) of
another runtime is refused with the destination untouched, since its address names another allocation there.
(Found adversarially, issue #15.)
"""

from __future__ import annotations

import pytest
import torch

from kvtier.compat import DeviceArray
from kvtier.errors import KvtierError
from kvtier.runtime import create


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



def test_ok_device_array_copy_across_devices_of_one_runtime_and_refusal_of_another_runtimes_slice():
    runtime, other = create("emulated:split:2:lazy"), create("emulated:split:2")
    a = DeviceArray.from_tensor(torch.arange(16, dtype=torch.int64), device=0, runtime=runtime)
    b = DeviceArray.from_tensor(torch.arange(100, 116, dtype=torch.int64), device=1, runtime=runtime)
    a.copy_(b)
    assert torch.equal(a.cpu(), torch.arange(100, 116))
    foreign = DeviceArray.from_tensor(torch.arange(300, 332, dtype=torch.int64).view(2, 16), runtime=other)
    with pytest.raises(KvtierError):
        a.copy_(foreign[1])
    assert torch.equal(a.cpu(), torch.arange(100, 116))
