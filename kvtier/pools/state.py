"""Per-request state pools: Mamba / linear-attention conv and temporal (SSM) state, DeepSeek-V4 compress state.

A state pool has one item per (request slot, layer, tensor) — page size 1. Engines keep the device tensors
request-major or layer-major and often strided (a slot's state padded, a view of a bigger tensor); kvtier takes them as
they are (``StateDevicePool.from_tensors``) and walks each item as evenly spaced chunks. Host layouts keep a slot
contiguous, so a request's whole state is one run for storage:

- ``page_first``         [slot][layer][tensor item]   a slot's tensors interleave per layer
- ``page_first_direct``  [slot][tensor][layer][item]  each (slot, tensor) is one run across layers
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.checks import index_array, integer
from kvtier.errors import InvalidArgument
from kvtier.memory import HostKind
from kvtier.memory.registration import DEFAULT_REGISTER_CHUNK_BYTES
from kvtier.pools.family import (
    FamilyDevicePool,
    FamilyHostPool,
    Part,
    Placement,
    allocate_parts,
    host_units,
    item_pieces,
)
from kvtier.pools.geometry import HostLayout
from kvtier.runtime import Runtime
from kvtier.runtime import get as get_runtime

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


STATE_LAYOUTS = (HostLayout.PAGE_FIRST, HostLayout.PAGE_FIRST_DIRECT)
"""The host layouts a state host pool keeps."""


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of a layer: its per-request shape and dtype (``float16``, ``bfloat16`` or ``float32``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(integer(n, f"{self.name} shape", low=1) for n in self.shape))
        dtype = str(self.dtype).removeprefix("torch.")
        if dtype not in DTYPE_BYTES:
            raise InvalidArgument(f"state {self.name!r}: dtype {self.dtype!r} is not one of {tuple(DTYPE_BYTES)}")
        object.__setattr__(self, "dtype", dtype)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class StateGeometry:
    name: str
    layers: int
    tensors: tuple[StateTensor, ...]

    def __post_init__(self) -> None:
        integer(self.layers, "layers", low=1)
        names = [t.name for t in self.tensors]
        if not names or len(set(names)) != len(names):
            raise InvalidArgument(f"a state pool needs distinct tensor names, got {names}")

    @classmethod
    def mamba(cls, layers: int, conv_shape: Sequence[int], temporal_shape: Sequence[int], *,
              conv_dtype: str = "bfloat16", temporal_dtype: str = "float32") -> StateGeometry:
        """Mamba2 / gated-delta-net layers: conv state [conv_dim, kernel - 1] and temporal state (e.g. [heads,
        head_k_dim, head_v_dim] for Qwen3-Next's linear attention, [heads, head_dim, state_size] for Mamba2)."""
        return cls("mamba", layers, (StateTensor("conv", tuple(conv_shape), conv_dtype),
                                     StateTensor("temporal", tuple(temporal_shape), temporal_dtype)))

    @classmethod
    def compress_state(cls, layers: int, shape: Sequence[int], dtype: str = "float32") -> StateGeometry:
        """DeepSeek-V4's compressor state per request and layer (the tokens of a block not yet compressed)."""
        return cls("dsv4_compress_state", layers, (StateTensor("state", tuple(shape), dtype),))

    @property
    def slot_bytes(self) -> int:
        """One request's state: every tensor of every layer."""
        return self.layers * sum(t.nbytes for t in self.tensors)

    def tensor(self, name: str) -> StateTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise InvalidArgument(f"{self.name} state has no tensor {name!r}")


def host_offsets(geometry: StateGeometry, layout: HostLayout | str) -> dict[str, tuple[list[int], int, int]]:
    """Per tensor: the buffer offset of each layer's item in slot 0, and the slot stride."""
    g, layout = geometry, HostLayout.of(layout, STATE_LAYOUTS, "a state host pool's layout")
    offsets: dict[str, tuple[list[int], int, int]] = {}
    before = 0
    per_layer = sum(t.nbytes for t in g.tensors)
    for t in g.tensors:
        if layout is HostLayout.PAGE_FIRST:
            bases = [layer * per_layer + before for layer in range(g.layers)]
        else:
            bases = [g.layers * before + layer * t.nbytes for layer in range(g.layers)]
        offsets[t.name] = (bases, g.slot_bytes, 0)
        before += t.nbytes
    return offsets


class StateHostPool(FamilyHostPool):
    @classmethod
    def allocate(cls, geometry: StateGeometry, layout: HostLayout | str = HostLayout.PAGE_FIRST, *,
                 slots: int | None = None, nbytes: int | None = None, kind: HostKind | str = HostKind.REGISTERED,
                 runtime: Runtime | None = None, register_chunk_bytes: int = DEFAULT_REGISTER_CHUNK_BYTES,
                 name: str | None = None) -> StateHostPool:
        layout = HostLayout.of(layout, STATE_LAYOUTS, "a state host pool's layout")
        count = host_units(None, slots, nbytes, geometry.slot_bytes, "slots")
        buffer = cls.make_buffer(count * geometry.slot_bytes, kind, runtime, register_chunk_bytes,
                                 geometry.slot_bytes, name)
        return cls(geometry, layout.value, count, buffer, host_offsets(geometry, layout))

    def page_pieces(self, slots: Any) -> tuple[np.ndarray, np.ndarray]:
        """Buffer offsets ``[slots, 1]`` and sizes ``[1]`` of each slot: a slot is one contiguous run in every state
        layout, so storage reads and writes a snapshot as it does a host page of one piece."""
        values = index_array(slots, "slots").astype(np.int64, copy=False)
        self.check_units(values, "slots")
        return (values * self.geometry.slot_bytes)[:, None], np.array([self.geometry.slot_bytes], dtype=np.int64)


class StateDevicePool(FamilyDevicePool):
    """Device state of ``slots`` requests: per tensor and layer, a base, a slot stride and the item's chunks."""

    @classmethod
    def allocate(cls, geometry: StateGeometry, slots: int, device: int, *, runtime: Runtime | None = None,
                 request_major: bool = False, pad: int = 0) -> StateDevicePool:
        """Fresh device state. ``request_major`` keeps one buffer per tensor as [slots][layers][item] (else one per
        layer, [slots][item]); ``pad`` bytes after every item make the slot stride larger than the item, as a view
        of a bigger engine tensor would — tests and benchmarks use both to walk strided state."""
        runtime = runtime or get_runtime()
        slots = integer(slots, "slots", low=1)
        pad = integer(pad, "pad", low=0)
        g = geometry
        if request_major:
            sizes = {t.name: [slots * g.layers * (t.nbytes + pad)] for t in g.tensors}
        else:
            sizes = {t.name: [slots * (t.nbytes + pad)] * g.layers for t in g.tensors}
        buffers, owned = allocate_parts(sizes, device, runtime)
        parts = {}
        for t in g.tensors:
            item = t.nbytes + pad
            if request_major:
                whole = buffers[t.name][0]
                bases = tuple[Any, ...](whole.region(layer * item, whole.nbytes - layer * item)
                                        for layer in range(g.layers))
                stride = g.layers * item
            else:
                bases, stride = tuple[Any, ...](buffers[t.name]), item
            parts[t.name] = (Part(t.name, tuple(range(g.layers)), "slot", t.nbytes),
                             Placement(bases, stride, 0, t.nbytes))
        return cls(g, slots, device, runtime, parts, owned=owned)

    @classmethod
    def from_tensors(cls, geometry: StateGeometry, tensors: dict[str, Any], *, layer_dim: int = 0,
                     runtime: Runtime | None = None) -> StateDevicePool:
        """``tensors[name]``: a torch CUDA tensor whose dimensions ``layer_dim`` and the other of (0, 1) are layers
        and slots, followed by the state's shape (e.g. SGLang's [layers, slots + 1, conv_dim, kernel - 1]); or a
        list of per-layer [slots, *shape] tensors. Any strides: items must be evenly spaced chunks."""
        runtime = runtime or get_runtime()
        g = geometry
        if set(tensors) != {t.name for t in g.tensors}:
            raise InvalidArgument(f"expected tensors {[t.name for t in g.tensors]}, got {list(tensors)}")
        parts, keep, slots, device = {}, [], None, None
        for t in g.tensors:
            given = tensors[t.name]
            layers = list(given) if isinstance(given, (list, tuple)) else [
                given.select(layer_dim, i) for i in range(given.shape[layer_dim])]
            if len(layers) != g.layers:
                raise InvalidArgument(f"{t.name}: {len(layers)} layers, the geometry has {g.layers}")
            first = layers[0]
            if str(first.dtype).removeprefix("torch.") != t.dtype or tuple(first.shape[1:]) != t.shape:
                raise InvalidArgument(f"{t.name}: a layer is {first.dtype} {tuple(first.shape[1:])} per slot, the "
                                      f"geometry says {t.dtype} {t.shape}")
            for i, layer in enumerate(layers):
                if layer.stride() != first.stride() or layer.shape != first.shape or layer.dtype != first.dtype:
                    raise InvalidArgument(f"{t.name} layer {i}: every layer needs the same dtype, shape and strides")
                if layer.device != first.device:
                    raise InvalidArgument(f"{t.name} layer {i} is on {layer.device}, not {first.device}")
            if slots is not None and first.shape[0] != slots or device is not None and first.device != device:
                raise InvalidArgument(f"{t.name}: {first.shape[0]} slots on {first.device}, other tensors have "
                                      f"{slots} on {device}")
            slots, device = first.shape[0], first.device
            chunk, pieces, piece_stride = item_pieces(t.shape, first.stride()[1:], t.itemsize)
            parts[t.name] = (Part(t.name, tuple(range(g.layers)), "slot", chunk, pieces),
                             Placement(tuple(layers), first.stride()[0] * t.itemsize, 0, piece_stride))
            keep.append(given)
        assert slots is not None and device is not None
        return cls(g, int(slots), int(device.index or 0), runtime, parts, keep=keep)
