"""One engine, several threads: the cache's controller backs up from a background thread while callers load.

Each thread owns disjoint device pages and host slots and checks every byte of every round trip it makes. Staging
areas and index-ring slots were shared without a lock: ``staged`` corrupted data every time, ``kernel`` now and then.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.device_kernels import random_bytes
from helpers.pools import engine_on

from kvtier.memory import CpuAddress
from kvtier.pools import KVGeometry
from kvtier.transfer import BACKENDS

G = KVGeometry.mha(2, kv_heads=2, head_dim=32, itemsize=2, page_size=16)
THREADS, PAGES_EACH, ROUNDS = 4, 3, 6


def _worker(runtime, engine, dev, number, errors):
    rng = np.random.default_rng()
    mine = np.arange(number * 2 * PAGES_EACH, (number + 1) * 2 * PAGES_EACH)
    slots = mine[::-1].copy()
    try:
        for _ in range(ROUNDS):
            sources, targets = rng.permutation(mine[:PAGES_EACH]), rng.permutation(mine[PAGES_EACH:])
            data = {}
            for tensor in range(G.tensors):
                for layer, base in enumerate(dev.layer_device_addresses(tensor)):
                    for page in sources:
                        chunk = random_bytes(G.page_bytes)
                        runtime.memcpy(base + int(page) * G.page_bytes, CpuAddress(chunk.ctypes.data), G.page_bytes)
                        data[(tensor, layer, int(page))] = chunk
            engine.backup(sources, slots[:PAGES_EACH]).wait()
            engine.load(slots[:PAGES_EACH], targets).wait()
            for tensor in range(G.tensors):
                for layer, base in enumerate(dev.layer_device_addresses(tensor)):
                    for source, target in zip(sources, targets, strict=True):
                        out = np.empty(G.page_bytes, np.uint8)
                        runtime.memcpy(CpuAddress(out.ctypes.data), base + int(target) * G.page_bytes, G.page_bytes)
                        if not np.array_equal(out, data[(tensor, layer, int(source))]):
                            errors.append(f"thread {number}: tensor {tensor} layer {layer} page {target} differs")
                            return
    except Exception as exc:
        errors.append(f"thread {number}: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_threads_on_disjoint_pages_never_see_each_others_bytes(runtime, backend, layout):
    pages = THREADS * 2 * PAGES_EACH
    with engine_on(runtime, G, layout, device_pages=pages, host_pages=pages, backend=backend,
                   staging_bytes=2 * G.bytes_per_page) as (dev, host, engine):
        errors: list[str] = []
        threads = [threading.Thread(target=_worker, args=(runtime, engine, dev, n, errors)) for n in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not any(thread.is_alive() for thread in threads), "a worker hung"
        assert errors == []
