"""The ``*_direct`` functions of SGLang's kvcacheio: DMA copies of token runs and whole pages, no kernel.

SGLang issues one ``Tensor.copy_`` per run and layer (a page at a time for ``page_first_direct`` hosts), reading the
indices on the host first. kvtier reads them the same way, then queues every layer's runs in one
``memcpy_run_sets_async`` call on the caller's current stream: equally spaced runs become one strided copy, the rest
go in one batch. Operands resolve through the one resolver, so host tensors must be pinned or registered (the copy
engines read them asynchronously). A call is planned in two halves: each layer's tensor ends (:class:`End`), kept per
operand set as a kernel call's plan is, and the runs of its index values (:class:`Indexed`), kept per index tensors;
so a request's new indices over the same pools re-derive only the runs.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.address import Address, CpuAddress
from kvtier.compat.device_array import DeviceArray
from kvtier.compat.operands import (
    LIMIT,
    Call,
    address,
    call_for,
    extent,
    is_tensor,
    keep_plan,
    kept_plan,
    operand_key,
)
from kvtier.errors import InvalidArgument, KvtierError, about
from kvtier.locks import named_lock
from kvtier.memory.alias import span_chunks
from kvtier.memory.registration import span_generation, split_at_boundaries
from kvtier.pause_points import reached


def _index_values(x: Any, name: str) -> np.ndarray:
    import torch

    if not (is_tensor(x) or isinstance(x, DeviceArray)):
        raise InvalidArgument(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dtype not in (torch.int64, torch.int32):
        raise InvalidArgument(f"{name} must be int64 (or int32), got {x.dtype}")
    values = x.cpu() if isinstance(x, DeviceArray) else x.detach().to("cpu")
    return values.numpy().reshape(-1).astype(np.int64, copy=False)


def _indices(src_indices: Any, dst_indices: Any, page_size: Any) -> tuple[np.ndarray, np.ndarray, int]:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size <= 0:
        raise InvalidArgument(f"page_size must be a positive integer, got {page_size!r}")
    src, dst = _index_values(src_indices, "src_indices"), _index_values(dst_indices, "dst_indices")
    if src_indices.dtype != dst_indices.dtype:
        raise InvalidArgument(f"src_indices ({src_indices.dtype}) and dst_indices ({dst_indices.dtype}) must have one "
                              f"dtype")
    if src.size != dst.size:
        raise InvalidArgument(f"src_indices ({src.size}) and dst_indices ({dst.size}) must have the same length")
    if src.size % page_size:
        raise InvalidArgument(f"{src.size} indices are not whole pages of page_size={page_size}")
    return src, dst, int(page_size)


@dataclass(eq=False)
class Indexed:
    """A call's index values and what was derived from them (copy runs, the overlap check), kept for the next call
    with equal values: a per-layer load passes the same index tensors for each of its ~60 calls, which then compare
    the values instead of deriving everything again."""

    src: np.ndarray
    dst: np.ndarray
    page_size: int
    derived: dict[Any, Any] = field(default_factory=dict)

    def get(self, key: Any, make: Callable[..., Any], *args: Any) -> Any:
        """``make(*args)``, made once per key."""
        found = self.derived.get(key)
        if found is None:
            found = self.derived[key] = make(*args)
        return found


INDEXED_KEPT = 4
"""Index value sets kept (with their copies): a per-layer load uses one; a few streams load at once."""
_indexed: OrderedDict[tuple, Indexed] = OrderedDict()
_indexed_lock = named_lock("compat.indexed", fork_safe=True)


def _indexed_values(src_indices: Any, dst_indices: Any, page_size: Any) -> Indexed:
    """The checked index values of a call, with what earlier calls derived from equal values."""
    src, dst, page_size = _indices(src_indices, dst_indices, page_size)
    key = (id(src_indices), id(dst_indices), page_size)
    with _indexed_lock:
        reached("direct.indexed_locked")
        found = _indexed.get(key)
    if found is not None and np.array_equal(found.src, src) and np.array_equal(found.dst, dst):
        return found
    made = Indexed(src.copy(), dst.copy(), page_size)   # the caller may rewrite its index tensors in place
    with _indexed_lock:
        _indexed[key] = made
        _indexed.move_to_end(key)
        while len(_indexed) > INDEXED_KEPT:
            _indexed.popitem(last=False)
    return made


def _tensors(xs: Sequence[Any], name: str) -> list[Any]:
    if not isinstance(xs, (list, tuple)) or not xs:
        raise InvalidArgument(f"{name} must be a non-empty list of tensors")
    for i, x in enumerate(xs):
        if not (is_tensor(x) or isinstance(x, DeviceArray)):
            raise InvalidArgument(f"{name}[{i}] must be a tensor, got {type(x).__name__}")
        if not x.is_contiguous() or x.dim() < 1:
            raise InvalidArgument(f"{name}[{i}] must be a contiguous tensor of at least one dimension")
    return list(xs)


def _bytes(x: Any, dim: int) -> int:
    """Bytes between consecutive entries of dimension ``dim`` of a contiguous tensor: from its shape, since the stride
    torch keeps for a dimension of size 1 means nothing (a transposed or permuted view is contiguous with any)."""
    return math.prod(x.shape[dim + 1:]) * x.element_size()


@dataclass(frozen=True, eq=False)
class Runs:
    """A call's copies in bytes from each side's start of a layer, the same for every layer of one stride: computed
    once per call and shared, so each layer adds only two resolutions and two bounds checks (a per-layer call queues
    ~1000 copies in ~1 ms; rebuilding these arrays for every layer cost the compat call ~3% of that)."""

    dst_offsets: np.ndarray
    src_offsets: np.ndarray
    sizes: np.ndarray
    dst_span: tuple[int, int]
    src_span: tuple[int, int]


def _offsets(positions: np.ndarray, stride: int, name: str) -> tuple[np.ndarray, int, int]:
    """(``positions * stride`` bytes, the lowest and highest of them): the indices a call uses are checked here, once,
    to be non-negative and never to overflow int64."""
    if not positions.size:
        return positions * stride, 0, 0
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0:
        raise InvalidArgument(f"{name}: index {lo}: direct transfers take non-negative indices only")
    if hi > LIMIT // max(stride, 1):
        raise InvalidArgument(f"{name}: index {hi} is out of range of any tensor")
    return positions * stride, lo * stride, hi * stride


def _runs(dst_positions: np.ndarray, dst_stride: int, dst_name: str, src_positions: np.ndarray, src_stride: int,
          src_name: str, size: int | np.ndarray) -> Runs:
    """Copy ``i`` moves ``size`` (or ``size[i]``) bytes from source entry ``src_positions[i]`` to destination entry
    ``dst_positions[i]``, entries ``*_stride`` bytes apart."""
    (dst_offsets, dst_lo, dst_hi), (src_offsets, src_lo, src_hi) = (
        _offsets(dst_positions, dst_stride, dst_name), _offsets(src_positions, src_stride, src_name))
    if isinstance(size, np.ndarray):
        sizes = size.astype(np.int64, copy=False)
        return Runs(dst_offsets, src_offsets, sizes, (dst_lo, int((dst_offsets + sizes).max())),
                    (src_lo, int((src_offsets + sizes).max())))
    return Runs(dst_offsets, src_offsets, np.full(dst_offsets.shape, size, np.int64), (dst_lo, dst_hi + size),
                (src_lo, src_hi + size))


@dataclass(frozen=True)
class Copies:
    """One layer's copies, checked and resolved: ``sizes[i]`` bytes at each offset pair. A host side's base is its
    CPU address (copies take that), cut where kvtier registrations meet, which no single copy may cross."""

    dst: Address
    dst_offsets: np.ndarray
    src: Address
    src_offsets: np.ndarray
    sizes: np.ndarray


def _is_host(x: Any) -> bool:
    return is_tensor(x) and x.device.type == "cpu"


@dataclass(frozen=True)
class End:
    """One side of a layer's copies as far as it does not depend on the indices: where offset 0 is (the tensor's
    start moved on by ``shift`` bytes, the layer's place in a page), the bytes from there to the tensor's end, and
    whether a kvtier registration edge lies inside the tensor (only then are copies looked at for cutting). Made
    once per tensor set and kept (:func:`_kept`), so a request's new indices cost a bounds check per side."""

    base: Address
    shift: int
    size: int
    name: str
    edges: bool


