"""The transfer engine: KV pages between a device pool and a host pool, D2H (backup) and H2D (load).

Backups and loads run on their own streams, so both directions overlap. A load records one event per layer, so a
consumer can wait for layer i only (layer-wise overlap in prefill); every transfer ends with an event the caller can
poll or make a stream wait on. By default a transfer is ordered after the caller's current stream (torch's current
CUDA stream where torch is in use): the KV a backup reads was written there a moment ago, and the pages a load
overwrites may still be read there. ``after=None`` opts out for callers that order things themselves.

The engine is safe to call from several threads (one lock around queuing; waiting happens outside it). Closing the
engine, or either pool, first waits for the transfers queued over them; afterwards every use raises BufferClosed.
Backends (``BACKENDS``): ``kernel`` (SM copies under an SM budget; CUDA-graph capturable), ``staged`` (device relayout
into a staging area, then large DMAs), ``direct`` (one memcpy per contiguous run; also serves pageable host pools),
``batch`` (the runtime's batched memcpy).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.checks import index_array, integer
from kvtier.errors import BufferClosed, InvalidArgument
from kvtier.kernels import KernelLauncher
from kvtier.memory import HostBuffer, HostKind
from kvtier.memory.lifetime import wait_then
from kvtier.pools import DevicePool, HostPool
from kvtier.runtime import Graph, Stream
from kvtier.transfer.arguments import check_pools, checked_layers, choose_backup_threads
from kvtier.transfer.backend import Backend, BackendOptions
from kvtier.transfer.completion import Transfer, user_event
from kvtier.transfer.dma import BatchBackend, DirectBackend
from kvtier.transfer.indices import IndexRing, arena_bytes
from kvtier.transfer.job import D2H, H2D, Context, Job
from kvtier.transfer.kernel import KernelBackend
from kvtier.transfer.lifetime import PoolUser
from kvtier.transfer.ordering import CURRENT, order_after
from kvtier.transfer.plan import index_values, layer_spans, plan_for
from kvtier.transfer.staged import StagedBackend

BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (KernelBackend, StagedBackend, DirectBackend, BatchBackend)}


@dataclass(frozen=True)
class Settings:
    """An engine's settings, checked (and numpy integers made ints) before anything is allocated."""

    backend: str
    max_blocks: int
    threads: int
    index_bytes: int
    staging_bytes: int
    relayout_blocks: int | None
    index_ring_bytes: int | None
    layer_signals: bool | None = None
    backup_threads: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InvalidArgument(f"unknown io backend {self.backend!r}: choose one of {tuple(BACKENDS)}")
        limits = {"max_blocks": (1, None), "threads": (32, 1025), "index_bytes": (None, None),
                  "staging_bytes": (1, None), "relayout_blocks": (1, None), "index_ring_bytes": (1, None)}
        for name, (low, high) in limits.items():
            value = getattr(self, name)
            if value is not None or name not in ("relayout_blocks", "index_ring_bytes"):
                object.__setattr__(self, name, integer(value, name, low=low, high=high))
        if self.index_bytes not in (4, 8):
            raise InvalidArgument(f"index_bytes must be 4 (int32) or 8 (int64), got {self.index_bytes!r}")
        if self.threads % 32:
            raise InvalidArgument(f"threads must be whole warps (a multiple of 32), got {self.threads}")
        if self.backup_threads is not None:  # the default depends on the plan's chunk size: TransferEngine picks it
            object.__setattr__(self, "backup_threads", choose_backup_threads(self.backup_threads, self.threads,
                                                                             self.max_blocks))
        if self.layer_signals is not None and not isinstance(self.layer_signals, bool):
            raise InvalidArgument(f"layer_signals must be None (automatic), True or False, got {self.layer_signals!r}")
        if self.layer_signals and self.backend not in ("kernel", "staged"):
            raise InvalidArgument(f"layer_signals=True: the {self.backend!r} backend marks layers with events; only "
                                  f"'kernel' and 'staged' signal layers from the device")


