"""Index arrays on the device, uploaded on the transfer's own stream.

A ring of slots (pinned host staging + device buffer each): a slot is rewritten only after the event recorded behind
the work that read it has completed, so queuing many transfers never overwrites indices still in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtier.memory import DeviceAddress, DeviceBuffer, HostBuffer, HostKind
from kvtier.runtime import Event, Runtime, Stream


@dataclass
class _Slot:
    capacity: int = 0
    host: HostBuffer | None = None
    device: DeviceBuffer | None = None
    view: np.ndarray | None = None
    done: Event | None = None
    extra: list = field(default_factory=list)

    def close(self) -> None:
        self.view = None
        for handle in (self.host, self.device):
            if handle is not None:
                handle.close()
        if self.done is not None:
            self.done.close()


class IndexRing:
    def __init__(self, runtime: Runtime, device: int, stream: Stream, slots: int = 4) -> None:
        self.runtime, self.device, self.stream = runtime, device, stream
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0

    def upload(self, arrays: list[np.ndarray]) -> tuple[list[DeviceAddress], int]:
        """Queue the arrays' upload on the stream; returns their device addresses and the slot to fence."""
        index = self._next
        self._next = (self._next + 1) % len(self._slots)
        slot = self._slots[index]
        if slot.done is not None:
            slot.done.synchronize()
        sizes = [a.nbytes for a in arrays]
        offsets = np.concatenate(([0], np.cumsum([-(-s // 16) * 16 for s in sizes]))).astype(int).tolist()
        total = max(offsets[-1], 16)
        if total > slot.capacity:
            slot.close()
            capacity = max(total, 2 * slot.capacity, 1 << 16)
            slot.host = HostBuffer.allocate(capacity, HostKind.PINNED, runtime=self.runtime)
            slot.device = DeviceBuffer(capacity, self.device, runtime=self.runtime)
            slot.view = slot.host.as_tensor().numpy()
            slot.capacity, slot.done = capacity, None
        assert slot.view is not None and slot.host is not None and slot.device is not None
        for array, offset in zip(arrays, offsets, strict=False):
            slot.view[offset:offset + array.nbytes] = array.view(np.uint8).reshape(-1)
        self.runtime.memcpy_async(slot.device.address.value, slot.host.cpu_address.value, offsets[-1],
                                  stream=self.stream)
        return [slot.device.address + offset for offset in offsets[:-1]], index

    def fence(self, index: int) -> None:
        """Mark the end of the work that reads slot ``index``."""
        slot = self._slots[index]
        if slot.done is None:
            slot.done = self.runtime.create_event(self.device)
        slot.done.record(self.stream)

    def close(self) -> None:
        for slot in self._slots:
            if slot.done is not None:
                slot.done.synchronize()
            slot.close()
