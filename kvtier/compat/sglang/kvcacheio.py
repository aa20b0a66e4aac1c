"""SGLang's ``sgl_kernel.kvcacheio`` on kvtier's resolver and launch boundary: swap the import, keep the calls.

Names, argument order, defaults and results are SGLang's: indices are token (item) indices, ``item_size`` is the bytes
of one token of one layer, ``*_layout_dim`` the bytes of one token across all layers of a ``page_first`` host buffer,
tables are ``uint64`` tensors of ``data_ptr()`` values, negative indices are skipped, and kernels run on the caller's
current torch stream. What kvtier adds: every tensor and every table entry is resolved for the device of the call (a
pinned CPU tensor's ``data_ptr()`` is a CPU address, which a kernel must not dereference where host memory has a
separate device alias: AMD MI355X, WSL2), a pageable or foreign-device address is refused by name before anything is
copied, and the kernels are kvtier's own (prebuilt or JIT for the device; no torch ABI coupling). Indices on the CPU
are checked against the tensors they index; device-resident ones are checked with ``KVTIER_COMPAT_CHECKS=1``.

``block_quota`` is the SM budget (blocks, as in SGLang) and ``num_warps_per_block`` the warps of each block. Kernel
pointer tables are built on a call's first use of a set of layer bases and kept: warm a shape up once before capturing
it in a CUDA graph. See docs/sglang.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.compat.device_array import DeviceArray
from kvtier.compat.operands import (
    LIMIT,
    Call,
    address,
    call_for,
    check_indices,
    checks_on,
    extent,
    host_indices,
    keep_plan,
    kept_plan,
    operand_key,
    pointer_table,
    table_entries,
    table_room,
)
from kvtier.compat.sglang.direct import (
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_direct,
    transfer_kv_per_layer_direct_pf_lf,
)
from kvtier.errors import InvalidArgument, KvtierError, about
from kvtier.kernels.launch import ChunkCopy, ChunkSide, PreparedCopy
from kvtier.memory import DeviceAddress
from kvtier.memory.registration import span_generation
from kvtier.pause_points import reached

_is_hip = getattr(torch.version, "hip", None) is not None
WARPS = 16 if _is_hip else 32

__all__ = [
    "transfer_kv_per_layer", "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf", "transfer_kv_all_layer",
    "transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_lf_ph", "transfer_kv_direct",
    "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
]


@dataclass(frozen=True)
class Side:
    """One side of a copy: per KV tensor a tensor (whose layer ``l`` starts ``l * layer_stride`` bytes in) or a raw
    pointer table (one entry per layer); item ``i`` of a layer lies at ``(i // units_per_page) * page_stride +
    (i % units_per_page) * unit_stride``, head ``h`` a further ``h * piece_stride``."""

    name: str
    operands: tuple[Any, ...]
    page_stride: int
    layers: Sequence[int] = (0,)
    layer_stride: int = 0
    unit_stride: int = 0
    piece_stride: int = 0
    units_per_page: int = 1
    tables: bool = False

    def __post_init__(self) -> None:
        """Strides are products of the call's numbers (``page_size * layout_dim``, ``layer_id * layout_dim``): each
        checked here, once, to stay within LIMIT, so every offset built from them fits int64."""
        for what, value in (("page stride", self.page_stride), ("unit stride", self.unit_stride),
                            ("head stride", self.piece_stride),
                            ("layer offset", max(self.layers, default=0) * self.layer_stride)):
            if value > LIMIT:
                raise InvalidArgument(f"{self.name}: the {what} these arguments give ({value} bytes) is out of range "
                                      f"of any tensor")

    def entries(self, call: Call, n_layers: int) -> list[Entry]:
        """Per KV tensor and layer: the address kernels use, and the bytes from it to the end of its memory (a
        tensor's extent; for a table entry, its allocation's end where the runtime knows it)."""
        names = ("k", "v") if len(self.operands) == 2 else ("",)
        out: list[Entry] = []
        for operand, kv in zip(self.operands, names, strict=True):
            what = f"{self.name}{'_' + kv if kv else ''}{'_layers' if self.tables else ''}"
            if self.tables:
                raw, rows = table_entries(call, operand, what)
                if len(rows) != n_layers:
                    raise InvalidArgument(f"{what} holds {len(rows)} layer addresses, not num_layers={n_layers}")
                pairs = enumerate(zip(raw, rows, strict=True))
                out += [Entry(row, None, f"{what}[{i}]", value) for i, (value, row) in pairs]
            else:
                if not operand.is_contiguous():
                    raise InvalidArgument(f"{what} must be contiguous: the kernels address items by byte offset "
                                          f"(item i at i * stride), so a strided view would be misread")
                base, size = address(call, operand, what), extent(operand)
                out += [Entry(base + layer * self.layer_stride, size - layer * self.layer_stride, what)
                        for layer in self.layers]
        return out

    def check_reach(self, call: Call, entries: list[Entry], units: np.ndarray | None, chunk_bytes: int,
                    pieces: int) -> None:
        """Every byte the copy touches lies inside the memory of each entry whose size is known: item 0 when the
        indices stay on the device, every item given in ``units`` (offsets counted without overflow). A table
        entry's size is asked of the runtime (its allocation's end) in both cases."""
        worst, far = 0, 0
        if units is not None and units.size:
            pages, slots = np.divmod(units, self.units_per_page)
            if int(pages.max()) > LIMIT // max(self.page_stride, 1):
                worst = int(units[np.argmax(pages)])
                raise InvalidArgument(f"{self.name} index {worst} is out of range of any tensor")
            offsets = pages * self.page_stride + slots * self.unit_stride
            worst, far = int(units[np.argmax(offsets)]), int(offsets.max())
        reach = far + (pieces - 1) * self.piece_stride + chunk_bytes
        generation = span_generation(call.runtime)
        for entry in entries:
            room = entry.room
            if entry.raw is not None:
                try:
                    room, split = table_room(call, entry.raw, entry.address, generation)
                except KvtierError as error:
                    raise about(error, entry.what) from None
                if split and units is None:
                    raise InvalidArgument(f"{entry.what} lies in a host buffer registered in chunks whose device "
                                          f"aliases do not continue each other, and indices on the device cannot "
                                          f"be checked to stay in its first {room} bytes: pass the indices as a "
                                          f"pinned CPU tensor, or register the buffer in one chunk")
            if room is not None and reach > room:
                raise InvalidArgument(f"{self.name} index {worst} reaches {reach} bytes into {entry.what}, which "
                                      f"holds {max(room, 0)} from there: out of range")


@dataclass(frozen=True)
class Entry:
    """A kernel table entry: its address, the bytes from it to the end of its tensor (None: ask the runtime about
    ``raw``, the address a foreign table gave), and its name for errors."""

    address: DeviceAddress
    room: int | None
    what: str
    raw: int | None = None


def _positive(value: Any, name: str, multiple: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 < value <= LIMIT or \
            value % multiple:
        raise InvalidArgument(f"{name} must be a positive integer{f' divisible by {multiple}' if multiple > 1 else ''}"
                              f", got {value!r}")
    return int(value)


def _layer(value: Any, name: str = "layer_id") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= LIMIT:
        raise InvalidArgument(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def _layout_holds(layout_dim: int, layers: int, item_size: int, name: str) -> None:
    if layers * item_size > layout_dim:
        raise InvalidArgument(f"{name}={layout_dim} bytes per token cannot hold {layers} layers of item_size="
                              f"{item_size}: layers would overlap the next token")


@dataclass(eq=False)
class Plan:
    """A call's operands checked and resolved: each side's entries (for index checks), its strides, and the pointer
    tables and prepared launch once built (the tables held, so they outlive every launch of it). Index operands are
    not part of it: every call binds its own (a per-layer loader passes new indices each request, the same layers)."""

    entries: list[list[Entry]]
    strides: list[tuple[int, int, int, int]]
    n_tensors: int
    tables: list[Any] = field(default_factory=list)
    prepared: PreparedCopy | None = None

    def bind(self, call: Call, indices: list[DeviceAddress], n_units: int, numbers: tuple) -> PreparedCopy:
        """The launch over ``indices`` (``n_units`` pairs): the kept preparation with these indices bound, or a new
        one."""
        n_layers, chunk_bytes, pieces, block_quota, warps, unit_major, index_bytes = numbers
        if self.prepared is not None:
            bound = call.launcher.rebind(self.prepared, indices[0], indices[1], n_units, call.device)
            if bound is not None:
                return bound
        tables = self.tables or [pointer_table(call, [entry.address for entry in e]) for e in self.entries]
        self.tables = tables
        sides = [ChunkSide(table, *strides) for table, strides in zip(tables, self.strides, strict=True)]
        copy = ChunkCopy(sides[0], sides[1], indices[0], indices[1], index_bytes, n_units, 0, n_layers, pieces,
                         chunk_bytes, self.n_tensors, n_layers, unit_major=unit_major)
        prepared = call.launcher.prepare(copy, [(0, n_layers)], device=call.device, max_blocks=block_quota,
                                         threads=warps * 32)
        reached("kvcacheio.bind_store")
        self.prepared = prepared    # another thread may store its own meanwhile: launch this one
        reached("kvcacheio.bind_return")
        return prepared


def _copy(src: Side, dst: Side, src_indices: Any, dst_indices: Any, *, n_layers: int, chunk_bytes: int,
          pieces: int = 1, block_quota: Any, num_warps_per_block: Any, unit_major: bool = False) -> None:
    """One kernel launch on the caller's current stream: for each KV tensor, layer, index pair and piece, copy
    ``chunk_bytes``. A call over the same tensors and numbers as an earlier one (and no raw tables, no kvtier host
    buffer registered or closed since) reuses its checked plan and binds its own indices: a per-layer load is ~60
    such calls a request, each otherwise resolving and checking anew."""
    block_quota = _positive(block_quota, "block_quota")
    warps = _positive(num_warps_per_block, "num_warps_per_block")
    if warps > 32:
        raise InvalidArgument(f"num_warps_per_block={warps}: a block holds at most 32 warps (1,024 threads)")
    index_bytes = check_indices(src_indices, dst_indices)
    call = call_for([*src.operands, *dst.operands, src_indices, dst_indices], [src_indices, dst_indices])
    call.launcher.check_threads(warps * 32, block_quota)
    numbers = (n_layers, chunk_bytes, pieces, block_quota, warps, unit_major, index_bytes)
    named = [(x, f"{side.name}_{'kv'[i]}" if len(side.operands) == 2 else side.name)
             for side in (src, dst) for i, x in enumerate(side.operands)]
    if checks_on():
        call.stream.synchronize()   # what is checked is what the kernel reads, also in pinned indices still written
    host = [host_indices(src_indices), host_indices(dst_indices)]
    unread = (host[0] is None, host[1] is None)
    key = _plan_key(call, src, dst, named, (*numbers, unread))
    plan = kept_plan(call, key, [(x, what) for x, what in named if isinstance(x, DeviceArray)])
    fresh = plan is None
    if plan is None:
        plan = Plan([side.entries(call, n_layers) for side in (src, dst)],
                    [(s.page_stride, s.unit_stride, s.piece_stride, s.units_per_page) for s in (src, dst)],
                    len(src.operands))
    n_units = src_indices.numel()
    indices = [address(call, x, what) for x, what in ((src_indices, "src_indices"), (dst_indices, "dst_indices"))] \
        if n_units else []
    if fresh:
        for side, side_entries, check in zip((src, dst), plan.entries, unread, strict=True):
            if check:   # as far as it can be checked without index values
                side.check_reach(call, side_entries, None, chunk_bytes, pieces)
        keep_plan(call, key, plan)
    for side, own, other, side_entries in ((src, 0, 1, plan.entries[0]), (dst, 1, 0, plan.entries[1])):
        units, partner = host[own], host[other]
        if units is not None:   # a unit whose pair is absent on either side is skipped, so not checked
            units = units[(units >= 0) & (partner >= 0)] if partner is not None else units[units >= 0]
            side.check_reach(call, side_entries, units, chunk_bytes, pieces)
    if n_units:
        plan.bind(call, indices, n_units, numbers)(0, n_layers, call.stream)


def _plan_key(call: Call, src: Side, dst: Side, named: list[tuple[Any, str]], numbers: tuple) -> tuple | None:
    """The key a call's plan is kept under, or None (raw tables, or an operand kvtier cannot tell unchanged)."""
    if src.tables or dst.tables:
        return None
    operands = [operand_key(call, x) for x, _ in named]
    if any(k is None for k in operands):
        return None
    shape = [(s.page_stride, tuple(s.layers), s.layer_stride, s.unit_stride, s.piece_stride, s.units_per_page)
             for s in (src, dst)]
    return (call.device, span_generation(call.runtime), *shape, *numbers, *operands)


