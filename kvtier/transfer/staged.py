"""The ``staged`` backend: relayout on the device at HBM speed, then a few large DMAs.

SM copies over PCIe top out near 93% of the link; the copy engines reach the link's ceiling, but only on large
contiguous pieces. So a backup gathers the pages into a device staging area laid out exactly like the host pool (in
host-slot order, so consecutive host slots are consecutive staging slots), and moves each run of consecutive host
slots with one DMA; a load does the reverse. The relayout kernel uses many SMs for a short time
(``relayout_blocks``, default all), which keeps SM-busy time a small fraction of the transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import KvtierError
from kvtier.memory import DeviceBuffer
from kvtier.pools import HostLayout, build_pointer_table, host_strides
from kvtier.runtime import Stream

if TYPE_CHECKING:
    from kvtier.transfer.engine import Transfer, TransferEngine


def slot_runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """Sorted host slots → (first staging slot, first host slot, length) of each run of consecutive slots."""
    if slots.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [slots.size])))
    return [(int(k), int(slots[k]), int(n)) for k, n in zip(starts, lengths, strict=True)]


class StagingArea:
    def __init__(self, engine: TransferEngine, staging_bytes: int, relayout_blocks: int | None) -> None:
        g = engine.geometry
        self.engine, self.geometry = engine, g
        self.capacity = staging_bytes // g.bytes_per_page
        if self.capacity < 1:
            raise KvtierError(f"staging_bytes={staging_bytes} holds no page ({g.bytes_per_page} bytes each)")
        runtime = engine.runtime
        self.blocks = relayout_blocks or runtime.device_attributes(engine.device).multiprocessors
        self.layout = engine.host_pool.layout
        self.strides = host_strides(g, self.layout, self.capacity)
        self.tensor_bytes = self.capacity * g.layers * g.page_bytes
        self.buffer = DeviceBuffer(g.tensors * self.tensor_bytes, engine.device, runtime=runtime)
        self.tables = [build_pointer_table(runtime, engine.device, self.layer_addresses(t))
                       for t in range(g.tensors)]

    def layer_addresses(self, tensor: int) -> list:
        base = self.buffer.address + tensor * self.tensor_bytes
        return [base + layer * self.strides.layer for layer in range(self.geometry.layers)]

    def run(self, direction: str, src: np.ndarray, dst: np.ndarray, layers: Sequence[int], per_layer: bool,
            stream: Stream, transfer: Transfer) -> None:
        engine = self.engine
        device_pages, host_pages = (src, dst) if direction == "d2h" else (dst, src)
        order = np.argsort(host_pages, kind="stable")
        batches = [order[i:i + self.capacity] for i in range(0, order.size, self.capacity)]
        for number, batch in enumerate(batches):
            last = number == len(batches) - 1
            staged = np.arange(batch.size, dtype=np.int64)
            runs = slot_runs(host_pages[batch])
            if direction == "d2h":
                arrays = engine.unit_arrays(device_pages[batch], staged)
            else:
                arrays = engine.unit_arrays(staged, device_pages[batch])
            ring = engine.rings[direction]
            (src_index, dst_index), slot = ring.upload(arrays)
            units = arrays[0].size
            if direction == "d2h":
                engine.kernel("d2h", src_index, dst_index, units, layers[0], len(layers), stream, self.tables,
                              self.blocks)
                self._dma("d2h", runs, layers, stream)
            else:
                self._load(runs, layers, src_index, dst_index, units, stream, transfer if last else None,
                           per_layer)
            ring.fence(slot)

    def _load(self, runs: list[tuple[int, int, int]], layers: Sequence[int], src_index: object, dst_index: object,
              units: int, stream: Stream, transfer: Transfer | None, per_layer: bool) -> None:
        engine = self.engine
        if self.layout is not HostLayout.LAYER_FIRST:
            self._dma("h2d", runs, layers, stream)
        for layer in layers:
            if self.layout is HostLayout.LAYER_FIRST:
                self._dma("h2d", runs, [layer], stream)
            engine.kernel("h2d", src_index, dst_index, units, layer, 1, stream, self.tables, self.blocks)
            if transfer is not None:
                engine.mark(transfer, layer, 1, stream, per_layer)

    def _dma(self, direction: str, runs: list[tuple[int, int, int]], layers: Sequence[int], stream: Stream) -> None:
        """One copy per run of host slots: per tensor (pages contiguous across layers) or per tensor and layer."""
        engine, g = self.engine, self.geometry
        host = engine.host_pool
        copies = []
        for tensor in range(g.tensors):
            if self.layout is HostLayout.LAYER_FIRST:
                staging = [a.value for a in self.layer_addresses(tensor)]
                host_layers = [a.value for a in host.layer_cpu_addresses(tensor)]
                for layer in layers:
                    copies += [(host_layers[layer] + h * g.page_bytes, staging[layer] + k * g.page_bytes,
                                n * g.page_bytes) for k, h, n in runs]
            else:
                staging_base = self.buffer.address.value + tensor * self.tensor_bytes
                host_base = host.buffer.cpu_address.value + host.tensor_offset(tensor)
                copies += [(host_base + h * host.strides.page, staging_base + k * self.strides.page,
                            n * host.strides.page) for k, h, n in runs]
        for host_address, staging_address, nbytes in copies:
            dst, src = (host_address, staging_address) if direction == "d2h" else (staging_address, host_address)
            engine.runtime.memcpy_async(dst, src, nbytes, stream=stream)

    def close(self) -> None:
        for table in self.tables:
            table.close()
        self.buffer.close()
