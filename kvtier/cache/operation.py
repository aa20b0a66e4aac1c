"""A transfer the cache started over some nodes: a backup (device → host) or a load-back (host → device)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvtier.transfer import Transfer

LOAD, BACKUP = "load", "backup"


class Operation:
    """``nodes`` grows when a node in flight is split (both halves finish together). The cache completes an
    operation exactly once (``finished``), from the controller's waiter or inline where it had to wait itself."""

    def __init__(self, kind: str, nodes: list[Any], device_pages: np.ndarray, host_pages: np.ndarray,
                 nbytes: int) -> None:
        self.kind, self.nodes = kind, nodes
        self.device_pages, self.host_pages, self.nbytes = device_pages, host_pages, nbytes
        self.transfer: Transfer | None = None
        self.submitted = time.perf_counter()
        self.finished = False
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.finished or (self.transfer is not None and self.transfer.done())

    def wait(self) -> None:
        """Block the CPU until the bytes have landed."""
        if self.transfer is not None:
            self.transfer.wait()

    def __repr__(self) -> str:
        state = "finished" if self.finished else "in flight"
        return f"{type(self).__name__}({self.kind}, {len(self.device_pages)} pages, {state})"


class LoadBack(Operation):
    """A load-back the caller can wait on per layer: ``stream_wait(layer=i)`` makes the caller's stream (or
    ``stream``) wait on the GPU for layer i only, so layer i's attention overlaps the load of later layers;
    ``wait_layer`` blocks the CPU instead. ``device_pages`` are the pages it fills; ``prefix_pages`` those of the
    whole matched prefix (the device part of the match, then these)."""

    def __init__(self, nodes: list[Any], device_pages: np.ndarray, host_pages: np.ndarray, nbytes: int,
                 loaded_tokens: int) -> None:
        super().__init__(LOAD, nodes, device_pages, host_pages, nbytes)
        self.loaded_tokens = loaded_tokens
        self.prefix_pages: np.ndarray = device_pages

    def stream_wait(self, stream: Any = None, *, layer: int | None = None) -> None:
        assert self.transfer is not None
        self.transfer.stream_wait(stream, layer=layer)

    def wait_layer(self, layer: int) -> None:
        assert self.transfer is not None
        self.transfer.wait_layer(layer)
