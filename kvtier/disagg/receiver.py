"""The decode side: listens for prefill senders, tells each which pages to fill per request, and learns when a
request's pages have landed.

It registers its memory with Mooncake once, by CPU address: the host pool itself, or (for a device pool the wire
cannot reach) a staging host pool it owns; a device pool is registered by its device addresses only where the wire
reaches device memory. Pages of a request count as landed only after the sender said ``done`` (and, through staging,
after kvtier's transfer engine copied them to the device pool). A sender that fails, dies or drops the connection
before that fails the request's :class:`Landing` with an error naming the peer and the request; its pages are never
reported landed, and the receiver and its pools stay usable for the next request and the next sender.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.checks import index_array
from kvtier.disagg.control import VERSION, Channel
from kvtier.disagg.endpoint import Endpoint
from kvtier.disagg.plan import Side, check_fit, default_staging_pages
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
from kvtier.pools import DevicePool, HostLayout, HostPool
from kvtier.transfer import TransferEngine

PENDING, LANDED, FAILED = "pending", "landed", "failed"


class Landing:
    """One request's pages on their way in. ``wait()`` returns the pages once landed, or raises why they never
    will."""

    def __init__(self, link: Link, request_id: str, pages: np.ndarray, wire_pages: np.ndarray) -> None:
        self.link, self.request_id, self.pages, self.wire_pages = link, request_id, pages, wire_pages
        self.state = PENDING
        self.error: BaseException | None = None
        self.bytes = 0

    @property
    def peer(self) -> str:
        return self.link.peer

    def done(self) -> bool:
        """Landed or failed (never blocks)."""
        return self.state != PENDING

    @property
    def landed(self) -> bool:
        return self.state == LANDED

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """The request's pages, once every byte has landed. Raises the failure (PeerLost, TransferFailed naming the
        peer and the request; BufferClosed after the receiver closed), or TransferTimedOut after ``timeout`` s, when
        the request is still pending (its pages are still the sender's to write)."""
        with self.link._cond:
            if not self.link._cond.wait_for(self.done, timeout):
                raise TransferTimedOut(f"request {self.request_id!r} from {self.peer} has not landed within "
                                       f"{timeout} s", peer=self.peer, request_id=self.request_id)
        if self.error is not None:
            raise self.error
        return self.pages.copy()

    def __repr__(self) -> str:
        return f"<Landing {self.request_id!r} from {self.peer}: {len(self.pages)} pages {self.state}>"


class Link:
    """The connection to one sender, after a good handshake. ``expect`` may be called from several threads."""

    def __init__(self, receiver: KVReceiver, channel: Channel, session: str) -> None:
        self.receiver, self._channel, self.session = receiver, channel, session
        self.peer = channel.peer
        self._cond = named_condition("disagg.link")
        self._landings: dict[str, Landing] = {}
        self._used: set[str] = set()
        self._lost: TransferFailed | BufferClosed | None = None
        self._reader = threading.Thread(target=self._read, name=f"kvtier-disagg-link {self.peer}", daemon=True)
        self._reader.start()

    def expect(self, request_id: str, pages: Any, *, skip: int = 0) -> Landing:
        """Ask the sender for request ``request_id``'s KV, from its page ``skip`` on, into ``pages`` of the
        receiver's pool (device pages for a device pool). A request id is used once per link."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument(f"a request id is a non-empty str, got {request_id!r}")
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise InvalidArgument(f"skip must be a non-negative int, got {skip!r}")
        values = index_array(pages, "pages").astype(np.int64, copy=True)
        self.receiver.pool.check_pages(values)
        if len(np.unique(values)) != len(values):
            raise InvalidArgument(f"request {request_id!r}: pages repeat")
        with self._cond:
            self.receiver._check_open()
            if self._lost is not None:
                raise type(self._lost)(f"request {request_id!r}: {self._lost}")
            if request_id in self._used:
                raise InvalidArgument(f"request id {request_id!r} was used on this link already: ids are used once")
            self._used.add(request_id)
        staging = self.receiver._staging
        try:
            wire_pages = staging.take(len(values), partial=False) if staging is not None else values
        except BaseException:
            with self._cond:
                self._used.discard(request_id)
            raise
        landing = Landing(self, request_id, values, wire_pages)
        with self._cond:
            lost = self._lost
            if lost is None:
                self._landings[request_id] = landing
        if lost is None:
            try:
                self._channel.send("want", request=request_id, pages=wire_pages.tolist(), skip=skip)
                return landing
            except PeerLost as exc:
                lost = exc
        self._finish(landing, type(lost)(f"request {request_id!r}: {lost}"))
        return landing

    def _read(self) -> None:
        while True:
            try:
                message = self._channel.recv()
                kind, request = message["kind"], str(message["request"])
                with self._cond:
                    landing = self._landings.pop(request, None)
                if kind not in ("done", "failed") or landing is None:
                    raise TransferFailed(f"{self.peer} sent {kind!r} for request {request!r}, which is not "
                                         f"pending here", peer=self.peer)
            except (KvtierError, KeyError, TypeError, ValueError) as exc:
                self._lose(exc)
                return
            if kind == "failed":
                self._finish(landing, TransferFailed(f"request {request!r}: {self.peer} failed to send it: "
                                                     f"{message.get('reason')}", peer=self.peer, request_id=request))
                continue
            try:
                self.receiver._land(landing)
                landing.bytes = int(message.get("bytes", 0))
                self._finish(landing, None)
            except BaseException as exc:
                self._finish(landing, exc)

    def _lose(self, cause: BaseException) -> None:
        """The connection is gone: every pending request fails, none lands."""
        if self.receiver._closing:
            lost: TransferFailed | BufferClosed = BufferClosed(f"the receiver closed its link to {self.peer}")
        elif isinstance(cause, PeerLost):
            lost = PeerLost(f"{self.peer} went away ({cause})", peer=self.peer)
        else:
            lost = TransferFailed(f"the link to {self.peer} failed: {cause}", peer=self.peer)
        with self._cond:
            self._lost = lost
            pending, self._landings = list(self._landings.values()), {}
        for landing in pending:
            error = type(lost)(f"request {landing.request_id!r}: {lost} before it landed")
            if isinstance(error, TransferFailed):
                error.peer, error.request_id = self.peer, landing.request_id
            self._finish(landing, error)

    def _finish(self, landing: Landing, error: BaseException | None) -> None:
        if landing.wire_pages is not landing.pages and self.receiver._staging is not None:
            self.receiver._staging.give(landing.wire_pages)
        with self._cond:
            landing.error = error
            landing.state = FAILED if error is not None else LANDED
            self._cond.notify_all()

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def close(self) -> None:
        self._channel.close()
        if self._reader is not threading.current_thread():
            self._reader.join()


class KVReceiver(Endpoint):
    """The decode side's endpoint: ``address`` is what senders connect to; ``accept`` gives one ``Link`` per
    sender."""

    def __init__(self, pool: HostPool | DevicePool, *, host: str = "127.0.0.1", port: int = 0,
                 dtype: str | None = None, staging_pages: int | None = None,
                 staging_layout: HostLayout | str = HostLayout.PAGE_FIRST_DIRECT, io_backend: str = "direct",
                 wire: MooncakeWire | None = None, device_direct: bool | None = None) -> None:
        """``pool``: where requests land (a host pool, or a device pool: staged through ``staging_pages`` host pages
        of ``staging_layout`` it owns, copied on with kvtier's transfer engine, ``io_backend``, unless the wire
        reaches device memory). ``dtype`` is compared with each sender's in the handshake."""
        pool.check_open()
        self.pool, self.dtype = pool, dtype
        direct = isinstance(pool, DevicePool) and (reaches_device(pool.runtime.name) if device_direct is None
                                                   else device_direct)
        self._cond = named_condition("disagg.receiver")
        self._closing = self._closed = False
        self._links: list[Link] = []
        self._staging: Staging | None = None
        self._engine: TransferEngine | None = None
        self.wire = wire or MooncakeWire(host, device_memory=direct)
        self._listener = socket.create_server((host, port))
        try:
            if isinstance(pool, HostPool):
                self.side = Side.of(pool, dtype)
                self.wire.register(pool.buffer.cpu_address, pool.buffer.nbytes)
            elif direct:
                self.side = Side.of(pool, dtype, device_direct=True)
                for tensor in range(pool.geometry.tensors):
                    for address in pool.layer_device_addresses(tensor):
                        self.wire.register(address, pool.layer_bytes)
            else:
                pages = staging_pages or default_staging_pages(pool.geometry, 256 << 20)
                self._staging = Staging(pool.geometry, HostLayout(staging_layout), pages, pool.runtime)
                self.side = Side.of(self._staging.pool, dtype)
                self.wire.register(self._staging.pool.buffer.cpu_address, self._staging.pool.buffer.nbytes)
                self._engine = TransferEngine(pool, self._staging.pool, backend=io_backend)
        except BaseException:
            self._release()
            raise
        pool.add_user(self)

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def _check_open(self) -> None:
        if self._closing:
            raise BufferClosed(f"this receiver ({self.address if not self._closed else 'closed'}) is closed")

    def accept(self, timeout: float | None = 30.0) -> Link:
        """The next sender, once its handshake passed. HandshakeRefused (and the sender is told why) when it holds
        other KV than this side; PeerLost when it closed before the handshake; TransferTimedOut when none came
        within ``timeout`` s. Call from one thread at a time."""
        self._check_open()
        self._listener.settimeout(timeout)
        try:
            sock, where = self._listener.accept()
        except TimeoutError as exc:
            raise TransferTimedOut(f"no sender connected to {self.address} within {timeout} s") from exc
        except OSError:
            self._check_open()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = Channel(sock, f"{where[0]}:{where[1]}")
        try:
            link = self._handshake(channel, timeout)
        except BaseException:
            channel.close()
            raise
        with self._cond:
            if self._closing:
                link.close()
                raise BufferClosed("the receiver closed during the handshake")
            self._links.append(link)
        return link

    def _handshake(self, channel: Channel, timeout: float | None) -> Link:
        try:
            hello = channel.recv(timeout)
        except PeerLost as exc:
            raise PeerLost(f"{channel.peer} closed the connection before the handshake", peer=channel.peer) from exc
        try:
            if hello["kind"] != "hello" or hello.get("version") != VERSION:
                raise HandshakeRefused(f"{channel.peer} said {hello['kind']!r} with protocol version "
                                       f"{hello.get('version')!r} (this side speaks {VERSION})", peer=channel.peer)
            theirs = hello["kv"]
            check_fit(self.side, Side(**theirs, layout="", pages=0, bases=()), channel.peer)
            session = str(hello["session"])
        except (HandshakeRefused, KeyError, TypeError) as exc:
            reason = str(exc) if isinstance(exc, HandshakeRefused) else f"a malformed hello: {exc!r}"
            with contextlib.suppress(PeerLost):
                channel.send("refused", reason=reason)
            if isinstance(exc, HandshakeRefused):
                raise
            raise HandshakeRefused(f"{channel.peer} sent {reason}", peer=channel.peer) from exc
        channel.send("welcome", version=VERSION, side=self.side.to_json(), session=self.wire.session)
        return Link(self, channel, session)

    def _land(self, landing: Landing) -> None:
        """A sender said ``done``: through staging, copy the pages on to the device pool first."""
        if self._engine is not None:
            self._engine.load(landing.wire_pages, landing.pages, per_layer=False).wait()

    # -- lifetime ---------------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """The pool is closing: close first (no sender may write into it after)."""
        self.close()

    def _stopping(self) -> Callable[[], None]:
        """Stop listening, drop every link (pending requests fail with BufferClosed, none lands); then unregister
        the memory (a sender still writing is refused by Mooncake from here on) and free the staging pool."""
        links = list(self._links)

        def stop() -> None:
            self._listener.close()
            for link in links:
                link.close()

        return stop

    def _release(self) -> None:
        self._listener.close()
        self._let_go()

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<KVReceiver {'closed' if self._closing else self.address}>"
