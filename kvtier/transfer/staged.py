"""The ``staged`` backend: relayout on the device at HBM speed, then a few large DMAs.

SM copies over PCIe top out near 93% of the link; the copy engines reach the link's ceiling, but only on large
contiguous pieces. So a backup gathers the pages into a device staging area laid out exactly like the host pool (in
host-slot order, so consecutive host slots are consecutive staging slots), and moves each run of consecutive host
slots with one DMA; a load does the reverse. The relayout kernel uses many SMs for a short time
(``relayout_blocks``, default all), which keeps SM-busy time a small fraction of the transfer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.errors import InvalidArgument
from kvtier.memory import DeviceBuffer
from kvtier.memory.lifetime import Owned
from kvtier.pools import HostLayout, PointerTable, build_pointer_table, host_strides
from kvtier.runtime import Stream
from kvtier.transfer.backend import Backend, BackendOptions
from kvtier.transfer.dma import host_pieces, queue_copies
from kvtier.transfer.indices import IndexRing
from kvtier.transfer.job import D2H, H2D, Context, Job
from kvtier.transfer.kernel import device_table, launch_copy, launch_signalled, signals_for
from kvtier.transfer.plan import layer_spans
from kvtier.transfer.signals import LayerSignals


def slot_runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """Sorted host slots → (first staging slot, first host slot, length) of each run of consecutive slots."""
    if slots.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [slots.size])))
    return [(int(k), int(slots[k]), int(n)) for k, n in zip(starts, lengths, strict=True)]


def units_at(units: np.ndarray, per_page: int, positions: np.ndarray) -> np.ndarray:
    """The units of the pages at ``positions`` of a job, from the job's units (computed once per transfer)."""
    return units.reshape(-1, per_page)[positions].reshape(-1)


