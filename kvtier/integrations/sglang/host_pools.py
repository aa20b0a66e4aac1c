"""SGLang's host pools as kvtier's storage sees them: each page as its CPU-domain byte pieces, in kvtier's order.

SGLang's host pools say where a page lives through ``get_page_buffer_meta(indices)``: the ``data_ptr()`` of their CPU
tensors plus offsets, so CPU addresses, never a device alias. kvtier still checks every piece against the pool's own
CPU tensors before it makes a view of it: a pointer outside them (a pool on another device, a stale index) is refused
by name instead of being read. A KV page is stored in kvtier's verified page format (its namespace names the
geometry, dtype and the host layout's byte order), a Mamba state slot in kvtier's state snapshot format.

Supported: MHA (``MHATokenToKVPoolHost``) and MLA (``MLATokenToKVPoolHost``) pools in ``layer_first``,
``page_first`` and ``page_first_direct``; Mamba state pools (``MambaPoolHost``) in their page-first layouts. Others
are refused by name at registration.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.errors import InvalidArgument
from kvtier.pools.geometry import HostLayout, KVGeometry
from kvtier.pools.state import StateGeometry, StateTensor

KV_LAYOUTS = {"layer_first": HostLayout.LAYER_FIRST, "page_first": HostLayout.PAGE_FIRST,
              "page_first_direct": HostLayout.PAGE_FIRST_DIRECT}
STATE_ORDER_LAYOUT = HostLayout.PAGE_FIRST_DIRECT
"""SGLang's Mamba slot is [tensor][layer][item] in both its page-first layouts: kvtier's tensor-major state order."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cpu_tensors(pool: Any) -> list[torch.Tensor]:
    if hasattr(pool, "temporal_buffer"):
        tensors = [pool.temporal_buffer, *pool.conv_buffer]
    else:
        buffer = getattr(pool, "kv_buffer", None)
        tensors = list(buffer) if isinstance(buffer, (list, tuple)) else [buffer]
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgument(f"{type(pool).__name__}: no host buffer to read pages from "
                                  f"(kv_buffer={tensor!r:.40})")
        if tensor.device.type != "cpu":
            raise InvalidArgument(f"{type(pool).__name__}: its buffer is on {tensor.device}; kvtier's storage reads "
                                  f"host pools through CPU addresses only")
        if not tensor.is_contiguous():
            raise InvalidArgument(f"{type(pool).__name__}: its host buffer is not contiguous")
    return [t for t in tensors if t.numel()]


@dataclass
class Span:
    start: int
    nbytes: int
    view: memoryview


