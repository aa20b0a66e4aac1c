"""No thread waits for a copy while holding the cache's lock: an allocation that needs a write_back victim backed up
first, or that must wait for transfers in flight, waits with the lock released, so another thread's
``match_prefix`` is served while the copy runs (before: it stalled for the whole copy)."""

from __future__ import annotations

import threading
import time

import pytest
from helpers.cache import BOUND, HeldOps, P, build, close_all, load_and_check, prompt, serve


def lookup_while_held(cache, tokens) -> float:
    """``match_prefix`` from another thread; its latency, or a failure when it does not return."""
    took: list[float] = []

    def look() -> None:
        start = time.perf_counter()
        cache.match_prefix(tokens)
        took.append(time.perf_counter() - start)

    looker = threading.Thread(target=look, name="looker")
    looker.start()
    looker.join(BOUND)
    assert took, f"match_prefix did not return within {BOUND} s while a backup was held: it waits for the cache lock"
    return took[0]


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_match_prefix_is_served_while_an_allocation_waits_for_a_backup(rt, monkeypatch, policy):
    cache, model, dev, host = build(rt, device_pages=8, host_pages=32, write_policy=policy)
    held = HeldOps(monkeypatch)
    allocator = None
    try:
        victim = prompt(8 * P)
        serve(cache, model, victim)             # the whole device pool: write_back has no host copy yet, and
        if policy == "write_through":           # write_through's backup of it is in flight (held)
            held.until_waiting("kvtier-cache-backups")
        got: list = []
        allocator = threading.Thread(target=lambda: got.append(cache.allocate(4)), name="allocator")
        allocator.start()
        held.until_waiting("allocator")
        latency = lookup_while_held(cache, prompt(4 * P))
        assert allocator.is_alive() and not got, "the allocation returned before its backup was released"
        held.release()
        allocator.join(BOUND)
        assert len(got) == 1 and len(got[0]) == 4, f"allocation failed (match_prefix took {latency * 1e3:.1f} ms)"
        cache.free(got[0])
        cache.drain()
        match = load_and_check(cache, model, victim)
        assert match.cached_tokens == 8 * P and match.host_tokens >= 4 * P  # the victim kept its KV, on the host
        cache.check()
    finally:
        held.release()
        if allocator is not None:
            allocator.join(BOUND)
        close_all(cache, dev, host)


def test_evict_under_write_back_waits_outside_the_lock_too(rt, monkeypatch):
    cache, model, dev, host = build(rt, device_pages=8, host_pages=32, write_policy="write_back")
    held = HeldOps(monkeypatch)
    evictor = None
    try:
        victim = prompt(8 * P)
        serve(cache, model, victim)
        freed: list = []
        evictor = threading.Thread(target=lambda: freed.append(cache.evict(device_pages=8)), name="evictor")
        evictor.start()
        held.until_waiting("evictor")
        lookup_while_held(cache, victim)
        held.release()
        evictor.join(BOUND)
        assert freed == [(8, 0)]
        assert load_and_check(cache, model, victim).host_tokens == 8 * P
        cache.check()
    finally:
        held.release()
        if evictor is not None:
            evictor.join(BOUND)
        close_all(cache, dev, host)