def _end(call: Call, x: Any, name: str, shift: int = 0) -> End:
    base, size = _kept(call, ("direct base",), [(x, name)], lambda: _base(call, x, name))
    edges = isinstance(base, CpuAddress) and bool(call.runtime.host_edges(base.value, base.value + size))
    return End(base + shift, shift, size, name, edges)


def _copies(call: Call, runs: Runs, dst: End, src: End) -> Copies | None:
    """``runs`` from ``src`` to ``dst``, once every copy is checked to lie inside both tensors; a host side is cut
    where kvtier registrations meet, which no single copy may cross."""
    if not runs.sizes.size:
        return None
    sides = ((dst, runs.dst_span), (src, runs.src_span))
    for end, (_, reach) in sides:
        if end.shift + reach > end.size:
            raise InvalidArgument(f"{end.name}: a copy reaches byte {end.shift + reach} of a tensor of {end.size} "
                                  f"bytes: index out of range")
    at, sizes = [runs.dst_offsets, runs.src_offsets], runs.sizes
    for side, (end, (lo, reach)) in enumerate(sides):
        if end.edges:
            start = end.base.value
            edges = [edge - start for edge in call.runtime.host_edges(start + lo, start + reach)]
            if edges:
                starts, sizes, origin, moved = split_at_boundaries(at[side], sizes, edges)
                at = [starts if i == side else other[origin] + moved for i, other in enumerate(at)]
    return Copies(dst.base, at[0], src.base, at[1], sizes)


