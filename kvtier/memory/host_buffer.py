"""Host buffers that devices can reach: pinned, registered anonymous mmap, registered shm, hugetlb — and pageable.

A ``HostBuffer`` owns its memory and its registrations. It hands out the CPU address for CPU-side consumers and the
device alias for kernels, and it outlives every torch view made of it: ``close()`` refuses while views are alive,
because unmapping under a live tensor turns the next read into a crash.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier import closings, osmem
from kvtier.address import CpuAddress
from kvtier.checks import integer
from kvtier.errors import BufferClosed, BufferInUse, InvalidArgument, KvtierError, OutOfMemory
from kvtier.locks import named_lock
from kvtier.memory import host_memory
from kvtier.memory.budget import check_host_budget
from kvtier.memory.collector import COLLECTOR
from kvtier.memory.lifetime import Drainable, Users
from kvtier.memory.registration import DEFAULT_REGISTER_CHUNK_BYTES, register_chunks, unregister_chunks
from kvtier.pause_points import reached
from kvtier.runtime import HostKind, Runtime
from kvtier.runtime import get as get_runtime

if TYPE_CHECKING:
    import torch


class _Resources:
    """What a buffer must give back; shared with the finalizer, so it holds no reference to the buffer.

    Only the process that created them gives them back. A fork child inherits this object and its finalizer, which
    runs at the child's normal exit; unregistering there would call a runtime that does not survive fork, and
    releasing the memory would remove an shm file the parent still owns. So in any other process ``release`` only
    marks the buffer closed: the runtime, the file and the mapping are left alone (the child's copy of the mapping
    goes when the child exits).
    """

    def __init__(self, runtime: Runtime, memory: host_memory.HostMemory) -> None:
        self.runtime, self.memory = runtime, memory
        self.chunks: list[tuple[int, int]] = []
        self.released = False
        self.viewed = False
        """Whether a tensor view was handed out: it may have fed kernels and copies kvtier does not track (torch's,
        the compat layer's), so the memory goes back only after the devices finish what is queued."""
        self.creator_pid = os.getpid()

    def release(self, keep_mapping: bool = False) -> None:
        """Give everything back; with ``keep_mapping`` (exit, views alive) only what outlives no reader: an shm
        file is removed (its mapping stays valid), the registration and the mapping go with the process. From
        ``close()`` and from the finalizer alike (a buffer dropped right after work was queued over it), a viewed
        buffer waits for the devices first."""
        if self.released:
            return
        self.released = True
        closings.counted()
        if os.getpid() != self.creator_pid:
            return
        if keep_mapping:
            if self.memory.forget is not None:
                self.memory.forget()
            return
        if self.viewed:
            self.runtime.after_device_work(self._give_back)
        else:
            self._give_back()

    def _give_back(self) -> None:
        try:
            unregister_chunks(self.runtime, self.chunks)
        finally:
            self.memory.release()


@dataclass(frozen=True)
class HostRegion:
    """An offset view of a host buffer: what a page or a layer slice of a pool is. Its CPU address is here; its
    device address comes from ``get_device_accessible_ptr(region, device)``, the one resolver."""

    buffer: "HostBuffer"
    offset: int
    nbytes: int

    @property
    def cpu_address(self) -> CpuAddress:
        return self.buffer.cpu_address + self.offset


def _host_memory(runtime: Runtime, kind: HostKind, nbytes: int, name: str | None) -> host_memory.HostMemory:
    if kind is HostKind.PINNED:
        return host_memory.pinned(runtime, nbytes)
    if kind is HostKind.SHM:
        return host_memory.shm_create(name or host_memory.new_shm_name(), nbytes)
    if kind is HostKind.HUGETLB:
        return host_memory.hugetlb(nbytes)
    return host_memory.anonymous(nbytes)


def _release(resources: _Resources, buffer: weakref.ref[HostBuffer]) -> None:
    """The buffer's finalizer: from close(), when it is collected, or at interpreter exit. Only at exit can views
    still be alive (a view keeps its buffer), and code that runs after (atexit handlers, other finalizers) may read
    them: then the mapping stays for the process to drop."""
    alive = buffer()
    resources.release(keep_mapping=alive is not None and alive.live_views() > 0)


def _after_fork_in_child() -> None:
    COLLECTOR.after_fork()
    for buffer in list(_buffers):
        buffer._reset_lock()


_buffers: weakref.WeakSet[HostBuffer] = weakref.WeakSet()
os.register_at_fork(after_in_child=_after_fork_in_child)


class HostBuffer:
    """Use :meth:`allocate` or :meth:`attach_shm`; close with :meth:`close` or a ``with`` block."""

    def __init__(self, runtime: Runtime, kind: HostKind, memory: host_memory.HostMemory, name: str | None) -> None:
        self.runtime, self.kind, self.name = runtime, kind, name
        self._resources = _Resources(runtime, memory)
        self._finalizer = weakref.finalize(self, _release, self._resources, weakref.ref(self))
        anchor_type: Any = type("HostBufferBytes", (ctypes.c_uint8 * memory.nbytes,), {})
        self._anchor = anchor_type.from_address(memory.address)
        self._anchor.owner = self
        self._baseline_refs = sys.getrefcount(self._anchor)
        self._users = Users()
        self._closing = False
        self._reset_lock()
        _buffers.add(self)
        #: seconds spent pinning: registration of every chunk, or the runtime's pinned allocation
        self.register_seconds = 0.0

    @classmethod
    def allocate(cls, nbytes: int, kind: HostKind | str = HostKind.REGISTERED, *, runtime: Runtime | None = None,
                 granularity: int = 1, register_chunk_bytes: int = DEFAULT_REGISTER_CHUNK_BYTES,
                 name: str | None = None) -> HostBuffer:
        """``granularity`` is the KV page size in bytes: no registration chunk boundary falls inside a page."""
        kind = HostKind(kind)
        runtime = runtime or get_runtime()
        nbytes = integer(nbytes, "HostBuffer size", low=1)
        granularity = integer(granularity, "granularity", low=1)
        register_chunk_bytes = integer(register_chunk_bytes, "register_chunk_bytes", low=1)
        if name is not None and kind is not HostKind.SHM:
            raise InvalidArgument(f"only shm buffers have names (kind={kind.value})")
        check_host_budget(nbytes)
        if kind is HostKind.SHM:
            name = name or host_memory.new_shm_name()
        started = time.perf_counter()
        try:
            memory = _host_memory(runtime, kind, nbytes, name)
        except OSError as exc:
            raise OutOfMemory(f"{kind.value} host buffer of {nbytes} bytes could not be mapped: {exc}") from exc
        buffer = cls(runtime, kind, memory, name)
        if kind is HostKind.PINNED:
            buffer.register_seconds = time.perf_counter() - started
        elif kind is not HostKind.PAGEABLE:
            buffer._register(granularity, register_chunk_bytes)
        return buffer

    @classmethod
    def attach_shm(cls, name: str, *, runtime: Runtime | None = None, granularity: int = 1,
                   register_chunk_bytes: int = DEFAULT_REGISTER_CHUNK_BYTES) -> HostBuffer:
        """Map and register, in this process, an shm buffer another process created; the creator removes it."""
        runtime = runtime or get_runtime()
        buffer = cls(runtime, HostKind.SHM, host_memory.shm_attach(name), name)
        buffer._register(granularity, register_chunk_bytes)
        return buffer

    def _register(self, granularity: int, chunk_bytes: int) -> None:
        memory = self._resources.memory
        page = host_memory.huge_page_size() if self.kind is HostKind.HUGETLB else osmem.PAGE_SIZE
        started = time.perf_counter()
        try:
            self._resources.chunks = register_chunks(self.runtime, memory.address, memory.nbytes,
                                                     chunk_bytes=chunk_bytes, granularity=math.lcm(granularity, page))
        except BaseException:
            self._finalizer()
            raise
        self.register_seconds = time.perf_counter() - started

    # -- what it is ----------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self._resources.memory.nbytes

    @property
    def closed(self) -> bool:
        return self._resources.released

    @property
    def path(self) -> str | None:
        return self._resources.memory.path

    @property
    def cpu_address(self) -> CpuAddress:
        self._check_open()
        return CpuAddress(self._resources.memory.address)

    @property
    def chunks(self) -> tuple[tuple[CpuAddress, int], ...]:
        return tuple((CpuAddress(start), size) for start, size in self._resources.chunks)

    @property
    def device_accessible(self) -> bool:
        return self.kind is not HostKind.PAGEABLE

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"0x{self._resources.memory.address:x}"
        return f"<HostBuffer {self.kind.value} {self.nbytes} bytes {state} on {self.runtime.name}>"

    @property
    def registration_boundaries(self) -> tuple[int, ...]:
        """Buffer offsets where a new registration chunk starts (none for one chunk): no DMA may cross one."""
        base = self._resources.memory.address
        return tuple(start - base for start, _ in self._resources.chunks[1:])

    # -- addresses and views ---------------------------------------------------------------------------------------
    def check_span(self, offset: int, nbytes: int, what: str = "span") -> tuple[int, int]:
        """[offset, offset + nbytes) as ints, if it lies inside the open buffer; offsets are integers, never bools."""
        self._check_open()
        offset, nbytes = integer(offset, f"{what} offset", low=0), integer(nbytes, f"{what} size", low=0)
        if offset + nbytes > self.nbytes:
            raise InvalidArgument(f"{what} [{offset}, +{nbytes}) is outside {self!r}")
        return offset, nbytes

    def region(self, offset: int, nbytes: int) -> HostRegion:
        return HostRegion(self, *self.check_span(offset, nbytes, "region"))

    def as_tensor(self, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
        """A flat CPU tensor over the buffer's bytes; it keeps the buffer from closing while it lives.

        A closed buffer is refused before torch is imported: a fork child's first torch import takes seconds."""
        self._check_open()
        import torch

        dtype = dtype or torch.uint8
        reached("host_buffer.as_tensor_checked")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if self.nbytes % itemsize:
            raise KvtierError(f"{self.nbytes} bytes is not a whole number of {dtype} elements")
        with self._lock:
            self._check_open()
            self._resources.viewed = self._viewing = True
            try:
                reached("host_buffer.as_tensor_viewing")
                return torch.frombuffer(self._anchor, dtype=dtype)
            finally:
                self._viewing = False

    def live_views(self) -> int:
        """How many tensor storages still view this buffer."""
        return sys.getrefcount(self._anchor) - self._baseline_refs

    # -- lifetime --------------------------------------------------------------------------------------------------
    def add_user(self, user: Drainable) -> None:
        """``user`` queues device work over this buffer: :meth:`close` waits for it first."""
        self._check_open()
        self._users.add(user)

    def remove_user(self, user: Drainable) -> None:
        self._users.discard(user)

    def close(self) -> None:
        """Wait for the transfers of every user (engine) still working on the buffer, and for the devices if it ever
        handed out tensor views (they may have fed kernels kvtier does not track), then unregister every chunk by its
        CPU address, unmap, and (shm owner) remove the file. Idempotent; a second close() waits for the first.

        Refused (``BufferInUse``) while tensor views are alive; views only garbage holds (a reference cycle, such as
        a caught exception's traceback and the frames in it) are collected first and do not count. Called from a
        finalizer while the collector runs, where that collection may still free the views, it returns and the
        buffer is closed after a collection that leaves no view."""
        if not (self.closed or self._closing or self._viewing or COLLECTOR.running_here()) and self.live_views():
            gc.collect()   # not under the lock: the finalizers it runs take others (the runtime's, inside kernels)
        with self._lock:   # held only to decide: draining users must not block their threads' as_tensor()
            if self.closed:
                return
            first = self._closed if self._closing else None
            if first is None:
                if self.live_views() > 0 or self._viewing:
                    if COLLECTOR.running_here():
                        COLLECTOR.close_later(self)
                        return
                    raise BufferInUse(f"{self!r} still has {self.live_views()} tensor view(s) alive"
                                      + (", one being made" if self._viewing else "") + "; delete them first")
                self._closing = True
        if first is not None:
            # a finalizer in a thread the first close() drains must not wait, nor a thread whose engine call the
            # first close() waits to return
            if not COLLECTOR.running_here() and self._users.inside_here() is None:
                first.wait()
            return
        self._users.close(self._give_back, self._reopen)

    def _reopen(self) -> None:
        with self._lock:
            self._closing = False

    def _give_back(self) -> None:
        try:
            self._finalizer()
        finally:
            self._closed.set()

    def _reset_lock(self) -> None:
        """A fresh lock and close state: at creation, and in a fork child, where a parent thread may have held the
        lock or been closing. That close does not go on in the child, so there it is finished: the child's copy is
        marked closed (in a child, release gives nothing back)."""
        self._lock = named_lock("host_buffer", reentrant=True)  # a view handed out, or close() begun: never both
        self._closed = threading.Event()
        self._viewing = False
        if getattr(self, "_closing", False) and not self.closed:
            self._finalizer()
        if self.closed:
            self._closed.set()

    def _check_open(self) -> None:
        """Closed, or closing: once close() starts draining its users, no new work may be queued over the buffer."""
        if self.closed or self._closing:
            raise BufferClosed(f"{self!r} is closed" if self.closed else f"{self!r} is being closed")

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        """A view still alive when the body raised must not hide the body's exception: the buffer then stays open
        until its views go (the finalizer releases it at the latest at exit)."""
        try:
            self.close()
        except BufferInUse:
            if exc is None:
                raise
