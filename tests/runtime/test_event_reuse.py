"""Events are cheap to ask for: the CUDA runtime hands out the handles of dropped events again (creating one costs
~11 µs on the H200 host and a per-layer load hands out one per layer). A reused handle must behave as a fresh event,
even when the dropped event's last record has not completed, and a closed event must not be usable (its handle may
already belong to someone else)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kvtier.errors import InvalidArgument
from kvtier.memory import DeviceBuffer

pytestmark = pytest.mark.gpu


def test_a_new_event_is_fresh_even_while_a_dropped_events_record_is_pending(runtime):
    blocked, idle = runtime.create_stream(0), runtime.create_stream(0)
    with DeviceBuffer(8, 0, runtime=runtime) as gate:
        gate.upload(np.array([0], np.uint64))
        runtime.wait_value(blocked, gate.address, 1)  # holds ``blocked`` until the gate opens
        for timing in (False, True):
            dropped = runtime.create_event(0, timing=timing)
            dropped.record(blocked)
            assert not dropped.query()
            del dropped
            gc.collect()
            fresh = [runtime.create_event(0, timing=timing) for _ in range(4)]
            for event in fresh:
                assert event.query(), "an event never recorded is complete, as a fresh CUDA event is"
                event.record(idle)
                event.synchronize()
            del fresh
        gate.upload(np.array([1], np.uint64))
        blocked.synchronize()
    blocked.close(), idle.close()


def test_reused_events_time_and_order_as_new_ones(runtime):
    stream = runtime.create_stream(0)
    for _ in range(3):
        start, end = runtime.create_event(0, timing=True), runtime.create_event(0, timing=True)
        start.record(stream)
        end.record(stream)
        end.synchronize()
        assert start.elapsed_ms(end) >= 0
        del start, end
        gc.collect()
    stream.close()


def test_a_closed_event_refuses_to_be_used(runtime):
    stream = runtime.create_stream(0)
    event, other = runtime.create_event(0, timing=True), runtime.create_event(0, timing=True)
    other.record(stream)
    event.close()
    event.close()  # idempotent
    reused = runtime.create_event(0, timing=True)  # may take the closed event's handle
    reused.record(stream)
    for use in (lambda: event.record(stream), event.query, event.synchronize, lambda: event.elapsed_ms(other),
                lambda: other.elapsed_ms(event)):
        with pytest.raises(InvalidArgument, match="closed"):
            use()
    reused.synchronize()
    assert reused.query()
    stream.close()
