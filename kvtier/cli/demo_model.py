"""The demo's stand-ins: a model that writes each new page's KV and reads loaded-back pages to check them, a hybrid
model's recurrent state, and a device-only radix cache as the baseline for "prefill saved"."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from kvtier.cache import Namespace, PageAllocator, RadixIndex, token_array
from kvtier.pools import DevicePool, HostLayout, HostPool
from kvtier.pools.state import StateDevicePool, StateHostPool
from kvtier.transfer import TransferEngine
from kvtier.transfer.family import FamilyEngine

POISON = 0x5A
"""What a page read back for checking holds before the read: a read that skips a piece leaves it, and fails."""

class StandInModel:
    """Writes the KV of new pages (bytes derived from the page key, different in every 16-byte piece) through a
    pinned scratch pool, and reads pages back to check them. The salt comes from the namespace, so that the pages a
    previous run stored are the KV this run expects, and two runs move the same bytes. The scratch pool keeps each
    page's layers in whole pieces (``page_first_direct``): one copy per piece, which the emulator runs fastest."""

    state: StandInState | None = None
    """Hybrid models: the stand-in for the linear-attention layers' state."""

    def __init__(self, device: DevicePool, namespace: Namespace, scratch_pages: int) -> None:
        g = device.geometry
        self.namespace, self.bytes_per_page = namespace, g.bytes_per_page
        self.salt = hashlib.sha256(b"kvtier-demo" + namespace.digest).digest()[:16]
        self.scratch = HostPool.allocate(g, HostLayout.PAGE_FIRST_DIRECT, pages=scratch_pages, kind="pinned",
                                         runtime=device.runtime)
        self.engine = TransferEngine(device, self.scratch, backend="kernel")
        self.view = self.scratch.buffer.as_tensor().numpy().reshape(g.tensors, scratch_pages, -1)
        self.ramp = (np.arange(g.bytes_per_page) // 16 % 251).astype(np.uint8).reshape(g.tensors, -1)

    def expected(self, key: bytes) -> np.ndarray:
        digest = np.frombuffer(hashlib.sha256(self.salt + key).digest(), np.uint8)
        return np.tile(digest, self.bytes_per_page // 32).reshape(self.ramp.shape) + self.ramp

    def write(self, keys: list[bytes], pages: np.ndarray) -> None:
        step = self.scratch.pages
        for start in range(0, len(pages), step):
            chunk = pages[start:start + step]
            for i, key in enumerate(keys[start:start + step]):
                self.view[:, i] = self.expected(key)
            self.engine.load(np.arange(len(chunk)), chunk, per_layer=False).wait()

    def mismatches(self, keys: list[bytes], pages: np.ndarray) -> int:
        bad, step = 0, self.scratch.pages
        for start in range(0, len(pages), step):
            chunk = pages[start:start + step]
            self.view[:] = POISON
            self.engine.backup(chunk, np.arange(len(chunk))).wait()
            bad += sum(not np.array_equal(self.view[:, i], self.expected(key))
                       for i, key in enumerate(keys[start:start + step]))
        return bad

    def close(self) -> None:
        if self.state is not None:
            self.state.close()
        del self.view
        self.engine.close()
        self.scratch.close()


class StandInState:
    """A hybrid model's recurrent state after a prefix: bytes derived from the prefix's last page key, written into a
    device slot and read back through a one-slot scratch host pool and the state engine."""

    def __init__(self, device: StateDevicePool, salt: bytes) -> None:
        self.salt, self.nbytes = salt, device.geometry.slot_bytes
        self.scratch = StateHostPool.allocate(device.geometry, "page_first", slots=1, kind="pinned",
                                              runtime=device.runtime)
        self.engine = FamilyEngine(device, self.scratch)
        self.view = self.scratch.buffer.as_tensor().numpy()

    def expected(self, key: bytes) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(self.salt + b"state" + key).digest()[:8], "little")
        return np.random.default_rng(seed).integers(1, 256, self.nbytes, dtype=np.uint8)

    def write(self, key: bytes, slot: int) -> None:
        self.view[:] = self.expected(key)
        self.engine.load([0], [slot], per_layer=False).wait()

    def matches(self, key: bytes, slot: int) -> bool:
        self.view[:] = POISON
        self.engine.backup([slot], [0]).wait()
        return bool(np.array_equal(self.view, self.expected(key)))

    def close(self) -> None:
        del self.view
        self.engine.close()
        self.scratch.close()


class DeviceOnlyBaseline:
    """A radix cache with the same device pool and no host tier: what an engine without kvtier would hit. For a
    hybrid model (``hybrid``) a match ends only where a request ended (where it would hold a state)."""

    def __init__(self, pages: int, page_size: int, *, hybrid: bool = False) -> None:
        self.index = RadixIndex(page_size, b"\0" * 32)
        self.pages, self.page_size = PageAllocator(pages, name="baseline"), page_size
        self.ends: set[Any] | None = set() if hybrid else None

    def serve(self, tokens: np.ndarray) -> int:
        tokens = token_array(tokens)
        ends = self.ends
        match = self.index.match(tokens, usable=None if ends is None else (lambda n: n in ends))
        need = len(tokens) // self.page_size - len(match.device_pages)
        self.index.lock(match.last_node)
        try:
            new = self.pages.allocate(need)
            while new is None:
                victims = self.index.lru_leaves("device", need - self.pages.free_pages)
                if not victims:
                    return match.device_tokens
                for victim in victims:
                    self.pages.free(victim.device)
                    self.index.set_device(victim, None)
                    self.index.remove(victim)
                new = self.pages.allocate(need)
        finally:
            self.index.unlock(match.last_node)
        placed = self.index.place(tokens, np.concatenate([match.device_pages, new]))
        self.pages.free(placed.duplicates)
        if ends is not None:
            ends.add(placed.last_node)
        return match.device_tokens
