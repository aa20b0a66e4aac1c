"""The control channel: small JSON messages, length-prefixed, over one TCP connection per sender/receiver pair.

The bytes of KV go over Mooncake; this channel carries only who fills which pages and when they are done. It is
also how each side learns the other died: the kernel closes a dead process's sockets, so a SIGKILLed peer reads as
end-of-file here at once, with no heartbeat.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
from typing import Any

from kvtier.errors import PeerLost, TransferFailed, TransferTimedOut
from kvtier.locks import named_lock

VERSION = 1
MAX_MESSAGE = 16 << 20
_LENGTH = struct.Struct(">I")


class Channel:
    """One connection. ``send`` may be called from several threads; ``recv`` from one (the reader)."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self._send_lock = named_lock("disagg.channel")
        self.closed = False

    @classmethod
    def connect(cls, address: str, timeout: float) -> Channel:
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout)
        except (OSError, ValueError) as exc:
            raise PeerLost(f"cannot reach the receiver at {address!r}: {exc}", peer=address) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        return cls(sock, address)

    def send(self, kind: str, **fields: Any) -> None:
        data = json.dumps({"kind": kind, **fields}).encode()
        with self._send_lock:
            try:
                self.sock.sendall(_LENGTH.pack(len(data)) + data)
            except OSError as exc:
                raise PeerLost(f"the connection to {self.peer} broke while sending {kind!r}: {exc}",
                               peer=self.peer) from exc

    def recv(self, timeout: float | None = None) -> dict[str, Any]:
        """The next message; PeerLost at end-of-file or a broken connection, TransferTimedOut after ``timeout``."""
        try:
            self.sock.settimeout(timeout)
            (length,) = _LENGTH.unpack(self._exactly(_LENGTH.size))
            if length > MAX_MESSAGE:
                raise TransferFailed(f"{self.peer} sent a {length}-byte control message (at most {MAX_MESSAGE}): "
                                     f"not a kvtier peer?", peer=self.peer)
            message = json.loads(self._exactly(length))
        except TimeoutError as exc:
            raise TransferTimedOut(f"no message from {self.peer} within {timeout} s", peer=self.peer) from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise TransferFailed(f"{self.peer} sent a malformed control message: {exc}", peer=self.peer) from exc
        except OSError as exc:
            raise PeerLost(f"the connection to {self.peer} is closed: {exc}", peer=self.peer) from exc
        finally:
            if not self.closed:
                with contextlib.suppress(OSError):
                    self.sock.settimeout(None)
        if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
            raise TransferFailed(f"{self.peer} sent a control message without a kind: {message!r:.200}",
                                 peer=self.peer)
        return message

    def _exactly(self, count: int) -> bytes:
        chunks, left = [], count
        while left:
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except TimeoutError:
                raise
            except OSError as exc:
                raise PeerLost(f"the connection to {self.peer} broke: {exc}", peer=self.peer) from exc
            if not chunk:
                raise PeerLost(f"{self.peer} closed the connection", peer=self.peer)
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        """Shut the connection down (a reader blocked in ``recv`` wakes with PeerLost) and close it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