def _kept(call: Call, shape: tuple, operands: Sequence[tuple[Any, str]], build: Callable[[], Any]) -> Any:
    """``build()`` over ``operands``, kept for the next call over the same tensors (by :func:`operand_key`) while
    kvtier's host ranges are unchanged (:func:`span_generation`, read before the build: a plan built while
    registrations change is kept under the old generation, which no later call asks for); DeviceArrays are resolved
    again on every use (a closed one is refused by name)."""
    keys = [operand_key(call, x) for x, _ in operands]
    key = None if None in keys else (call.device, span_generation(call.runtime), *shape, *keys)
    found = kept_plan(call, key, [(x, name) for x, name in operands if isinstance(x, DeviceArray)])
    if found is None:
        found = build()
        reached("direct.plan_built")
        keep_plan(call, key, found)
    return found


def _base(call: Call, x: Any, name: str) -> tuple[Address, int]:
    """(what copies take as ``x``'s start: its device address, or the CPU address of a host tensor once it is checked
    to resolve for the device; the bytes it spans)."""
    if _is_host(x) and call.runtime.host_range(x.data_ptr()) is not None:
        try:   # copies read kvtier's host memory by CPU address, cut per chunk: chunk aliases need not be contiguous
            span_chunks(call.runtime, x.data_ptr(), extent(x), call.device)
        except KvtierError as error:
            raise about(error, name) from None
        return CpuAddress(x.data_ptr()), extent(x)
    resolved = address(call, x, name)
    return (CpuAddress(x.data_ptr()) if _is_host(x) else resolved), extent(x)


def _refuse_shared(destinations: Sequence[Any], dst_name: str, sources: Sequence[Any], src_name: str) -> None:
    """A call's destination tensors must not overlap each other nor any source tensor: their copies go in batches, in
    no defined order, so which bytes land would depend on it (SGLang's loop of ``copy_`` keeps the last layer's
    bytes, or reads bytes an earlier layer wrote; kvtier refuses, as it refuses repeated destination indices).
    Sources may overlap each other (read twice)."""
    spans = sorted([_span(x, dst_name, i) for i, x in enumerate(destinations)]
                   + [_span(x, src_name, i) for i, x in enumerate(sources)])
    reach: tuple[int, str, int] = (0, "", -1)         # furthest end of any span so far, and whose
    reach_dst: tuple[int, str, int] = (0, "", -1)     # the same among destinations
    for start, end, name, i in spans:
        if start == end:
            continue
        written = name == dst_name
        clash = reach if written else reach_dst
        if clash[2] >= 0 and start < clash[0]:
            raise InvalidArgument(f"{clash[1]}[{clash[2]}] and {name}[{i}] overlap, and one of them is written: one "
                                  f"call's copies land in no defined order")
        reach = max(reach, (end, name, i))
        if written:
            reach_dst = max(reach_dst, (end, name, i))


