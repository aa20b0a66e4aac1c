"""The transfer engine of model-family pools (state, page rows): the same contract as ``TransferEngine``.

Backups run all layers on the D2H stream; loads run on the H2D stream and give one event per model layer (a layer
without rows in this pool gets its event at once, so a model waits on every layer alike): one launch per part, each
layer signalled from the device (``LayerSignals``), or a launch per part and layer where the runtime cannot. Each
part is an SM copy through the launch boundary (``kernel`` backend, ``max_blocks`` SMs), ordered after the caller's
current stream unless ``after`` says otherwise; one lock around queuing, so threads may share an engine; closing
drains.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.checks import index_array, integer
from kvtier.errors import InvalidArgument
from kvtier.kernels import ChunkCopy, ChunkSide, KernelLauncher
from kvtier.memory import HostKind
from kvtier.memory.lifetime import Owned
from kvtier.pools import build_pointer_table
from kvtier.pools.family import FamilyDevicePool, FamilyHostPool, Part
from kvtier.runtime import Graph, Stream
from kvtier.transfer.arguments import check_pools, checked_layers, choose_backup_threads
from kvtier.transfer.completion import Transfer, user_event
from kvtier.transfer.engine import CapturedLoad
from kvtier.transfer.indices import IndexRing, arena_bytes
from kvtier.transfer.job import D2H, H2D
from kvtier.transfer.lifetime import PoolUser
from kvtier.transfer.ordering import CURRENT, order_after
from kvtier.transfer.plan import layer_spans
from kvtier.transfer.signals import LayerSignals


class FamilyEngine(PoolUser):
    def __init__(self, device_pool: FamilyDevicePool, host_pool: FamilyHostPool, *, max_blocks: int = 2,
                 threads: int = 1024, index_bytes: int = 8, launcher: KernelLauncher | None = None,
                 index_ring_bytes: int | None = None, layer_signals: bool | None = None,
                 backup_threads: int | None = None) -> None:
        """``layer_signals``: per-layer loads as one launch per part whose layers are signalled from the device
        (default: where the runtime can wait on a memory value; False: a launch per part and layer, as before).
        ``threads`` and ``backup_threads``: threads per block of loads and of backups, as for TransferEngine."""
        check_pools(device_pool, host_pool)
        if host_pool.buffer.kind is HostKind.PAGEABLE:
            raise InvalidArgument("kernel copies need a device-accessible host pool, and this one is pageable: "
                                  "allocate it 'registered', 'pinned' or 'shm'")
        self.max_blocks = integer(max_blocks, "max_blocks", low=1)
        self.threads = integer(threads, "threads", low=32, high=1025)
        if self.threads % 32 or index_bytes not in (4, 8):
            raise InvalidArgument(f"threads must be whole warps and index_bytes 4 or 8, got {threads}, {index_bytes}")
        self.backup_threads = choose_backup_threads(backup_threads, self.threads, self.max_blocks)
        if layer_signals is not None and not isinstance(layer_signals, bool):
            raise InvalidArgument(f"layer_signals must be None (automatic), True or False, got {layer_signals!r}")
        signalled = LayerSignals.available(device_pool.runtime, device_pool.device)
        if layer_signals and not signalled:
            raise InvalidArgument(f"layer_signals=True: {device_pool.runtime.name} cannot wait on a memory value on "
                                  f"device {device_pool.device}")
        self.device_pool, self.host_pool, self.index_bytes = device_pool, host_pool, index_bytes
        self.geometry, self.runtime, self.device = device_pool.geometry, device_pool.runtime, device_pool.device
        self.launcher = launcher or KernelLauncher(self.runtime)
        self.launcher.check_threads(self.threads, self.max_blocks)
        self.launcher.check_threads(self.backup_threads, self.max_blocks)
        self._start(device_pool, host_pool)
        self._captures: weakref.WeakSet[CapturedLoad] = weakref.WeakSet()
        self._owned = Owned()
        with self._owned.building() as owned:
            self.streams = {d: owned.own(self.runtime.create_stream(self.device)) for d in (D2H, H2D)}
            most = max(part.units_per_page for part, _ in device_pool.parts()) * device_pool.units
            ring = index_ring_bytes or arena_bytes(most, index_bytes)
            self.rings = {d: owned.own(IndexRing(self.runtime, self.device, self.streams[d], ring))
                          for d in (D2H, H2D)}
            self._sides: dict[str, tuple[Part, ChunkSide, ChunkSide]] = {}
            for part, placement in device_pool.parts():
                host = host_pool.placement(part)
                tables = [owned.own(build_pointer_table(self.runtime, self.device, list(p.bases)))
                          for p in (placement, host)]
                device_side, host_side = (ChunkSide(t, p.page_stride, p.unit_stride, p.piece_stride,
                                                    part.units_per_page)
                                          for t, p in zip(tables, (placement, host), strict=True))
                self._sides[part.name] = (part, device_side, host_side)
            self._blocks = {name: i for i, name in enumerate(self._sides)}
            self.signals = (owned.own(LayerSignals(self.runtime, self.device,
                                                   [len(part.layers) for part, _, _ in self._sides.values()]))
                            if signalled and layer_signals is not False else None)
        self._attach()

    @property
    def default_unit(self) -> str:
        return "slot" if any(part.unit == "slot" for part, _, _ in self._sides.values()) else "page"

    # -- public operations ----------------------------------------------------------------------------------------
    def backup(self, device_units: Any, host_units: Any, *, unit: str | None = None, after: Any = CURRENT
               ) -> Transfer:
        """Every layer of ``device_units`` (slots, pages or tokens) → ``host_units``, on the D2H stream."""
        with self._lock:
            self._check_open()
            unit, dev, host = self._units(device_units, host_units, unit, D2H)
            return self._submit(D2H, unit, dev, host, None, after, per_layer=False)

    def load(self, host_units: Any, device_units: Any, *, unit: str | None = None,
             layers: Sequence[int] | None = None, after: Any = CURRENT, per_layer: bool = True) -> Transfer:
        """``host_units`` → ``device_units`` layer by layer on the H2D stream, one event per model layer."""
        with self._lock:
            self._check_open()
            unit, dev, host = self._units(device_units, host_units, unit, H2D)
            return self._submit(H2D, unit, dev, host, self._layers(layers), after, per_layer=bool(per_layer))

    def copy(self, src_units: Any, dst_units: Any, *, unit: str | None = None, stream: Any = None,
             after: Any = None) -> Transfer:
        """Device units → other device units of the same pool, every layer, on ``stream`` (default: the caller's
        current stream, so the copy is ordered after what wrote the sources and before what reads the copies), after
        ``after`` too (events or streams, e.g. the load that brings the sources): a hybrid cache forks a read-only
        state snapshot into a request's own slot this way."""
        with self._lock:
            self._check_open()
            unit, dst, src = self._units(dst_units, src_units, unit, H2D, host_side=False)
            if np.intersect1d(src, dst).size:
                raise InvalidArgument(f"{unit}s {np.intersect1d(src, dst)[:4].tolist()} are both copied from and "
                                      f"written: the result would depend on the order of the copies")
            target = self.runtime.current_stream(self.device) if stream is None else self.runtime.as_stream(stream)
            order_after(self.runtime, target, after)
            transfer = Transfer(self.runtime, user_event(self.runtime, self.device))
            if src.size:
                ring = self.rings[H2D]
                indices, lease = ring.upload([self._index(src), self._index(dst)])
                order_after(self.runtime, target, [ring.stream])
                try:
                    for part, device_side, _ in self._parts(unit):
                        call = ChunkCopy(src=device_side, dst=device_side, src_index=indices[0], dst_index=indices[1],
                                         index_bytes=self.index_bytes, n_units=src.size, layer_begin=0,
                                         n_layers=len(part.layers), n_pieces=part.pieces, chunk_bytes=part.chunk_bytes,
                                         n_tensors=1, table_layers=len(part.layers))
                        self.launcher.copy_chunks(call, device=self.device, stream=target,
                                                  max_blocks=self.max_blocks, threads=self.threads)
                finally:
                    marker = self.runtime.create_event(self.device)
                    marker.record(target)
                    ring.stream.wait(marker)
                    ring.fence(lease)
            transfer.finished.record(target)
            return transfer

    def capture_load(self, host_units: Any, device_units: Any, *, layer: int, unit: str | None = None
                     ) -> CapturedLoad:
        """A one-layer load captured as a graph (indices owned by the graph; host bytes read at each replay)."""
        with self._lock:
            self._check_open()
            unit, dev, host = self._units(device_units, host_units, unit, H2D)
            layer, = self._layers([layer])
            stream = self.runtime.create_stream(self.device)
            ring = None
            try:
                ring = IndexRing(self.runtime, self.device, stream, arena_bytes(dev.size, self.index_bytes))
                indices, lease = ring.upload([self._index(host), self._index(dev)])
                stream.synchronize()
                stream.begin_capture()
                try:
                    self._launch(H2D, unit, indices, dev.size, [layer], True, stream)
                finally:
                    graph: Graph = stream.end_capture()
                ring.fence(lease)
            except BaseException:
                if ring is not None:
                    ring.close()
                stream.close()
                raise
            captured = CapturedLoad(self, graph, stream, ring)  # type: ignore[arg-type]
            self._captures.add(captured)
            return captured

    def _drain_more(self) -> None:
        if self.signals is not None:
            self.signals.drain()

    def _release(self) -> None:
        for captured in list(self._captures):
            captured.close()
        self._owned.close()

    # -- internals --------------------------------------------------------------------------------------------------
    def _parts(self, unit: str) -> list[tuple[Part, ChunkSide, ChunkSide]]:
        return [sides for sides in self._sides.values() if sides[0].unit == unit]

    def _units(self, device_units: Any, host_units: Any, unit: str | None, direction: str, host_side: bool = True
               ) -> tuple[str, np.ndarray, np.ndarray]:
        """Checked index arrays; ``host_side=False``: the second list names device units too (a device copy)."""
        unit = unit or self.default_unit
        if not self._parts(unit):
            kinds = sorted({part.unit for part, _, _ in self._sides.values()})
            raise InvalidArgument(f"{self.geometry.name} pools move {' or '.join(kinds)}s, not {unit}s")
        other = "host" if host_side else "source device"
        dev, host = index_array(device_units, f"device {unit}s"), index_array(host_units, f"{other} {unit}s")
        if dev.size != host.size:
            raise InvalidArgument(f"{dev.size} device {unit}s but {host.size} {other} {unit}s: index lists must match")
        per_page = self._parts(unit)[0][0].units_per_page
        self.device_pool.check_units(dev // per_page if unit == "token" else dev, f"device {unit}")
        (self.host_pool if host_side else self.device_pool).check_units(
            host // per_page if unit == "token" else host, f"{other} {unit}")
        if unit == "token" and not getattr(self.geometry, "token_granular", True):
            pages = self.geometry.whole_pages(dev, host)
            if pages is None:
                raise InvalidArgument(f"{self.geometry.name} rows are packed per page: a token transfer must cover "
                                      f"whole pages from their first token, on both sides (got {dev.size} tokens)")
            unit, (dev, host) = "page", pages
        destination = host if direction == D2H else dev
        ordered = np.sort(destination)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if repeated.size:
            raise InvalidArgument(f"destination {unit} {int(repeated[0])} appears twice: a unit written twice in one "
                                  f"transfer would mix the bytes of both sources")
        return unit, dev, host

    def _layers(self, layers: Sequence[int] | None) -> list[int]:
        return checked_layers(layers, self.geometry.layers)

    def _index(self, units: np.ndarray) -> np.ndarray:
        if self.index_bytes == 4 and units.size and int(units.max()) >= 1 << 31:
            raise InvalidArgument(f"unit {int(units.max())} does not fit int32 indices: use index_bytes=8")
        return units.astype(np.int64 if self.index_bytes == 8 else np.int32)

    def _submit(self, direction: str, unit: str, dev: np.ndarray, host: np.ndarray, layers: list[int] | None,
                after: Any, per_layer: bool) -> Transfer:
        stream = self.streams[direction]
        order_after(self.runtime, stream, after)
        transfer = Transfer(self.runtime, user_event(self.runtime, self.device))
        layers = list(range(self.geometry.layers)) if layers is None else layers
        marks = transfer.layer_events if per_layer else None
        if dev.size:
            ring = self.rings[direction]
            src, dst = (dev, host) if direction == D2H else (host, dev)
            indices, lease = ring.upload([self._index(src), self._index(dst)])
            try:
                if per_layer and direction == H2D and self.signals is not None:
                    self._launch_signalled(unit, indices, dev.size, layers, stream, transfer)
                else:
                    self._launch(direction, unit, indices, dev.size, layers, per_layer, stream, marks)
            finally:
                ring.fence(lease)
        elif marks is not None:
            for layer in layers:
                marks[layer] = self._mark(stream)
        transfer.finished.record(stream)
        return transfer

    def _mark(self, stream: Stream) -> Any:
        event = user_event(self.runtime, self.device)
        event.record(stream)
        return event

    def _launch_signalled(self, unit: str, indices: list[Any], count: int, layers: list[int], stream: Stream,
                          transfer: Transfer) -> None:
        """A per-layer load as one launch per part and run of the part's layers; each part advances its own
        counters, and a model layer's event waits for every part that stores it."""
        signals = self.signals
        assert signals is not None
        signals.begin(stream)
        adds: dict[int, list[tuple[int, int, int]]] = {layer: [] for layer in layers}
        for part, device_side, host_side in self._parts(unit):
            block = self._blocks[part.name]
            where = {layer: i for i, layer in enumerate(part.layers)}
            spans = layer_spans([where[layer] for layer in layers if layer in where], False)
            call = ChunkCopy(src=host_side, dst=device_side, src_index=indices[0], dst_index=indices[1],
                             index_bytes=self.index_bytes, n_units=count, layer_begin=0, n_layers=len(part.layers),
                             n_pieces=part.pieces, chunk_bytes=part.chunk_bytes, n_tensors=1,
                             table_layers=len(part.layers), layer_done=signals.block(block))
            launch = self.launcher.prepare(call, spans, device=self.device, max_blocks=self.max_blocks,
                                           threads=self.threads)
            for begin, n in spans:
                launch(begin, n, stream)
            if launch.chunks_per_layer:
                for layer in layers:
                    if layer in where:
                        adds[layer].append((block, where[layer], launch.chunks_per_layer))
        signals.arm([(layer, adds[layer]) for layer in layers], transfer)

    def _launch(self, direction: str, unit: str, indices: list[Any], count: int, layers: list[int], per_layer: bool,
                stream: Stream, marks: dict[int, Any] | None = None) -> None:
        """Per-layer: for each model layer, every part that has it, then the layer's event. Otherwise one launch per
        part and run of consecutive layers. Each part's copy is checked and resolved once (``prepare``); a layer
        costs its launches only."""
        groups = [[(layer, 1)] for layer in layers] if per_layer else [layer_spans(layers, False)]
        chosen = set(layers)
        launches = []
        for part, device_side, host_side in self._parts(unit):
            where = {layer: i for i, layer in enumerate(part.layers)}
            spans = layer_spans([where[layer] for layer in layers if layer in where], per_layer)
            src, dst = (device_side, host_side) if direction == D2H else (host_side, device_side)
            call = ChunkCopy(src=src, dst=dst, src_index=indices[0], dst_index=indices[1], index_bytes=self.index_bytes,
                             n_units=count, layer_begin=0, n_layers=len(part.layers), n_pieces=part.pieces,
                             chunk_bytes=part.chunk_bytes, n_tensors=1, table_layers=len(part.layers))
            launch = self.launcher.prepare(call, spans, device=self.device, max_blocks=self.max_blocks,
                                           threads=self.backup_threads if direction == D2H else self.threads)
            launches.append((launch, where, dict(spans)))
        for group in groups:
            for launch, where, starts in launches:
                positions = [where[layer] for begin, n in group for layer in range(begin, begin + n)
                             if layer in where and layer in chosen]
                for position in positions:
                    if position in starts:
                        launch(position, starts[position], stream)
            if marks is not None:
                for begin, n in group:
                    for layer in range(begin, begin + n):
                        marks[layer] = self._mark(stream)
