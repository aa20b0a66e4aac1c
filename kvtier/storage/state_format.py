"""The stored state snapshot format: a hybrid model's recurrent state after a prefix, as one stored value.

A snapshot is stored as a "page" of its own format, so every backend stores, reads and verifies it with the code it
has for KV pages (:mod:`kvtier.storage.snapshots`): the same header length and checksum as a KV page
(:class:`~kvtier.storage.format.StoredFormat`), another magic (``KVTS``), so a KV page is never read as a snapshot or
a snapshot as a KV page (a ``kind`` miss either way). Its fields name what the bytes are: the state kind, layers,
tensors, a fingerprint of the state geometry (every tensor's name, shape and dtype), the byte order of the host
layout, the payload length, the namespace and the key. A snapshot of another model or state geometry is a counted
miss (``namespace`` / ``geometry``), never bytes in a slot.

Layout (little-endian): magic ``KVTS``, version u16, header length u16, checksum algorithm u8, reserved u8, payload
order u16, layers / tensors u32 each, geometry fingerprint u64, payload length u64, namespace digest (32 bytes), key
(32 bytes), state kind (16 bytes, NUL-padded ASCII, cut to 16), checksum (16 bytes).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.keys import Namespace
from kvtier.pools.geometry import HostLayout
from kvtier.pools.state import STATE_LAYOUTS, StateGeometry
from kvtier.storage.format import HEADER_BYTES, STATE_MAGIC, XXH3_128, StoredFormat

VERSION = 1
_FIELDS = struct.Struct("<4sHHBBHIIQQ32s32s16s")
LAYER_MAJOR, TENSOR_MAJOR = 1, 2
"""Payload orders: a slot's bytes per layer, every tensor of it (``page_first``), or per tensor, every layer of it
(``page_first_direct``); one tensor or one layer makes them the same bytes (``LAYER_MAJOR``)."""

if _FIELDS.size + 16 != HEADER_BYTES:
    raise ImportError("the state snapshot header must be as long as a KV page header")   # stores rely on it


def state_payload_order(geometry: StateGeometry, layout: HostLayout | str) -> int:
    """The byte order of a slot of ``geometry`` in a state host pool of ``layout``."""
    layout = HostLayout.of(layout, STATE_LAYOUTS, "a state host pool's layout")
    if layout is HostLayout.PAGE_FIRST or len(geometry.tensors) == 1 or geometry.layers == 1:
        return LAYER_MAJOR
    return TENSOR_MAJOR


def geometry_fingerprint(geometry: StateGeometry) -> int:
    """64 bits of SHA-256 over the state geometry's kind, layers and every tensor's name, shape and dtype."""
    canonical = json.dumps({"kind": geometry.name, "layers": geometry.layers,
                            "tensors": [[t.name, list(t.shape), t.dtype] for t in geometry.tensors]},
                           sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:8], "little")


@dataclass(frozen=True)
class StateFormat(StoredFormat):
    """What every state snapshot of one namespace and state geometry must say about itself."""

    namespace_digest: bytes
    geometry: StateGeometry
    order: int

    magic = STATE_MAGIC
    version = VERSION
    fields = _FIELDS
    field_names = ("magic", "version", "header length", "checksum algorithm", "reserved", "payload order",
                   "layers", "tensors", "geometry", "payload length", "namespace", "key", "kind")

    @classmethod
    def of(cls, namespace: Namespace, geometry: StateGeometry,
           layout: HostLayout | str = HostLayout.PAGE_FIRST) -> StateFormat:
        """The format of ``namespace``'s snapshots of ``geometry`` read from and written to state host pools of
        ``layout``."""
        if not isinstance(namespace, Namespace):
            raise InvalidArgument(f"namespace={namespace!r:.60}: a kvtier.cache.Namespace")
        if not isinstance(geometry, StateGeometry):
            raise InvalidArgument(f"geometry={geometry!r:.60}: a kvtier.pools.state.StateGeometry")
        if not geometry.name.isascii():
            raise InvalidArgument(f"state kind {geometry.name!r}: stored snapshots name their kind in ASCII")
        return cls(namespace.digest, geometry, state_payload_order(geometry, layout))

    @property
    def payload_bytes(self) -> int:
        return self.geometry.slot_bytes

    def _fields(self, key: bytes) -> bytes:
        g = self.geometry
        return _FIELDS.pack(STATE_MAGIC, VERSION, HEADER_BYTES, XXH3_128, 0, self.order, g.layers, len(g.tensors),
                            geometry_fingerprint(g), self.payload_bytes, self.namespace_digest, key,
                            g.name.encode()[:16])

    def _reason(self, first: str, stored: tuple[Any, ...]) -> str:
        reason = {"namespace": "namespace", "key": "key", "payload order": "layout",
                  "header length": "format"}.get(first, "geometry")
        if reason == "layout" and stored[5] not in (LAYER_MAJOR, TENSOR_MAJOR):
            reason = "corrupt"
        return reason