def _span(x: Any, name: str, i: int) -> tuple[int, int, str, int]:
    """(first byte, end, ``name``, ``i``) of operand ``name[i]``; a closed DeviceArray is refused by that name."""
    try:
        start = int(x.data_ptr())
    except KvtierError as error:
        raise about(error, f"{name}[{i}]") from None
    return start, start + extent(x), name, i


def _refuse_overlap(starts: np.ndarray, lengths: np.ndarray | int, name: str, unit: str) -> None:
    """Two copies writing the same bytes (a repeated destination index, or runs that overlap) are refused: one call's
    copies land in no defined order, so which source would win is undefined (SGLang's loop of ``copy_`` keeps the
    last, its kernels race). Checked once per call on the destination indices (``lengths`` ``unit``s from each of
    ``starts``): every layer's copies are those runs scaled by the layer's row or page bytes."""
    if isinstance(lengths, np.ndarray):
        order = np.argsort(starts)
        first, ends = starts[order], starts[order] + lengths[order]
    else:
        first = np.sort(starts)
        ends = first + lengths
    clash = np.flatnonzero(first[1:] < ends[:-1])
    if clash.size:
        a, b = int(first[clash[0]]), int(first[clash[0] + 1])
        raise InvalidArgument(f"{name}: two copies write the same bytes ({unit} {a} and {b}): destination indices "
                              f"repeat or overlap, and one call's copies land in no defined order")


SUBMIT_COPIES = 1024
"""Copies queued per ``memcpy_run_sets_async`` call: a layer's K and V of a per-layer call go in one batch, and a call
over every layer starts moving bytes after its first layers are queued instead of after all of them."""


def _submit(call: Call, plans: list[Copies | None]) -> None:
    """Queue every layer's copies, in batches of about SUBMIT_COPIES, only after all of them were checked: a refusal
    leaves every tensor as it was."""
    sets: list[tuple[Address, np.ndarray, Address, np.ndarray, np.ndarray]] = []
    count = 0
    for plan in plans:
        if plan is None:
            continue
        sets.append((plan.dst, plan.dst_offsets, plan.src, plan.src_offsets, plan.sizes))
        count += plan.sizes.size
        if count >= SUBMIT_COPIES:
            call.runtime.memcpy_run_sets_async(sets, stream=call.stream, batched=True)
            sets, count = [], 0
    if sets:
        call.runtime.memcpy_run_sets_async(sets, stream=call.stream, batched=True)


def _same(a: int, b: int, what: str) -> int:
    if a != b:
        raise InvalidArgument(f"{what}: {a} bytes on the source side but {b} on the destination side")
    return a


def transfer_kv_direct(src_layers: Sequence[Any], dst_layers: Sequence[Any], src_indices: Any, dst_indices: Any,
                       page_size: int) -> None:
    """For each layer, tokens ``src_indices`` of ``src_layers[l]`` → tokens ``dst_indices`` of ``dst_layers[l]``
    (dimension 0 is the token), each run of consecutive indices on both sides as one copy."""
    src_layers, dst_layers = _tensors(src_layers, "src_layers"), _tensors(dst_layers, "dst_layers")
    if len(src_layers) != len(dst_layers):
        raise InvalidArgument(f"src_layers ({len(src_layers)}) and dst_layers ({len(dst_layers)}) must have the same "
                              f"number of layers")
    indexed = _indexed_values(src_indices, dst_indices, page_size)
    call = call_for([*src_layers, *dst_layers], [])

    def build() -> list[tuple[End, End, int]]:
        _refuse_shared(dst_layers, "dst_layers", src_layers, "src_layers")
        return [(_end(call, d, f"dst_layers[{layer}]"), _end(call, s, f"src_layers[{layer}]"),
                 _same(_bytes(s, 0), _bytes(d, 0), f"layer {layer} token rows"))
                for layer, (s, d) in enumerate(zip(src_layers, dst_layers, strict=True))]

    named = [(x, f"{side}[{i}]") for side, xs in (("src_layers", src_layers), ("dst_layers", dst_layers))
             for i, x in enumerate(xs)]
    layers = _kept(call, ("direct", len(src_layers)), named, build)
    reached("direct.before_copies")
    if not indexed.src.size:
        return
    starts, lengths = indexed.get("token runs", _token_runs, indexed.src, indexed.dst)
    _submit(call, [_copies(call, indexed.get(("rows", row), _runs, indexed.dst[starts], row, dst.name,
                                             indexed.src[starts], row, src.name, lengths * row), dst, src)
                   for dst, src, row in layers])