def _heads(item_size: int, head_num: Any, layout_dim: int | None = None) -> tuple[int, int]:
    head_num = _positive(head_num, "head_num")
    if item_size % head_num or (layout_dim is not None and layout_dim % head_num):
        raise InvalidArgument(f"head_num={head_num} must divide item_size={item_size}"
                              + ("" if layout_dim is None else f" and the layout dim {layout_dim}"))
    return head_num, item_size // head_num


def _page_head(name: str, operands: tuple[Any, ...], layers: Sequence[int], item_size: int, layout_dim: int,
               page_size: int, head_num: int) -> Side:
    """A ``page_head`` host buffer, ``[pages, heads, page_size, layers, head bytes]`` per tensor."""
    per_head = layout_dim // head_num
    return Side(name, operands, page_size * layout_dim, layers, item_size // head_num, per_head, per_head * page_size,
                page_size)


# -- per layer, K and V ----------------------------------------------------------------------------------------------
def transfer_kv_per_layer(src_k: Any, dst_k: Any, src_v: Any, dst_v: Any, src_indices: Any, dst_indices: Any,
                          item_size: int, block_quota: int = 2, num_warps_per_block: int = WARPS) -> None:
    """One layer, layer-first on both sides: item ``i`` at ``i * item_size`` of each tensor."""
    item_size = _positive(item_size, "item_size", 8)
    _copy(Side("src", (src_k, src_v), item_size), Side("dst", (dst_k, dst_v), item_size), src_indices, dst_indices,
          n_layers=1, chunk_bytes=item_size, block_quota=block_quota, num_warps_per_block=num_warps_per_block)


