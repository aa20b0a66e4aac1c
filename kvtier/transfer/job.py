"""What the engine hands a backend (a :class:`Job` over a :class:`Context`) and what it hands back to the caller (a
:class:`Transfer`). Backends see these and nothing else of the engine."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.checks import index_array, integer
from kvtier.errors import BufferClosed, InvalidArgument, KvtierError, capture_refused
from kvtier.kernels import KernelLauncher
from kvtier.locks import named_lock
from kvtier.memory.lifetime import wait_then
from kvtier.pools import DevicePool, HostPool
from kvtier.pools.geometry import KVGeometry
from kvtier.runtime import Event, Runtime, Stream
from kvtier.transfer.plan import ChunkPlan

D2H, H2D = "d2h", "h2d"
CURRENT = "current"
"""``after=CURRENT`` (the default): order the transfer after the caller's current stream."""


def checked_layers(layers: Sequence[int] | None, count: int) -> list[int]:
    """``layers`` (default: all ``count``) as a list, each in range and none repeated."""
    if layers is None:
        return list(range(count))
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__len__"):
        raise InvalidArgument(f"layers must be a sequence of layer indices, got {layers!r}")
    chosen = index_array(layers, "layers").tolist()
    bad = [x for x in chosen if not 0 <= x < count]
    if bad:
        raise InvalidArgument(f"layer {bad[0]} is out of range (pool has {count} layers)")
    if len(set(chosen)) != len(chosen):
        raise InvalidArgument(f"layers {chosen} repeat a layer")
    return chosen


BACKUP_THREADS = 512


NARROW_CHUNK_BYTES = 512


def choose_backup_threads(given: Any, threads: int, max_blocks: int, chunk_bytes: int | None = None) -> int:
    """Threads per block of kernel backups: ``given``, or by default ``threads`` capped at 512 when the budget is more
    than one block and the copy's chunks are at least 512 bytes. On the H200 two 1024-thread blocks writing to host
    memory slowed a concurrent bf16 GEMM by 90%, two of 512 threads by 10%, at the same 50 GB/s; but one 512-thread
    block writes only 53% of the link (1024: 72%), and 64-byte rows at 2 SMs 66% (1024: 77%)."""
    if given is None:
        narrow = chunk_bytes is not None and chunk_bytes < NARROW_CHUNK_BYTES
        return threads if max_blocks == 1 or narrow else min(threads, BACKUP_THREADS)
    value = integer(given, "backup_threads", low=32, high=1025)
    if value % 32:
        raise InvalidArgument(f"backup_threads must be whole warps (a multiple of 32), got {value}")
    return value


def user_event(runtime: Runtime, device: int) -> Event:
    """An event handed to the caller (a transfer's end, a layer's landing): timed, so a trace can put it on a clock
    (``elapsed_ms``, or cudaEventElapsedTime against the caller's own events); kvtier's internal events are not. It
    belongs to its Transfer, which kvtier itself may still wait on (the cache's load-backs do): ``close()`` on it does
    nothing, and it is released when the Transfer and the caller's references are dropped."""
    event = runtime.create_event(device, timing=True)
    event.keeper = "Transfer"
    return event


def check_pools(device_pool: Any, host_pool: Any) -> None:
    """Both open, of one geometry and one runtime: what every engine over a pair of pools first checks."""
    device_pool.check_open()
    host_pool.check_open()
    if device_pool.geometry != host_pool.geometry:
        raise InvalidArgument(f"pool geometries differ: {device_pool.geometry} vs {host_pool.geometry}")
    if device_pool.runtime is not host_pool.runtime:
        raise InvalidArgument("device and host pools belong to different runtimes")


