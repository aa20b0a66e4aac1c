"""Fill pools with fresh random bytes and read them back, page by page, through the CPU-side copy APIs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from helpers.device_kernels import random_bytes
from kvtier.memory import CpuAddress, HostKind
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.transfer import TransferEngine

SMALL_MHA = KVGeometry.mha(2, kv_heads=2, head_dim=32, itemsize=2, page_size=16)
"""Two layers, two heads of 64 bytes, 16-token pages (2 KiB per tensor and layer): small, and 16-byte aligned."""


def _layers(pool: DevicePool):
    for tensor in range(pool.geometry.tensors):
        for layer, address in enumerate(pool.layer_device_addresses(tensor)):
            yield tensor, layer, address


def landed(pool: DevicePool) -> None:
    """Wait for the pageable uploads the copy API may still have in flight (cudaMemcpy returns before they land)."""
    pool.runtime.legacy_stream(pool.device).synchronize()


def fill_device(pool: DevicePool) -> dict[tuple[int, int], np.ndarray]:
    """Random bytes in every (tensor, layer); returns them as [pages, page_bytes] arrays."""
    data = {}
    for tensor, layer, address in _layers(pool):
        chunk = random_bytes(pool.layer_bytes)
        pool.runtime.memcpy(address, CpuAddress(chunk.ctypes.data), chunk.nbytes)
        data[(tensor, layer)] = chunk.reshape(pool.pages, -1)
    landed(pool)
    return data


def poison_device(pool: DevicePool, value: int = 0xEE) -> None:
    poison = np.full(pool.layer_bytes, value, np.uint8)
    for _, _, address in _layers(pool):
        pool.runtime.memcpy(address, CpuAddress(poison.ctypes.data), poison.nbytes)
    landed(pool)


def read_device(pool: DevicePool, tensor: int, layer: int) -> np.ndarray:
    out = np.empty(pool.layer_bytes, np.uint8)
    pool.runtime.memcpy(CpuAddress(out.ctypes.data), pool.layer_device_addresses(tensor)[layer], out.nbytes)
    return out.reshape(pool.pages, -1)


def host_bytes(pool: HostPool) -> np.ndarray:
    return pool.buffer.as_tensor().numpy().copy()


def fill_host(pool: HostPool, value: int | None = None) -> np.ndarray:
    view = pool.buffer.as_tensor().numpy()
    view[:] = random_bytes(view.size) if value is None else value
    snapshot = view.copy()
    del view
    return snapshot


@contextlib.contextmanager
def engine_on(runtime, g, layout, *, device_pages=4, host_pages=4, kind=HostKind.REGISTERED, engine=True,
              **engine_kwargs) -> Iterator[tuple[DevicePool, HostPool, TransferEngine | None]]:
    """A device pool, a host pool and (unless ``engine=False``) an engine over them, all closed afterwards."""
    dev = DevicePool.allocate(g, device_pages, 0, runtime=runtime)
    host = None
    made = None
    try:
        host = HostPool.allocate(g, layout, pages=host_pages, kind=kind, runtime=runtime)
        made = TransferEngine(dev, host, **engine_kwargs) if engine else None
        yield dev, host, made
    finally:
        if made is not None:
            made.close()
        if host is not None:
            host.close()
        dev.close()


def launch_names(runtime, monkeypatch) -> list[str]:
    """The names of the kernels ``runtime`` launches from now on (the list fills as they are queued)."""
    names: list[str] = []
    launch = runtime.launch

    def counted(program, name, **kwargs):
        names.append(name)
        return launch(program, name, **kwargs)

    monkeypatch.setattr(runtime, "launch", counted)
    return names


def small_engine(rt, backend: str = "kernel", layout: str = "layer_first", *, heads: int = 1,
                 register_chunk_bytes: int | None = None):
    """(geometry, device pool of 8 pages, host pool of 10, engine) of 3 layers of 4-token pages, a staging area of
    3 pages: small enough that a transfer of 6 pages runs in pieces. ``register_chunk_bytes``: the host pool is
    registered in chunks of that size."""
    g = KVGeometry("mha", 3, 4, 128, heads)
    dev = DevicePool.allocate(g, 8, 0, runtime=rt)
    extra = {} if register_chunk_bytes is None else {"register_chunk_bytes": register_chunk_bytes}
    host_pool = HostPool.allocate(g, layout, pages=10, runtime=rt, **extra)
    engine = TransferEngine(dev, host_pool, backend=backend, staging_bytes=3 * g.bytes_per_page)
    return g, dev, host_pool, engine


def host_page(host_pool: HostPool, snapshot: np.ndarray, t: int, layer: int, p: int) -> np.ndarray:
    """Page ``p`` of tensor ``t``, layer ``layer`` in ``snapshot`` (a copy of the host pool's bytes)."""
    g = host_pool.geometry
    at = host_pool.tensor_offset(t) + layer * host_pool.strides.layer + p * host_pool.strides.page
    return snapshot[at:at + g.page_bytes]


def host_page_offsets(host_pool: HostPool, tensor: int, layer: int, page: int) -> np.ndarray:
    """Buffer offsets of host page ``page`` of (tensor, layer), in the device page's byte order, from the strides
    (any layout: a page's slots and heads may lie apart)."""
    g, s = host_pool.geometry, host_pool.strides
    slot = np.arange(g.page_size)[:, None, None]
    head = np.arange(g.heads)[None, :, None]
    byte = np.arange(g.head_bytes)[None, None, :]
    return (host_pool.tensor_offset(tensor) + layer * s.layer + page * s.page + slot * s.slot + head * s.head
            + byte).reshape(-1)


def landed_or_untouched(g, dev: DevicePool, host_pool: HostPool, host_data: np.ndarray, pages, dst_pages,
                        poison: int = 0xEE) -> tuple[int, int]:
    """(landed, untouched) counts of the device pages ``dst_pages``: each must hold exactly its host page or be all
    ``poison`` (nothing queued); anything else fails."""
    landed = untouched = 0
    for t in range(g.tensors):
        for layer in range(g.layers):
            got = read_device(dev, t, layer)
            for p, d in zip(pages, dst_pages, strict=True):
                if np.array_equal(got[d], host_page(host_pool, host_data, t, layer, p)):
                    landed += 1
                elif (got[d] == poison).all():
                    untouched += 1
                else:
                    raise AssertionError(f"device page {d} (tensor {t}, layer {layer}) holds neither its host page "
                                         f"nor the poison")
    return landed, untouched


def at_first_event(rt, action):
    """Run ``action`` at the first event ``rt`` creates (inside an engine's call, under its lock, where a finalizer or
    a signal handler on the queuing thread runs): (undo, fired)."""
    original = rt.create_event
    fired: list = []

    def hooked(*args, **kwargs):
        if not fired:
            fired.append(1)
            action()
        return original(*args, **kwargs)

    rt.create_event = hooked
    return lambda: setattr(rt, "create_event", original), fired


def host_page_rows(host, snapshot, tensor, layer, slot):
    """Host slot ``slot`` of (tensor, layer) as the device page it loads into: its token rows, wherever the layout
    puts them."""
    g = host.geometry
    start = tensor * host.tensor_bytes + slot * host.strides.page + layer * host.strides.layer
    return np.concatenate([snapshot[start + t * host.strides.slot:start + t * host.strides.slot + g.row_bytes]
                           for t in range(g.page_size)])
