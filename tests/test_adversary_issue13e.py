"""Adversary 5 (issue 13): grouped layer walks, the cache's after= snapshots, and events. Each test here fails because
of a defect; its docstring says what is wrong and what should happen."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import KvtierError, WrongRuntime
from kvtier.kernels import ChunkCopy, ChunkSide, KernelLauncher
from kvtier.memory import DeviceBuffer
from kvtier.pools import build_pointer_table
from kvtier.runtime import create
from kvtier.runtime.emulated import EmulatedRuntime
from kvtier.transfer.ordering import after_events

MODES = ["split", "unified"]


# -- ChunkCopy.validate lets a layer_group through that the launch cannot pass ---
@pytest.mark.parametrize("layer_group", [1 << 31, 1 << 40])
def test_a_layer_group_beyond_int32_is_refused_by_validate(layer_group):
    """``ChunkCopy.validate`` checks ``layer_group`` is a positive int but not that it fits the kernel's ``int
    layer_group`` parameter: 2**31 passes validation, and the launch then dies in argument packing with a bare
    ``struct.error`` ("'i' format requires ...") instead of a KvtierError. (Every layer count in a launch fits int32,
    so such a group means "all layers" and could equally be clamped.) validate() should refuse it (KvtierError) or the
    launch should clamp it to the launch's layers, as the kernel's ``walk_group`` does."""
    runtime = EmulatedRuntime("split", seed=0)
    memories = [DeviceBuffer(4 * 128, 0, runtime=runtime) for _ in range(2)]
    tables = [build_pointer_table(runtime, 0, [m.address + r * 128 for r in range(4)]) for m in memories]
    index = DeviceBuffer(16, 0, runtime=runtime)
    index.upload(np.array([0, 1], np.int64))
    sides = [ChunkSide(t, 0, 64, 0, 1 << 20) for t in tables]
    stream = runtime.create_stream(0)
    call = ChunkCopy(sides[0], sides[1], index, index, 8, 2, 0, 4, 1, 64, 1, 4, layer_group=layer_group)
    try:
        try:
            call.validate()
        except KvtierError:
            return                                   # refused up front: fine
        KernelLauncher(runtime).copy_chunks(call, device=0, stream=stream)   # else it must launch
        stream.synchronize()
    except KvtierError:
        pass
    finally:
        stream.close()
        for handle in (index, *tables, *memories):
            handle.close()


# -- emulated streams and events take another runtime's events and streams ---
@pytest.mark.parametrize("mode", MODES)
def test_a_stream_refuses_to_wait_on_another_runtimes_event(mode):
    """``runtime.as_event`` (and so every ``after=``) refuses an event of another emulated runtime with WrongRuntime,
    but ``EmulatedStream.wait`` only checks ``isinstance(event, EmulatedEvent)``: it queues a wait on a marker of a
    scheduler that never runs here, and the stream later fails ``synchronize`` with a misleading "waits on work that
    can never run (a wait on a memory value nothing writes ...)". ``stream.wait`` should raise WrongRuntime at once,
    as ``as_event`` does."""
    here, there = EmulatedRuntime(mode, seed=0), EmulatedRuntime(mode, seed=0)
    stream, theirs = here.create_stream(0), there.create_stream(0)
    there.busy(theirs, 20)
    event = there.create_event(0)
    event.record(theirs)
    try:
        with pytest.raises(WrongRuntime):
            stream.wait(event)
    finally:
        stream.close()
        theirs.close()


@pytest.mark.parametrize("mode", MODES)
def test_an_event_refuses_to_record_on_another_runtimes_stream(mode):
    """``EmulatedEvent.record`` takes a stream of another emulated runtime (only ``isinstance`` is checked): the event
    then tracks a marker of a scheduler that its own runtime never runs. It should raise WrongRuntime, like
    ``runtime.as_stream``."""
    here, there = EmulatedRuntime(mode, seed=0), EmulatedRuntime(mode, seed=0)
    event, theirs = here.create_event(0), there.create_stream(0)
    try:
        with pytest.raises(WrongRuntime):
            event.record(theirs)
    finally:
        theirs.close()


# -- events and streams of different devices ---
def test_an_event_refuses_to_record_on_a_stream_of_another_device():
    """CUDA: "cudaEventRecord() will fail if the input event and input stream are associated to different devices"
    (programming guide, multi-device system; cudaErrorInvalidResourceHandle), while cudaStreamWaitEvent across devices
    is fine. The emulator records an event of device 0 on a stream of device 1 without complaint, so code that does so
    (see the next test) passes here and fails on a multi-GPU host. The emulated record should refuse it."""
    runtime = create("emulated:split:2")
    stream = runtime.create_stream(1)
    try:
        with pytest.raises(KvtierError):
            runtime.create_event(0).record(stream)
    finally:
        stream.close()


def test_after_a_stream_of_another_device_records_a_marker_that_cuda_accepts():
    """``after_events(runtime, device, after)`` (every engine's and the cache's ``after=``) turns a stream into
    ``runtime.create_event(device)`` recorded on that stream. For a stream of another device (a torch stream of GPU 1
    given to an engine of GPU 0) that is an event of one device recorded on a stream of another, which CUDA refuses
    (cudaEventRecord: cudaErrorInvalidResourceHandle, an opaque error). The marker should be an event of the stream's
    own device (a wait on it from device ``device`` is legal), or the call should fail with a clear error."""
    runtime = create("emulated:split:2")
    other = runtime.create_stream(1)
    try:
        try:
            markers = after_events(runtime, 0, other)
        except KvtierError as error:
            assert "device" in str(error)              # a clear refusal is fine too
            return
        assert markers is not None
        assert all(marker.device == other.device for marker in markers), \
            f"marker of device {[m.device for m in markers]} recorded on a stream of device {other.device}"
    finally:
        other.close()
