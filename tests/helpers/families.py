"""Model-family pools: device images, host views and the byte models of state backups and loads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from helpers.device_kernels import random_bytes
from kvtier.memory import CpuAddress, DeviceAddress
from kvtier.pools.state import StateDevicePool, StateGeometry, StateHostPool
from kvtier.transfer.family import FamilyEngine

POISON = 0xEE



def synced(runtime: Any) -> None:
    """Wait for the pageable copies the copy API may still have in flight on the legacy stream of device 0."""
    runtime.legacy_stream(0).synchronize()



def write_device(runtime: Any, address: DeviceAddress, data: np.ndarray) -> None:
    data = np.ascontiguousarray(data)
    runtime.memcpy(address, CpuAddress(data.ctypes.data), data.nbytes)
    synced(runtime)



def read_at(runtime: Any, address: DeviceAddress, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    runtime.memcpy(CpuAddress(out.ctypes.data), address, nbytes)
    synced(runtime)
    return out



class DeviceImage:
    """Every byte a family device pool owns, as named spans (address, size): fill, poison and read them all."""

    def __init__(self, runtime: Any, spans: dict[Any, tuple[DeviceAddress, int]]) -> None:
        self.runtime, self.spans = runtime, spans

    def fill(self) -> dict[Any, np.ndarray]:
        data = {}
        for key, (address, nbytes) in self.spans.items():
            data[key] = random_bytes(nbytes)
            write_device(self.runtime, address, data[key])
        return data

    def poison(self, value: int = POISON) -> dict[Any, np.ndarray]:
        data = {}
        for key, (address, nbytes) in self.spans.items():
            data[key] = np.full(nbytes, value, np.uint8)
            write_device(self.runtime, address, data[key])
        return data

    def read(self) -> dict[Any, np.ndarray]:
        return {key: read_at(self.runtime, address, nbytes) for key, (address, nbytes) in self.spans.items()}



def assert_image(got: dict[Any, np.ndarray], expected: dict[Any, np.ndarray]) -> None:
    assert got.keys() == expected.keys()
    for key in got:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=f"device span {key}")



def host_view(pool: Any) -> np.ndarray:
    return pool.buffer.as_tensor().numpy()





@contextlib.contextmanager
def closing(*things: Any) -> Iterator[None]:
    try:
        yield
    finally:
        for thing in reversed(things):
            thing.close()



STATES = {
    # conv fp16 30 B (2-byte access), temporal bf16 36 B (4-byte access)
    "fp16-bf16": lambda layers: StateGeometry.mamba(layers, (3, 5), (2, 3, 3), conv_dtype="float16",
                                                    temporal_dtype="bfloat16"),
    # fp32 both, 48 and 64 bytes (16-byte access when unpadded)
    "fp32": lambda layers: StateGeometry.mamba(layers, (4, 3), (2, 2, 4), conv_dtype="float32",
                                               temporal_dtype="float32"),
    # odd: bf16 14 B and fp32 12 B
    "odd": lambda layers: StateGeometry.mamba(layers, (7,), (1, 3, 1), conv_dtype="bfloat16",
                                              temporal_dtype="float32"),
    "compress": lambda layers: StateGeometry.compress_state(layers, (5, 3), "float32"),
}



class StateModel:
    """Where ``StateDevicePool.allocate`` and ``StateHostPool`` keep each (tensor, layer, slot) item, by their
    documented layouts (not by the library's offsets)."""

    def __init__(self, g: StateGeometry, slots: int, request_major: bool, pad: int, layout: str) -> None:
        self.g, self.slots, self.request_major, self.pad, self.layout = g, slots, request_major, pad, layout

    def device_spans(self, pool: StateDevicePool) -> dict[Any, tuple[DeviceAddress, int]]:
        spans = {}
        for t in self.g.tensors:
            _, placement = pool.part(t.name)
            item = t.nbytes + self.pad
            if self.request_major:
                spans[(t.name, None)] = (placement.bases[0], self.slots * self.g.layers * item)
            else:
                for layer in range(self.g.layers):
                    spans[(t.name, layer)] = (placement.bases[layer], self.slots * item)
        return spans

    def device_item(self, name: str, layer: int, slot: int) -> tuple[Any, int]:
        item = self.g.tensor(name).nbytes + self.pad
        if self.request_major:
            return (name, None), (slot * self.g.layers + layer) * item
        return (name, layer), slot * item

    def host_item(self, name: str, layer: int, slot: int) -> int:
        g = self.g
        before = sum(t.nbytes for t in g.tensors[:[t.name for t in g.tensors].index(name)])
        per_layer = sum(t.nbytes for t in g.tensors)
        if self.layout == "page_first":
            return slot * g.slot_bytes + layer * per_layer + before
        return slot * g.slot_bytes + before * g.layers + layer * g.tensor(name).nbytes



@contextlib.contextmanager
def state_pools(runtime: Any, g: StateGeometry, *, slots: int = 5, host_slots: int = 7, request_major: bool = False,
                pad: int = 0, layout: str = "page_first", **engine_kwargs: Any
                ) -> Iterator[tuple[StateDevicePool, StateHostPool, FamilyEngine, StateModel]]:
    dev = StateDevicePool.allocate(g, slots, 0, runtime=runtime, request_major=request_major, pad=pad)
    host = StateHostPool.allocate(g, layout, slots=host_slots, runtime=runtime)
    engine = FamilyEngine(dev, host, **engine_kwargs)
    with closing(dev, host, engine):
        yield dev, host, engine, StateModel(g, slots, request_major, pad, layout)



def state_backup_expected(model: StateModel, device: dict[Any, np.ndarray], host: np.ndarray, src: Any, dst: Any
                          ) -> np.ndarray:
    out = host.copy()
    for s, d in zip(src, dst, strict=True):
        for t in model.g.tensors:
            for layer in range(model.g.layers):
                key, offset = model.device_item(t.name, layer, int(s))
                h = model.host_item(t.name, layer, int(d))
                out[h:h + t.nbytes] = device[key][offset:offset + t.nbytes]
    return out



def state_load_expected(model: StateModel, device: dict[Any, np.ndarray], host: np.ndarray, src: Any, dst: Any,
                        layers: Any = None) -> dict[Any, np.ndarray]:
    out = {k: v.copy() for k, v in device.items()}
    for s, d in zip(src, dst, strict=True):
        for t in model.g.tensors:
            for layer in range(model.g.layers) if layers is None else layers:
                key, offset = model.device_item(t.name, layer, int(d))
                h = model.host_item(t.name, layer, int(s))
                out[key][offset:offset + t.nbytes] = host[h:h + t.nbytes]
    return out
