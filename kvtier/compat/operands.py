"""Operands of a compat call: the runtime and device it runs on, tensors and raw pointer tables as device addresses.

Everything a kernel will read goes through the one resolver here: tensors (pinned, registered or device) with
``get_device_accessible_ptr``, every entry of a raw ``uint64`` pointer table with ``resolve_foreign_address``. Kernel
pointer tables are built once per distinct set of entries and kept (a serving engine passes the same few layer bases
on every call), so a warmed-up call allocates nothing and can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.compat.device_array import DeviceArray
from kvtier.errors import InvalidArgument, KvtierError, WrongRuntime, about
from kvtier.kernels.launch import KernelLauncher
from kvtier.locks import named_lock
from kvtier.memory import DeviceAddress, get_device_accessible_ptr, resolve_foreign_address, tensor_extent
from kvtier.memory.registration import registered_span, span_generation
from kvtier.pause_points import reached
from kvtier.pools import PointerTable, build_pointer_table
from kvtier.runtime import Runtime, Stream
from kvtier.runtime import get as get_runtime

TABLES_KEPT = 4096
"""Kernel pointer tables kept per runtime; past this the least recently used is freed (after a device sync)."""
LIMIT = 1 << 62
"""No size or index a compat call takes goes past this: byte offsets then fit int64 with room for a sum."""
CHECK_ENV = "KVTIER_COMPAT_CHECKS"
"""Set to 1 to read device-resident indices back (a sync) and check them against the tensors they index."""


@dataclass
class Call:
    """Where one compat call runs: runtime, device, the caller's current stream there, and the launcher."""

    runtime: Runtime
    device: int
    stream: Stream
    launcher: KernelLauncher
    keys: dict[int, tuple | None] = field(default_factory=dict, repr=False)
    """:func:`operand_key` of each operand by ``id``, once per call (its operands live as long as the call)."""


ENTRIES_KEPT = 1 << 16
"""Resolutions of table entries inside kvtier's host ranges kept per runtime (least recently used dropped)."""


def _keep(cache: OrderedDict, key: tuple, value: Any, limit: int | None = None) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > (limit or TABLES_KEPT):
        cache.popitem(last=False)


class _PerRuntime:
    def __init__(self, runtime: Runtime) -> None:
        self.launcher = KernelLauncher(runtime)
        self.tables: OrderedDict[tuple, PointerTable] = OrderedDict()
        self.foreign: OrderedDict[tuple, tuple[Any, list[int]]] = OrderedDict()
        self.aliases: OrderedDict[tuple[int, int], tuple[tuple[int, int], DeviceAddress]] = OrderedDict()
        self.rooms: OrderedDict[tuple, tuple[tuple[int, int], tuple[int | None, bool]]] = OrderedDict()
        self.plans: OrderedDict[tuple, Any] = OrderedDict()
        self.lock = named_lock("compat.runtime", fork_safe=True)


_state: weakref.WeakKeyDictionary[Runtime, _PerRuntime] = weakref.WeakKeyDictionary()
_state_lock = named_lock("compat.state", fork_safe=True)


def _per_runtime(runtime: Runtime) -> _PerRuntime:
    with _state_lock:
        state = _state.get(runtime)
        if state is None:
            state = _state[runtime] = _PerRuntime(runtime)
        return state


def is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def call_for(operands: Sequence[Any], indices: Sequence[Any]) -> Call:
    """The runtime of the call's kvtier arrays (all the same one), else kvtier's default; the device of its index
    tensors where they are on one, else of its first device-resident operand, else the runtime's current device. An
    operand on another device is refused by name when it is resolved."""
    runtimes = {id(x.runtime): x.runtime for x in operands if isinstance(x, DeviceArray)}
    if len(runtimes) > 1:
        raise WrongRuntime("a call's DeviceArrays belong to different runtimes")
    runtime = next(iter(runtimes.values())) if runtimes else get_runtime()
    devices = {d for d in (_device_of(x, runtime) for x in indices) if d is not None}
    if len(devices) > 1:
        raise InvalidArgument(f"the index tensors are on different devices ({sorted(devices)})")
    placed = (d for d in (_device_of(x, runtime) for x in operands) if d is not None)
    device = devices.pop() if devices else next(placed, runtime.current_device())
    runtime.check_device(device)
    return Call(runtime, device, runtime.current_stream(device), _per_runtime(runtime).launcher)