class CapturedLoad:
    """A per-layer load captured as a graph; each ``replay`` copies the host pages as they are then. It lives no
    longer than its engine: after ``close()`` (its own or the engine's) a replay raises BufferClosed."""

    def __init__(self, engine: TransferEngine, graph: Graph, stream: Stream, ring: IndexRing) -> None:
        self._engine, self.graph, self.stream, self._ring = engine, graph, stream, ring
        self.closed = False

    def replay(self) -> None:
        with self._engine._lock:
            if self.closed:
                raise BufferClosed("this captured load is closed")
            self._engine._check_open()
            self.graph.launch(self.stream)

    def drain(self) -> None:
        if not self.closed:
            self.stream.synchronize()

    def close(self) -> None:
        """Wait for replays in flight (and one another thread is queuing), then free the graph, its indices and its
        stream. Idempotent. Asked for inside the engine's own call on this thread (a replay or load, which still
        uses them), it happens as that call returns; replays and loads are refused from then on."""
        engine = self._engine
        if engine.inside_call_here() and not self.closed:
            self.closed = True
            engine.after_call(self._close_now)
            return
        with engine._lock:
            if self.closed:
                return
            self.closed = True
            self._close_now()

    def _close_now(self) -> None:
        with self._engine._lock:
            wait_then(self.stream.synchronize, self._free, self._reopen)

    def _reopen(self) -> None:
        self.closed = False

    def _free(self) -> None:
        self.graph.close()
        self._ring.close()
        self.stream.close()


class CapturedShape(CapturedLoad):
    """Loads of one page count as a graph (see :meth:`TransferEngine.capture_shape`). A load writes the page lists
    into pinned staging, copies them into the graph's indices on the capture stream, and replays the graph there; the
    capture stream follows the engine's H2D stream and ``after``, and the engine's H2D stream follows the load."""

    SLOTS = 8
    """Staging slots: a load waits on the CPU only for the upload of the load ``SLOTS`` before it (which may still
    wait for its ``after``), not for the last one."""

    def __init__(self, engine: TransferEngine, graph: Graph, stream: Stream, ring: IndexRing, indices: list[Any],
                 pages: int, layers: list[int]) -> None:
        super().__init__(engine, graph, stream, ring)
        self.pages, self.layers, self._indices = pages, layers, indices
        runtime = engine.runtime
        self._nbytes = pages * engine.plan.units_per_page * engine.index_bytes
        self._staging = HostBuffer.allocate(2 * self._nbytes * self.SLOTS, HostKind.PINNED, runtime=runtime)
        self._view = self._staging.as_tensor().numpy()
        self._uploaded = [runtime.create_event(engine.device) for _ in range(self.SLOTS)]
        self._loads = 0

    def load(self, host_pages: Any, device_pages: Any, *, after: Any = CURRENT) -> Transfer:
        engine = self._engine
        with engine._lock:
            if self.closed:
                raise BufferClosed("this captured shape is closed")
            engine._check_open()
            dev, host = engine._pages(device_pages, host_pages, H2D)
            if dev.size != self.pages:
                raise InvalidArgument(f"this shape loads {self.pages} pages, got {dev.size}")
            runtime, h2d = engine.runtime, engine.streams[H2D]
            order_after(runtime, self.stream, h2d)
            order_after(runtime, self.stream, after)
            slot = self._loads % self.SLOTS
            self._loads += 1
            self._uploaded[slot].synchronize()    # the copy that last used this staging slot has read it
            for k, units in enumerate((engine._units(host), engine._units(dev))):
                at = (2 * slot + k) * self._nbytes
                self._view[at:at + self._nbytes] = units.view(np.uint8)
                runtime.memcpy_async(self._indices[k], self._staging.cpu_address + at, self._nbytes,
                                     stream=self.stream)
            self._uploaded[slot].record(self.stream)
            self.graph.launch(self.stream)
            transfer = Transfer(runtime, user_event(runtime, engine.device))
            transfer.finished.record(self.stream)
            h2d.wait(transfer.finished)
            return transfer

    def replay(self) -> None:
        raise InvalidArgument("a captured shape loads pages: call load(host_pages, device_pages)")

    def _free(self) -> None:
        try:
            super()._free()
        finally:
            del self._view
            self._staging.close()


