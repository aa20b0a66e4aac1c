"""A hybrid model's cache (GQA KV in page pools beside linear-attention state pools) and its reference model."""

from __future__ import annotations

import ctypes
import hashlib

import numpy as np

from helpers.cache import TINY, KVModel, P
from kvtier.cache import CacheSettings, KVCache, Namespace, page_keys
from kvtier.memory import CpuAddress
from kvtier.pools import DevicePool, HostPool
from kvtier.pools.state import StateDevicePool, StateGeometry, StateHostPool

STATE = StateGeometry.mamba(6, (8, 3), (2, 4, 4))          # 6 linear layers beside TINY's 2 attention layers



class HybridModel(KVModel):
    """KV as :class:`KVModel`; the state after a prefix is fresh random bytes derived from the prefix's last page key
    (never zeros), written into and read from device state slots with plain copies."""

    def __init__(self, pool: DevicePool, states: StateDevicePool, namespace: Namespace) -> None:
        super().__init__(pool, namespace)
        self.states = states
        self.items = [(part.item_bytes, base, placement.page_stride)
                      for part, placement in states.parts() for base in placement.bases]

    def state(self, tokens) -> list[np.ndarray]:
        key = page_keys(self.namespace, tokens)[-1]
        seed = int.from_bytes(hashlib.sha256(self.salt + b"state" + key).digest()[:8], "little")
        rng = np.random.default_rng(seed)
        return [rng.integers(1, 256, size, dtype=np.uint8) for size, _, _ in self.items]

    def write_state(self, tokens, slot: int) -> None:
        self._put(slot, self.state(tokens))

    def poison_states(self) -> None:
        for slot in range(self.states.units):
            self._put(slot, [np.full(size, 0xEE, np.uint8) for size, _, _ in self.items])

    def _put(self, slot: int, data: list[np.ndarray]) -> None:
        runtime = self.states.runtime
        for chunk, (_, base, stride) in zip(data, self.items, strict=True):
            runtime.memcpy(base + slot * stride, CpuAddress(chunk.ctypes.data), chunk.nbytes)
        runtime.legacy_stream(self.states.device).synchronize()

    def state_ok(self, tokens, slot: int) -> bool:
        runtime = self.states.runtime
        for expected, (size, base, stride) in zip(self.state(tokens), self.items, strict=True):
            out = np.zeros(size, np.uint8)
            runtime.memcpy(CpuAddress(out.ctypes.data), base + slot * stride, size)
            if not np.array_equal(out, expected):
                return False
        return True

    def poison_kv(self) -> None:
        for _, _, address in self.pieces:
            poison = np.full(self.pool.pages * self.g.page_bytes, 0xEE, np.uint8)
            self.pool.runtime.memcpy(address, CpuAddress(poison.ctypes.data), poison.nbytes)
        self.pool.runtime.legacy_stream(self.pool.device).synchronize()



class Hybrid:
    def __init__(self, runtime, *, device_pages=16, host_pages=32, device_states=4, host_states=8, storage=None,
                 state=STATE, state_layout="page_first", tenant=None, **settings):
        """``storage``: a callable namespace → backend (the cache gets it; close it after the cache); ``state``,
        ``state_layout``: the state geometry and the state host pool's layout; ``tenant``: the namespace's (tests
        sharing a server keep apart by it)."""
        settings.setdefault("calibrate", False)
        settings.setdefault("io_backend", "kernel")
        settings.setdefault("load_back_min_tokens", 0)
        self.dev = DevicePool.allocate(TINY, device_pages, 0, runtime=runtime)
        self.host = HostPool.allocate(TINY, "page_first", pages=host_pages, kind="pinned", runtime=runtime)
        self.sdev = StateDevicePool.allocate(state, device_states, 0, runtime=runtime)
        self.shost = StateHostPool.allocate(state, state_layout, slots=host_states, runtime=runtime)
        self.ns = Namespace("hybrid", TINY, "bfloat16", tenant=tenant)
        self.cache = KVCache(self.dev, self.host, self.ns, CacheSettings(**settings), state=(self.sdev, self.shost),
                             storage=storage(self.ns) if storage else None)
        self.model = HybridModel(self.dev, self.sdev, self.ns)

    def poison(self):
        """Every byte of all four pools set to 0xEE, so a byte served without being loaded shows."""
        self.model.poison_kv()
        self.model.poison_states()
        for pool in (self.host, self.shost):
            ctypes.memset(pool.buffer.cpu_address.value, 0xEE, pool.buffer.nbytes)

    def serve(self, tokens, *, force=True):
        """One request: match, load back, check every served byte (KV and state), prefill the rest, insert with a
        state snapshot. Returns (match, tokens served from the cache)."""
        cache, model = self.cache, self.model
        tokens = np.asarray(tokens)
        with cache.request(tokens, force=force, prefetch=False) as request:
            request.wait()
            assert not request.declined, "the match needed a load-back that did not happen"
            match, prefix, state = request.match, request.prefix_pages, request.state
            served = len(prefix) * P
            assert served == match.cached_tokens
            assert not model.mismatches(tokens, prefix), "served wrong KV"
            if served:
                assert state is not None and model.state_ok(tokens[:served], state), "served a wrong state"
            slot = request.allocate_state()
            new = request.allocate()
            model.write(tokens, new, first_page=len(prefix))
            model.write_state(tokens, slot)
            request.insert()
        return match, served

    def close(self):
        self.cache.close()
        for pool in (self.shost, self.sdev, self.host, self.dev):
            pool.close()