def _device_of(x: Any, runtime: Runtime) -> int | None:
    if isinstance(x, DeviceArray):
        return x.device_index
    if is_tensor(x) and x.device.type != "cpu":
        return x.device.index if x.device.index is not None else runtime.current_device()
    return None


def kernel_operand(x: Any) -> Any:
    """What the launch boundary resolves for ``x``: the region of a DeviceArray, a tensor as it is."""
    return x.region if isinstance(x, DeviceArray) else x


def address(call: Call, x: Any, what: str) -> DeviceAddress:
    """``x`` (a tensor or DeviceArray) as an address kernels on the call's device may use; the whole extent is
    checked to lie in memory the device reaches."""
    if not (is_tensor(x) or isinstance(x, DeviceArray)):
        raise InvalidArgument(f"{what} must be a tensor, got {type(x).__name__}")
    try:
        return get_device_accessible_ptr(kernel_operand(x), call.device, runtime=call.runtime)
    except KvtierError as error:
        raise about(error, what) from None


def extent(x: Any) -> int:
    """Bytes a tensor or DeviceArray spans from its ``data_ptr()`` on."""
    return x.nbytes if isinstance(x, DeviceArray) else tensor_extent(x)[1]


def operand_key(call: Call, x: Any) -> tuple | None:
    """What resolving the tensor or DeviceArray ``x`` for the call depends on, or None where kvtier cannot tell that
    unchanged: host memory it did not register (pinned by torch or anyone else), whose alias may differ under the
    same address after a free. A device tensor's address is its ``data_ptr()``; a CPU tensor inside kvtier's host
    ranges resolves the same while :func:`span_generation` is unchanged (part of every plan key); a DeviceArray is
    keyed by its address and resolved again on every use (its buffer may be closed since)."""
    found = call.keys.get(id(x), _UNKEYED)
    if found is not _UNKEYED:
        return found
    key = call.keys[id(x)] = _operand_key(call, x)
    return key


_UNKEYED: Any = object()


def _operand_key(call: Call, x: Any) -> tuple | None:
    if isinstance(x, DeviceArray):
        try:
            return ("array", x.data_ptr(), x.device_index, x.shape, x.dtype)
        except KvtierError:     # closed: the full path refuses it by name
            return None
    if not is_tensor(x):
        return None
    if x.device.type == "cpu" and call.runtime.host_range(x.data_ptr()) is None:
        return None
    return (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device)


def kept_plan(call: Call, key: tuple | None, arrays: Sequence[tuple[Any, str]]) -> Any:
    """The plan stored under ``key`` (see :func:`keep_plan`), once the DeviceArrays among its operands still
    resolve (a closed one is refused here, by name); None if there is none."""
    if key is None:
        return None
    state = _per_runtime(call.runtime)
    with state.lock:
        plan = state.plans.get(key)
        if plan is not None:
            reached("operands.kept_plan_locked")
            state.plans.move_to_end(key)
    if plan is not None:
        for x, what in arrays:
            address(call, x, what)
    return plan


def keep_plan(call: Call, key: tuple | None, plan: Any) -> None:
    """Keep a checked, resolved call under ``key``: every operand's :func:`operand_key`, the call's own numbers and
    :func:`span_generation` (so a host buffer registered or closed since makes every call plan again)."""
    if key is not None:
        state = _per_runtime(call.runtime)
        with state.lock:
            _keep(state.plans, key, plan)


