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

from collections.abc import Iterable, Sequence

import numpy as np

from kvtier.memory import DeviceBuffer
from kvtier.memory.device_buffer import DeviceRegion
from kvtier.memory.lifetime import Owned
from kvtier.runtime import Runtime, Stream
from kvtier.transfer.completion import Transfer, user_event


class LayerSignals:
    """Counters in device memory, the targets queued so far, and the stream that turns them into layer events.

    Counters come in blocks, one per copy that signals (a KV pool has one, indexed by layer; a family pool one per
    part, indexed by the part's own layers), so a model layer's event can wait for every part that stores it."""

    def __init__(self, runtime: Runtime, device: int, blocks: Sequence[int]) -> None:
        self.runtime, self.device = runtime, device
        self.offsets = [0]
        for size in blocks:
            self.offsets.append(self.offsets[-1] + int(size))
        total = max(1, self.offsets[-1])
        self.targets = [0] * total
        self._owned = Owned()
        with self._owned.building() as owned:
            self.counters = owned.own(DeviceBuffer(8 * total, device, runtime=runtime))
            self.counters.upload(np.zeros(total, np.uint64))
            self.stream = owned.own(runtime.create_stream(device))
            self._start = owned.own(runtime.create_event(device))

    @staticmethod
    def available(runtime: Runtime, device: int) -> bool:
        return runtime.supports_wait_value(device)

    def block(self, index: int) -> DeviceRegion:
        """Block ``index``'s counters: the ``layer_done`` operand of that copy's launches."""
        first, end = self.offsets[index], self.offsets[index + 1]
        return self.counters.region(8 * first, 8 * (end - first))

    def begin(self, stream: Stream) -> None:
        """Call before queuing the load's launches on ``stream``: the signal stream follows it from here."""
        self._start.record(stream)
        self.stream.wait(self._start)

    def arm(self, layers: Iterable[tuple[int, Sequence[tuple[int, int, int]]]], transfer: Transfer) -> None:
        """After the launches are queued: for each (model layer, [(block, position, chunks), ...]), in order, the
        layer's event fires once each named counter has grown by ``chunks`` more than every earlier load asked of
        it (a layer with no counters gets its event at once, in order)."""
        runtime, base = self.runtime, self.counters.address
        for layer, adds in layers:
            for block, position, chunks in adds:
                at = self.offsets[block] + position
                self.targets[at] += chunks
                runtime.wait_value(self.stream, base + 8 * at, self.targets[at])
            event = user_event(runtime, self.device)
            event.record(self.stream)
            transfer.layer_events[layer] = event

    def drain(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self._owned.close()
