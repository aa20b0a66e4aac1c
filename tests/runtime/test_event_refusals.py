"""Streams and events refuse what a GPU would refuse, or would silently get wrong, instead of dropping an ordering
without a word: a wait on a closed event (on CUDA its handle may already be another event's), an event or stream of
another emulated runtime (whose scheduler never runs here), an event recorded on a stream of another device
(cudaEventRecord refuses it). A close racing a query answers or says "closed", never an AttributeError."""

from __future__ import annotations

import threading

import pytest
from helpers.runtimes import EMULATED_MODES

from kvtier.errors import InvalidArgument, KvtierError, WrongRuntime
from kvtier.runtime import create
from kvtier.runtime.emulated import EmulatedRuntime

# -- closed events ---


@pytest.mark.parametrize("mode", EMULATED_MODES)
def test_a_stream_refuses_to_wait_on_a_closed_event(mode):
    """``Stream.wait(event)`` with a closed event silently did nothing on the emulator (``close`` drops the marker,
    and ``EmulatedStream.wait`` skipped events without one), while record/query/synchronize/elapsed_ms of the same
    event raise InvalidArgument "closed". A wait that is dropped without a word loses an ordering the caller asked
    for; on CUDA the closed handle may already belong to another event (see the CUDA test below). It raises
    InvalidArgument "closed" like every other use. (Found adversarially, issue #13.)"""
    runtime = EmulatedRuntime(mode, seed=0)
    producer, consumer = runtime.create_stream(0), runtime.create_stream(0)
    event = runtime.create_event(0)
    event.record(producer)
    event.close()
    with pytest.raises(InvalidArgument, match="closed"):
        consumer.wait(event)


def test_cuda_stream_wait_refuses_a_closed_event_whose_handle_was_recycled():
    """CUDA (through a stand-in cudart, no GPU needed): ``CudaStream.wait`` passed ``event.native`` to
    cudaStreamWaitEvent without the closed check that record/query/synchronize/elapsed_ms go through
    (``CudaEvent._handle``). Since closed handles go to the runtime's spare list and are handed out again by
    ``create_event``, waiting on a closed event made the stream wait on whatever the handle's new owner records. The
    wait raises InvalidArgument "closed" and never reaches cudaStreamWaitEvent. (Found adversarially, issue #13.)"""
    bindings = pytest.importorskip("cuda.bindings.runtime")
    from kvtier.runtime.cuda import CudaEvent, CudaStream

    class Cudart:
        cudaError_t = bindings.cudaError_t
        cudaEventDisableTiming = 2

        def __init__(self):
            self.handles, self.waited = iter(range(100, 200)), []

        def cudaEventCreateWithFlags(self, flags):
            return self.cudaError_t.cudaSuccess, next(self.handles)

        def cudaEventDestroy(self, handle):
            return (self.cudaError_t.cudaSuccess,)

        def cudaStreamWaitEvent(self, stream, event, flags):
            self.waited.append(event)
            return (self.cudaError_t.cudaSuccess,)

    cudart, spare = Cudart(), []
    closed = CudaEvent(cudart, 0, spare=spare)
    closed.close()
    reused = CudaEvent(cudart, 0, spare=spare, handle=spare.pop())  # what create_event does with a spare handle
    assert reused.native == closed.native
    stream = CudaStream(cudart, 0, 7, owned=False)
    with pytest.raises(InvalidArgument, match="closed"):
        stream.wait(closed)
    assert cudart.waited == [], "the closed event's handle (now another event's) reached cudaStreamWaitEvent"


def test_an_event_closed_while_another_thread_queries_it_raises_a_kvtier_error():
    """``EmulatedEvent.query`` checked ``closed`` once and then read ``self.marker`` again after making progress;
    ``close()`` (from another thread, without the scheduler lock) set the marker to None in between, and the query
    died with AttributeError "'NoneType' object has no attribute 'done'". The interleaving is forced here by closing
    from another thread inside the scheduler's progress step. A query racing a close answers (from the marker it
    read) or raises InvalidArgument "closed", never an AttributeError. (Found adversarially, issue #13.)"""
    runtime = EmulatedRuntime("split", seed=0)
    stream = runtime.create_stream(0)
    event = runtime.create_event(0)
    event.record(stream)
    progress = runtime.scheduler.progress

    def progress_while_closed_elsewhere(*args, **kwargs):
        closer = threading.Thread(target=event.close)
        closer.start()
        closer.join()
        return progress(*args, **kwargs)

    runtime.scheduler.progress = progress_while_closed_elsewhere
    try:
        event.query()
    except InvalidArgument:
        pass
    finally:
        runtime.scheduler.progress = progress
        stream.synchronize()


# -- another runtime's events and streams ---


@pytest.mark.parametrize("mode", EMULATED_MODES)
def test_a_stream_refuses_to_wait_on_another_runtimes_event(mode):
    """``runtime.as_event`` (and so every ``after=``) refuses an event of another emulated runtime with WrongRuntime,
    but ``EmulatedStream.wait`` only checked ``isinstance(event, EmulatedEvent)``: it queued a wait on a marker of a
    scheduler that never runs here, and the stream later failed ``synchronize`` with a misleading "waits on work that
    can never run (a wait on a memory value nothing writes ...)". ``stream.wait`` raises WrongRuntime at once, as
    ``as_event`` does. (Found adversarially, issue #13.)"""
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


@pytest.mark.parametrize("mode", EMULATED_MODES)
def test_an_event_refuses_to_record_on_another_runtimes_stream(mode):
    """``EmulatedEvent.record`` took a stream of another emulated runtime (only ``isinstance`` was checked): the event
    then tracked a marker of a scheduler that its own runtime never runs. It raises WrongRuntime, like
    ``runtime.as_stream``. (Found adversarially, issue #13.)"""
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
    is fine. The emulator recorded an event of device 0 on a stream of device 1 without complaint, so code that did so
    passed here and failed on a multi-GPU host. The emulated record refuses it. (Found adversarially, issue #13.)"""
    runtime = create("emulated:split:2")
    stream = runtime.create_stream(1)
    try:
        with pytest.raises(KvtierError):
            runtime.create_event(0).record(stream)
    finally:
        stream.close()
