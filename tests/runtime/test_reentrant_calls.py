"""Runtime calls that a finalizer makes from inside a running emulated kernel.

An emulated kernel runs Python, so the garbage collector can run inside it and with it the finalizer of any buffer
held in a reference cycle. A free must then wait for the kernel to end (as cudaFree waits on a GPU), not drain the
stream from the middle of it and run what is queued behind; a wait there cannot be honoured and is refused by name.
The collector is run at the kernel's first chunk through a trace function: the moment an allocation there could
trigger it, forced.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.operands import collect_inside_first_kernel, dev_idx, device, poison

from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import RuntimeCallError
from kvtier.memory import HostBuffer, HostKind
from kvtier.runtime import create

POISON = 0x5A
ROWS, ROW = 8, 16


class Cycle:
    """Garbage only the collector frees: it refers to itself."""

    def __init__(self, payload) -> None:
        self.me, self.payload = self, payload


def _random(runtime) -> DeviceArray:
    return DeviceArray.from_tensor(torch.randint(1, 255, (ROWS, ROW), dtype=torch.uint8), runtime=runtime)


def _poisoned(runtime) -> DeviceArray:
    return DeviceArray.from_tensor(torch.full((ROWS, ROW), POISON, dtype=torch.uint8), runtime=runtime)


def _two_chained_copies(runtime):
    """K1 copies a -> b and K2 copies b -> c on one stream, both queued before either runs (lazy schedule). Run once
    first, so that the traced run only queues the two kernels (a first call also uploads its tables)."""
    a, b, c = _random(runtime), _poisoned(runtime), _poisoned(runtime)
    rows = DeviceArray.from_tensor(torch.arange(ROWS), runtime=runtime)

    def run():
        io.transfer_kv_per_layer_mla(a, b, rows, rows, ROW)
        io.transfer_kv_per_layer_mla(b, c, rows, rows, ROW)
        runtime.synchronize(0)
    run()
    for x in (b, c):
        x.copy_(torch.full((ROWS, ROW), POISON, dtype=torch.uint8))
    return a, b, c, run


@pytest.mark.parametrize("mode", ["split", "unified"])
def test_a_host_buffer_collected_inside_a_kernel_is_freed_after_it_and_stream_order_holds(mode):
    runtime = create(f"emulated:{mode}:lazy")
    a, b, c, run = _two_chained_copies(runtime)
    buffer = HostBuffer.allocate(4096, HostKind.PINNED, runtime=runtime)
    address = buffer.cpu_address.value
    Cycle(buffer)
    del buffer
    collect_inside_first_kernel(run)
    assert torch.equal(b.cpu(), a.cpu())
    assert torch.equal(c.cpu(), a.cpu()), "the free ran K2 before K1 had written b"
    assert runtime.host_range(address) is None
    assert runtime.pointer_attributes(address).type.name == "UNREGISTERED"


def test_a_device_free_inside_a_kernel_happens_once_the_kernel_ends():
    runtime = create("emulated:split:lazy")
    a, b, c, run = _two_chained_copies(runtime)
    doomed = DeviceArray.from_tensor(torch.ones(64, dtype=torch.uint8), runtime=runtime)
    address = doomed.data_ptr()
    Cycle(doomed)
    del doomed
    collect_inside_first_kernel(run)
    assert torch.equal(c.cpu(), a.cpu())
    assert runtime.pointer_attributes(address).type.name == "UNREGISTERED"
    with pytest.raises(RuntimeCallError, match="not a device allocation"):
        runtime.device_free(address)


def test_a_wait_from_inside_a_kernel_is_refused_by_name_and_runs_nothing_out_of_order():
    runtime = create("emulated:split:lazy")
    a, b, c, run = _two_chained_copies(runtime)
    errors: list[BaseException] = []

    class Waits:
        def __del__(self) -> None:
            try:
                runtime.synchronize(0)
            except BaseException as error:  # noqa: BLE001
                errors.append(error)

    Cycle(Waits())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collect_inside_first_kernel(run)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeCallError)
    assert "inside a running emulated operation" in str(errors[0])
    assert torch.equal(c.cpu(), a.cpu())


def test_a_device_array_collected_while_a_kernel_runs_does_not_run_the_next_kernel_first():
    """Two compat calls on one stream: K1 copies a -> b, K2 copies b -> c, so c must equal a. While the emulated
    device runs K1 (``Scheduler._step``, under the runtime's RLock), the garbage collector frees an unrelated
    DeviceArray that sat in a reference cycle: its finalizer calls ``EmulatedRuntime.device_free``, which re-enters
    the RLock and drains the device (``_drain_before_free`` -> ``Scheduler.drain``), running K2, queued behind K1,
    before K1 has written b. c ends up poison: a stream-order violation (wrong bytes) that no GPU can show, since
    cudaFree cannot run inside a kernel. Any Python allocation inside an emulated kernel may trigger the collector, so
    any CI test that drops cyclic garbage holding device or host buffers (an exception kept with its traceback, an
    object graph with back-references) can read stale bytes now and then. Forced: the lazy schedule (K1 and K2 both
    queued before anything runs) and ``gc.collect()`` at the first chunk of K1, the moment an allocation there could
    trigger it. (A generator kernel, e.g. the engine's signalled copies, would fault instead: its own generator is
    re-entered.)"""
    rt = create("emulated:split:lazy")
    n, row = 8, 16
    a, b, c = device(rt, (n, row)), device(rt, (n, row), data=False), device(rt, (n, row), data=False)
    si, di = dev_idx(rt, list(range(n))), dev_idx(rt, list(range(n)))
    io.transfer_kv_per_layer_mla(a, b, si, di, row)
    io.transfer_kv_per_layer_mla(b, c, si, di, row)
    rt.synchronize(0)
    poison(b), poison(c)

    class Node:
        pass

    cyclic = Node()
    cyclic.me, cyclic.array = cyclic, DeviceArray.from_tensor(torch.ones(16, dtype=torch.uint8), runtime=rt)
    del cyclic
    io.transfer_kv_per_layer_mla(a, b, si, di, row)     # K1
    io.transfer_kv_per_layer_mla(b, c, si, di, row)     # K2, after K1 on the same stream
    collect_inside_first_kernel(lambda: rt.synchronize(0))
    assert torch.equal(b.cpu(), a.cpu())
    assert torch.equal(c.cpu(), a.cpu()), "K2 ran before K1 had written b"
