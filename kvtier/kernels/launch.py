"""The launch boundary: the only place kvtier starts a kernel.

Buffer operands arrive as objects (device buffers, pointer tables, host buffers, tensors) and are resolved here with
``get_device_accessible_ptr`` for the device the kernel runs on; a raw integer is refused, so no CPU address can slip
into a kernel, and every address the kernel will read is checked for its alignment (16 bytes for the vector copies).
The runtime then loads the program once per device and launches it its own way: CUDA packs the arguments for
cuLaunchKernel, the emulator runs the Python reference through the device's address map. The caller's current device
is unchanged.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtier.address import DeviceAddress
from kvtier.errors import AddressDomainError, KvtierError, MisalignedAddress
from kvtier.kernels import reference
from kvtier.kernels.loader import kernel_image
from kvtier.kernels.source import (
    BULK_STAGES,
    DEFAULT_UNROLL,
    INDEX_TYPES,
    KERNEL_NAMES,
    SHIPPED,
    SWAP_WIDTHS,
    WIDTHS,
    Specialization,
    bulk_kernel,
    copy_kernel,
    source_hash,
    swap_kernel,
)
from kvtier.memory import DeviceBuffer, get_device_accessible_ptr
from kvtier.runtime import KernelArg, ProgramSpec, Runtime, Stream, i32, i64

MAX_THREADS = 1024
MAX_GROUP = 64
MAX_COUNT = (1 << 31) - 1
PIECE_BYTES = 4096
VECTOR_BYTES = 16
BULK_THREADS = 256
BULK_STAGE_BYTES = 6144
"""A bulk-copy block: 8 warps, each with BULK_STAGES stages of 6 KiB (~192 KiB of shared memory per SM)."""


@dataclass(frozen=True)
class ChunkSide:
    """How one side locates chunk (layer, unit, piece): see the comment at the top of transfer.cu."""

    table: Any
    page_stride: int
    unit_stride: int
    piece_stride: int = 0
    units_per_page: int = 1


@dataclass(frozen=True, kw_only=True)
class ChunkCopy:
    """One launch: for each tensor, layer in [layer_begin, +n_layers), unit i, piece p: copy chunk_bytes src → dst.

    Both tables hold ``table_layers`` per-layer addresses for each of ``n_tensors`` tensors, tensor-major. Fields are
    keyword-only: fifteen positional integers are too easy to swap."""

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
    unit_major: bool = False
    """Walk chunks (tensor, unit, layer, piece) instead of (layer, tensor, unit, piece): where the host keeps a unit's
    layers adjacent, a many-layer copy then moves long contiguous host runs. Results are the same either way. The
    same as a ``layer_group`` of every layer."""
    layer_group: int = 1
    """Layers walked together: the launch walks groups of this many consecutive layers one after another, and each
    group unit by unit (tensor, unit, layer, piece). 1 is the layer-major walk; more keeps a unit's adjacent host rows
    in one run (``page_first`` hosts) while early layers still land first."""
    layer_done: Any = None
    """A device buffer of one uint64 counter per table layer: the counter of each layer group's first layer grows by
    the group's chunk count (:attr:`PreparedCopy.chunks_per_layer` times the group's layers) as its chunks land, so a
    stream can wait for the layers of a many-layer launch (``Stream.wait_value``). Not with ``unit_major``."""

    @property
    def walk_group(self) -> int:
        """The layers the kernel walks together (``layer_group``, or every layer for ``unit_major``)."""
        return MAX_COUNT if self.unit_major else self.layer_group

    def validate(self) -> None:
        if self.chunk_bytes <= 0:
            raise KvtierError(f"chunk size {self.chunk_bytes} must be a positive number of bytes")
        for side in (self.src, self.dst):
            if side.units_per_page < 1:
                raise KvtierError(f"units_per_page must be >= 1, got {side.units_per_page}")
        if self.index_bytes not in INDEX_TYPES:
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
        if type(self.layer_group) is not int or not 1 <= self.layer_group <= MAX_COUNT:
            raise KvtierError(f"layer_group must be an int in [1, {MAX_COUNT}] (layers walked together), got "
                              f"{self.layer_group!r}")
        if self.layer_done is not None:
            if self.unit_major:
                raise KvtierError("layer counters need the layer-major walk or a layer_group: a unit-major copy "
                                  "finishes every layer at the end")
            nbytes = getattr(self.layer_done, "nbytes", None)
            if nbytes is not None and nbytes < 8 * self.rows_per_tensor:
                raise KvtierError(f"a layer counter buffer of {nbytes} bytes cannot hold {self.rows_per_tensor} "
                                  f"8-byte counters")
        for side in (self.src, self.dst):
            entries = getattr(side.table, "entries", None)
            if entries is not None and len(entries) != self.n_tensors * self.rows_per_tensor:
                raise KvtierError(f"a table of {len(entries)} entries cannot hold {self.n_tensors} tensors x "
                                  f"{self.rows_per_tensor} layers")

    @property
    def width(self) -> int:
        """The widest access every chunk size and stride of the launch allows (16 bytes for KV rows)."""
        sizes = [self.chunk_bytes] + [v for side in (self.src, self.dst)
                                      for v in (side.page_stride, side.unit_stride, side.piece_stride)]
        return widest(sizes)

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
        cuts = _cuts(self.chunk_bytes, most, self.width) if self.n_pieces == 1 else 1
        if cuts == 1 or self.chunks * cuts > MAX_COUNT:
            return self
        piece = self.chunk_bytes // cuts
        src, dst = (replace(s, piece_stride=piece) for s in (self.src, self.dst))
        return replace(self, src=src, dst=dst, n_pieces=cuts, chunk_bytes=piece)


def widest(values: Sequence[int]) -> int:
    """The widest access width dividing every value (sizes, strides, addresses)."""
    return next(w for w in WIDTHS if all(int(v) % w == 0 for v in values))


@dataclass(frozen=True)
class SwapIn:
    """One HiSparse swap-in launch over ``batch`` requests; ``state`` is the nine operands of the kernel's HotState,
    in its order (slot_tokens, lru, lru_next, token_slot, flags, miss_src, miss_dst, host_locs, device_locs)."""

    state: tuple[Any, ...]
    host: ChunkSide
    device: ChunkSide
    topk: Any
    requests: Any
    seq_lens: Any
    out: Any
    batch: int
    n_slots: int
    k: int
    max_tokens: int
    layer: int
    state_layers: int
    n_tensors: int
    table_layers: int
    row_bytes: int

    def validate(self) -> None:
        if len(self.state) != 9:
            raise KvtierError(f"a swap-in takes 9 state operands, got {len(self.state)}")
        if not 1 <= self.k <= self.n_slots:
            raise KvtierError(f"top-k of {self.k} for {self.n_slots} hot slots: need 1 <= k <= slots")
        if self.row_bytes <= 0 or self.batch < 0 or self.max_tokens < 1:
            raise KvtierError(f"bad swap-in shape: rows of {self.row_bytes} bytes, batch {self.batch}")
        if not 0 <= self.layer < self.state_layers or not 0 <= self.layer < self.table_layers:
            raise KvtierError(f"layer {self.layer} outside the state's {self.state_layers} layers")

    @property
    def width(self) -> int:
        return widest([self.row_bytes] + [v for side in (self.host, self.device)
                                          for v in (side.page_stride, side.unit_stride)])


@functools.cache
def _cuts(chunk_bytes: int, most: int, width: int = 16) -> int:
    """The fewest equal cuts of a chunk into whole ``width``-byte vectors, each at most ``most`` bytes."""
    vectors = chunk_bytes // width
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


class PreparedCopy:
    """A checked copy with its operands resolved: ``prepared(begin, count, stream)`` launches layers [begin, +count),
    one of the spans it was prepared for. ``chunks_per_layer`` is what each layer's counter grows by (0: nothing to
    copy, nothing launched). It holds the objects whose addresses it resolved (``keep``: tables, indices, counters):
    a table dropped by its last other owner between preparing and launching would otherwise be freed under the
    launch."""

    def __init__(self, program: Any, name: str, head: list[KernelArg], shape: tuple[KernelArg, ...], blocks: int,
                 threads: int, allowed: set[tuple[int, int]], table_layers: int, chunks_per_layer: int,
                 runtime: Runtime | None = None, shared_bytes: int = 0, index_bytes: int = 0,
                 chunks_per_unit: int = 0, layers: int = 0, keep: tuple[Any, ...] = ()) -> None:
        self.program, self.name, self.head, self.shape = program, name, head, shape
        self.blocks, self.threads, self.allowed, self.table_layers = blocks, threads, allowed, table_layers
        self.chunks_per_layer, self.runtime, self.shared_bytes = chunks_per_layer, runtime, shared_bytes
        self.index_bytes, self.chunks_per_unit, self.layers, self.keep = index_bytes, chunks_per_unit, layers, keep

    def __call__(self, begin: int, count: int, stream: Stream) -> None:
        if (begin, count) not in self.allowed:
            raise KvtierError(f"layers [{begin}, +{count}) were not among the spans this copy was prepared for")
        if count and self.runtime is not None:
            rows = i32(self.table_layers or begin + count)
            args: list[KernelArg] = [*self.head, i32(begin), i32(count), self.shape[0], rows, *self.shape[1:]]
            self.runtime.launch(self.program, self.name, grid=self.blocks, block=self.threads, args=args,
                                stream=stream, shared_bytes=self.shared_bytes)


class KernelLauncher:
    """Resolves, checks and launches the transfer kernels (AOT or JIT images, or the Python reference).

    Cheap to create: the runtime keeps one loaded program per build and device, shared by every launcher."""

    def __init__(self, runtime: Runtime, *, mode: str | None = None, unroll: int = DEFAULT_UNROLL,
                 max_threads: int = MAX_THREADS, max_width: int = VECTOR_BYTES, streaming: bool = True,
                 skip_absent: bool = True, bulk: bool = False) -> None:
        """``unroll`` and ``max_threads`` specialize the kernel (JIT only): loads in flight per thread, and the block
        size the register budget is fitted to; ``streaming=False`` (JIT only) drops the evict-first cache hints,
        ``skip_absent=False`` (JIT only, engine calls only) the test for absent units (see ``Specialization``).
        ``max_width`` caps the access width (bytes per load and store; a launch otherwise takes the widest its
        addresses allow). ``bulk`` (experimental, sm_90+) moves 16-byte-aligned copies without layer counters
        through the Tensor Memory Accelerator (``cp.async.bulk``), 256 threads a block. The last three exist for
        measuring."""
        numbers = (unroll, max_threads, max_width)
        if (any(type(n) is not int for n in numbers) or unroll < 1 or not 32 <= max_threads <= MAX_THREADS
                or max_threads % 32 or max_width not in WIDTHS):
            raise KvtierError(f"bad kernel specialization: unroll={unroll!r}, max_threads={max_threads!r} (whole "
                              f"warps up to {MAX_THREADS}), max_width={max_width!r} (an int, one of {WIDTHS})")
        self.runtime, self.mode, self.unroll, self.max_threads = runtime, mode, unroll, max_threads
        self.max_width, self.bulk = max_width, bool(bulk)
        self._bulk_devices: dict[int, bool] = {}
        self.spec = _transfer_program(mode, Specialization(unroll, max_threads, bool(streaming), bool(skip_absent)))
        self._widths: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._buffers: weakref.WeakKeyDictionary[DeviceBuffer, DeviceAddress] = weakref.WeakKeyDictionary()

    def origin(self, device: int) -> str:
        """Where the device's kernel code comes from: ``aot:<fatbin>``, ``jit:...`` or ``reference``."""
        return self.runtime.load_program(self.spec, device).origin

    def resolve(self, operand: Any, device: int, align: int) -> DeviceAddress:
        """The operand's address for ``device``, through the one resolver. Device buffers (pointer tables, the same
        few at every launch) are resolved once per launcher and device; a closed one is still refused here."""
        if isinstance(operand, int):
            raise AddressDomainError(f"kernel operand 0x{operand:x} is a raw integer: pass the buffer, not its address")
        if isinstance(operand, DeviceBuffer) and operand.device == device:
            address = self._buffers.get(operand)
            if address is None or operand.closed:
                address = self._buffers[operand] = get_device_accessible_ptr(operand, device, runtime=self.runtime)
        else:
            address = get_device_accessible_ptr(operand, device, runtime=self.runtime)
        _check_aligned(address, align, "kernel operand")
        return address

    def _entry_width(self, table: Any) -> int:
        """The widest access every per-layer base in a pointer table allows (16 for KV pools, whose bases are checked
        when the pool is made). A table's entries never change, so each table is measured once."""
        width = self._widths.get(table) if hasattr(table, "entries") else None
        if width is None:
            width = widest([entry.value for entry in getattr(table, "entries", ())])
            if hasattr(table, "entries"):
                self._widths[table] = width
        return width

    def copy_chunks(self, call: ChunkCopy, *, device: int, stream: Stream, max_blocks: int = 2,
                    threads: int = MAX_THREADS) -> PreparedCopy:
        """One launch: every tensor of layers [call.layer_begin, +call.n_layers)."""
        return self.copy_layer_spans(call, [(call.layer_begin, call.n_layers)], device=device, stream=stream,
                                     max_blocks=max_blocks, threads=threads)

    def copy_layer_spans(self, call: ChunkCopy, spans: Sequence[tuple[int, int]], *, device: int, stream: Stream,
                         max_blocks: int = 2, threads: int = MAX_THREADS,
                         after_each: Callable[[int, int], None] | None = None) -> PreparedCopy:
        """One launch per (first layer, layer count) span, ``after_each(begin, count)`` after each (a per-layer load
        records its layer events there). Shapes are checked and operands resolved once for all spans: a per-layer
        load of 61 layers is 61 launches that differ only in two integers."""
        launch = self.prepare(call, spans, device=device, max_blocks=max_blocks, threads=threads)
        for begin, count in spans:
            launch(begin, count, stream)
            if after_each is not None:
                after_each(begin, count)
        return launch

    def prepare(self, call: ChunkCopy, spans: Sequence[tuple[int, int]], *, device: int, max_blocks: int = 2,
                threads: int = MAX_THREADS) -> PreparedCopy:
        """Check ``call`` for every span and resolve its operands once; returns a :class:`PreparedCopy`, whose
        ``(begin, count, stream)`` call starts the copy of layers [begin, +count) — one of ``spans`` — at the cost of
        packing two integers. Engines that interleave several copies per layer (a state's tensors, a row's regions)
        prepare each once."""
        for begin, count in spans:
            replace(call, layer_begin=begin, n_layers=count).validate()
        self.check_threads(threads, max_blocks)
        if call.table_layers == 0 and len(set(spans)) > 1:
            raise KvtierError("a copy prepared for several spans needs table_layers: without it each span would "
                              "read the table as if it held a different number of layers per tensor")
        if call.n_units == 0 or not spans:
            return PreparedCopy(None, "", [], (), max_blocks, threads, set(spans), 0, 0)
        call = replace(call, n_layers=max(count for _, count in spans)).in_pieces()
        width = min(call.width, self.max_width, *(self._entry_width(side.table) for side in (call.src, call.dst)))
        group = self._group(call.chunk_bytes, width)
        sides = [self._side(side, device) for side in (call.src, call.dst)]
        indices = [self.resolve(index, device, call.index_bytes) for index in (call.src_index, call.dst_index)]
        counters = (DeviceAddress(0, device) if call.layer_done is None
                    else self.resolve(call.layer_done, device, 8))
        program = self.runtime.load_program(self.spec, device)
        head: list[KernelArg] = [*sides, *indices, i64(call.n_units)]
        chunks = call.n_tensors * call.n_units * call.n_pieces
        keep = (call.src.table, call.dst.table, call.layer_done, call.src_index, call.dst_index)
        shape: tuple[KernelArg, ...]
        if (self.bulk and width == VECTOR_BYTES and call.layer_done is None and call.chunk_bytes <= BULK_STAGE_BYTES
                and self._bulk_capable(device)):
            shape = (i32(call.n_tensors), i32(call.n_pieces), i64(call.chunk_bytes), i32(BULK_STAGE_BYTES),
                     i32(call.walk_group))
            warps = BULK_THREADS // 32
            return PreparedCopy(program, bulk_kernel(call.index_bytes), head, shape, max_blocks, BULK_THREADS,
                                set(spans), call.table_layers, chunks, self.runtime,
                                warps * BULK_STAGES * (BULK_STAGE_BYTES + 8), call.index_bytes,
                                call.n_tensors * call.n_pieces, call.n_layers, keep)
        shape = (i32(call.n_tensors), i32(call.n_pieces), i64(call.chunk_bytes), i32(group), i32(call.walk_group),
                 counters)
        return PreparedCopy(program, copy_kernel(call.index_bytes, width), head, shape, max_blocks, threads,
                            set(spans), call.table_layers, chunks, self.runtime, 0, call.index_bytes,
                            call.n_tensors * call.n_pieces, call.n_layers, keep)

    def rebind(self, prepared: PreparedCopy, src_index: Any, dst_index: Any, n_units: int,
               device: int) -> PreparedCopy | None:
        """``prepared`` over other index operands of the same item size and ``n_units`` pairs: a per-layer loader
        prepares each layer once and binds every request's indices to it (resolving two operands instead of
        checking and resolving the whole copy). None where ``prepared`` cannot take them (nothing to copy, or more
        chunks than it was cut for): prepare the copy again."""
        if prepared.program is None or n_units <= 0 or n_units * prepared.chunks_per_unit * prepared.layers > \
                MAX_COUNT:
            return None
        indices = [self.resolve(index, device, prepared.index_bytes) for index in (src_index, dst_index)]
        head = [*prepared.head[:2], *indices, i64(n_units)]
        return PreparedCopy(prepared.program, prepared.name, head, prepared.shape, prepared.blocks, prepared.threads,
                            prepared.allowed, prepared.table_layers, n_units * prepared.chunks_per_unit,
                            prepared.runtime, prepared.shared_bytes, prepared.index_bytes, prepared.chunks_per_unit,
                            prepared.layers, (*prepared.keep[:3], src_index, dst_index))

    def _bulk_capable(self, device: int) -> bool:
        capable = self._bulk_devices.get(device)
        if capable is None:
            major = self.runtime.device_attributes(device).compute_capability[0]
            # sm_90 / sm_100 parts give a block ~227 KiB of shared memory; consumer parts (sm_120) under 100 KiB
            capable = self._bulk_devices[device] = self.runtime.name.startswith("emulated") or (
                self.runtime.name == "cuda" and major in (9, 10))  # a HIP gfx9 part reports major 9 too
        return capable

    def check_threads(self, threads: int, blocks: int = 1) -> None:
        """Blocks of ``threads`` this launcher's kernels can run (its ``max_threads`` fits their registers)."""
        if blocks < 1 or threads < 32 or threads > self.max_threads or threads % 32:
            raise KvtierError(f"launch of {blocks} blocks x {threads} threads: this launcher needs >= 1 block and "
                              f"32..{self.max_threads} threads in whole warps (its max_threads)")

    def _group(self, chunk_bytes: int, width: int) -> int:
        group = chunk_group(chunk_bytes // width, self.unroll)
        if group * chunk_bytes // width > MAX_COUNT:
            raise KvtierError(f"chunks of {chunk_bytes} bytes are too large for one kernel copy (the kernel counts "
                              f"{width}-byte vectors in 31 bits)")
        return group

    def _side(self, side: ChunkSide, device: int) -> tuple[KernelArg, ...]:
        return (self.resolve(side.table, device, 8), i64(side.page_stride), i64(side.unit_stride),
                i64(side.piece_stride), i64(side.units_per_page))

    def swap_in(self, call: SwapIn, *, device: int, stream: Stream, threads: int = MAX_THREADS) -> None:
        """One HiSparse swap-in launch (one block per request of the batch); see ``transfer.cu``."""
        call.validate()
        self.check_threads(threads)
        if call.batch == 0:
            return
        width = min(call.width, self.max_width, *(self._entry_width(side.table) for side in (call.host, call.device)))
        width = next(w for w in SWAP_WIDTHS if width % w == 0) if width >= SWAP_WIDTHS[-1] else 0
        if not width:
            raise MisalignedAddress(f"swap-in rows of {call.row_bytes} bytes need 4-byte aligned rows and bases, "
                                    f"and a launcher whose max_width allows 4-byte accesses (it is "
                                    f"{self.max_width})")
        state = tuple(self.resolve(op, device, 8 if i >= 5 else 4) for i, op in enumerate(call.state))
        args: list[KernelArg] = [state, self._side(call.host, device), self._side(call.device, device),
                                 *(self.resolve(op, device, size) for op, size in
                                   ((call.topk, 4), (call.requests, 8), (call.seq_lens, 8), (call.out, 8))),
                                 i32(call.batch), i32(call.n_slots), i32(call.k), i64(call.max_tokens), i32(call.layer),
                                 i32(call.state_layers), i32(call.n_tensors), i32(call.table_layers),
                                 i64(call.row_bytes), i32(self._group(call.row_bytes, width))]
        program = self.runtime.load_program(self.spec, device)
        self.runtime.launch(program, swap_kernel(width), grid=call.batch, block=threads, args=args, stream=stream)


def _check_aligned(address: DeviceAddress, align: int, what: str) -> None:
    if not address.aligned(align):
        raise MisalignedAddress(f"{what} {address} is not {align}-byte aligned: the kernel reads it {align} bytes "
                                f"at a time, and a misaligned access faults the whole device")




@functools.cache
def _transfer_program(mode: str | None, spec: Specialization = SHIPPED) -> ProgramSpec:
    """The transfer kernels as a program: images built AOT or JIT for the device's compute capability, and the
    Python reference for the emulator. One spec per specialization, so the runtime's cache key is stable."""

    def image(arch: str) -> tuple[bytes, str]:
        return kernel_image(arch, mode, spec)

    references: dict[str, Callable[..., Any]] = {
        copy_kernel(size, width): functools.partial(reference.copy_chunks, index_bytes=size, width=width)
        for size in INDEX_TYPES for width in WIDTHS}
    references.update({swap_kernel(width): functools.partial(reference.hot_swap_in, width=width)
                       for width in SWAP_WIDTHS})
    references.update({bulk_kernel(size): functools.partial(reference.copy_chunks, index_bytes=size)
                       for size in INDEX_TYPES})
    key = f"transfer-{source_hash()}-{mode or 'auto'}-{spec.label()}"
    return ProgramSpec(key, KERNEL_NAMES, image, references)
