"""Per-layer events for loads that run as one launch.

A per-layer load used to be one kernel launch and one event per layer: each launch ends when its slowest warp ends,
and queuing 32-61 launches from Python costs 1.4-5.7 ms on the H200 host, more than a small load takes on the link.
Here the copy kernel walks all the load's layers in one launch and advances a device counter per layer as each
layer's chunks land; a signal stream waits for each counter to reach its target (``Runtime.wait_value``) and then
records that layer's event. Consumers keep using events, so nothing changes for them.

Counters only grow: each load adds its chunk count per layer to the targets, so no reset is ever queued. The waits
are queued after the kernel that advances them, and the signal stream first waits for the load's stream (an ordering
the GPU can see, as CUDA asks of stream memory waits).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.memory import DeviceBuffer
from kvtier.memory.lifetime import Owned
from kvtier.runtime import Runtime, Stream
from kvtier.transfer.job import Transfer


class LayerSignals:
    """A counter per layer in device memory, the targets queued so far, and the stream that turns them into events."""

    def __init__(self, runtime: Runtime, device: int, layers: int) -> None:
        self.runtime, self.device = runtime, device
        self.targets = [0] * layers
        self._owned = Owned()
        with self._owned.building() as owned:
            self.counters = owned.own(DeviceBuffer(8 * layers, device, runtime=runtime))
            self.counters.upload(np.zeros(layers, np.uint64))
            self.stream = owned.own(runtime.create_stream(device))
            self._start = owned.own(runtime.create_event(device))

    @staticmethod
    def available(runtime: Runtime, device: int) -> bool:
        return runtime.supports_wait_value(device)

    def begin(self, stream: Stream) -> None:
        """Call before queuing the load's launches on ``stream``: the signal stream follows it from here."""
        self._start.record(stream)
        self.stream.wait(self._start)

    def arm(self, spans: Sequence[tuple[int, int]], chunks_per_layer: int, transfer: Transfer) -> None:
        """After the launches of ``spans`` are queued: layer l's event fires once its counter has grown by
        ``chunks_per_layer`` more than every earlier load asked of it."""
        runtime, base = self.runtime, self.counters.address
        for begin, count in spans:
            for layer in range(begin, begin + count):
                self.targets[layer] += chunks_per_layer
                runtime.wait_value(self.stream, base + 8 * layer, self.targets[layer])
                event = runtime.create_event(self.device)
                event.record(self.stream)
                transfer.layer_events[layer] = event

    def drain(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self._owned.close()
