"""What each side of a transfer is (``Side``: geometry, layout, where each tensor's layers start in the wire's
address domain) and how a request's pages map between two sides: contiguous runs, or a local conversion first.

Two sides whose pages break into the same pieces with the same byte order inside (``compatible``) are written run by
run, adjacent runs merged: ``layer_first``, ``page_first_direct``, one-head ``page_head`` and a device pool all split
into (tensor, layer, page) pieces; ``page_first`` and ``page_head`` match only themselves (whole pages). Any other
pair would be a scatter of rows or heads (2 KiB runs for Llama-3-8B), which Mooncake's TCP transport moves at a
twentieth of its speed for large runs, so the *sender* converts: it gathers its pages into staging memory laid out
as the receiver's (``gather``, on the CPU for a host pool; kvtier's transfer engine does it for a device pool), and
the wire writes whole pieces from there.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvtier import osmem
from kvtier.errors import HandshakeRefused
from kvtier.pools import DevicePool, HostLayout, HostPool, KVGeometry, PoolKind, device_strides, host_strides
from kvtier.pools.geometry import Strides

DEVICE = "device"
"""The layout name of a device pool's side (layer-first, every (tensor, layer) its own base)."""


@dataclass(frozen=True)
class Side:
    """One side's registered pages, as the handshake carries them (JSON): enough to address any byte of any page."""

    kind: str
    layers: int
    page_size: int
    row_bytes: int
    heads: int
    dtype: str | None
    layout: str
    pages: int
    bases: tuple[tuple[int, ...], ...]
    """``bases[tensor][layer]``: the address of page 0, slot 0, head 0 in the wire's domain (CPU for host pools)."""

    @classmethod
    def of(cls, pool: HostPool | DevicePool, dtype: str | None, *, device_direct: bool = False) -> Side:
        g = pool.geometry
        if isinstance(pool, HostPool):
            layout = pool.layout.value
            bases = tuple(tuple(a.value for a in pool.layer_cpu_addresses(t)) for t in range(g.tensors))
        else:
            if not device_direct:
                raise HandshakeRefused("a device pool is a side of its own only where the wire reaches device "
                                       "memory; stage it through a host pool")
            layout = DEVICE
            bases = tuple(tuple(a.value for a in pool.layer_device_addresses(t)) for t in range(g.tensors))
        return cls(g.kind.value, g.layers, g.page_size, g.row_bytes, g.heads, dtype, layout, pool.pages, bases)

    @classmethod
    def from_json(cls, data: Any) -> Side:
        try:
            fields = dict(data)
            fields["bases"] = tuple(tuple(int(a) for a in row) for row in fields["bases"])
            side = cls(**fields)
            side.geometry  # noqa: B018  (checks the fields)
            side.strides  # noqa: B018
        except Exception as exc:
            raise HandshakeRefused(f"the peer described its pages in a form this kvtier cannot read: {exc}") from exc
        return side

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def geometry(self) -> KVGeometry:
        return KVGeometry(PoolKind(self.kind), self.layers, self.page_size, self.row_bytes, self.heads)

    @property
    def strides(self) -> Strides:
        if self.layout == DEVICE:
            return device_strides(self.geometry)
        return host_strides(self.geometry, HostLayout(self.layout), self.pages)


def check_fit(mine: Side, theirs: Side, peer: str) -> None:
    """Refuse a peer whose pages are not this side's kind of pages, naming every difference."""
    names = ("kind", "layers", "page_size", "row_bytes", "heads", "dtype")
    different = [f"{name} {getattr(theirs, name)!r} (here {getattr(mine, name)!r})" for name in names
                 if getattr(mine, name) != getattr(theirs, name)]
    if different:
        raise HandshakeRefused(f"{peer} holds other KV than this side: {', '.join(different)}", peer=peer)


def _unit(side: Side) -> str:
    g, strides = side.geometry, side.strides
    return "piece" if strides.page_piece_contiguous(g) else "page"


def compatible(a: Side, b: Side) -> bool:
    """Whether pages of ``a`` and ``b`` split into the same pieces, each with the same byte order."""
    if _unit(a) == "piece" and _unit(b) == "piece":
        return True
    return a.layout == b.layout


@dataclass(frozen=True)
class Runs:
    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def _units(side: Side, pages: np.ndarray, unit: str) -> tuple[np.ndarray, int]:
    """Addresses of every unit of ``pages`` (order: tensor, layer, page), and the unit's size."""
    g, s = side.geometry, side.strides
    pages = pages.astype(np.int64)
    if unit == "piece":
        bases = np.asarray(side.bases, dtype=np.int64).reshape(-1)           # [tensor * layer]
        return (bases[:, None] + pages[None, :] * s.page).reshape(-1), g.page_bytes
    bases = np.asarray([row[0] for row in side.bases], dtype=np.int64)      # a page's layers are inside it
    return (bases[:, None] + pages[None, :] * s.page).reshape(-1), g.layers * g.page_bytes


def plan_runs(src: Side, src_pages: np.ndarray, dst: Side, dst_pages: np.ndarray) -> Runs:
    """Contiguous runs taking ``src_pages`` of ``src`` to ``dst_pages`` of ``dst`` (compatible sides), merged where
    both ends continue: consecutive pages on both sides make one run per (tensor, layer) or per tensor."""
    if not compatible(src, dst):
        raise ValueError(f"{src.layout} -> {dst.layout} is not run-compatible: convert first")
    unit = "piece" if _unit(src) == "piece" and _unit(dst) == "piece" else "page"
    s, size = _units(src, src_pages, unit)
    d, _ = _units(dst, dst_pages, unit)
    if not len(s):
        empty = np.zeros(0, dtype=np.int64)
        return Runs(empty, empty, empty)
    order = np.argsort(s, kind="stable")
    s, d = s[order], d[order]
    breaks = np.flatnonzero((s[1:] != s[:-1] + size) | (d[1:] != d[:-1] + size)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [len(s)])))
    return Runs(s[starts], d[starts], counts * size)


def staging_layout(dst: Side) -> HostLayout:
    """The host layout a sender stages in for ``dst``: the receiver's own (a device receiver: ``layer_first``)."""
    return HostLayout.LAYER_FIRST if dst.layout == DEVICE else HostLayout(dst.layout)


def _view(pool: HostPool, tensor: int) -> np.ndarray:
    """[page, layer, slot, head, byte] over one tensor of a host pool's memory, in its own layout (a numpy view of
    the CPU address: the caller keeps the pool open while it is used)."""
    g, s = pool.geometry, pool.strides
    memory = np.ctypeslib.as_array(osmem.byte_array(pool.buffer.cpu_address.value, pool.buffer.nbytes))
    start = pool.tensor_offset(tensor)
    return np.lib.stride_tricks.as_strided(memory[start:start + pool.tensor_bytes],
                                           (pool.pages, g.layers, g.page_size, g.heads, g.head_bytes),
                                           (s.page, s.layer, s.slot, s.head, 1), writeable=True)


def gather(src: HostPool, src_pages: np.ndarray, dst: HostPool, dst_pages: np.ndarray) -> None:
    """Copy pages between host pools of different layouts on the CPU (each page's bytes rearranged on the way)."""
    for tensor in range(src.geometry.tensors):
        a, b = _view(src, tensor), _view(dst, tensor)
        for s, d in zip(src_pages.tolist(), dst_pages.tolist(), strict=True):
            np.copyto(b[d], a[s])


def default_staging_pages(geometry: KVGeometry, budget: int = 64 << 20) -> int:
    return max(1, min(4096, math.ceil(budget / geometry.bytes_per_page)))