class TransferEngine(PoolUser):
    def __init__(self, device_pool: DevicePool, host_pool: HostPool, *, backend: str = "kernel",
                 max_blocks: int = 2, threads: int = 1024, index_bytes: int = 8,
                 launcher: KernelLauncher | None = None, staging_bytes: int = 256 << 20,
                 relayout_blocks: int | None = None, index_ring_bytes: int | None = None,
                 layer_signals: bool | None = None, backup_threads: int | None = None) -> None:
        """``max_blocks`` is the SM budget of kernel copies, ``threads`` the threads per block of its loads and
        ``backup_threads`` of its backups (default: ``threads``, at most 512 when ``max_blocks`` > 1 and chunks are at
        least 512 bytes; see :func:`kvtier.transfer.arguments.choose_backup_threads` for the measurements);
        ``staging_bytes`` the device staging area of each direction (staged backend), whose relayout kernels use
        ``relayout_blocks`` (default: every SM); ``index_ring_bytes`` the index arena of each stream (default: two
        transfers of the whole device pool).
        ``layer_signals`` (kernel backend): per-layer loads as one launch whose layers are signalled from the device
        (default: where the runtime supports it; False: one launch and one event per layer, as before)."""
        settings = Settings(backend, max_blocks, threads, index_bytes, staging_bytes, relayout_blocks,
                            index_ring_bytes, layer_signals, backup_threads)
        if launcher is not None and backend in ("kernel", "staged"):
            launcher.check_threads(settings.threads, settings.max_blocks)
            if backend == "kernel" and settings.backup_threads is not None:
                launcher.check_threads(settings.backup_threads, settings.max_blocks)
        check_pools(device_pool, host_pool)
        self.device_pool, self.host_pool, self.backend = device_pool, host_pool, backend
        self.runtime, self.device = device_pool.runtime, device_pool.device
        self.geometry, self.plan = device_pool.geometry, plan_for(device_pool.geometry, host_pool.strides)
        self.max_blocks, self.threads, self.index_bytes = settings.max_blocks, settings.threads, settings.index_bytes
        self.backup_threads = choose_backup_threads(settings.backup_threads, settings.threads, settings.max_blocks,
                                                    self.plan.chunk_bytes)
        self._start(device_pool, host_pool)
        self._captures: weakref.WeakSet[CapturedLoad] = weakref.WeakSet()
        self.streams = {D2H: self.runtime.create_stream(self.device), H2D: self.runtime.create_stream(self.device)}
        ring_bytes = settings.index_ring_bytes or arena_bytes(self.plan.units_per_page * device_pool.pages,
                                                              self.index_bytes)
        launcher = launcher or KernelLauncher(self.runtime)
        context = Context(self.runtime, self.device, self.geometry, self.plan, device_pool, host_pool, launcher,
                          self.streams, self.index_bytes, self.max_blocks, self.threads, self.backup_threads)
        try:
            options = BackendOptions(ring_bytes, settings.staging_bytes, settings.relayout_blocks,
                                     settings.layer_signals)
            self._backend = BACKENDS[backend](context, options)
        except BaseException:
            for stream in self.streams.values():
                stream.close()
            raise
        self._attach()

    # -- public operations ----------------------------------------------------------------------------------------
    def backup(self, device_pages: Any, host_pages: Any, *, after: Any = CURRENT) -> Transfer:
        """All layers of ``device_pages`` → ``host_pages``, on the D2H stream. ``after``: ``CURRENT`` (default, the
        caller's current stream), an event or stream (kvtier's or torch's) or a list of them, or None (no ordering)."""
        with self._lock:
            self._check_open()
            dev, host = self._pages(device_pages, host_pages, D2H)
            return self._submit(D2H, dev, host, range(self.geometry.layers), after, per_layer=False)

    def load(self, host_pages: Any, device_pages: Any, *, layers: Sequence[int] | None = None,
             after: Any = CURRENT, per_layer: bool = True) -> Transfer:
        """``host_pages`` → ``device_pages`` layer by layer on the H2D stream, one event per layer.

        ``per_layer=False`` moves each run of consecutive layers in one operation and records only the final event:
        fewer launches and no per-layer tails, for loads that no layer-wise compute waits on."""
        with self._lock:
            self._check_open()
            dev, host = self._pages(device_pages, host_pages, H2D)
            return self._submit(H2D, dev, host, self._layers(layers), after, per_layer=bool(per_layer))

    def capture_load(self, host_pages: Any, device_pages: Any, *, layer: int) -> CapturedLoad:
        """Capture a one-layer load as a graph (kernel backend). The graph owns its indices; the host bytes are read
        when it replays. Order replays yourself (they run on ``captured.stream``)."""
        with self._lock:
            self._check_open()
            if not isinstance(self._backend, KernelBackend):
                raise InvalidArgument(f"graph capture needs the kernel backend, not {self.backend!r}")
            dev, host = self._pages(device_pages, host_pages, H2D)
            layer = integer(layer, "layer", low=0, high=self.geometry.layers)
            stream = self.runtime.create_stream(self.device)
            try:
                graph, ring, _ = self._backend.capture(self._units(host), self._units(dev), [(layer, 1)], stream)
            except BaseException:
                stream.close()
                raise
            captured = CapturedLoad(self, graph, stream, ring)
            self._captures.add(captured)
            return captured

    def capture_shape(self, pages: int, *, layers: Sequence[int] | None = None) -> CapturedShape:
        """Loads of exactly ``pages`` pages (of ``layers``, default all), captured once as a graph (kernel backend):
        each ``shape.load(host_pages, device_pages)`` checks its page lists, writes them into the graph's indices and
        replays it on the shape's stream, ordered after the engine's H2D stream and ``after`` (the H2D stream then
        waits for it) — no kernel checks and no launches from Python. For an engine that loads the same number of
        pages again and again (decode-time swaps, fixed-size chunks); such loads have no layer events."""
        with self._lock:
            self._check_open()
            if not isinstance(self._backend, KernelBackend):
                raise InvalidArgument(f"graph capture needs the kernel backend, not {self.backend!r}")
            pages = integer(pages, "pages", low=1, high=min(self.device_pool.pages, self.host_pool.pages) + 1)
            chosen = self._layers(layers)
            units = self._units(np.arange(pages))
            stream = self.runtime.create_stream(self.device)
            try:
                graph, ring, indices = self._backend.capture(units, units, layer_spans(chosen, False), stream)
            except BaseException:
                stream.close()
                raise
            shape = CapturedShape(self, graph, stream, ring, indices, pages, chosen)
            self._captures.add(shape)
            return shape

    def _drain_more(self) -> None:
        self._backend.drain()

    def _release(self) -> None:
        for captured in list(self._captures):
            captured.close()
        self._backend.close()
        for stream in self.streams.values():
            stream.close()

    # -- internals --------------------------------------------------------------------------------------------------
    def _pages(self, device_pages: Any, host_pages: Any, direction: str) -> tuple[np.ndarray, np.ndarray]:
        dev, host = index_array(device_pages, "device_pages"), index_array(host_pages, "host_pages")
        if dev.size != host.size:
            raise InvalidArgument(f"{dev.size} device pages but {host.size} host pages: index lists must match")
        self.device_pool.check_pages(dev)
        self.host_pool.check_pages(host)
        destination, name = (host, "host_pages") if direction == D2H else (dev, "device_pages")
        ordered = np.sort(destination)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if repeated.size:
            raise InvalidArgument(f"{name} names page {int(repeated[0])} more than once: a destination page written "
                                  f"twice in one transfer would mix the bytes of both sources")
        return dev, host

    def _layers(self, layers: Sequence[int] | None) -> list[int]:
        return checked_layers(layers, self.geometry.layers)

    def _units(self, pages: np.ndarray) -> np.ndarray:
        return index_values(self.plan.units(pages), self.index_bytes)

    def _submit(self, direction: str, dev: np.ndarray, host: np.ndarray, layers: Sequence[int], after: Any,
                per_layer: bool) -> Transfer:
        stream = self.streams[direction]
        order_after(self.runtime, stream, after)
        transfer = Transfer(self.runtime, user_event(self.runtime, self.device))
        job = Job(direction, dev, host, self._units(dev), self._units(host), list(layers), per_layer, stream,
                  transfer)
        if dev.size:
            self._backend.run(job)
        else:
            for layer in job.layers:
                job.mark(self.runtime, self.device, layer, stream)
        transfer.finished.record(stream)
        return transfer


