"""A cache whose caller closed one of its pools refuses every call, naming the pool: it never hands out a page
number in freed device memory, nor reports a host hit in a freed buffer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers.cache import P, build, prompt, serve

from kvtier.errors import BufferClosed


@pytest.mark.parametrize("closed", ["device", "host"])
def test_every_call_after_a_pool_closed_raises_buffer_closed_naming_it(rt, closed):
    cache, model, dev, host = build(rt, device_pages=8, host_pages=16)
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    cache.drain()
    held = cache.match_prefix(tokens, lock=True)
    mine = cache.allocate(2)
    (dev if closed == "device" else host).close()
    calls = {
        "match_prefix": lambda: cache.match_prefix(tokens),
        "allocate": lambda: cache.allocate(1),
        "free": lambda: cache.free(mine),
        "insert": lambda: cache.insert(prompt(2 * P), mine),
        "load_back": lambda: cache.load_back(held),
        "lock": lambda: cache.lock(cache.match_prefix(tokens)),
        "unlock": lambda: cache.unlock(held),
        "backup": lambda: cache.backup(held),
        "page_keys": lambda: cache.page_keys(held),
        "prefetch": lambda: cache.prefetch(tokens),
        "evict": lambda: cache.evict(device_pages=1, host_pages=1),
        "drain": cache.drain,
    }
    for name, call in calls.items():
        with pytest.raises(BufferClosed, match=f"{closed} pool") as raised:
            call()
        assert "close the cache before its pools" in str(raised.value), name
    cache.close()                                   # still closes, and gives every page back
    assert cache.device.free_pages == cache.device.pages and cache.host.free_pages == cache.host.pages
    host.close()
    dev.close()


def test_a_pool_closed_between_calls_of_one_request_stops_the_request(rt):
    cache, model, dev, host = build(rt, device_pages=8, host_pages=16)
    tokens = prompt(4 * P)
    match = cache.match_prefix(tokens, lock=True)
    pages = cache.allocate(4)
    model.write(tokens, pages)
    host.close()
    with pytest.raises(BufferClosed, match="host pool"):
        cache.insert(tokens, np.asarray(pages))
    with pytest.raises(BufferClosed, match="host pool"):
        cache.unlock(match)
    cache.close()
    dev.close()


def test_a_host_buffer_closed_under_its_pool_after_calls_that_found_it_open_stops_the_next_call(rt):
    """The cache asks its pools again only when something in the process closed since they last answered: a buffer
    closed under a pool (not the pool) between two calls is such a closing."""
    cache, model, dev, host = build(rt, device_pages=8, host_pages=16)
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    cache.drain()
    for _ in range(3):
        cache.match_prefix(tokens)
    host.buffer.close()
    with pytest.raises(BufferClosed, match="host pool"):
        cache.match_prefix(tokens)
    cache.close()
    dev.close()


ROOT = Path(__file__).resolve().parents[2]

AT_EXIT = textwrap.dedent("""
    import weakref
    import numpy as np
    from kvtier.cache import CacheSettings, KVCache, Namespace
    from kvtier.errors import BufferClosed
    from kvtier.pools import DevicePool, HostPool
    from kvtier.pools.geometry import KVGeometry
    from kvtier.runtime import create

    g = KVGeometry.mha(layers=2, kv_heads=1, head_dim=32, itemsize=2, page_size=4)
    rt = create("emulated:split")
    host = HostPool.allocate(g, "page_first", pages=16, kind="pinned", runtime=rt)

    class Engine:          # an engine whose cleanup (or a daemon thread) still asks the cache for a page at exit
        pass

    engine = Engine()

    def last_request():
        print("device pool closed:", dev.closed, flush=True)
        try:
            print("HANDED OUT", cache.allocate(1).tolist(), flush=True)
        except BufferClosed:
            print("REFUSED", flush=True)

    weakref.finalize(engine, last_request)
    dev = DevicePool.allocate(g, 8, 0, runtime=rt)
    cache = KVCache(dev, host, Namespace("exit", g, "bfloat16"),
                    CacheSettings(calibrate=False, io_backend="direct", load_back_min_tokens=0))
    tokens = np.arange(16, dtype=np.uint32)
    cache.match_prefix(tokens)
    cache.match_prefix(tokens)
""")


def test_device_buffers_freed_by_their_finalizers_at_exit_stop_the_next_call():
    """At interpreter exit weakref.finalize frees every DeviceBuffer without DeviceBuffer.close(): that counts as a
    closing too, so a last call from a finalizer or a daemon thread is refused rather than handed a page of freed
    device memory. (Found adversarially: the count first missed it.)"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", AT_EXIT], env=env, capture_output=True, text=True, timeout=120)
    assert "device pool closed: True" in done.stdout, done.stdout + done.stderr
    assert "REFUSED" in done.stdout, done.stdout + done.stderr
