"""Page keys: what a page of KV *is*, independent of where it lives.

A page's key is SHA-256 over its parent page's key and this page's token ids (little-endian uint32), and the first
page's parent is the namespace digest. So a key names the whole prefix up to the end of its page, in one model, KV
geometry and dtype, tensor-parallel rank, adapter and tenant: two namespaces never share a key, and keys are the same
in every process, on every machine and in every version of kvtier that keeps ``KEY_FORMAT`` (no ``hash()``, no
per-process seed). Peers served one tenant's or adapter's KV to another through weaker keys, and lost every
cross-instance hit when a per-process seed changed.

The chain runs in C where the package's install built ``kvtier._chain_keys`` (OpenSSL's SHA-256, the GIL released:
~0.1 µs a 1-token page), else with hashlib (one Python call per page, ~0.6 µs): the keys are the same. Either way the
radix index never hashes on its hot path: it matches token ids and computes keys only when something (storage, a
caller) asks for them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.errors import InvalidArgument
from kvtier.pools.geometry import KVGeometry

try:
    from kvtier import _chain_keys as _native
except ImportError:                               # not built (no compiler or OpenSSL headers at install)
    _native = None  # type: ignore[assignment]

KEY_FORMAT = "kvtier-page-key-v1"
KEY_BYTES = 32
TOKEN_LIMIT = 1 << 32


def token_array(tokens: Any, what: str = "tokens", *, copy: bool = True) -> np.ndarray:
    """Token ids as a fresh contiguous uint32 array (the cache keeps views of it); a 1-D list, numpy array or torch
    tensor of non-negative ids < 2**32. ``copy=False`` for a lookup that keeps nothing: a uint32 array comes back as
    it is."""
    if type(tokens) is np.ndarray and tokens.dtype == np.uint32 and tokens.ndim == 1:
        return tokens.copy() if copy else tokens  # already what the cache keeps: nothing to check
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):
        tokens = tokens.detach().cpu().numpy()
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise InvalidArgument(f"{what} must be one sequence of token ids, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        raise InvalidArgument(f"{what} must hold integer token ids, got dtype {array.dtype}")
    if array.dtype != np.uint32:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= TOKEN_LIMIT:
            raise InvalidArgument(f"{what} holds token id {low if low < 0 else high}: ids must be in [0, 2**32)")
    return array.astype(np.uint32)


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two pages of equal tokens hold different KV. ``geometry`` fixes layers, page size, row
    bytes and heads; ``dtype`` names the element type (``"bfloat16"``, ``"fp8_e4m3"``); ``tenant`` is an optional
    salt that keeps one tenant's pages from ever matching another's."""

    model: str
    geometry: KVGeometry
    dtype: str
    tp_rank: int = 0
    tp_size: int = 1
    adapter: str | None = None
    tenant: str | None = None
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgument("Namespace.model must name the model (a non-empty string)")
        if not isinstance(self.geometry, KVGeometry):
            raise InvalidArgument(f"Namespace.geometry must be a KVGeometry, got {type(self.geometry).__name__}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise InvalidArgument("Namespace.dtype must name the KV element type, e.g. 'bfloat16'")
        ints = all(type(v) is int for v in (self.tp_rank, self.tp_size))
        if not ints or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(f"tensor-parallel rank {self.tp_rank!r} of size {self.tp_size!r} is not valid "
                                  f"(ints, 0 <= rank < size)")
        for name in ("adapter", "tenant"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidArgument(f"Namespace.{name} must be a string or None, got {getattr(self, name)!r}")
        object.__setattr__(self, "digest", hashlib.sha256(self.canonical().encode()).digest())

    def canonical(self) -> str:
        """The namespace as stable JSON (sorted keys, no whitespace): what the digest hashes."""
        g = self.geometry
        fields = {"format": KEY_FORMAT, "model": self.model, "dtype": self.dtype,
                  "geometry": {"kind": g.kind.value, "layers": g.layers, "page_size": g.page_size,
                               "row_bytes": g.row_bytes, "heads": g.heads},
                  "tp_rank": self.tp_rank, "tp_size": self.tp_size, "adapter": self.adapter, "tenant": self.tenant}
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @property
    def page_size(self) -> int:
        return self.geometry.page_size


def chain_keys(parent: bytes, tokens: np.ndarray, page_size: int) -> list[bytes]:
    """Keys of the whole pages of ``tokens`` following a page whose key is ``parent`` (the namespace digest for the
    first page of a prompt)."""
    if len(parent) != KEY_BYTES:
        raise InvalidArgument(f"a parent key is {KEY_BYTES} bytes, got {len(parent)}")
    data = np.ascontiguousarray(tokens[: len(tokens) // page_size * page_size], dtype="<u4").tobytes()
    if _native is not None:
        return _native.chain(bytes(parent), data, 4 * page_size)
    return python_chain(bytes(parent), data, 4 * page_size)


def python_chain(parent: bytes, data: bytes, width: int) -> list[bytes]:
    """The chain with hashlib, one call per page: where the C one (``kvtier._chain_keys``) was not built."""
    sha256 = hashlib.sha256
    keys: list[bytes] = []
    key = parent
    for start in range(0, len(data), width):
        key = sha256(key + data[start:start + width]).digest()
        keys.append(key)
    return keys


def page_keys(namespace: Namespace, tokens: Any) -> list[bytes]:
    """Keys of every whole page of a prompt in ``namespace``."""
    return chain_keys(namespace.digest, token_array(tokens), namespace.page_size)


STATE_KEY_FORMAT = b"kvtier-state-key-v1"


def state_key(page_key: bytes) -> bytes:
    """The storage key of the state snapshot after the prefix ending with the page of ``page_key`` (a hybrid model's
    recurrent state there): SHA-256 of a domain tag and that page key. Derived from the page key, it names the same
    prefix in the same namespace, yet no page key ever equals it (the tag keeps the two domains apart)."""
    if not isinstance(page_key, bytes) or len(page_key) != KEY_BYTES:
        raise InvalidArgument(f"a page key is {KEY_BYTES} bytes, got {page_key!r:.40}")
    return hashlib.sha256(STATE_KEY_FORMAT + page_key).digest()