def transfer_kv_per_layer_pf_lf(src_k: Any, dst_k: Any, src_v: Any, dst_v: Any, src_indices: Any, dst_indices: Any,
                                layer_id: int, item_size: int, src_layout_dim: int, block_quota: int = 2,
                                num_warps_per_block: int = WARPS) -> None:
    """Layer ``layer_id`` of a ``page_first`` source (item ``i`` at ``i * src_layout_dim + layer_id * item_size``)
    into a layer-first destination."""
    item_size, layer_id = _positive(item_size, "item_size", 8), _layer(layer_id)
    src_layout_dim = _positive(src_layout_dim, "src_layout_dim")
    _layout_holds(src_layout_dim, layer_id + 1, item_size, "src_layout_dim")
    _copy(Side("src", (src_k, src_v), src_layout_dim, (layer_id,), item_size),
          Side("dst", (dst_k, dst_v), item_size), src_indices, dst_indices, n_layers=1, chunk_bytes=item_size,
          block_quota=block_quota, num_warps_per_block=num_warps_per_block)


def transfer_kv_per_layer_ph_lf(src_k: Any, dst_k: Any, src_v: Any, dst_v: Any, src_indices: Any, dst_indices: Any,
                                layer_id: int, item_size: int, src_layout_dim: int, page_size: int, head_num: int,
                                block_quota: int = 2, num_warps_per_block: int = WARPS) -> None:
    """Layer ``layer_id`` of a ``page_head`` source (``[pages, heads, page_size, layers, head bytes]``) into a
    layer-first destination, head by head."""
    item_size, layer_id = _positive(item_size, "item_size", 8), _layer(layer_id)
    src_layout_dim, page_size = _positive(src_layout_dim, "src_layout_dim"), _positive(page_size, "page_size")
    head_num, head_bytes = _heads(item_size, head_num, src_layout_dim)
    _layout_holds(src_layout_dim, layer_id + 1, item_size, "src_layout_dim")
    _copy(_page_head("src", (src_k, src_v), (layer_id,), item_size, src_layout_dim, page_size, head_num),
          Side("dst", (dst_k, dst_v), item_size, piece_stride=head_bytes), src_indices, dst_indices, n_layers=1,
          chunk_bytes=head_bytes, pieces=head_num, block_quota=block_quota, num_warps_per_block=num_warps_per_block)


