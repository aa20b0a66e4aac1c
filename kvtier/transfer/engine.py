"""The transfer engine: KV pages between a device pool and a host pool, D2H (backup) and H2D (load).

Backups and loads run on their own streams, so both directions overlap. A load records one event per layer, so a
consumer can wait for layer i only (layer-wise overlap in prefill); every transfer ends with an event the caller can
poll. Backends: ``kernel`` (SM copies under an SM budget; CUDA-graph capturable), ``staged`` (device relayout into a
staging area, then large DMAs: see ``staged.py``), ``direct`` (one memcpy per
contiguous run; also serves pageable host pools), ``batch`` (runs through the runtime's batched memcpy, falling back to
``direct`` where it is unavailable or capture is on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.errors import KvtierError
from kvtier.kernels import ChunkCopy, KernelLauncher
from kvtier.memory import HostKind
from kvtier.pools import DevicePool, HostPool, build_pointer_table, device_strides
from kvtier.runtime import Event, Graph, Stream
from kvtier.transfer.indices import IndexRing
from kvtier.transfer.plan import layer_spans, merge_runs, plan_for
from kvtier.transfer.staged import StagingArea

BACKENDS = ("kernel", "staged", "direct", "batch")
KERNEL_BACKENDS = ("kernel", "staged")
D2H, H2D = "d2h", "h2d"


@dataclass
class Transfer:
    """A queued transfer: ``done()`` polls, ``wait()`` blocks, ``layer_events[i]`` marks layer i (loads)."""

    finished: Event
    layer_events: dict[int, Event] = field(default_factory=dict)

    def done(self) -> bool:
        return self.finished.query()

    def wait(self) -> None:
        self.finished.synchronize()

    def wait_layer(self, layer: int) -> None:
        if layer not in self.layer_events:
            raise KvtierError(f"layer {layer} is not part of this transfer (layers {sorted(self.layer_events)})")
        self.layer_events[layer].synchronize()


@dataclass
class CapturedLoad:
    """A per-layer load captured as a graph; each ``replay`` copies the host pages as they are then."""

    graph: Graph
    stream: Stream
    keep: list[Any]

    def replay(self) -> None:
        self.graph.launch(self.stream)

    def close(self) -> None:
        self.graph.close()
        for handle in self.keep:
            handle.close()


def _pages(values: Any, what: str) -> np.ndarray:
    array = np.asarray(values.cpu() if hasattr(values, "cpu") else values)
    if array.size == 0:
        return np.empty(0, np.int64)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise KvtierError(f"{what} indices must be integers, got dtype {array.dtype}")
    return array.astype(np.int64).reshape(-1)


class TransferEngine:
    def __init__(self, device_pool: DevicePool, host_pool: HostPool, *, backend: str = "kernel",
                 max_blocks: int = 2, threads: int = 1024, index_bytes: int = 8,
                 launcher: KernelLauncher | None = None, staging_bytes: int = 256 << 20,
                 relayout_blocks: int | None = None) -> None:
        """``max_blocks`` is the SM budget of kernel copies; ``staging_bytes`` the device staging area of each
        direction (staged backend), whose relayout kernels use ``relayout_blocks`` (default: every SM)."""
        if backend not in BACKENDS:
            raise KvtierError(f"unknown io backend {backend!r}: choose one of {BACKENDS}")
        if device_pool.geometry != host_pool.geometry:
            raise KvtierError(f"pool geometries differ: {device_pool.geometry} vs {host_pool.geometry}")
        if device_pool.runtime is not host_pool.runtime:
            raise KvtierError("device and host pools belong to different runtimes")
        if backend == "kernel" and host_pool.buffer.kind is HostKind.PAGEABLE:
            raise KvtierError("the kernel backend needs a device-accessible host pool, and this one is pageable: "
                              "allocate it 'registered', 'pinned' or 'shm', or use backend='direct'")
        if index_bytes not in (4, 8):
            raise KvtierError(f"index_bytes must be 4 (int32) or 8 (int64), got {index_bytes}")
        self.device_pool, self.host_pool, self.backend = device_pool, host_pool, backend
        self.runtime, self.device = device_pool.runtime, device_pool.device
        self.geometry, self.plan = device_pool.geometry, plan_for(device_pool.geometry, host_pool.strides)
        self.max_blocks, self.threads, self.index_bytes = max_blocks, threads, index_bytes
        self.streams = {D2H: self.runtime.create_stream(self.device), H2D: self.runtime.create_stream(self.device)}
        self._closables: list[Any] = list(self.streams.values())
        if backend in KERNEL_BACKENDS:
            self.launcher = launcher or KernelLauncher(self.runtime)
            tensors = range(self.geometry.tensors)
            self.device_table = build_pointer_table(self.runtime, self.device,
                                                    [a for t in tensors for a in device_pool.layers[t]])
            self.rings = {d: IndexRing(self.runtime, self.device, s) for d, s in self.streams.items()}
            self._closables += [self.device_table, *self.rings.values()]
        if backend == "kernel":
            self.host_table = build_pointer_table(
                self.runtime, self.device, [a for t in tensors for a in host_pool.layer_addresses(t, self.device)])
            self._closables.append(self.host_table)
        if backend == "staged":
            self.staging = {d: StagingArea(self, staging_bytes, relayout_blocks) for d in (D2H, H2D)}
            self._closables += list(self.staging.values())

    # -- public operations ----------------------------------------------------------------------------------------
    def backup(self, device_pages: Any, host_pages: Any, *, after: Event | None = None) -> Transfer:
        """All layers of ``device_pages`` → ``host_pages``, on the D2H stream."""
        dev, host = self._check(device_pages, host_pages)
        return self._run(D2H, dev, host, range(self.geometry.layers), after, per_layer=False)

    def load(self, host_pages: Any, device_pages: Any, *, layers: Sequence[int] | None = None,
             after: Event | None = None, per_layer: bool = True) -> Transfer:
        """``host_pages`` → ``device_pages`` layer by layer on the H2D stream, one event per layer.

        ``per_layer=False`` moves each run of consecutive layers in one operation and records only the final event:
        fewer launches and no per-layer tails, for loads that no layer-wise compute waits on."""
        dev, host = self._check(device_pages, host_pages)
        chosen = list(range(self.geometry.layers)) if layers is None else [int(x) for x in layers]
        bad = [x for x in chosen if not 0 <= x < self.geometry.layers]
        if bad:
            raise KvtierError(f"layer {bad[0]} is out of range (pool has {self.geometry.layers} layers)")
        return self._run(H2D, host, dev, chosen, after, per_layer=per_layer)

    def capture_load(self, host_pages: Any, device_pages: Any, *, layer: int) -> CapturedLoad:
        """Capture a one-layer load as a graph (kernel backend).

        The graph owns its indices; the host bytes are read when it replays.
        """
        if self.backend != "kernel":
            raise KvtierError(f"graph capture needs the kernel backend, not {self.backend!r}")
        dev, host = self._check(device_pages, host_pages)
        if not 0 <= layer < self.geometry.layers:
            raise KvtierError(f"layer {layer} is out of range (pool has {self.geometry.layers} layers)")
        stream = self.runtime.create_stream(self.device)
        ring = IndexRing(self.runtime, self.device, stream, slots=1)
        (src_index, dst_index), slot = ring.upload(self.unit_arrays(host, dev))
        stream.synchronize()
        stream.begin_capture()
        try:
            self.kernel(H2D, src_index, dst_index, len(self.plan.units(host)), layer, 1, stream)
        finally:
            graph = stream.end_capture()
        return CapturedLoad(graph, stream, [ring, stream])

    def synchronize(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()

    def close(self) -> None:
        self.synchronize()
        for handle in reversed(self._closables):
            handle.close()
        self._closables.clear()

    # -- internals --------------------------------------------------------------------------------------------------
    def _check(self, device_pages: Any, host_pages: Any) -> tuple[np.ndarray, np.ndarray]:
        dev, host = _pages(device_pages, "device page"), _pages(host_pages, "host page")
        if dev.size != host.size:
            raise KvtierError(f"{dev.size} device pages but {host.size} host pages: index lists must match")
        self.device_pool.check_pages(dev)
        self.host_pool.check_pages(host)
        return dev, host

    def unit_arrays(self, src: np.ndarray, dst: np.ndarray) -> list[np.ndarray]:
        dtype = np.int64 if self.index_bytes == 8 else np.int32
        return [self.plan.units(src).astype(dtype), self.plan.units(dst).astype(dtype)]

    def _run(self, direction: str, src: np.ndarray, dst: np.ndarray, layers: Sequence[int], after: Event | None,
             per_layer: bool) -> Transfer:
        stream = self.streams[direction]
        if after is not None:
            stream.wait(after)
        transfer = Transfer(self.runtime.create_event(self.device))
        if src.size and self.backend == "staged":
            self.staging[direction].run(direction, src, dst, layers, per_layer, stream, transfer)
        elif src.size and self.backend == "kernel":
            ring = self.rings[direction]
            (src_index, dst_index), slot = ring.upload(self.unit_arrays(src, dst))
            units = len(self.plan.units(src))
            for begin, count in layer_spans(layers, per_layer):
                self.kernel(direction, src_index, dst_index, units, begin, count, stream)
                self.mark(transfer, begin, count, stream, per_layer)
            ring.fence(slot)
        elif src.size:
            runs = self._runs(direction, src, dst)
            for begin, count in layer_spans(layers, per_layer):
                for layer in range(begin, begin + count):
                    self._dma(direction, runs, layer, stream)
                self.mark(transfer, begin, count, stream, per_layer)
        else:
            for layer in layers if per_layer else ():
                self.mark(transfer, layer, 1, stream, per_layer)
        transfer.finished.record(stream)
        return transfer

    def mark(self, transfer: Transfer, begin: int, count: int, stream: Stream, per_layer: bool) -> None:
        if per_layer:
            event = self.runtime.create_event(self.device)
            event.record(stream)
            transfer.layer_events[begin] = event

    def kernel(self, direction: str, src_index: Any, dst_index: Any, units: int, begin: int, count: int,
               stream: Stream, host_table: Any = None, blocks: int | None = None) -> None:
        """One launch for every tensor; ``host_table`` may name a staging area laid out like the host pool."""
        device_side = self.plan.device_side(self.device_table)
        host_side = self.plan.host_side(self.host_table if host_table is None else host_table)
        src, dst = (device_side, host_side) if direction == D2H else (host_side, device_side)
        call = ChunkCopy(src, dst, src_index, dst_index, self.index_bytes, units, begin, count, self.plan.pieces,
                         self.plan.chunk_bytes, self.geometry.tensors, self.geometry.layers)
        self.launcher.copy_chunks(call, device=self.device, stream=stream, max_blocks=blocks or self.max_blocks,
                                  threads=self.threads)

    def _runs(self, direction: str, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, ...]:
        device_offsets = self.plan.offsets(src if direction == D2H else dst, device_strides(self.geometry))
        host_offsets = self.plan.offsets(dst if direction == D2H else src, self.host_pool.strides)
        if direction == D2H:
            return merge_runs(device_offsets, host_offsets, self.plan.chunk_bytes)
        return merge_runs(host_offsets, device_offsets, self.plan.chunk_bytes)

    def _dma(self, direction: str, runs: tuple[np.ndarray, ...], layer: int, stream: Stream) -> None:
        src_offsets, dst_offsets, sizes = runs
        for tensor in range(self.geometry.tensors):
            device_base = self.device_pool.layers[tensor][layer].value
            host_base = self.host_pool.layer_cpu_addresses(tensor)[layer].value
            src_base, dst_base = (device_base, host_base) if direction == D2H else (host_base, device_base)
            srcs, dsts = (src_base + src_offsets).tolist(), (dst_base + dst_offsets).tolist()
            if self.backend == "batch":
                self.runtime.memcpy_batch_async(dsts, srcs, sizes.tolist(), stream=stream)
            else:
                for d, s, n in zip(dsts, srcs, sizes.tolist(), strict=True):
                    self.runtime.memcpy_async(d, s, n, stream=stream)