def after_events(runtime: Runtime, device: int, after: Any, *, skip: Stream | None = None,
                 snapshot: Stream | None = None) -> list[Event] | None:
    """``after`` as events recorded now (None for None): ``CURRENT`` (the caller's current stream of ``device``), a
    :class:`Transfer` (its end), an event or stream (kvtier's or torch's), or a list of them; a stream that is
    ``skip`` itself needs no event. What every engine and the cache order transfers after. With ``snapshot`` (a
    stream of kvtier's), the caller's own events are replaced by one event of kvtier's recorded on it after them, for
    holders that keep the events past the call (the caller may close or re-record theirs)."""
    if after is None:
        return None
    if isinstance(after, str):
        if after != CURRENT:
            raise InvalidArgument(f"after={after!r}: use {CURRENT!r}, a Transfer, an event, a stream, a list or None")
        after = runtime.current_stream(device)
    theirs, sources = [], []
    for item in after if isinstance(after, (list, tuple)) else [after]:   # every item checked before any is used
        if isinstance(item, Transfer):
            item = item.finished
        if isinstance(item, Event) or hasattr(item, "cuda_event"):
            theirs.append(runtime.as_event(item))
        else:
            sources.append(runtime.as_stream(item))
    events = []
    for source in sources:
        if source is skip:
            continue
        marker = runtime.create_event(source.device)  # an event records only on a stream of its own device
        marker.record(source)
        events.append(marker)
    if theirs and snapshot is not None:
        for event in theirs:
            snapshot.wait(event)
        marker = runtime.create_event(device)
        marker.record(snapshot)
        theirs = [marker]
    return events + theirs


def order_after(runtime: Runtime, stream: Stream, after: Any) -> None:
    """Make ``stream`` wait for ``after`` (see :func:`after_events`). Every engine orders through here."""
    for event in after_events(runtime, stream.device, after, skip=stream) or []:
        stream.wait(event)


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


@dataclass(frozen=True)
class Context:
    """What every backend may use: the pools, the plan, the kernel launcher and the engine's settings."""

    runtime: Runtime
    device: int
    geometry: KVGeometry
    plan: ChunkPlan
    device_pool: DevicePool
    host_pool: HostPool
    launcher: KernelLauncher
    streams: dict[str, Stream]
    index_bytes: int
    max_blocks: int
    threads: int
    backup_threads: int | None = None  # the kernel backend's backups (None: ``threads``)


@dataclass
class Job:
    """One transfer as a backend runs it. ``stream`` already waits for everything the caller ordered it after;
    a backend that uses another stream makes it wait for ``stream`` first."""

    direction: str
    device_pages: np.ndarray
    host_pages: np.ndarray
    device_units: np.ndarray
    host_units: np.ndarray
    layers: Sequence[int]
    per_layer: bool
    stream: Stream
    transfer: Transfer

    @property
    def src_units(self) -> np.ndarray:
        return self.device_units if self.direction == D2H else self.host_units

    @property
    def dst_units(self) -> np.ndarray:
        return self.host_units if self.direction == D2H else self.device_units

    def mark(self, runtime: Runtime, device: int, begin: int, stream: Stream) -> None:
        """Record layer ``begin``'s event on ``stream`` (per-layer loads only)."""
        if self.per_layer:
            event = user_event(runtime, device)
            event.record(stream)
            self.transfer.layer_events[begin] = event


class Backend:
    """An io backend: moves the pages of a :class:`Job`. One ``run`` each; ``drain`` waits for its own streams."""

    name = "abstract"

    def __init__(self, context: Context, **options: Any) -> None:
        """``options``: the engine's backend settings (ring_bytes, staging_bytes, ...); each backend takes its own."""
        self.context = context

    def run(self, job: Job) -> None:
        raise NotImplementedError("need Backend.run")

    def drain(self) -> None:
        """Wait for streams the backend owns besides the engine's (the engine waits for its own)."""

    def close(self) -> None:
        """Free what the backend owns; the engine drained everything before."""