# -- all layers, K and V ---------------------------------------------------------------------------------------------
def transfer_kv_all_layer(src_k_layers: Any, dst_k_layers: Any, src_v_layers: Any, dst_v_layers: Any,
                          src_indices: Any, dst_indices: Any, item_size: int, num_layers: int, block_quota: int = 2,
                          num_warps_per_block: int = WARPS) -> None:
    """Every layer, layer-first on both sides, each side's layers found through ``uint64`` tables of their
    ``data_ptr()``s."""
    item_size, num_layers = _positive(item_size, "item_size", 8), _positive(num_layers, "num_layers")
    _copy(Side("src", (src_k_layers, src_v_layers), item_size, tables=True),
          Side("dst", (dst_k_layers, dst_v_layers), item_size, tables=True), src_indices, dst_indices,
          n_layers=num_layers, chunk_bytes=item_size, block_quota=block_quota,
          num_warps_per_block=num_warps_per_block)


def transfer_kv_all_layer_lf_pf(src_k_layers: Any, dst_k: Any, src_v_layers: Any, dst_v: Any, src_indices: Any,
                                dst_indices: Any, item_size: int, dst_layout_dim: int, num_layers: int,
                                block_quota: int = 2, num_warps_per_block: int = WARPS) -> None:
    """Every layer from layer-first tensors (through tables) into a ``page_first`` destination; the copy walks a
    token's layers together, so it writes each destination token as one run."""
    item_size, num_layers = _positive(item_size, "item_size", 8), _positive(num_layers, "num_layers")
    dst_layout_dim = _positive(dst_layout_dim, "dst_layout_dim")
    _layout_holds(dst_layout_dim, num_layers, item_size, "dst_layout_dim")
    _copy(Side("src", (src_k_layers, src_v_layers), item_size, tables=True),
          Side("dst", (dst_k, dst_v), dst_layout_dim, range(num_layers), item_size), src_indices, dst_indices,
          n_layers=num_layers, chunk_bytes=item_size, block_quota=block_quota,
          num_warps_per_block=num_warps_per_block, unit_major=True)