def _token_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first index, length) of each run of indices consecutive on both sides, checked not to overlap."""
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    _refuse_overlap(dst[starts], lengths, "dst_layers[0]", "tokens")
    return starts, lengths


def _kv_split(page_first: Sequence[Any], layer_first: Sequence[Any], pf_name: str, lf_name: str) -> tuple[bool, int]:
    """(MLA, layers per call): one ``page_first`` tensor means MLA, two mean K and V with the layer-first list holding
    K's layers then V's."""
    if len(page_first) not in (1, 2):
        raise InvalidArgument(f"{pf_name} must hold one tensor (MLA) or two (K and V), got {len(page_first)}")
    mla = len(page_first) == 1
    if not mla and len(layer_first) % 2:
        raise InvalidArgument(f"{lf_name} must hold K's layers then V's (an even count), got {len(layer_first)}")
    return mla, len(layer_first) if mla else len(layer_first) // 2


def _page_starts(indexed: Indexed, to_page_first: bool) -> tuple[np.ndarray, np.ndarray]:
    """(pages of the page-first side, first tokens of the layer-first side): every ``page_size``-th index."""
    ps = indexed.page_size
    pf_indices, lf_indices = (indexed.dst, indexed.src) if to_page_first else (indexed.src, indexed.dst)
    return pf_indices[::ps] // ps, lf_indices[::ps]


def _page_overlap(pages: np.ndarray, tokens: np.ndarray, page_size: int, pf_name: str, lf_name: str,
                  to_page_first: bool) -> bool:
    if to_page_first:
        _refuse_overlap(pages, 1, f"{pf_name}[0]", "page")
    else:
        _refuse_overlap(tokens, page_size, f"{lf_name}[0]", "tokens from")
    return True


def _page_runs(pages: np.ndarray, tokens: np.ndarray, strides: tuple[int, int, int], host_name: str,
               other_name: str, to_page_first: bool) -> Runs:
    """Page copies of ``strides`` (page-first page bytes, layer-first token bytes, bytes a copy)."""
    host_side, other_side = (pages, strides[0], host_name), (tokens, strides[1], other_name)
    dst, src = (host_side, other_side) if to_page_first else (other_side, host_side)
    return _runs(*dst, *src, strides[2])


def _page_copies(page_first: Sequence[Any], layer_first: Sequence[Any], pf_name: str, lf_name: str,
                 indexed: Indexed, first_layer: int, to_page_first: bool) -> None:
    """Whole pages between ``page_first`` tensors and layer-first ones: the page-first side's pages and the other
    side's first tokens are every ``page_size``-th index of their side."""
    _kv_split(page_first, layer_first, pf_name, lf_name)
    call = call_for([*page_first, *layer_first], [])
    named = [(x, f"{name}[{i}]") for name, xs in ((pf_name, page_first), (lf_name, layer_first))
             for i, x in enumerate(xs)]
    shape = ("pages", indexed.page_size, first_layer, to_page_first, len(page_first), len(layer_first))
    layers = _kept(call, shape, named, lambda: _page_ends(call, page_first, layer_first, pf_name, lf_name,
                                                          indexed.page_size, first_layer, to_page_first))
    reached("direct.before_copies")
    if not indexed.src.size:
        return
    pages, tokens = indexed.get(("pages", to_page_first), _page_starts, indexed, to_page_first)
    indexed.get(("overlap", to_page_first), _page_overlap, pages, tokens, indexed.page_size, pf_name, lf_name,
                to_page_first)
    plans = []
    for host, other, strides in layers:
        runs = indexed.get(("runs", to_page_first, strides), _page_runs, pages, tokens, strides, host.name,
                           other.name, to_page_first)
        plans.append(_copies(call, runs, host, other) if to_page_first else _copies(call, runs, other, host))
    _submit(call, plans)


