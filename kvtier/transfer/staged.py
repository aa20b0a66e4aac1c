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
from kvtier.transfer.indices import IndexRing
from kvtier.transfer.plan import layer_spans

RING_SLOTS = 32
"""Index slots of the relayout stream. Queuing a transfer must not wait for the GPU: with 4 slots the Python thread
blocked on batch i-4, so the per-layer relayouts of the last batch were queued only after the DMAs had drained
(H200, DeepSeek-V3 MLA, 61 layers: per-layer loads 86% of the link vs 95% without layer events)."""

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
        halves = 2 if self.capacity >= 2 else 1
        self.half = self.capacity // halves
        runtime = engine.runtime
        self.blocks = relayout_blocks or runtime.device_attributes(engine.device).multiprocessors
        self.layout = engine.host_pool.layout
        self.strides = host_strides(g, self.layout, self.capacity)
        self.tensor_bytes = self.capacity * g.layers * g.page_bytes
        self.buffer = DeviceBuffer(g.tensors * self.tensor_bytes, engine.device, runtime=runtime)
        self.table = build_pointer_table(runtime, engine.device,
                                         [a for t in range(g.tensors) for a in self.layer_addresses(t)])
        self.stream = runtime.create_stream(engine.device)
        self.ring = IndexRing(runtime, engine.device, self.stream, slots=RING_SLOTS)
        self.free = [runtime.create_event(engine.device) for _ in range(halves)]
        self.ready, self.idle = runtime.create_event(engine.device), runtime.create_event(engine.device)

    def layer_addresses(self, tensor: int) -> list:
        base = self.buffer.address + tensor * self.tensor_bytes
        return [base + layer * self.strides.layer for layer in range(self.geometry.layers)]

    def run(self, direction: str, src: np.ndarray, dst: np.ndarray, layers: Sequence[int], per_layer: bool,
            stream: Stream, transfer: Transfer) -> None:
        """Batches alternate between the two halves of the staging area, so the relayout of one batch (on the
        relayout stream) overlaps the DMA of the previous one (on the transfer's stream)."""
        device_pages, host_pages = (src, dst) if direction == "d2h" else (dst, src)
        order = np.argsort(host_pages, kind="stable")
        batches = [order[i:i + self.half] for i in range(0, order.size, self.half)]
        for number, batch in enumerate(batches):
            half = number % len(self.free)
            staged = half * self.half + np.arange(batch.size, dtype=np.int64)
            runs = [(k + half * self.half, h, n) for k, h, n in slot_runs(host_pages[batch])]
            last = transfer if number == len(batches) - 1 else None
            if direction == "d2h":
                self._backup_batch(half, device_pages[batch], staged, runs, layers, stream)
            else:
                self._load_batch(half, device_pages[batch], staged, runs, layers, stream, last, per_layer)
        stream.wait(self.idle)

    def _relayout(self, direction: str, device_pages: np.ndarray, staged: np.ndarray, spans: list[tuple[int, int]],
                  transfer: Transfer | None = None, per_layer: bool = False) -> None:
        """Upload the batch's indices once, then one launch per span (marking each layer when ``transfer``)."""
        engine = self.engine
        pair = (device_pages, staged) if direction == "d2h" else (staged, device_pages)
        (src_index, dst_index), slot = self.ring.upload(engine.unit_arrays(*pair))
        units = len(engine.plan.units(device_pages))
        for begin, count in spans:
            engine.kernel(direction, src_index, dst_index, units, begin, count, self.stream, self.table, self.blocks)
            if transfer is not None:
                engine.mark(transfer, begin, count, self.stream, per_layer)
        self.ring.fence(slot)

    def _backup_batch(self, half: int, device_pages: np.ndarray, staged: np.ndarray,
                      runs: list[tuple[int, int, int]], layers: Sequence[int], stream: Stream) -> None:
        self.stream.wait(self.free[half])
        self._relayout("d2h", device_pages, staged, layer_spans(layers, False))
        self.ready.record(self.stream)
        stream.wait(self.ready)
        self._dma("d2h", runs, layers, stream)
        self.free[half].record(stream)
        self.idle.record(self.stream)

    def _load_batch(self, half: int, device_pages: np.ndarray, staged: np.ndarray, runs: list[tuple[int, int, int]],
                    layers: Sequence[int], stream: Stream, transfer: Transfer | None, per_layer: bool) -> None:
        stream.wait(self.free[half])
        self._dma("h2d", runs, layers, stream)
        self.ready.record(stream)
        self.stream.wait(self.ready)
        spans = layer_spans(layers, per_layer and transfer is not None)
        self._relayout("h2d", device_pages, staged, spans, transfer, per_layer)
        self.free[half].record(self.stream)
        self.idle.record(self.stream)

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
        self.stream.synchronize()
        self.ring.close()
        for event in (*self.free, self.ready, self.idle):
            event.close()
        self.stream.close()
        self.table.close()
        self.buffer.close()