def transfer_kv_all_layer_lf_ph(src_k_layers: Any, dst_k: Any, src_v_layers: Any, dst_v: Any, src_indices: Any,
                                dst_indices: Any, item_size: int, dst_layout_dim: int, num_layers: int,
                                page_size: int, head_num: int, block_quota: int = 2,
                                num_warps_per_block: int = WARPS) -> None:
    """Every layer from layer-first tensors (through tables) into a ``page_head`` destination, head by head."""
    item_size, num_layers = _positive(item_size, "item_size", 8), _positive(num_layers, "num_layers")
    dst_layout_dim, page_size = _positive(dst_layout_dim, "dst_layout_dim"), _positive(page_size, "page_size")
    head_num, head_bytes = _heads(item_size, head_num, dst_layout_dim)
    _layout_holds(dst_layout_dim, num_layers, item_size, "dst_layout_dim")
    _copy(Side("src", (src_k_layers, src_v_layers), item_size, piece_stride=head_bytes, tables=True),
          _page_head("dst", (dst_k, dst_v), range(num_layers), item_size, dst_layout_dim, page_size, head_num),
          src_indices, dst_indices, n_layers=num_layers, chunk_bytes=head_bytes, pieces=head_num,
          block_quota=block_quota, num_warps_per_block=num_warps_per_block)