def _page_ends(call: Call, page_first: Sequence[Any], layer_first: Sequence[Any], pf_name: str, lf_name: str,
               page_size: int, first_layer: int, to_page_first: bool) -> list[tuple[End, End, tuple[int, int, int]]]:
    """(page-first side, layer-first side, (page bytes, token bytes, bytes a copy)) of each layer's copies, once the
    tensors are checked to hold the pages and layers asked for."""
    mla, layers = _kv_split(page_first, layer_first, pf_name, lf_name)
    if to_page_first:
        _refuse_shared(page_first, pf_name, layer_first, lf_name)
    else:
        _refuse_shared(layer_first, lf_name, page_first, pf_name)
    ends = []
    for t, host in enumerate(page_first):
        if host.dim() < 3:
            raise InvalidArgument(f"{pf_name}[{t}] must be [pages, layers, page_size, ...], got {host.dim()} dims")
        if page_size > host.shape[2]:
            raise InvalidArgument(f"page_size={page_size} is larger than the {host.shape[2]} tokens of a page of "
                                  f"{pf_name}[{t}]: a copy would run into the next layer's or page's tokens")
        if first_layer + layers > host.shape[1]:
            raise InvalidArgument(f"layers [{first_layer}, {first_layer + layers}) exceed the {host.shape[1]} of "
                                  f"{pf_name}[{t}]")
        for j in range(layers):
            i = j if mla else j + t * layers
            other = layer_first[i]
            size = _same(page_size * _bytes(host, 2), page_size * _bytes(other, 0), f"{lf_name}[{i}] pages")
            ends.append((_end(call, host, f"{pf_name}[{t}]", (first_layer + j) * _bytes(host, 1)),
                         _end(call, other, f"{lf_name}[{i}]"), (_bytes(host, 0), _bytes(other, 0), size)))
    return ends


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: Sequence[Any], dst_ptrs: Sequence[Any], src_indices: Any,
                                       dst_indices: Any, layer_id: int, page_size: int) -> None:
    """Pages of a ``page_first_direct`` source (``src_ptrs``: K and V as ``[pages, layers, page_size, ...]``, or one
    MLA tensor) from layer ``layer_id`` on into layer-first ``dst_ptrs`` (K's layers then V's), a page per copy."""
    src_ptrs, dst_ptrs = _tensors(src_ptrs, "src_ptrs"), _tensors(dst_ptrs, "dst_ptrs")
    if isinstance(layer_id, bool) or not isinstance(layer_id, (int, np.integer)) or layer_id < 0:
        raise InvalidArgument(f"layer_id must be a non-negative integer, got {layer_id!r}")
    _page_copies(src_ptrs, dst_ptrs, "src_ptrs", "dst_ptrs", _indexed_values(src_indices, dst_indices, page_size),
                 int(layer_id), to_page_first=False)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: Sequence[Any], dst_ptrs: Sequence[Any], src_indices: Any,
                                       dst_indices: Any, page_size: int) -> None:
    """Every layer of layer-first ``src_ptrs`` (K's layers then V's) into pages of a ``page_first_direct``
    destination (``dst_ptrs``: K and V, or one MLA tensor), a page per copy."""
    src_ptrs, dst_ptrs = _tensors(src_ptrs, "src_ptrs"), _tensors(dst_ptrs, "dst_ptrs")
    _page_copies(dst_ptrs, src_ptrs, "dst_ptrs", "src_ptrs", _indexed_values(src_indices, dst_indices, page_size), 0,
                 to_page_first=True)