def table_values(table: Any, what: str) -> np.ndarray:
    """The raw entries of a ``uint64`` pointer table: a tensor (any device; a device one is read back) or a
    DeviceArray."""
    import torch

    if isinstance(table, DeviceArray):
        values = table.cpu()
    elif is_tensor(table):
        values = table.detach().to("cpu")
    else:
        raise InvalidArgument(f"{what} must be a uint64 tensor of addresses, got {type(table).__name__}")
    if values.dtype not in (torch.uint64, torch.int64) or values.dim() != 1:
        raise InvalidArgument(f"{what} must be a 1-D uint64 (or int64) tensor of addresses, got {values.dtype} "
                              f"of shape {tuple(values.shape)}")
    return values.contiguous().view(torch.int64).numpy().view(np.uint64).copy()


def table_entries(call: Call, table: Any, what: str) -> tuple[list[int], list[DeviceAddress]]:
    """A raw pointer table's entries, as given and resolved for the call's device. A CPU table is read on every call
    (a few µs: writes through ``.data``, ``.numpy()`` or its storage change no version counter); a device tensor
    table, whose read-back waits for the stream, once per tensor object and version (torch counts in-place changes;
    a new tensor at a freed one's address is another table); a DeviceArray's on every call. An entry inside kvtier's
    host ranges keeps its resolution while those ranges are unchanged (:func:`span_generation`: a buffer closed or
    registered since makes the next call resolve again); any other entry is resolved on every call. So memory closed
    or moved since is refused or followed, never reached through a stale alias, and a warm call asks nothing of the
    driver for kvtier's buffers. Refused while the call's stream captures: the entries are read now, so a graph would
    replay the capture-time ones whatever the table holds then (SGLang's kernel reads the table when it runs)."""
    if call.stream.capturing:
        raise InvalidArgument(f"{what}: a raw pointer table cannot be used while the stream captures "
                              f"(cudaStreamBeginCapture): it is read when the call is made, so the graph would replay "
                              f"its capture-time entries; capture calls over tensors (kvtier keeps their tables), or "
                              f"run calls over raw tables outside a capture")
    state = _per_runtime(call.runtime)
    key = None
    if is_tensor(table) and table.device.type != "cpu":
        try:
            key = (call.device, id(table), table.data_ptr(), table.numel(), str(table.device), table._version)
        except RuntimeError:    # an inference tensor keeps no version: read it every time
            key = None
    values = None
    if key is not None:
        with state.lock:
            found = state.foreign.get(key)
            if found is not None and found[0]() is table:
                state.foreign.move_to_end(key)
                values = found[1]
    if values is None:
        values = table_values(table, what).tolist()
        if key is not None:
            with state.lock:
                _keep(state.foreign, key, (weakref.ref(table), values))
    generation = span_generation(call.runtime)
    return values, [_resolve_entry(call, state, generation, value, f"{what}[{i}]")
                    for i, value in enumerate(values)]


def _resolve_entry(call: Call, state: _PerRuntime, generation: tuple[int, int], value: int,
                   what: str) -> DeviceAddress:
    key = (call.device, value)
    with state.lock:
        found = state.aliases.get(key)
    if found is not None and found[0] == generation:
        return found[1]
    try:
        entry = resolve_foreign_address(value, call.device, runtime=call.runtime)
    except KvtierError as error:
        raise about(error, f"{what} = 0x{value:x}") from None
    if call.runtime.host_range(value) is not None:
        with state.lock:
            _keep(state.aliases, key, (generation, entry), ENTRIES_KEPT)
    return entry


