"""How a caller learns a transfer has landed: the :class:`Transfer` every engine call returns (poll, wait, or make a
stream wait on the device, for the whole transfer or one layer) and the events it hands out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.runtime import Event, Runtime


def user_event(runtime: Runtime, device: int) -> Event:
    """An event handed to the caller (a transfer's end, a layer's landing): timed, so a trace can put it on a clock
    (``elapsed_ms``, or cudaEventElapsedTime against the caller's own events); kvtier's internal events are not. It
    belongs to its Transfer, which kvtier itself may still wait on (the cache's load-backs do): ``close()`` on it does
    nothing, and it is released when the Transfer and the caller's references are dropped."""
    event = runtime.create_event(device, timing=True)
    event.keeper = "Transfer"
    return event


@dataclass
class Transfer:
    """A queued transfer: ``done()`` polls, ``wait()`` blocks the CPU, ``stream_wait()`` makes a stream wait on the
    GPU (no CPU block: layer i's compute waits for layer i only); ``layer_events[i]`` marks layer i (per-layer loads).
    Layer events signalled from the device are recorded on the engine's signal stream, a moment after their layer
    lands; ``done()`` and ``wait()`` cover the copy itself."""

    runtime: Runtime
    finished: Event
    layer_events: dict[int, Event] = field(default_factory=dict)

    def done(self) -> bool:
        return self.finished.query()

    def wait(self) -> None:
        self.finished.synchronize()

    def wait_layer(self, layer: int) -> None:
        self._event(layer).synchronize()

    def stream_wait(self, stream: Any = None, *, layer: int | None = None) -> None:
        """Make ``stream`` (default: the caller's current stream of the transfer's device) wait for the transfer, or
        for one layer of it, on the device."""
        event = self.finished if layer is None else self._event(layer)
        target = self.runtime.current_stream(event.device) if stream is None else self.runtime.as_stream(stream)
        target.wait(event)

    def _event(self, layer: int) -> Event:
        if layer not in self.layer_events:
            if not self.layer_events:
                raise InvalidArgument(f"this transfer has no layer events (a backup, a load with per_layer=False, or a "
                                      f"load of no layers): wait for the whole transfer instead of layer {layer}")
            raise InvalidArgument(f"layer {layer} is not part of this transfer (layers {sorted(self.layer_events)})")
        return self.layer_events[layer]
