"""A transfer the cache started over some nodes: a backup (device → host) or a load-back (host → device).

On a hybrid cache one operation moves a chain's KV pages and its state snapshots together (``transfer`` and
``state_transfer``, either may be None when there is nothing of that kind): it completes, or fails, as one."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from kvtier.errors import InvalidArgument
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
        self.state_transfer: Transfer | None = None
        self.state_device = self.state_host = np.zeros(0, dtype=np.int64)
        self.submitted = time.perf_counter()
        self.finished = False
        self.error: BaseException | None = None
        self.give_back: Callable[[], None] | None = None
        """Set when only part of the copies could be queued: the room to return once that part has finished."""

    def transfers(self) -> list[Transfer]:
        return [t for t in (self.transfer, self.state_transfer) if t is not None]

    def done(self) -> bool:
        return self.finished or (bool(self.transfers()) and all(t.done() for t in self.transfers()))

    def wait(self) -> None:
        """Block the CPU until the bytes (KV and state) have landed."""
        for transfer in self.transfers():
            transfer.wait()

    def __repr__(self) -> str:
        state = "finished" if self.finished else "in flight"
        return f"{type(self).__name__}({self.kind}, {len(self.device_pages)} pages, {state})"


class LoadBack(Operation):
    """A load-back the caller can wait on per layer: ``stream_wait(layer=i)`` makes the caller's stream (or
    ``stream``) wait on the GPU for layer i only, so layer i's attention overlaps the load of later layers;
    ``wait_layer`` blocks the CPU instead. ``device_pages`` are the pages it fills; ``prefix_pages`` those of the
    whole matched prefix (the device part of the match, then these).

    Hybrid caches: ``layer_map[i]`` says whether model layer ``i`` is attention (``("kv", j)``: KV layer j) or
    linear attention (``("state", k)``: state layer k), so ``layer=i`` waits for the part of the load that layer
    reads; ``device_state`` is the device slot of the match's state snapshot once this has landed."""

    def __init__(self, nodes: list[Any], device_pages: np.ndarray, host_pages: np.ndarray, nbytes: int,
                 loaded_tokens: int, layer_map: tuple[tuple[str, int], ...] | None = None) -> None:
        super().__init__(LOAD, nodes, device_pages, host_pages, nbytes)
        self.loaded_tokens = loaded_tokens
        self.prefix_pages: np.ndarray = device_pages
        self.layer_map = layer_map
        self.device_state: int | None = None

    def stream_wait(self, stream: Any = None, *, layer: int | None = None) -> None:
        for transfer, part in self._parts(layer):
            transfer.stream_wait(stream, layer=part)

    def wait_layer(self, layer: int) -> None:
        for transfer, part in self._parts(layer):
            if part is None:
                transfer.wait()
            else:
                transfer.wait_layer(part)

    def _parts(self, layer: int | None) -> list[tuple[Transfer, int | None]]:
        """The transfers (and their own layer index) that model layer ``layer`` (None: all) waits for."""
        if layer is None:
            return [(t, None) for t in self.transfers()]
        if self.layer_map is None:
            assert self.transfer is not None
            return [(self.transfer, layer)]
        if not isinstance(layer, int) or not 0 <= layer < len(self.layer_map):
            raise InvalidArgument(f"layer {layer!r} is not a layer of this model (0..{len(self.layer_map) - 1})")
        kind, index = self.layer_map[layer]
        transfer = self.transfer if kind == "kv" else self.state_transfer
        return [] if transfer is None else [(transfer, index)]