def pointer_table(call: Call, entries: Sequence[DeviceAddress]) -> PointerTable:
    """A kernel pointer table holding ``entries``, built on first use and kept."""
    state = _per_runtime(call.runtime)
    key = (call.device, tuple(e.value for e in entries))
    with state.lock:
        table = state.tables.get(key)
        if table is not None and not table.closed:
            state.tables.move_to_end(key)
            return table
    reached("operands.build_table")
    table = build_pointer_table(call.runtime, call.device, list(entries))
    with state.lock:
        stored = state.tables.get(key)
        if stored is not None and not stored.closed:
            return stored   # another thread built one meanwhile: every call shares the first stored
        state.tables[key] = table
        while len(state.tables) > TABLES_KEPT:
            state.tables.popitem(last=False)   # freed when the last call holding it lets go (the free waits for
                                               # the device), never closed under a call about to launch with it
    reached("operands.table_stored")
    return table


def table_room(call: Call, raw: int, resolved: DeviceAddress,
               generation: tuple[int, int] | None = None) -> tuple[int | None, bool]:
    """(bytes reachable from a table entry at contiguous device addresses, where known; whether the memory goes on
    past that at a different alias). A kvtier host buffer registered in chunks is one span where the chunks'
    aliases continue each other (always in unified addressing); where they do not (split aliases), a kernel must
    not run from one chunk into the next. Kept per entry while kvtier's host ranges are unchanged (``generation``:
    :func:`span_generation`, read by a caller asking about many entries)."""
    runtime = call.runtime
    state, key = _per_runtime(runtime), (call.device, raw, resolved.value)
    generation = generation or span_generation(runtime)
    with state.lock:
        found = state.rooms.get(key)
    if found is not None and found[0] == generation:
        return found[1]
    if runtime.host_range(raw) is None:
        end = runtime.allocation_end(raw)
        return (None, False) if end is None else (end - raw, False)
    result = _registered_room(call, raw, resolved)
    with state.lock:
        _keep(state.rooms, key, (generation, result), ENTRIES_KEPT)
    return result


def _registered_room(call: Call, raw: int, resolved: DeviceAddress) -> tuple[int | None, bool]:
    runtime = call.runtime
    end = runtime.allocation_end(raw)
    if end is None:
        return None, False
    span = registered_span(runtime, raw)
    if span is None:
        return end - raw, False
    span_end = span[1]
    while end < span_end:
        following = resolve_foreign_address(end, call.device, runtime=runtime)
        if following != resolved + (end - raw):
            return end - raw, True
        end = runtime.allocation_end(end) or span_end
    return end - raw, False


def checks_on() -> bool:
    return os.environ.get(CHECK_ENV) == "1"


def host_indices(x: Any) -> np.ndarray | None:
    """Index values readable without waiting for the device (a CPU tensor), or with ``KVTIER_COMPAT_CHECKS=1`` any
    index operand (read back after a sync); else None."""
    if is_tensor(x) and x.device.type == "cpu":
        return x.detach().numpy().reshape(-1).astype(np.int64)
    if checks_on():
        values = x.cpu() if isinstance(x, DeviceArray) else x.detach().to("cpu")
        return values.numpy().reshape(-1).astype(np.int64)
    return None


def check_indices(src: Any, dst: Any) -> int:
    """The index operands' common length and item size; both contiguous int64 (or int32) of one dtype."""
    import torch

    for name, x in (("src_indices", src), ("dst_indices", dst)):
        if not (is_tensor(x) or isinstance(x, DeviceArray)):
            raise InvalidArgument(f"{name} must be a tensor, got {type(x).__name__}")
        if x.dtype not in (torch.int64, torch.int32):
            raise InvalidArgument(f"{name} must be int64 (or int32), got {x.dtype}")
        if not x.is_contiguous():
            raise InvalidArgument(f"{name} must be contiguous: the kernel reads it as one array")
    if src.dtype != dst.dtype:
        raise InvalidArgument(f"src_indices ({src.dtype}) and dst_indices ({dst.dtype}) must have one dtype")
    if src.numel() != dst.numel():
        raise InvalidArgument(f"src_indices ({src.numel()}) and dst_indices ({dst.numel()}) must have the same "
                              f"length")
    return src.element_size()