class _EngineLock:
    """An engine's lock (reentrant). A close() asked for by the thread that holds it, in the middle of the engine's
    own call (a signal handler, a finalizer the collector ran there), must not free the streams and staging area that
    call is still queuing on: it is kept, and runs once that thread lets go of the lock."""

    def __init__(self) -> None:
        self._lock = named_lock("engine", reentrant=True)
        self._depth = 0
        self._after: list[Callable[[], None]] = []

    def held_here(self) -> bool:
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]

    def after_call(self, close: Callable[[], None]) -> None:
        """Run ``close`` once this thread lets go of the lock (the caller holds it)."""
        self._after.append(close)

    def __enter__(self) -> _EngineLock:
        self._lock.acquire()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        after = self._after if not self._depth else []
        if after:
            self._after = []
        self._lock.release()
        for close in after:
            try:
                close()
            except KvtierError as error:
                if not capture_refused(error):
                    raise
                warnings.warn(f"a close asked for inside an engine call was refused as the call returned, a stream "
                              f"capturing ({error}): it stays open; close it once the capture ends", RuntimeWarning,
                              stacklevel=2)


class PoolUser:
    """What every engine over a device pool and a host pool shares: it is their user (closing either waits for its
    work), queues under one lock, and closes once — draining first, then letting go of the pools and freeing what it
    owns (``_release``). Subclasses say how to drain."""

    device_pool: Any
    host_pool: Any
    streams: dict[str, Stream]
    _captures: Any

    def _start(self, device_pool: Any, host_pool: Any) -> None:
        """First thing in ``__init__``."""
        self._lock = _EngineLock()
        self._closed = False
        self._closing = False
        self.device_pool, self.host_pool = device_pool, host_pool

    def _attach(self) -> None:
        """Last thing in ``__init__``, once nothing can fail: the pools now wait for this engine when they close."""
        self.device_pool.add_user(self)
        self.host_pool.add_user(self)

    @property
    def closed(self) -> bool:
        """Closed, or closing once the engine call this thread is inside returns."""
        return self._closed or self._closing

    def inside_call_here(self) -> bool:
        """Whether this thread is inside one of the engine's own calls (a signal handler or finalizer run there)."""
        return self._lock.held_here()

    def after_call(self, close: Callable[[], None]) -> None:
        """Run ``close`` (of the engine, or of a pool or captured load it is using) once the engine call this
        thread is inside returns: freeing what that call is still queuing on must wait for it."""
        self._lock.after_call(close)

    def synchronize(self) -> None:
        """Wait for everything queued so far (and every replay of a captured load)."""
        self.drain()

    def drain(self) -> None:
        """Wait for the engine's streams, captured loads and whatever else it queues on (``_drain_more``)."""
        with self._lock:
            if not self._closed:
                self._drain_streams()
                self._drain_more()

    def _drain_more(self) -> None:
        """Streams the engine uses beyond ``streams`` (a backend's, the layer signals')."""

    def _drain_streams(self) -> None:
        """Wait for the engine's own streams and captured loads (under the lock; nothing once closed)."""
        for stream in self.streams.values():
            stream.synchronize()
        for captured in list(self._captures):
            captured.drain()

    def _release(self) -> None:
        """Free what the engine owns (tables, rings, streams); everything queued has finished."""

    def close(self) -> None:
        """Wait for queued work, then free what the engine owns. Idempotent. Asked for in the middle of one of the
        engine's own calls on this thread, it happens as that call returns (no new call is taken meanwhile). Refused
        while a stream of the device captures (the wait is not allowed then): the engine stays open."""
        if self._lock.held_here() and not self._closed:
            if not self._closing:
                self._closing = True
                self._lock.after_call(self.close)
            return
        with self._lock:
            if self._closed:
                return
            wait_then(self.drain, self._finish_close, self._reopen)

    def _reopen(self) -> None:
        self._closing = False

    def _finish_close(self) -> None:
        self._closed = True
        self.device_pool.remove_user(self)
        self.host_pool.remove_user(self)
        self._release()

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise BufferClosed(f"this {type(self).__name__} is closed")
        self.device_pool.check_open()
        self.host_pool.check_open()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
