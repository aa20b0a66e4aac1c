"""The stored page format: a fixed header, then the page's bytes.

A page in storage outlives the process that wrote it and may be read by another process, another version of kvtier,
another model: so it says what it is. The header carries the format version, the namespace digest, the page key, the
KV geometry, the dtype, the payload length and an xxh3-128 checksum over the header fields and the payload. A reader
compares every field with what it expects and recomputes the checksum; a page that fails any check is a *miss*
(counted by reason), never loaded. xxh3 guards against corruption (torn writes, flipped bits, truncation); identity
comes from the SHA-256 keys.

Layout (little-endian): magic ``KVTP``, version u16, header length u16, checksum algorithm u8, pool kind u8,
payload order u16, layers / page size / row bytes / heads u32 each, payload length u64, namespace digest (32 bytes),
page key (32 bytes), dtype (16 bytes, NUL-padded ASCII), checksum (16 bytes).

The payload is the host pool's pieces of the page, read one after another, so its byte order depends on the host
layout; the payload order (``kvtier.pools.payload_order``) says which, and a reader of another order counts a miss
(``layout``) and leaves the page to caches of that order. Version 1 had no order (2 reserved bytes there).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import xxhash

from kvtier.errors import InvalidArgument
from kvtier.keys import Namespace
from kvtier.pools.geometry import HostLayout, KVGeometry, PoolKind, payload_order, valid_payload_order

MAGIC = b"KVTP"
VERSION = 2
XXH3_128 = 1
_FIELDS = struct.Struct("<4sHHBBHIIIIQ32s32s16s")
_CHECKSUM = struct.Struct("<16s")
HEADER_BYTES = _FIELDS.size + _CHECKSUM.size
KINDS = {kind: number for number, kind in enumerate(PoolKind, start=1)}


class PageRejected(Exception):
    """A stored page failed verification; ``reason`` is the miss counter it goes to."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


STATE_MAGIC = b"KVTS"
"""The magic of a stored state snapshot (:mod:`kvtier.storage.state_format`): a KV reader that finds it counts a
``kind`` miss, as a state reader that finds a KV page does."""
MAGICS = {MAGIC: "a KV page", STATE_MAGIC: "a state snapshot"}


class StoredFormat:
    """The rules every stored value shares, whatever it holds: a ``HEADER_BYTES`` header (magic, version and header
    length first, then the fields a subclass packs in ``_fields``, then an xxh3-128 checksum over those fields and
    the payload), every field compared on every read. Stores call only these methods, so a value of any format goes
    through every backend unchanged."""

    magic: ClassVar[bytes]
    version: ClassVar[int]
    fields: ClassVar[struct.Struct]
    field_names: ClassVar[tuple[str, ...]]

    @property
    def payload_bytes(self) -> int:
        raise NotImplementedError

    @property
    def stored_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    def _fields(self, key: bytes) -> bytes:
        raise NotImplementedError

    def _reason(self, first: str, stored: tuple[Any, ...]) -> str:
        """The miss counter for a header whose first differing field (by ``field_names``) is ``first``."""
        raise NotImplementedError

    def header(self, key: bytes, payload: Sequence[Any]) -> bytes:
        """The header of a page whose bytes are the buffers ``payload`` (in order)."""
        digest = self.digest(key)
        for piece in payload:
            digest.update(piece)
        return self.sealed(key, digest.digest())

    def digest(self, key: bytes) -> Any:
        """A running checksum of a page being written under ``key``: feed it the payload in order (while it is in
        the CPU's caches, for writers that stream), then ``sealed(key, digest.digest())`` is the header."""
        return xxhash.xxh3_128(self._fields(key))

    def sealed(self, key: bytes, checksum: bytes) -> bytes:
        """The header of ``key``'s page whose running checksum (``digest(key)`` fed the payload) is ``checksum``."""
        return self._fields(key) + checksum

    def check_header(self, header: Any, key: bytes) -> bytes:
        """Raise PageRejected unless ``header`` is this format's header for ``key``; returns its checksum."""
        if len(header) < HEADER_BYTES:
            raise PageRejected("short", f"{len(header)} header bytes of {HEADER_BYTES}")
        header = bytes(header[:HEADER_BYTES])
        if header[:4] != self.magic:
            if header[:4] in MAGICS:
                raise PageRejected("kind", f"{MAGICS[header[:4]]}, not {MAGICS[self.magic]}")
            raise PageRejected("corrupt", "not a kvtier page (bad magic)")
        version = struct.unpack_from("<H", header, 4)[0]
        if version != self.version:
            raise PageRejected("format", f"stored format version {version}, this kvtier reads {self.version}")
        expected = self._fields(key)
        stored = header[:self.fields.size]
        if stored != expected:
            unpacked, wanted = self.fields.unpack(stored), self.fields.unpack(expected)
            differing = [n for n, a, b in zip(self.field_names, unpacked, wanted, strict=False) if a != b]
            first = next((n for n in differing if n != "payload order"), differing[0])   # geometry says more
            raise PageRejected(self._reason(first, unpacked), f"stored {first} differs from this namespace's")
        return header[self.fields.size:HEADER_BYTES]

    def check_payload(self, header: Any, checksum: bytes, payload: Sequence[Any]) -> None:
        """Raise PageRejected unless the payload (the buffers, in order) has the length and checksum the header
        names."""
        self.check_length(sum(memoryview(p).nbytes for p in payload))
        digest = self.verifier(header)
        for piece in payload:
            digest.update(piece)
        self.check_digest(digest, checksum)

    def check_length(self, length: int) -> None:
        """Raise PageRejected unless ``length`` is the payload length of this format's pages: a reader that learns
        a stored value's size before its bytes (a Redis reply's length line) checks it before it reads the payload
        into a page, so a value of another size never runs past the page's buffers."""
        if length != self.payload_bytes:
            raise PageRejected("short", f"{length} payload bytes of {self.payload_bytes}")

    def verifier(self, header: Any) -> Any:
        """A running checksum for reading the page of a checked ``header``: feed it the payload in order."""
        return xxhash.xxh3_128(bytes(header[:self.fields.size]))

    @staticmethod
    def check_digest(digest: Any, checksum: bytes) -> None:
        if digest.digest() != checksum:
            raise PageRejected("corrupt", "checksum mismatch")


