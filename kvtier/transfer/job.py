"""What the engine hands a backend: a :class:`Job` (one transfer's pages, units, layers and stream) over a
:class:`Context` (the pools, the plan, the launcher and the settings). Backends see these and nothing else of the
engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.kernels import KernelLauncher
from kvtier.pools import DevicePool, HostPool
from kvtier.pools.geometry import KVGeometry
from kvtier.runtime import Runtime, Stream
from kvtier.transfer.completion import Transfer, user_event
from kvtier.transfer.plan import ChunkPlan

D2H, H2D = "d2h", "h2d"


@dataclass(frozen=True)
class Context:
    """What every backend may use: the pools, the plan, the kernel launcher and the engine's settings."""

    runtime: Runtime
    device: int
    geometry: KVGeometry
    plan: ChunkPlan
    device_pool: DevicePool
    host_pool: HostPool
    launcher: KernelLauncher
    streams: dict[str, Stream]
    index_bytes: int
    max_blocks: int
    threads: int
    backup_threads: int | None = None  # the kernel backend's backups (None: ``threads``)


@dataclass
class Job:
    """One transfer as a backend runs it. ``stream`` already waits for everything the caller ordered it after;
    a backend that uses another stream makes it wait for ``stream`` first."""

    direction: str
    device_pages: np.ndarray
    host_pages: np.ndarray
    device_units: np.ndarray
    host_units: np.ndarray
    layers: Sequence[int]
    per_layer: bool
    stream: Stream
    transfer: Transfer

    @property
    def src_units(self) -> np.ndarray:
        return self.device_units if self.direction == D2H else self.host_units

    @property
    def dst_units(self) -> np.ndarray:
        return self.host_units if self.direction == D2H else self.device_units

    def mark(self, runtime: Runtime, device: int, begin: int, stream: Stream) -> None:
        """Record layer ``begin``'s event on ``stream`` (per-layer loads only)."""
        if self.per_layer:
            event = user_event(runtime, device)
            event.record(stream)
            self.transfer.layer_events[begin] = event
