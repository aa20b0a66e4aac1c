"""A prefetch longer than the host tier's room commits the leading pages that fit (after the eviction the policy
allows) and counts the rest; it never commits nothing just because the whole chain does not fit."""

from __future__ import annotations

from cache_helpers import P, build, close_all, prompt, serve
from kvtier.storage import MemoryStore, SharedPages


def stored_chain(rt, shared, pages):
    """A first cache writes a ``pages``-page prompt through to the shared store; returns (prompt, model salt)."""
    tokens = prompt(pages * P)
    cache, model, dev, host = build(rt, device_pages=64, host_pages=64,
                                    storage=lambda ns: MemoryStore(ns, shared=shared))
    try:
        serve(cache, model, tokens)
        cache.drain()
        assert cache.stats()["storage_pages.written"] == pages
    finally:
        close_all(cache, dev, host)
        cache.storage.close()
    return tokens, model.salt


def test_a_chain_longer_than_the_free_host_pages_commits_the_leading_pages_that_fit(rt):
    shared = SharedPages()
    tokens, salt = stored_chain(rt, shared, 40)
    cache, model, dev, host = build(rt, device_pages=64, host_pages=24,
                                    storage=lambda ns: MemoryStore(ns, shared=shared))
    model.salt = salt
    try:
        fetch = cache.prefetch(tokens)                      # default batch: 32 pages, more than the 24 free
        fetch.settle("wait_complete")
        assert (fetch.outcome, fetch.stored_pages, fetch.committed_pages) == ("host_full", 40, 24)
        stats = cache.stats()
        assert stats["prefetch_skipped.host_full"] == 16
        assert stats["hit_tokens.storage"] == 24 * P
        match, served = serve(cache, model, tokens)         # every byte loaded back is checked
        assert (match.host_tokens, served) == (24 * P, 24)
        cache.check()
    finally:
        close_all(cache, dev, host)
        cache.storage.close()


def test_room_is_made_by_evicting_what_the_host_tier_may_give_up(rt):
    shared = SharedPages()
    tokens, salt = stored_chain(rt, shared, 40)
    cache, model, dev, host = build(rt, device_pages=64, host_pages=24, storage_write=False,
                                    storage=lambda ns: MemoryStore(ns, shared=shared))
    model.salt = salt
    try:
        other = prompt(10 * P)
        serve(cache, model, other)                          # 10 host pages, evictable once backed up
        cache.drain()
        assert cache.host.free_pages == 14
        fetch = cache.prefetch(tokens)
        fetch.settle("wait_complete")
        assert (fetch.outcome, fetch.committed_pages) == ("host_full", 24)
        assert cache.match_prefix(other).host_tokens == 0   # its host copy made the room (its device copy stays)
        match, served = serve(cache, model, tokens)
        assert served == 24
        cache.check()
    finally:
        close_all(cache, dev, host)
        cache.storage.close()


def test_a_locked_host_prefix_is_never_evicted_for_a_prefetch(rt):
    shared = SharedPages()
    tokens, salt = stored_chain(rt, shared, 40)
    cache, model, dev, host = build(rt, device_pages=64, host_pages=24, storage_write=False,
                                    storage=lambda ns: MemoryStore(ns, shared=shared))
    model.salt = salt
    try:
        other = prompt(20 * P)
        serve(cache, model, other)
        cache.drain()
        cache.evict(device_pages=20)                        # host only now
        held = cache.match_prefix(other, lock=True)
        fetch = cache.prefetch(tokens)
        fetch.settle("wait_complete")
        assert (fetch.outcome, fetch.committed_pages) == ("host_full", 4)
        assert cache.stats()["prefetch_skipped.host_full"] == 36
        assert cache.match_prefix(other).host_tokens == 20 * P
        load = cache.load_back(held, force=True)
        load.wait()
        assert not model.mismatches(other, load.prefix_pages)
        cache.unlock(held)
        cache.check()
    finally:
        close_all(cache, dev, host)
        cache.storage.close()