class SGLangPool:
    """One SGLang host pool bound for storage I/O: what a page of it is (``geometry``), and its pages' pieces."""

    def __init__(self, pool: Any, name: str) -> None:
        self.pool, self.name = pool, name
        self.kind = type(pool).__name__
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        self.stride = int(getattr(pool, "logical_page_size", self.page_size) or self.page_size)
        """Host indices per page: SGLang addresses a page by ``logical_page_size`` slots (``page_size`` times the
        decode-context-parallel size; this rank stores ``page_size`` tokens of each)."""
        self.slots = int(getattr(pool, "logical_size", getattr(pool, "size", 0)) or 0)
        self.row_split = ""
        self.state: StateGeometry | None = None
        self.geometry: KVGeometry | None = None
        self.layout = HostLayout.PAGE_FIRST
        if hasattr(pool, "temporal_buffer"):
            self.state = self._state_geometry(pool)
            self.layout = STATE_ORDER_LAYOUT
            self.page_bytes = self.state.slot_bytes
        else:
            self.geometry, self.layout = self._kv_geometry(pool)
            self.page_bytes = self.geometry.bytes_per_page
        self.dtype = dtype_name(pool.dtype)
        self.spans = []
        self._tensors = _cpu_tensors(pool)              # kept: the views below stay valid while this lives
        for tensor in self._tensors:
            nbytes = tensor.numel() * tensor.element_size()
            view = memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")
            self.spans.append(Span(tensor.data_ptr(), nbytes, view))
        self.spans.sort(key=lambda s: s.start)
        self._starts = np.array([s.start for s in self.spans], dtype=np.int64)
        self._ends = self._starts + np.array([s.nbytes for s in self.spans], dtype=np.int64)
        self.pieces_per_page = len(self._meta(torch.arange(self.stride, dtype=torch.int64))[0])
        self._check_page_bytes()

    def _kv_geometry(self, pool: Any) -> tuple[KVGeometry, HostLayout]:
        layout = KV_LAYOUTS.get(str(getattr(pool, "layout", None)))
        if layout is None:
            raise InvalidArgument(f"{self.kind} layout {getattr(pool, 'layout', None)!r}: kvtier's HiCache backend "
                                  f"stores {', '.join(KV_LAYOUTS)} pools")
        itemsize = pool.dtype.itemsize
        if hasattr(pool, "kv_cache_dim"):
            geometry = KVGeometry.mla(pool.layer_num, pool.kv_cache_dim * itemsize, self.page_size)
            self.row_split = f"mla{getattr(pool, 'kv_lora_rank', 0)}+{getattr(pool, 'qk_rope_head_dim', 0)}"
        elif hasattr(pool, "head_num") and hasattr(pool, "head_dim"):
            if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
                raise InvalidArgument(f"{self.kind}: K and V head sizes differ ({pool.head_dim} and "
                                      f"{pool.v_head_dim}); kvtier's page format has one row size")
            geometry = KVGeometry.mha(pool.layer_num, pool.head_num, pool.head_dim, itemsize, self.page_size)
        else:
            raise InvalidArgument(f"{self.kind}: not an MHA, MLA or Mamba host pool kvtier knows how to store")
        return geometry, layout

    def _state_geometry(self, pool: Any) -> StateGeometry:
        if getattr(pool, "slot_state_buffers", ()):
            raise InvalidArgument(f"{self.kind}: slot side states are not stored by kvtier's HiCache backend")
        tensors = []
        if int(np.prod(pool.temporal_state_shape)) > 0:
            tensors.append(StateTensor("temporal", tuple(pool.temporal_state_shape), dtype_name(pool.temporal_dtype)))
        tensors += [StateTensor(f"conv{i}", tuple(shape), dtype_name(pool.conv_dtype))
                    for i, shape in enumerate(pool.conv_state_shapes)]
        return StateGeometry(self.name, pool.num_mamba_layers, tuple(tensors))

    def _meta(self, indices: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        ptrs, sizes = self.pool.get_page_buffer_meta(indices)
        return np.asarray(ptrs, dtype=np.int64), np.asarray(sizes, dtype=np.int64)

    def _check_page_bytes(self) -> None:
        ptrs, sizes = self._meta(torch.arange(self.stride, dtype=torch.int64))
        if int(sizes.sum()) != self.page_bytes:
            raise InvalidArgument(f"{self.kind}: a page is {int(sizes.sum())} bytes by get_page_buffer_meta but "
                                  f"{self.page_bytes} by its geometry; kvtier cannot store this pool's format")

    def page_order(self, n: int) -> np.ndarray:
        """The order of a page's pieces in kvtier's payload: SGLang lists a ``layer_first`` MHA page per layer, K
        then V; kvtier stores a page per tensor, every layer of K then every layer of V."""
        if self.geometry is not None and self.geometry.tensors == 2 and n > 2:
            return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])
        return np.arange(n)

    def check_indices(self, host_indices: Any, pages: int) -> torch.Tensor:
        """``host_indices`` as SGLang's allocator hands them out, on the CPU: ``stride`` consecutive slots a page,
        each page starting at a multiple of ``stride`` inside the pool, no two pages on the same slots. SGLang's
        ``get_page_buffer_meta`` reads only each page's first index, so anything else would read or write slots
        the caller did not name (and two pages read into one place fail their checksums as if damaged)."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise InvalidArgument(f"{self.name}: host_indices must be a 1-D tensor, got {host_indices!r:.60}")
        dtype = host_indices.dtype
        if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
            raise InvalidArgument(f"{self.name}: host_indices must be integers, got {dtype}")
        if host_indices.numel() != pages * self.stride:
            raise InvalidArgument(f"{self.name}: {pages} keys need {pages * self.stride} host indices "
                                  f"({self.stride} per page), got {host_indices.numel()}")
        indices = host_indices.detach().to("cpu", torch.int64)
        rows = indices.reshape(pages, self.stride)
        starts = rows[:, 0]
        if pages and (bool((starts < 0).any()) or bool((starts + self.stride > self.slots).any())):
            raise InvalidArgument(f"{self.name}: host indices outside the pool's {self.slots} slots")
        if pages and (bool((starts % self.stride).any())
                      or not torch.equal(rows, starts[:, None] + torch.arange(self.stride))):
            raise InvalidArgument(f"{self.name}: each page's {self.stride} host indices must be one run of "
                                  f"consecutive slots from a page boundary, as SGLang's allocator gives them")
        if pages > 1 and torch.unique(starts).numel() != pages:
            raise InvalidArgument(f"{self.name}: two pages of one call name the same host slots")
        return indices

    def pieces(self, host_indices: torch.Tensor, pages: int) -> list[list[memoryview]]:
        """The CPU byte views of ``pages`` pages starting at each ``page_size``-th of ``host_indices``, each page's
        pieces in kvtier's order. Raises InvalidArgument (nothing read) for indices of the wrong length or a piece
        outside the pool's CPU tensors."""
        indices = self.check_indices(host_indices, pages)
        if pages == 0:
            return []
        ptrs, sizes = self._meta(indices)
        if len(ptrs) != pages * self.pieces_per_page or len(sizes) != len(ptrs):
            raise InvalidArgument(f"{self.kind}.get_page_buffer_meta gave {len(ptrs)} pieces for {pages} pages, "
                                  f"expected {pages * self.pieces_per_page}")
        where = np.searchsorted(self._starts, ptrs, side="right") - 1
        inside = (where >= 0) & (ptrs + sizes <= self._ends[np.maximum(where, 0)]) & (sizes > 0)
        if not inside.all():
            bad = int(np.argmin(inside))
            raise InvalidArgument(f"{self.name}: page piece {bad} at {int(ptrs[bad]):#x} (+{int(sizes[bad])}) lies "
                                  f"outside the pool's CPU buffers; host indices out of range?")
        offsets = ptrs - self._starts[where]
        order = self.page_order(self.pieces_per_page)
        rows = np.stack([offsets, sizes, where]).reshape(3, pages, self.pieces_per_page)[:, :, order]
        views = [s.view for s in self.spans]
        return [[views[w][o:o + n] for o, n, w in zip(*page, strict=True)]
                for page in zip(rows[0].tolist(), rows[1].tolist(), rows[2].tolist(), strict=True)]


def flat_page(tensor: Any, nbytes: int, what: str) -> list[memoryview]:
    """A flat page tensor (SGLang's ``get_data_page`` / ``get_dummy_flat_data_page``) as one CPU byte view."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgument(f"{what}: a CPU tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise InvalidArgument(f"{what}: a tensor on {tensor.device}; kvtier reads and writes pages in CPU memory")
    if not tensor.is_contiguous():
        raise InvalidArgument(f"{what}: not contiguous")
    size = tensor.numel() * tensor.element_size()
    if size != nbytes:
        raise InvalidArgument(f"{what}: {size} bytes, a page is {nbytes}")
    array: Any = tensor.view(torch.uint8).reshape(-1).numpy()
    return [memoryview(array).cast("B")]
