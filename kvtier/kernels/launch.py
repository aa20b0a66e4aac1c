"""The launch boundary: the only place kvtier starts a kernel.

Buffer operands arrive as objects (device buffers, pointer tables, host buffers, tensors) and are resolved here with
``get_device_accessible_ptr`` for the device the kernel runs on; a raw integer is refused, so no CPU address can slip
into a kernel. The caller's current device is unchanged. On the emulated runtime the Python reference runs instead,
through the same resolution.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

from kvtier.errors import AddressDomainError, KvtierError
from kvtier.kernels import reference
from kvtier.kernels.loader import kernel_image
from kvtier.kernels.source import DEFAULT_UNROLL, KERNEL_NAMES
from kvtier.memory import get_device_accessible_ptr
from kvtier.runtime import Runtime, Stream

MAX_THREADS = 1024
MAX_GROUP = 64
MAX_COUNT = (1 << 31) - 1
PIECE_BYTES = 4096


@dataclass(frozen=True)
class ChunkSide:
    """How one side locates chunk (layer, unit, piece): see the comment at the top of transfer.cu."""

    table: Any
    page_stride: int
    unit_stride: int
    piece_stride: int = 0
    units_per_page: int = 1


class _Side(ctypes.Structure):
    _fields_ = [("table", ctypes.c_uint64), ("page_stride", ctypes.c_int64), ("unit_stride", ctypes.c_int64),
                ("piece_stride", ctypes.c_int64), ("units_per_page", ctypes.c_int64)]


@dataclass(frozen=True)
class ChunkCopy:
    """One launch: for each tensor, layer in [layer_begin, +n_layers), unit i, piece p: copy chunk_bytes src → dst.

    Both tables hold ``table_layers`` per-layer addresses for each of ``n_tensors`` tensors, tensor-major."""

    src: ChunkSide
    dst: ChunkSide
    src_index: Any
    dst_index: Any
    index_bytes: int
    n_units: int
    layer_begin: int
    n_layers: int
    n_pieces: int
    chunk_bytes: int
    n_tensors: int = 1
    table_layers: int = 0

    def validate(self) -> None:
        if self.chunk_bytes <= 0 or self.chunk_bytes % 16:
            raise KvtierError(f"chunk size {self.chunk_bytes} must be a positive multiple of 16 bytes")
        for side in (self.src, self.dst):
            strides = (side.page_stride, side.unit_stride, side.piece_stride)
            if any(s % 16 for s in strides):
                raise KvtierError(f"strides {strides} must be multiples of 16 bytes (16-byte vector copies)")
            if side.units_per_page < 1:
                raise KvtierError(f"units_per_page must be >= 1, got {side.units_per_page}")
        if self.index_bytes not in KERNEL_NAMES:
            raise KvtierError(f"indices must be int32 or int64, got {self.index_bytes}-byte items")
        if self.n_units < 0 or self.n_layers < 0 or self.n_pieces < 1 or self.layer_begin < 0 or self.n_tensors < 1:
            raise KvtierError(f"bad launch shape: units={self.n_units} layers={self.n_layers} pieces={self.n_pieces}")
        if self.layer_begin + self.n_layers > self.rows_per_tensor:
            raise KvtierError(f"layers [{self.layer_begin}, +{self.n_layers}) exceed the table's "
                              f"{self.rows_per_tensor}")
        chunks = self.chunks
        if chunks > MAX_COUNT or max(self.src.units_per_page, self.dst.units_per_page) > MAX_COUNT:
            raise KvtierError(f"{chunks} chunks in one launch (units_per_page {self.src.units_per_page}/"
                              f"{self.dst.units_per_page}): the kernel counts in 31 bits; split the transfer")
        for side in (self.src, self.dst):
            entries = getattr(side.table, "entries", None)
            if entries is not None and len(entries) != self.n_tensors * self.rows_per_tensor:
                raise KvtierError(f"a table of {len(entries)} entries cannot hold {self.n_tensors} tensors x "
                                  f"{self.rows_per_tensor} layers")

    @property
    def rows_per_tensor(self) -> int:
        return self.table_layers or self.layer_begin + self.n_layers

    @property
    def chunks(self) -> int:
        return self.n_tensors * self.n_layers * self.n_units * self.n_pieces

    def in_pieces(self, most: int = PIECE_BYTES) -> ChunkCopy:
        """The same copy with each chunk cut into equal pieces of at most ``most`` bytes, where chunks are single
        pieces: warps then take ~4 KiB at a time, so the last warps of a launch finish within a few µs of each other
        (a per-layer load of 32 KiB chunks otherwise idles ~25 µs per launch waiting for the slowest warp)."""
        cuts = _cuts(self.chunk_bytes, most) if self.n_pieces == 1 else 1
        if cuts == 1 or self.chunks * cuts > MAX_COUNT:
            return self
        piece = self.chunk_bytes // cuts
        src, dst = (ChunkSide(s.table, s.page_stride, s.unit_stride, piece, s.units_per_page)
                    for s in (self.src, self.dst))
        return ChunkCopy(src, dst, self.src_index, self.dst_index, self.index_bytes, self.n_units, self.layer_begin,
                         self.n_layers, cuts, piece, self.n_tensors, self.table_layers)


@functools.cache
def _cuts(chunk_bytes: int, most: int) -> int:
    """The fewest equal cuts of a chunk into whole 16-byte vectors, each at most ``most`` bytes."""
    vectors = chunk_bytes // 16
    return next(k for k in range(max(1, -(-chunk_bytes // most)), vectors + 1) if vectors % k == 0)


@functools.cache
def chunk_group(vectors: int, unroll: int) -> int:
    """How many chunks a warp takes at once: enough 16-byte vectors for ``unroll`` loads per lane in flight, and a
    total that fills its batches of 32 * unroll (72-vector rows in groups of 4 would leave the second batch 1/8 full).
    """
    batch = 32 * unroll
    smallest = max(1, min(MAX_GROUP, -(-batch // vectors)))

    def fill(group: int) -> float:
        work = group * vectors
        return work / (-(-work // batch) * batch)

    good = [g for g in range(smallest, MAX_GROUP + 1) if fill(g) >= 0.9]
    return good[0] if good else max(range(smallest, MAX_GROUP + 1), key=fill)


class KernelLauncher:
    """Loads the transfer kernels per device (AOT or JIT) and launches them; one per runtime user."""

    def __init__(self, runtime: Runtime, *, mode: str | None = None, unroll: int = DEFAULT_UNROLL,
                 max_threads: int = MAX_THREADS) -> None:
        """``unroll`` and ``max_threads`` specialize the kernel (JIT only): loads in flight per thread, and the block
        size the register budget is fitted to."""
        if unroll < 1 or not 32 <= max_threads <= MAX_THREADS or max_threads % 32:
            raise KvtierError(f"bad kernel specialization: unroll={unroll}, max_threads={max_threads}")
        self.runtime, self.mode, self.unroll, self.max_threads = runtime, mode, unroll, max_threads
        self._functions: dict[tuple[int, int], Any] = {}
        self.origins: dict[int, str] = {}

    def resolve(self, operand: Any, device: int) -> int:
        if isinstance(operand, int):
            raise AddressDomainError(f"kernel operand 0x{operand:x} is a raw integer: pass the buffer, not its address")
        return get_device_accessible_ptr(operand, device, runtime=self.runtime).value

    def copy_chunks(self, call: ChunkCopy, *, device: int, stream: Stream, max_blocks: int = 2,
                    threads: int = MAX_THREADS) -> None:
        call.validate()
        if max_blocks < 1 or threads < 32 or threads > self.max_threads or threads % 32:
            raise KvtierError(f"launch of {max_blocks} blocks x {threads} threads: need >=1 block and 32..1024 "
                              f"threads in whole warps")
        if call.n_units == 0 or call.n_layers == 0:
            return
        call = call.in_pieces()
        group = chunk_group(call.chunk_bytes // 16, self.unroll)
        if group * call.chunk_bytes // 16 > MAX_COUNT:
            raise KvtierError(f"chunks of {call.chunk_bytes} bytes are too large for one kernel copy (the kernel "
                              f"counts 16-byte vectors in 31 bits)")
        sides = [(self.resolve(s.table, device), s.page_stride, s.unit_stride, s.piece_stride, s.units_per_page)
                 for s in (call.src, call.dst)]
        indices = [self.resolve(i, device) for i in (call.src_index, call.dst_index)]
        scalars = (call.n_units, call.layer_begin, call.n_layers, call.n_tensors, call.rows_per_tensor,
                   call.n_pieces, call.chunk_bytes)
        if self.runtime.runs_python_kernels:
            self.runtime.launch_python(reference.copy_chunks, *sides, *indices, *scalars,  # type: ignore[attr-defined]
                                       call.index_bytes, device=device, stream=stream)
            return
        args = [_Side(*sides[0]), _Side(*sides[1]), ctypes.c_uint64(indices[0]), ctypes.c_uint64(indices[1]),
                ctypes.c_int64(call.n_units), ctypes.c_int(call.layer_begin), ctypes.c_int(call.n_layers),
                ctypes.c_int(call.n_tensors), ctypes.c_int(call.rows_per_tensor), ctypes.c_int(call.n_pieces),
                ctypes.c_int64(call.chunk_bytes), ctypes.c_int(group)]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        function = self._function(device, call.index_bytes)
        self.runtime.launch_function(function, device, max_blocks, threads,  # type: ignore[attr-defined]
                                     ctypes.addressof(params), stream=stream)

    def _function(self, device: int, index_bytes: int) -> Any:
        key = (device, index_bytes)
        if key not in self._functions:
            major, minor = self.runtime.device_attributes(device).compute_capability
            image, origin = kernel_image(f"sm_{major}{minor}", self.mode, self.unroll, self.max_threads)
            module = self.runtime.load_module(image, device)  # type: ignore[attr-defined]
            for size, name in KERNEL_NAMES.items():
                self._functions[(device, size)] = self.runtime.get_function(module, name)  # type: ignore[attr-defined]
            self.origins[device] = origin
        return self._functions[key]
