"""Index arrays on the device, uploaded on the transfer's own stream.

A ring of slots (pinned host staging + device buffer each): a slot is rewritten only after the event recorded behind
the work that read it has completed, so queuing many transfers never overwrites indices still in use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.memory import DeviceAddress, DeviceBuffer, HostBuffer, HostKind
from kvtier.runtime import Event, Runtime, Stream


@dataclass
class _Slot:
    host: HostBuffer
    device: DeviceBuffer
    view: np.ndarray
    done: Event | None = None

    @property
    def capacity(self) -> int:
        return self.host.nbytes

    def close(self) -> None:
        if self.done is not None:
            self.done.synchronize()
            self.done.close()
        del self.view
        self.host.close()
        self.device.close()


class IndexRing:
    def __init__(self, runtime: Runtime, device: int, stream: Stream, slots: int = 4) -> None:
        self.runtime, self.device, self.stream = runtime, device, stream
        self._slots: list[_Slot | None] = [None] * slots
        self._next = 0

    def _slot(self, index: int, nbytes: int) -> _Slot:
        """Slot ``index``, once the work that last read it is done, with room for ``nbytes``."""
        slot = self._slots[index]
        if slot is not None and slot.done is not None:
            slot.done.synchronize()
        if slot is None or slot.capacity < nbytes:
            capacity = max(nbytes, 2 * slot.capacity if slot else 0, 1 << 16)
            if slot is not None:
                slot.close()
            host = HostBuffer.allocate(capacity, HostKind.PINNED, runtime=self.runtime)
            slot = _Slot(host, DeviceBuffer(capacity, self.device, runtime=self.runtime), host.as_tensor().numpy())
            self._slots[index] = slot
        return slot

    def upload(self, arrays: list[np.ndarray]) -> tuple[list[DeviceAddress], int]:
        """Queue the arrays' upload on the stream; returns their device addresses and the slot to fence."""
        index = self._next
        self._next = (self._next + 1) % len(self._slots)
        offsets = np.concatenate(([0], np.cumsum([-(-a.nbytes // 16) * 16 for a in arrays]))).astype(int).tolist()
        slot = self._slot(index, max(offsets[-1], 16))
        for array, offset in zip(arrays, offsets, strict=False):
            slot.view[offset:offset + array.nbytes] = array.view(np.uint8).reshape(-1)
        self.runtime.memcpy_async(slot.device.address.value, slot.host.cpu_address.value, offsets[-1],
                                  stream=self.stream)
        return [slot.device.address + offset for offset in offsets[:-1]], index

    def fence(self, index: int) -> None:
        """Mark the end of the work that reads slot ``index``."""
        slot = self._slots[index]
        if slot is None:
            return
        if slot.done is None:
            slot.done = self.runtime.create_event(self.device)
        slot.done.record(self.stream)

    def close(self) -> None:
        for slot in self._slots:
            if slot is not None:
                slot.close()
        self._slots = [None] * len(self._slots)
