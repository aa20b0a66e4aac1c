"""KV pool geometry and host layouts: where every (tensor, layer, page, token, head) lives, in bytes.

A device pool is layer-first, as engines own it: per tensor (K and V for MHA; one for MLA and K-only) and per layer, a
[pages * page_size, row_bytes] array. A host pool puts the same bytes in one of four layouts:

- ``layer_first``        [layer][page][slot][row]     per-layer pieces of a page are contiguous (like the device)
- ``page_first``         [page][slot][layer][row]     a page is contiguous; its layers interleave per token
- ``page_first_direct``  [page][layer][slot][row]     a page is contiguous, and so is each (page, layer) piece
- ``page_head``          [page][head][layer][slot][head_bytes]  a page is contiguous, per head across layers
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.checks import Choice
from kvtier.errors import InvalidArgument, KvtierError


class PoolKind(Choice):
    __what__ = "pool kind"
    MHA = "mha"
    MLA = "mla"
    K_ONLY = "k_only"


class HostLayout(Choice):
    __what__ = "host layout"
    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"
    PAGE_HEAD = "page_head"

    @classmethod
    def of(cls, value: HostLayout | str, supported: tuple[HostLayout | str, ...], what: str) -> HostLayout:
        """``value`` as a layout a pool of one kind supports (the model-family pools keep a subset), refused with the
        supported names otherwise: one layout vocabulary, checked where a pool is made."""
        if isinstance(supported, str) or not isinstance(supported, (tuple, list, frozenset, set)):
            raise InvalidArgument(f"supported must be a tuple of host layouts, got {supported!r}")
        allowed = tuple(cls(choice) for choice in supported)
        layout = cls(value)
        if layout not in allowed:
            choices = ", ".join(repr(member.value) for member in allowed)
            raise InvalidArgument(f"{what} cannot be {layout.value!r}: choose one of {choices}")
        return layout


@dataclass(frozen=True)
class KVGeometry:
    """Per tensor and layer, each token has ``row_bytes`` (``heads`` pieces of ``row_bytes // heads``)."""

    kind: PoolKind
    layers: int
    page_size: int
    row_bytes: int
    heads: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", PoolKind(self.kind))
        for name in ("layers", "page_size", "row_bytes", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KvtierError(f"KVGeometry.{name} must be a positive int, got {value!r}")
        if self.row_bytes < 64 or self.row_bytes % 16:
            raise KvtierError(f"row of {self.row_bytes} bytes: rows must be at least 64 bytes and a multiple of 16")
        if self.row_bytes % self.heads or self.head_bytes % 16:
            raise KvtierError(f"{self.heads} heads must split a {self.row_bytes}-byte row into multiples of 16 bytes")

    @classmethod
    def mha(cls, layers: int, kv_heads: int, head_dim: int, itemsize: int, page_size: int) -> KVGeometry:
        return cls(PoolKind.MHA, layers, page_size, kv_heads * head_dim * itemsize, kv_heads)

    @classmethod
    def mla(cls, layers: int, latent_bytes: int, page_size: int) -> KVGeometry:
        """MLA: one latent row per token (DeepSeek-V3 bf16: (512 + 64) * 2 = 1152 bytes; FP8 + scales: 656)."""
        return cls(PoolKind.MLA, layers, page_size, latent_bytes, 1)

    @classmethod
    def k_only(cls, layers: int, heads: int, head_dim: int, itemsize: int, page_size: int) -> KVGeometry:
        return cls(PoolKind.K_ONLY, layers, page_size, heads * head_dim * itemsize, heads)

    @property
    def tensors(self) -> int:
        return 2 if self.kind is PoolKind.MHA else 1

    @property
    def head_bytes(self) -> int:
        return self.row_bytes // self.heads

    @property
    def page_bytes(self) -> int:
        """One (tensor, layer, page) piece."""
        return self.page_size * self.row_bytes

    @property
    def bytes_per_page(self) -> int:
        """A whole page: every tensor and layer."""
        return self.tensors * self.layers * self.page_bytes


@dataclass(frozen=True)
class Strides:
    """Byte strides of one tensor of a pool; ``layer`` is folded into per-layer base addresses."""

    layer: int
    page: int
    slot: int
    head: int

    def page_piece_contiguous(self, geometry: KVGeometry) -> bool:
        """Is each (page, layer) piece one contiguous run of ``page_bytes``?"""
        return self.row_contiguous(geometry) and self.slot == geometry.row_bytes

    def row_contiguous(self, geometry: KVGeometry) -> bool:
        return geometry.heads == 1 or self.head == geometry.head_bytes


def device_strides(geometry: KVGeometry) -> Strides:
    g = geometry
    return Strides(layer=0, page=g.page_bytes, slot=g.row_bytes, head=g.head_bytes)


def host_strides(geometry: KVGeometry, layout: HostLayout, pages: int) -> Strides:
    g, layout = geometry, HostLayout(layout)
    if layout is HostLayout.LAYER_FIRST:
        return Strides(layer=pages * g.page_bytes, page=g.page_bytes, slot=g.row_bytes, head=g.head_bytes)
    if layout is HostLayout.PAGE_FIRST:
        return Strides(layer=g.row_bytes, page=g.page_size * g.layers * g.row_bytes, slot=g.layers * g.row_bytes,
                       head=g.head_bytes)
    if layout is HostLayout.PAGE_FIRST_DIRECT:
        return Strides(layer=g.page_bytes, page=g.layers * g.page_bytes, slot=g.row_bytes, head=g.head_bytes)
    piece = g.page_size * g.head_bytes
    return Strides(layer=piece, page=g.heads * g.layers * piece, slot=g.head_bytes, head=g.layers * piece)


ORDER_DIMS = {"layer": 1, "token": 2, "head": 3}


def payload_order(geometry: KVGeometry, layout: HostLayout | str) -> int:
    """An exact code for the order a page's bytes take when its host pieces are read one after another, which is
    what storage keeps: the nesting of the page's dimensions, outermost first, dimensions of size 1 left out, one
    decimal digit each (layer 1, token 2, head 3: ``layer_first`` is 123, ``page_first`` 213, ``page_head`` 312).
    Pages of two layouts with one code are interchangeable (``layer_first`` and ``page_first_direct`` always,
    ``page_head`` with one head too), pages of two codes are not. Derived from the strides, and checked against the
    byte order itself, so no layout is special-cased and no two orders can share a code."""
    import numpy as np

    g, layout = geometry, HostLayout(layout)
    strides = host_strides(g, layout, 2)                    # two pages: a layer_first layer stride spans a page
    dims = [(name, size, stride) for name, size, stride in
            (("layer", g.layers, strides.layer), ("token", g.page_size, strides.slot), ("head", g.heads, strides.head))
            if size > 1]
    nesting = sorted(dims, key=lambda d: -d[2])
    code = 0
    for name, _, _ in nesting:
        code = code * 10 + ORDER_DIMS[name]
    layer, slot, head = np.meshgrid(np.arange(g.layers), np.arange(g.page_size), np.arange(g.heads), indexing="ij")
    address = layer * strides.layer + slot * strides.slot + head * strides.head
    order = np.argsort(address, axis=None, kind="stable")
    index = {"layer": layer, "token": slot, "head": head}
    expected = np.lexsort([index[name].reshape(-1) for name, _, _ in reversed(nesting)]) if nesting else order
    if not np.array_equal(order, expected):
        raise InvalidArgument(f"{layout.value}: a page's bytes do not nest its dimensions; no payload order for it")
    return code or 1


def valid_payload_order(code: int) -> bool:
    """Whether ``code`` is one :func:`payload_order` can give (distinct digits 1-3), so a damaged header field is
    told from a page of another order."""
    digits = str(code)
    return code >= 1 and set(digits) <= set("123") and len(set(digits)) == len(digits)