@dataclass(frozen=True)
class PageFormat(StoredFormat):
    """What every page of one namespace must say about itself; builds and checks headers."""

    namespace_digest: bytes
    geometry: KVGeometry
    dtype: str
    order: int

    magic = MAGIC
    version = VERSION
    fields = _FIELDS
    field_names = ("magic", "version", "header length", "checksum algorithm", "pool kind", "payload order",
                   "layers", "page size", "row bytes", "heads", "payload length", "namespace", "key", "dtype")

    @classmethod
    def of(cls, namespace: Namespace, layout: HostLayout | str = HostLayout.PAGE_FIRST) -> PageFormat:
        """The format of ``namespace``'s pages read from and written to host pools of ``layout``."""
        dtype = namespace.dtype
        if len(dtype.encode()) > 16 or not dtype.isascii():
            raise InvalidArgument(f"dtype {dtype!r}: stored pages name their dtype in at most 16 ASCII characters")
        return cls(namespace.digest, namespace.geometry, dtype, payload_order(namespace.geometry, layout))

    @property
    def payload_bytes(self) -> int:
        return self.geometry.bytes_per_page

    def _fields(self, key: bytes) -> bytes:
        g = self.geometry
        return _FIELDS.pack(MAGIC, VERSION, HEADER_BYTES, XXH3_128, KINDS[g.kind], self.order, g.layers, g.page_size,
                            g.row_bytes, g.heads, self.payload_bytes, self.namespace_digest, key, self.dtype.encode())

    def _reason(self, first: str, stored: tuple[Any, ...]) -> str:
        reason = {"namespace": "namespace", "key": "key", "payload order": "layout",
                  "header length": "format"}.get(first, "geometry")
        if reason == "layout" and not valid_payload_order(stored[5]):
            reason = "corrupt"                         # no layout orders bytes that way: a damaged field
        return reason


def describe_header(header: bytes) -> dict[str, Any] | None:
    """The fields of a stored header (for ``kvtier storage ls``), or None if it is not one."""
    if len(header) < HEADER_BYTES or header[:4] != MAGIC:
        return None
    (_, version, _, _, kind, order, layers, page_size, row_bytes, heads, length, namespace, key,
     dtype) = _FIELDS.unpack_from(header)
    kinds = {v: k for k, v in KINDS.items()}
    return {"version": version, "kind": kinds[kind].value if kind in kinds else kind, "payload_order": order,
            "layers": layers,
            "page_size": page_size, "row_bytes": row_bytes, "heads": heads, "payload_bytes": length,
            "namespace": namespace.hex(), "key": key.hex(), "dtype": dtype.rstrip(b"\0").decode(errors="replace")}