# -- MLA (one tensor) ------------------------------------------------------------------------------------------------
def transfer_kv_per_layer_mla(src: Any, dst: Any, src_indices: Any, dst_indices: Any, item_size: int,
                              block_quota: int = 2, num_warps_per_block: int = WARPS) -> None:
    item_size = _positive(item_size, "item_size", 8)
    _copy(Side("src", (src,), item_size), Side("dst", (dst,), item_size), src_indices, dst_indices, n_layers=1,
          chunk_bytes=item_size, block_quota=block_quota, num_warps_per_block=num_warps_per_block)


def transfer_kv_per_layer_mla_pf_lf(src: Any, dst: Any, src_indices: Any, dst_indices: Any, layer_id: int,
                                    item_size: int, src_layout_dim: int, block_quota: int = 2,
                                    num_warps_per_block: int = WARPS) -> None:
    item_size, layer_id = _positive(item_size, "item_size", 8), _layer(layer_id)
    src_layout_dim = _positive(src_layout_dim, "src_layout_dim")
    _layout_holds(src_layout_dim, layer_id + 1, item_size, "src_layout_dim")
    _copy(Side("src", (src,), src_layout_dim, (layer_id,), item_size), Side("dst", (dst,), item_size), src_indices,
          dst_indices, n_layers=1, chunk_bytes=item_size, block_quota=block_quota,
          num_warps_per_block=num_warps_per_block)


def transfer_kv_all_layer_mla(src_layers: Any, dst_layers: Any, src_indices: Any, dst_indices: Any, item_size: int,
                              num_layers: int, block_quota: int = 2, num_warps_per_block: int = WARPS) -> None:
    item_size, num_layers = _positive(item_size, "item_size", 8), _positive(num_layers, "num_layers")
    _copy(Side("src", (src_layers,), item_size, tables=True), Side("dst", (dst_layers,), item_size, tables=True),
          src_indices, dst_indices, n_layers=num_layers, chunk_bytes=item_size, block_quota=block_quota,
          num_warps_per_block=num_warps_per_block)


def transfer_kv_all_layer_mla_lf_pf(src_layers: Any, dst: Any, src_indices: Any, dst_indices: Any, item_size: int,
                                    dst_layout_dim: int, num_layers: int, block_quota: int = 2,
                                    num_warps_per_block: int = WARPS) -> None:
    item_size, num_layers = _positive(item_size, "item_size", 8), _positive(num_layers, "num_layers")
    dst_layout_dim = _positive(dst_layout_dim, "dst_layout_dim")
    _layout_holds(dst_layout_dim, num_layers, item_size, "dst_layout_dim")
    _copy(Side("src", (src_layers,), item_size, tables=True),
          Side("dst", (dst,), dst_layout_dim, range(num_layers), item_size), src_indices, dst_indices,
          n_layers=num_layers, chunk_bytes=item_size, block_quota=block_quota,
          num_warps_per_block=num_warps_per_block, unit_major=True)