class StagingArea:
    """One direction's staging: a device buffer laid out like the host pool, its relayout stream, its index ring.

    The ring is sized for every batch of the largest transfer: queuing must not wait for the GPU (with 4 index slots
    the Python thread blocked on batch i-4, so the per-layer relayouts of the last batch were queued only after the
    DMAs had drained; H200, DeepSeek-V3 MLA, 61 layers: per-layer loads 86% of the link vs 95% without)."""

    def __init__(self, context: Context, table: PointerTable, staging_bytes: int, relayout_blocks: int | None,
                 ring_bytes: int, signals: LayerSignals | None = None) -> None:
        g = context.geometry
        self.signals = signals
        self.context, self.geometry, self.device_table = context, g, table
        self.capacity = staging_bytes // g.bytes_per_page
        if self.capacity < 1:
            raise InvalidArgument(f"staging_bytes={staging_bytes} holds no page ({g.bytes_per_page} bytes each)")
        halves = 2 if self.capacity >= 2 else 1
        self.half = self.capacity // halves
        runtime, device = context.runtime, context.device
        self.blocks = relayout_blocks or runtime.device_attributes(device).multiprocessors
        self.layout = context.host_pool.layout
        self.strides = host_strides(g, self.layout, self.capacity)
        self.tensor_bytes = self.capacity * g.layers * g.page_bytes
        self._owned = Owned()
        with self._owned.building() as owned:
            self.buffer = owned.own(DeviceBuffer(g.tensors * self.tensor_bytes, device, runtime=runtime))
            self.table = owned.own(build_pointer_table(
                runtime, device, [r for t in range(g.tensors) for r in self.layer_regions(t)]))
            self.stream = owned.own(runtime.create_stream(device))
            self.ring = owned.own(IndexRing(runtime, device, self.stream, ring_bytes))
            self.free = [owned.own(runtime.create_event(device)) for _ in range(halves)]
            self.ready, self.idle = owned.own(runtime.create_event(device)), owned.own(runtime.create_event(device))
            self.start = owned.own(runtime.create_event(device))

    def layer_regions(self, tensor: int) -> list:
        base = tensor * self.tensor_bytes
        return [self.buffer.region(base + layer * self.strides.layer, self.tensor_bytes - layer * self.strides.layer)
                for layer in range(self.geometry.layers)]

    def run(self, job: Job) -> None:
        """Batches alternate between the two halves of the staging area, so the relayout of one batch (on the
        relayout stream) overlaps the DMA of the previous one (on the job's stream). The relayout stream first waits
        for the job's stream, which already waits for everything the caller ordered the transfer after: a relayout
        that skipped it read KV the model had not written yet (H200: 50% stale)."""
        self.start.record(job.stream)
        self.stream.wait(self.start)
        per_page = self.context.plan.units_per_page
        order = np.argsort(job.host_pages, kind="stable")
        batches = [order[i:i + self.half] for i in range(0, order.size, self.half)]
        for number, batch in enumerate(batches):
            half = number % len(self.free)
            staged = half * self.half + np.arange(batch.size, dtype=np.int64)
            runs = [(k + half * self.half, h, n) for k, h, n in slot_runs(job.host_pages[batch])]
            device_units = units_at(job.device_units, per_page, batch)
            staged_units = self.context.plan.units(staged).astype(device_units.dtype)
            if job.direction == D2H:
                self._backup_batch(half, device_units, staged_units, runs, job)
            else:
                self._load_batch(half, device_units, staged_units, runs, job, number == len(batches) - 1)
        job.stream.wait(self.idle)

    def _relayout(self, job: Job, indices_of: list[np.ndarray], spans: list[tuple[int, int]], mark: bool) -> None:
        """Upload the batch's indices once, then one launch per span, marking each layer when ``mark``: from the
        device (one launch per run of layers, ``LayerSignals``) where the engine has signals, else with an event
        after a launch per layer."""
        context, signals = self.context, self.signals
        indices, lease = self.ring.upload(indices_of)

        def marked(begin: int, count: int) -> None:
            if mark:
                job.mark(context.runtime, context.device, begin, self.stream)

        try:
            if mark and signals is not None:
                launch_signalled(context, job.direction, indices, indices_of[0].size, list(job.layers), self.stream,
                                 self.table, self.device_table, signals, job.transfer, self.blocks)
            else:
                launch_copy(context, job.direction, indices, indices_of[0].size, spans, self.stream, self.table,
                            self.device_table, self.blocks, after_each=marked)
        finally:
            self.ring.fence(lease)

    def _backup_batch(self, half: int, device_units: np.ndarray, staged_units: np.ndarray,
                      runs: list[tuple[int, int, int]], job: Job) -> None:
        self.stream.wait(self.free[half])
        self._relayout(job, [device_units, staged_units], layer_spans(job.layers, False), False)
        self.ready.record(self.stream)
        job.stream.wait(self.ready)
        self._dma(D2H, runs, job.layers, job.stream)
        self.free[half].record(job.stream)
        self.idle.record(self.stream)

    def _load_batch(self, half: int, device_units: np.ndarray, staged_units: np.ndarray,
                    runs: list[tuple[int, int, int]], job: Job, last: bool) -> None:
        job.stream.wait(self.free[half])
        self._dma(H2D, runs, job.layers, job.stream)
        self.ready.record(job.stream)
        self.stream.wait(self.ready)
        marking = job.per_layer and last
        self._relayout(job, [staged_units, device_units], layer_spans(job.layers, marking), marking)
        self.free[half].record(self.stream)
        self.idle.record(self.stream)

    def _dma(self, direction: str, runs: list[tuple[int, int, int]], layers: Sequence[int], stream: Stream) -> None:
        """One copy per run of host slots and tensor: pages are contiguous across layers, or (``layer_first``) a
        run's layers are equally spaced on both sides, so they go run by run, layer after layer, and the runtime
        makes each run one strided copy (random slots: 32 KiB per call was per-call bound, 21-31% of the link).
        Copies that form no strided copy go batched: queuing them one call each took most of the host time of a
        staged transfer, and a transfer queued right after it (the other direction) started that much later.
        Copies are cut at the host buffer's registration boundaries."""
        context, g = self.context, self.geometry
        host = context.host_pool
        if not runs or not layers:
            return
        staged_first, host_first, lengths = (np.array(column, np.int64) for column in zip(*runs, strict=True))
        if self.layout is HostLayout.LAYER_FIRST:
            chosen = np.asarray(layers, np.int64)
            host_layers, staging_layers = chosen * host.strides.layer, chosen * self.strides.layer
            host_page = staging_page = g.page_bytes
        else:
            host_layers = staging_layers = np.zeros(1, np.int64)
            host_page, staging_page = host.strides.page, self.strides.page
        host_offsets, staging_offsets = [], []
        for tensor in range(g.tensors):
            host_offsets.append(host.tensor_offset(tensor) + (host_first * host_page)[:, None] + host_layers)
            staging_offsets.append(tensor * self.tensor_bytes + (staged_first * staging_page)[:, None]
                                   + staging_layers)
        sizes = np.tile(np.repeat(lengths * host_page, host_layers.size), g.tensors)
        offsets, staging, nbytes = host_pieces(context, np.concatenate(host_offsets, axis=None),
                                               np.concatenate(staging_offsets, axis=None), sizes)
        queue_copies(context, direction, (host.buffer.cpu_address, offsets), (self.buffer.address, staging), nbytes,
                     stream, batched=True)

    def drain(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self._owned.close()


class StagedBackend(Backend):
    name = "staged"

    def __init__(self, context: Context, options: BackendOptions) -> None:
        super().__init__(context, options)
        self._owned = Owned()
        with self._owned.building() as owned:
            self.table = owned.own(device_table(context))
            self.signals = signals_for(context, options.layer_signals, owned)
            self.areas = {d: owned.own(StagingArea(context, self.table, options.staging_bytes,
                                                   options.relayout_blocks, options.ring_bytes,
                                                   self.signals if d == H2D else None))
                          for d in (D2H, H2D)}

    def run(self, job: Job) -> None:
        self.areas[job.direction].run(job)

    def drain(self) -> None:
        for area in self.areas.values():
            area.drain()
        if self.signals is not None:
            self.signals.drain()

    def close(self) -> None:
        self._owned.close()
