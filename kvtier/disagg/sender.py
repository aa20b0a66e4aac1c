"""The prefill side: connects to one receiver, learns its pages, and writes each request's KV where it asks.

Per request the receiver says which of its pages to fill (a ``want``); ``send`` waits for that, writes the bytes
straight into the receiver's registered memory over Mooncake, and only then says ``done``. Where the receiver's
layout differs (``page_first`` here, ``layer_first`` there), this side converts: it gathers its pages into staging
memory in the receiver's layout, a few MiB at a time, and writes whole pieces from there (``plan.py`` says why).
A device pool goes through the same staging memory (kvtier's transfer engine copies and converts device → host),
unless the wire reaches device memory (the CUDA wheel on a GPU), where it is registered by its device addresses.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.checks import index_array
from kvtier.disagg.control import VERSION, Channel
from kvtier.disagg.endpoint import Endpoint
from kvtier.disagg.plan import (
    DEVICE,
    Side,
    check_fit,
    compatible,
    default_staging_pages,
    gather,
    plan_runs,
    staging_layout,
)
from kvtier.disagg.staging import Staging
from kvtier.disagg.wire import MooncakeWire, reaches_device
from kvtier.errors import (
    BufferClosed,
    HandshakeRefused,
    InvalidArgument,
    KvtierError,
    PeerLost,
    TransferFailed,
    TransferTimedOut,
)
from kvtier.locks import named_condition
from kvtier.pause_points import reached
from kvtier.pools import DevicePool, HostPool
from kvtier.transfer import TransferEngine


def identity(pool: HostPool | DevicePool, dtype: str | None) -> dict[str, Any]:
    """What both sides must agree on before any byte moves."""
    g = pool.geometry
    return {"kind": g.kind.value, "layers": g.layers, "page_size": g.page_size, "row_bytes": g.row_bytes,
            "heads": g.heads, "dtype": dtype}


class KVSender(Endpoint):
    """One prefill → decode link. ``pool``: the pool the request's pages are in (host or device). Thread-safe:
    several requests may be sent at once from several threads."""

    def __init__(self, receiver: str, pool: HostPool | DevicePool, *, dtype: str | None = None,
                 staging_pages: int | None = None, io_backend: str = "direct", timeout: float = 30.0,
                 wire: MooncakeWire | None = None, device_direct: bool | None = None) -> None:
        """Connect to the receiver at ``receiver`` (``host:port``, its ``KVReceiver.address``) and shake hands:
        HandshakeRefused when the two pools hold different KV (geometry, page size, ``dtype``), PeerLost when it
        cannot be reached, TransferTimedOut when it does not answer within ``timeout`` seconds."""
        pool.check_open()
        self.pool, self.dtype, self.timeout = pool, dtype, timeout
        direct = reaches_device(pool.runtime.name) if device_direct is None else device_direct
        self._direct_device = isinstance(pool, DevicePool) and direct
        self.wire = wire or MooncakeWire(device_memory=self._direct_device)
        self._cond = named_condition("disagg.sender")
        self._wanted: dict[str, tuple[np.ndarray, int]] = {}
        self._used: set[str] = set()
        self._inflight = 0
        self._lost: TransferFailed | None = None
        self._closing = self._closed = False
        self._staging: Staging | None = None
        self._engine: TransferEngine | None = None
        self._reader: threading.Thread | None = None
        self._staging_pages, self._io_backend = staging_pages, io_backend
        self._channel = Channel.connect(receiver, timeout)
        self.peer = receiver
        try:
            self._handshake()
            self._prepare()
        except BaseException:
            self._release()
            raise
        self._reader = threading.Thread(target=self._read, name=f"kvtier-disagg-sender {receiver}", daemon=True)
        self._reader.start()
        pool.add_user(self)

    def _handshake(self) -> None:
        mine = identity(self.pool, self.dtype)
        self._channel.send("hello", version=VERSION, kv=mine, session=self.wire.session)
        try:
            reply = self._channel.recv(self.timeout)
        except PeerLost as exc:
            raise PeerLost(f"{self.peer} closed the connection during the handshake", peer=self.peer) from exc
        if reply["kind"] == "refused":
            raise HandshakeRefused(f"{self.peer} refused the handshake: {reply.get('reason')}", peer=self.peer)
        if reply["kind"] != "welcome" or reply.get("version") != VERSION:
            raise HandshakeRefused(f"{self.peer} answered {reply['kind']!r} (protocol version "
                                   f"{reply.get('version')!r}; this side speaks {VERSION})", peer=self.peer)
        self.target = Side.from_json(reply["side"])
        self.target_session = str(reply["session"])
        check_fit(Side(**mine, layout=DEVICE, pages=0, bases=()), self.target, self.peer)

    def _prepare(self) -> None:
        """Register what the wire reads from: the pool itself where its pages are laid out as the receiver's, else
        staging memory in the receiver's layout."""
        pool = self.pool
        if isinstance(pool, HostPool) or self._direct_device:
            self.side: Side | None = Side.of(pool, self.dtype, device_direct=self._direct_device)
            if compatible(self.side, self.target):
                if isinstance(pool, HostPool):
                    self.wire.register(pool.buffer.cpu_address, pool.buffer.nbytes)
                else:
                    for tensor in range(pool.geometry.tensors):
                        for address in pool.layer_device_addresses(tensor):
                            self.wire.register(address, pool.layer_bytes)
                return
        pages = default_staging_pages(pool.geometry) if self._staging_pages is None else self._staging_pages
        self._staging = Staging(pool.geometry, staging_layout(self.target), pages, pool.runtime)
        self.side = Side.of(self._staging.pool, self.dtype)
        self.wire.register(self._staging.pool.buffer.cpu_address, self._staging.pool.buffer.nbytes)
        if isinstance(pool, DevicePool):
            self._engine = TransferEngine(pool, self._staging.pool, backend=self._io_backend)

    @property
    def converts(self) -> bool:
        """Whether this side stages pages (a layout conversion, or a device pool the wire cannot reach)."""
        return self._staging is not None

    def _read(self) -> None:
        while True:
            try:
                message = self._channel.recv()
                if message["kind"] != "want":
                    raise TransferFailed(f"{self.peer} sent {message['kind']!r}, not a kvtier receiver?",
                                         peer=self.peer)
                pages = np.asarray(message["pages"], dtype=np.int64)
                request, skip = str(message["request"]), int(message.get("skip", 0))
            except (KvtierError, KeyError, TypeError, ValueError) as exc:
                lost = exc if isinstance(exc, TransferFailed) else TransferFailed(
                    f"{self.peer} sent a malformed want: {exc}", peer=self.peer)
                with self._cond:
                    self._lost = lost
                    self._cond.notify_all()
                return
            with self._cond:
                self._wanted[request] = (pages, skip)
                self._cond.notify_all()

    def send(self, request_id: str, pages: Any, *, timeout: float | None = None) -> int:
        """Send the KV of ``pages`` (of this side's pool, in token order) as request ``request_id``: wait for the
        receiver to ask for it, write, then tell it the request is done. Returns the bytes written. A request id is
        used once per link (InvalidArgument the second time). Raises PeerLost / TransferFailed naming the peer and
        the request when the receiver goes away or the write fails; TransferTimedOut when no want came within
        ``timeout`` (default: the link's)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument(f"a request id is a non-empty str, got {request_id!r}")
        values = index_array(pages, "pages").astype(np.int64, copy=False)
        self.pool.check_pages(values)
        with self._cond:
            if self._closing:
                raise BufferClosed(f"this sender (to {self.peer}) is closed")
            if request_id in self._used:
                raise InvalidArgument(f"request id {request_id!r} was sent on this link already: ids are used once")
            self._used.add(request_id)
            self._inflight += 1
        try:
            dst, skip = self._want(request_id, self.timeout if timeout is None else timeout)
            src = values[skip:skip + len(dst)]
            if skip < 0 or len(src) != len(dst):
                self._fail(request_id, f"it asked for {len(dst)} pages from page {skip}, this side has "
                                       f"{len(values)}")
            try:
                self.pool.check_open()
                written = self._move(request_id, src, dst)
            except BaseException as exc:
                self._fail(request_id, str(exc), exc)
            reached("disagg.sender.before_done")
            self._channel.send("done", request=request_id, bytes=written)
            return written
        except PeerLost as exc:
            if exc.request_id is None:
                raise PeerLost(f"request {request_id!r}: {exc}", peer=self.peer, request_id=request_id) from exc
            raise
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def _want(self, request_id: str, timeout: float) -> tuple[np.ndarray, int]:
        with self._cond:
            if not self._cond.wait_for(lambda: request_id in self._wanted or self._lost is not None or self._closing,
                                       timeout):
                raise TransferTimedOut(f"request {request_id!r}: {self.peer} did not ask for it within {timeout} s",
                                       peer=self.peer, request_id=request_id)
            if request_id in self._wanted:
                return self._wanted.pop(request_id)
            if self._closing:
                raise BufferClosed(f"request {request_id!r}: the sender to {self.peer} closed")
            assert self._lost is not None
            raise type(self._lost)(f"request {request_id!r}: {self._lost}", peer=self.peer, request_id=request_id)

    def _fail(self, request_id: str, reason: str, cause: BaseException | None = None) -> None:
        """Tell the receiver the request failed (if it can still hear it), and raise here."""
        with contextlib.suppress(PeerLost):
            self._channel.send("failed", request=request_id, reason=reason)
        if isinstance(cause, KvtierError):
            raise cause
        raise TransferFailed(f"request {request_id!r} to {self.peer}: {reason}", peer=self.peer,
                             request_id=request_id) from cause

    def _check_going(self, request_id: str) -> None:
        if self._closing:
            raise BufferClosed(f"request {request_id!r}: the sender to {self.peer} closed during the transfer")

    def _move(self, request_id: str, src: np.ndarray, dst: np.ndarray) -> int:
        assert self.side is not None
        if self._staging is None:
            runs = plan_runs(self.side, src, self.target, dst)
            return self._write(request_id, runs)
        return self._move_staged(request_id, src, dst, self._staging)

    def _move_staged(self, request_id: str, src: np.ndarray, dst: np.ndarray, staging: Staging) -> int:
        """Chunk by chunk through staging: chunk k+1 is gathered (or copied from the device) while chunk k is on
        the wire, so the conversion costs little beyond the wire's own time. A chunk is at most half the staging
        pages; with none free, the oldest chunk in flight is finished first (two sends sharing staging never wait
        for each other's pages while holding their own)."""
        assert self.side is not None
        flying: list[tuple[Any, np.ndarray]] = []
        written, done, chunk = 0, 0, max(1, staging.pool.pages // 2)
        try:
            while done < len(src):
                self._check_going(request_id)
                staged = staging.take(min(chunk, len(src) - done), partial=True, wait=not flying)
                if not len(staged):
                    written += self._finish(request_id, *flying.pop(0))
                    continue
                try:
                    part = src[done:done + len(staged)]
                    if self._engine is not None:
                        self._engine.backup(part, staged).wait()
                    else:
                        assert isinstance(self.pool, HostPool)
                        gather(self.pool, part, staging.pool, staged)
                    runs = plan_runs(self.side, staged, self.target, dst[done:done + len(staged)])
                except BaseException:
                    staging.give(staged)
                    raise
                flying.append((self.wire.start(self.target_session, runs.src, runs.dst, runs.lengths,
                                               going=lambda: self._check_going(request_id)), staged))
                done += len(staged)
                if len(flying) > 1:
                    written += self._finish(request_id, *flying.pop(0))
            while flying:
                written += self._finish(request_id, *flying.pop(0))
        finally:
            for writing, staged in flying:
                with contextlib.suppress(BaseException):
                    writing.finish()
                staging.give(staged)
        return written

    def _finish(self, request_id: str, writing: Any, staged: np.ndarray) -> int:
        """Wait for one chunk's batches, then give its staging pages back (only then: the wire reads them)."""
        assert self._staging is not None
        try:
            return int(writing.finish())
        except TransferFailed as exc:
            raise TransferFailed(f"request {request_id!r} to {self.peer}: {exc}", peer=self.peer,
                                 request_id=request_id) from exc
        finally:
            self._staging.give(staged)

    def _write(self, request_id: str, runs: Any) -> int:
        self._check_going(request_id)
        try:
            return self.wire.write(self.target_session, runs.src, runs.dst, runs.lengths, request_id=request_id,
                                   going=lambda: self._check_going(request_id))
        except TransferFailed as exc:
            raise TransferFailed(f"request {request_id!r} to {self.peer}: {exc}", peer=self.peer,
                                 request_id=request_id) from exc

    # -- lifetime ---------------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for the sends in flight (the pool's close calls this before giving its memory back)."""
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0)

    def _stopping(self) -> Callable[[], None]:
        """Sends waiting for a want raise BufferClosed, a send mid-write stops after its current batch (the receiver
        hears it failed); once none is in flight, the link and the registrations go."""
        self._cond.notify_all()
        self._cond.wait_for(lambda: self._inflight == 0)
        return lambda: None

    def _release(self) -> None:
        self._channel.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join()
        self._let_go()

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<KVSender to {self.peer}{' closed' if self._closing else ''}>"
