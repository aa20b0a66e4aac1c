"""What every engine checks of its arguments: the pair of pools, the layers of a call, the threads per block of its
backups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.checks import index_array, integer
from kvtier.errors import InvalidArgument


def checked_layers(layers: Sequence[int] | None, count: int) -> list[int]:
    """``layers`` (default: all ``count``) as a list, each in range and none repeated."""
    if layers is None:
        return list(range(count))
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__len__"):
        raise InvalidArgument(f"layers must be a sequence of layer indices, got {layers!r}")
    chosen = index_array(layers, "layers").tolist()
    bad = [x for x in chosen if not 0 <= x < count]
    if bad:
        raise InvalidArgument(f"layer {bad[0]} is out of range (pool has {count} layers)")
    if len(set(chosen)) != len(chosen):
        raise InvalidArgument(f"layers {chosen} repeat a layer")
    return chosen


BACKUP_THREADS = 512


NARROW_CHUNK_BYTES = 512


def choose_backup_threads(given: Any, threads: int, max_blocks: int, chunk_bytes: int | None = None) -> int:
    """Threads per block of kernel backups: ``given``, or by default ``threads`` capped at 512 when the budget is more
    than one block and the copy's chunks are at least 512 bytes. On the H200 two 1024-thread blocks writing to host
    memory slowed a concurrent bf16 GEMM by 90%, two of 512 threads by 10%, at the same 50 GB/s; but one 512-thread
    block writes only 53% of the link (1024: 72%), and 64-byte rows at 2 SMs 66% (1024: 77%)."""
    if given is None:
        narrow = chunk_bytes is not None and chunk_bytes < NARROW_CHUNK_BYTES
        return threads if max_blocks == 1 or narrow else min(threads, BACKUP_THREADS)
    value = integer(given, "backup_threads", low=32, high=1025)
    if value % 32:
        raise InvalidArgument(f"backup_threads must be whole warps (a multiple of 32), got {value}")
    return value


def check_pools(device_pool: Any, host_pool: Any) -> None:
    """Both open, of one geometry and one runtime: what every engine over a pair of pools first checks."""
    device_pool.check_open()
    host_pool.check_open()
    if device_pool.geometry != host_pool.geometry:
        raise InvalidArgument(f"pool geometries differ: {device_pool.geometry} vs {host_pool.geometry}")
    if device_pool.runtime is not host_pool.runtime:
        raise InvalidArgument("device and host pools belong to different runtimes")
