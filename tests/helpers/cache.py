"""A stand-in model for cache tests: the KV of a page is a function of its page key and a per-run salt, written into
and read from device pages with plain copies (no transfer engine), so a test can check every byte it is served."""

from __future__ import annotations

import hashlib
import threading

import numpy as np

from kvtier.cache import CacheSettings, KVCache, Match, Namespace, page_keys
from kvtier.cache.operation import BACKUP, Operation
from kvtier.memory import CpuAddress
from kvtier.pools import DevicePool, HostPool, KVGeometry

TINY = KVGeometry.mha(layers=2, kv_heads=1, head_dim=32, itemsize=2, page_size=4)
P = TINY.page_size


def prompt(n: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """``n`` random token ids (a prompt no other test shares)."""
    return (rng or np.random.default_rng()).integers(0, 128256, n)


class KVModel:
    def __init__(self, pool: DevicePool, namespace: Namespace) -> None:
        self.pool, self.namespace = pool, namespace
        self.salt = np.random.default_rng().bytes(16)
        self.g = pool.geometry
        self.pieces = [(t, layer, a) for t in range(self.g.tensors)
                       for layer, a in enumerate(pool.layer_device_addresses(t))]

    def page(self, key: bytes) -> np.ndarray:
        """[tensors * layers, page_bytes] of fresh-looking bytes (never all zeros) for one page key."""
        seed = int.from_bytes(hashlib.sha256(self.salt + key).digest()[:8], "little")
        return np.random.default_rng(seed).integers(1, 256, (len(self.pieces), self.g.page_bytes), dtype=np.uint8)

    def write(self, tokens, pages, first_page: int = 0) -> None:
        """Prefill: write the KV of whole pages ``first_page..`` of ``tokens`` into device ``pages``."""
        keys = page_keys(self.namespace, tokens)
        for key, page in zip(keys[first_page:], pages, strict=False):
            data = self.page(key)
            for row, (_, _, address) in enumerate(self.pieces):
                chunk = np.ascontiguousarray(data[row])
                self.pool.runtime.memcpy(address + int(page) * self.g.page_bytes, CpuAddress(chunk.ctypes.data),
                                         chunk.nbytes)
        self.pool.runtime.legacy_stream(self.pool.device).synchronize()

    def mismatches(self, tokens, pages) -> list[int]:
        """Indices of the pages (of the prompt's first ``len(pages)``) whose device bytes are not their KV."""
        keys = page_keys(self.namespace, tokens)
        bad = []
        out = np.empty(self.g.page_bytes, np.uint8)
        for i, (key, page) in enumerate(zip(keys, pages, strict=False)):
            expected = self.page(key)
            for row, (_, _, address) in enumerate(self.pieces):
                out[:] = 0
                self.pool.runtime.memcpy(CpuAddress(out.ctypes.data), address + int(page) * self.g.page_bytes,
                                         out.nbytes)
                if not np.array_equal(out, expected[row]):
                    bad.append(i)
                    break
        return bad


def build(runtime, *, device_pages=16, host_pages=32, geometry=TINY, layout="page_first", model="tiny",
          storage=None, **settings) -> tuple[KVCache, KVModel, DevicePool, HostPool]:
    """``storage``: a callable namespace → backend (the cache gets the backend; close it after the cache)."""
    settings.setdefault("calibrate", False)
    settings.setdefault("io_backend", "kernel")
    settings.setdefault("load_back_min_tokens", 0)
    dev = DevicePool.allocate(geometry, device_pages, 0, runtime=runtime)
    host = HostPool.allocate(geometry, layout, pages=host_pages, kind="pinned", runtime=runtime)
    ns = Namespace(model, geometry, "bfloat16")
    cache = KVCache(dev, host, ns, CacheSettings(**settings), storage=storage(ns) if storage else None)
    return cache, KVModel(dev, ns), dev, host


def serve(cache: KVCache, model: KVModel, tokens, *, force: bool = True) -> tuple[Match, int]:
    """One request as an engine runs it (``cache.request``); returns the match and how many pages were served from the
    cache, after checking every served byte."""
    tokens = np.asarray(tokens)
    with cache.request(tokens, force=force, prefetch=False) as request:
        request.wait()
        match = request.match
        assert not model.mismatches(tokens, match.device_pages), "device hit served wrong KV"
        prefix = request.prefix_pages
        if request.load is not None:
            assert not model.mismatches(tokens, prefix), "load-back served wrong KV"
        new = request.allocate()
        model.write(tokens, new, first_page=len(prefix))
        request.insert()
    return match, len(prefix)


def load_and_check(cache: KVCache, model: KVModel, tokens) -> Match:
    """Match ``tokens``, load its host part back (forced) and check every byte of the whole cached prefix."""
    with cache.request(tokens, force=True, prefetch=False) as request:
        request.wait()
        assert not model.mismatches(tokens, request.prefix_pages)
    return request.match


def close_all(cache: KVCache, dev: DevicePool, host: HostPool) -> None:
    cache.close()
    host.close()
    dev.close()


class AsyncKVModel(KVModel):
    """Writes KV as a GPU prefill does: copies queued on the caller's current stream, landing only when it runs."""

    def __init__(self, pool: DevicePool, namespace: Namespace) -> None:
        super().__init__(pool, namespace)
        self.staging: list[int] = []

    def write(self, tokens, pages, first_page: int = 0) -> None:
        runtime = self.pool.runtime
        stream = runtime.current_stream(self.pool.device)
        for key, page in zip(page_keys(self.namespace, tokens)[first_page:], pages, strict=False):
            data = self.page(key)
            for row, (_, _, address) in enumerate(self.pieces):
                staged = runtime.host_alloc(self.g.page_bytes)
                np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * self.g.page_bytes).from_address(staged))[:] = \
                    data[row]
                self.staging.append(staged)
                runtime.memcpy_async(address + int(page) * self.g.page_bytes, CpuAddress(staged), self.g.page_bytes,
                                     stream=stream)

    def close(self) -> None:
        self.pool.runtime.synchronize(self.pool.device)
        for staged in self.staging:
            self.pool.runtime.host_free(staged)


