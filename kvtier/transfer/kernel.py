"""The ``kernel`` backend: SM copies under an SM budget, one launch per layer (or per run of layers), K and V in one
launch. Also the pointer tables and the one launch helper the ``staged`` backend's relayout shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.errors import InvalidArgument
from kvtier.kernels import ChunkCopy, PreparedCopy
from kvtier.memory import HostKind
from kvtier.memory.lifetime import Owned
from kvtier.pools import PointerTable, build_pointer_table
from kvtier.runtime import Graph, Stream
from kvtier.transfer.backend import Backend, BackendOptions
from kvtier.transfer.indices import IndexRing, arena_bytes
from kvtier.transfer.job import D2H, H2D, Context, Job
from kvtier.transfer.plan import layer_spans
from kvtier.transfer.signals import LayerSignals


def device_table(context: Context) -> PointerTable:
    """The device pool's per-layer bases, tensor-major, resolved for the engine's device."""
    pool = context.device_pool
    return build_pointer_table(context.runtime, context.device,
                               [op for t in range(context.geometry.tensors) for op in pool.layers[t]])


def launch_copy(context: Context, direction: str, indices: list[Any], units: int, spans: list[tuple[int, int]],
                stream: Stream, host_table: Any, device_table: Any, blocks: int | None = None,
                after_each: Callable[[int, int], None] | None = None, layer_done: Any = None,
                threads: int | None = None, layer_group: int = 1) -> PreparedCopy:
    """One launch per span of layers, every tensor in each; ``host_table`` may name a staging area laid out like the
    host pool; ``after_each(begin, count)`` runs after each launch is queued. With ``layer_done`` (a counter per
    layer) the walk goes ``layer_group`` layers at a time and the counter of each group's first layer grows as the
    group lands."""
    plan, g = context.plan, context.geometry
    device_side, host_side = plan.device_side(device_table), plan.host_side(host_table)
    src, dst = (device_side, host_side) if direction == D2H else (host_side, device_side)
    call = ChunkCopy(src=src, dst=dst, src_index=indices[0], dst_index=indices[1], index_bytes=context.index_bytes,
                     n_units=units, layer_begin=0, n_layers=g.layers, n_pieces=plan.pieces,
                     chunk_bytes=plan.chunk_bytes, n_tensors=g.tensors, table_layers=g.layers,
                     unit_major=plan.unit_major and layer_done is None, layer_group=layer_group, layer_done=layer_done)
    return context.launcher.copy_layer_spans(call, spans, device=context.device, stream=stream,
                                             max_blocks=blocks or context.max_blocks,
                                             threads=threads or context.threads,
                                             after_each=after_each)


def launch_signalled(context: Context, direction: str, indices: list[Any], units: int, layers: list[int],
                     stream: Stream, host_table: Any, device_table: Any, signals: LayerSignals, transfer: Any,
                     blocks: int | None = None, layer_group: int = 1) -> None:
    """A per-layer copy as one launch per run of consecutive ``layers``, walked ``layer_group`` layers at a time:
    each group's first layer waits for its counter (block 0 of ``signals``, indexed by layer) to grow by the group's
    chunks, and the group's other layers get their events right after it."""
    spans = layer_spans(layers, False)
    signals.begin(stream)
    prepared = launch_copy(context, direction, indices, units, spans, stream, host_table, device_table, blocks,
                           layer_done=signals.block(0), layer_group=layer_group)
    chunks = prepared.chunks_per_layer
    adds: list[tuple[int, list[tuple[int, int, int]]]] = []
    for begin, count in spans:
        for first in range(begin, begin + count, layer_group):
            size = min(layer_group, begin + count - first)
            adds.append((first, [(0, first, chunks * size)]))
            adds.extend((layer, []) for layer in range(first + 1, first + size))
    signals.arm(adds, transfer)


def signals_for(context: Context, layer_signals: bool | None, owned: Any) -> LayerSignals | None:
    """The engine's layer counters (one per layer) when per-layer loads should be signalled from the device:
    ``layer_signals`` None means where the runtime can wait on a memory value, True insists, False declines."""
    available = LayerSignals.available(context.runtime, context.device)
    if layer_signals and not available:
        raise InvalidArgument(f"layer_signals=True: {context.runtime.name} cannot wait on a memory value on device "
                              f"{context.device}")
    if not available or layer_signals is False:
        return None
    return owned.own(LayerSignals(context.runtime, context.device, [context.geometry.layers]))


class KernelBackend(Backend):
    name = "kernel"

    def __init__(self, context: Context, options: BackendOptions) -> None:
        """``options.layer_signals``: run per-layer loads as one launch with device-side layer counters (default:
        where the runtime can wait on a memory value); False keeps one launch and one event per layer."""
        super().__init__(context, options)
        if context.host_pool.buffer.kind is HostKind.PAGEABLE:
            raise InvalidArgument("the kernel backend needs a device-accessible host pool, and this one is pageable: "
                                  "allocate it 'registered', 'pinned' or 'shm', or use backend='direct'")
        self._owned = Owned()
        with self._owned.building() as owned:
            self.signals = signals_for(context, options.layer_signals, owned)
            self.device_table = owned.own(device_table(context))
            host = context.host_pool
            self.host_table = owned.own(build_pointer_table(
                context.runtime, context.device,
                [region for t in range(context.geometry.tensors) for region in host.layer_regions(t)]))
            self.rings = {d: owned.own(IndexRing(context.runtime, context.device, context.streams[d],
                                                 options.ring_bytes))
                          for d in (D2H, H2D)}

    def run(self, job: Job) -> None:
        context = self.context
        ring = self.rings[job.direction]
        indices, lease = ring.upload([job.src_units, job.dst_units])
        try:
            if job.per_layer and self.signals is not None:
                launch_signalled(context, job.direction, indices, job.src_units.size, list(job.layers), job.stream,
                                 self.host_table, self.device_table, self.signals, job.transfer,
                                 layer_group=context.plan.signal_group())
            else:
                launch_copy(context, job.direction, indices, job.src_units.size,
                            layer_spans(job.layers, job.per_layer), job.stream, self.host_table, self.device_table,
                            after_each=lambda begin, _: job.mark(context.runtime, context.device, begin, job.stream),
                            threads=context.backup_threads if job.direction == D2H else None)
        finally:
            ring.fence(lease)

    def capture(self, host_units: np.ndarray, device_units: np.ndarray, spans: list[tuple[int, int]], stream: Stream
                ) -> tuple[Graph, IndexRing, list[Any]]:
        """A load of ``spans`` (one launch each) captured on ``stream`` as a graph; the graph owns its index ring,
        and reads its indices from the returned addresses at every replay."""
        context = self.context
        ring = IndexRing(context.runtime, context.device, stream, arena_bytes(host_units.size, context.index_bytes))
        try:
            indices, lease = ring.upload([host_units, device_units])
            stream.synchronize()
            stream.begin_capture()
            try:
                launch_copy(context, H2D, indices, host_units.size, spans, stream, self.host_table,
                            self.device_table)
            finally:
                graph = stream.end_capture()
            ring.fence(lease)
        except BaseException:
            ring.close()
            raise
        return graph, ring, indices

    def drain(self) -> None:
        if self.signals is not None:
            self.signals.drain()

    def close(self) -> None:
        self._owned.close()