# -- threads ---------------------------------------------------------------------------------------------------------
BOUND = 20.0
"""Seconds a thread is given before the test calls it stuck (only a failure waits this long)."""


class HeldOps:
    """Operations of ``kind`` look long: their waits block until ``release()``; ``waiting`` names the threads blocked
    in one. ``then(op, thread)`` may raise after the real wait (a fault, an interrupt)."""

    def __init__(self, monkeypatch, kind=BACKUP, then=None):
        self.gate = threading.Event()
        self.waiting: set[str] = set()
        self.changed = threading.Condition()
        self.kind, self.then = kind, then
        real = Operation.wait

        def held(op):
            if op.kind == self.kind and not self.gate.is_set():
                with self.changed:
                    self.waiting.add(threading.current_thread().name)
                    self.changed.notify_all()
                self.gate.wait(BOUND * 3)
            real(op)
            if self.then is not None:
                self.then(op, threading.current_thread().name)

        monkeypatch.setattr(Operation, "wait", held)

    def until_waiting(self, name):
        with self.changed:
            assert self.changed.wait_for(lambda: name in self.waiting, BOUND), f"{name} never waited for a transfer"

    def release(self):
        self.gate.set()


def spawn(name, target):
    """``target()`` on a thread named ``name``; returns (thread, results) where results gets ('ok', value) or
    ('raised', exception)."""
    results: list = []

    def body():
        try:
            results.append(("ok", target()))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            results.append(("raised", exc))

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread, results


def joined(thread):
    thread.join(BOUND)
    assert not thread.is_alive(), f"{thread.name} is stuck"


def counting_events(monkeypatch, rt):
    made: list = []
    create_event = rt.create_event
    monkeypatch.setattr(rt, "create_event", lambda *a, **k: made.append(a) or create_event(*a, **k))
    return made
