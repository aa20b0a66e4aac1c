"""A prefetch longer than the host tier's room commits the leading pages that fit (after the eviction the policy
allows) and counts the rest; it never commits nothing just because the whole chain does not fit."""

from __future__ import annotations

import pytest
from helpers.cache import P, close_all, load_and_check, prompt, serve
from helpers.storage import second, stores_of, warm


@pytest.fixture
def stored(rt):
    """A 40-page prompt a first cache wrote through to a shared store, and a second cache with 24 host pages over it
    (yields the prompt, the cache and its model)."""
    storage, stores = stores_of()
    tokens = prompt(40 * P)
    salt = warm(rt, storage, [tokens])
    cache, model, dev, host = second(rt, storage, salt, host_pages=24, storage_write=False)
    yield tokens, cache, model
    close_all(cache, dev, host)
    for store in stores:
        store.close()


def fetched(cache, tokens):
    fetch = cache.prefetch(tokens)                  # default batch: 32 pages, more than the host tier's 24
    fetch.settle("wait_complete")
    return fetch


def test_a_chain_longer_than_the_free_host_pages_commits_the_leading_pages_that_fit(stored):
    tokens, cache, model = stored
    fetch = fetched(cache, tokens)
    assert (fetch.outcome, fetch.stored_pages, fetch.committed_pages) == ("host_full", 40, 24)
    stats = cache.stats()
    assert stats["prefetch_skipped.host_full"] == 16
    assert stats["hit_tokens.storage"] == 24 * P
    match, served = serve(cache, model, tokens)     # every byte loaded back is checked
    assert (match.host_tokens, served) == (24 * P, 24)
    cache.check()


def test_room_is_made_by_evicting_what_the_host_tier_may_give_up(stored):
    tokens, cache, model = stored
    other = prompt(10 * P)
    serve(cache, model, other)                      # 10 host pages, evictable once backed up
    cache.drain()
    assert cache.host.free_pages == 14
    fetch = fetched(cache, tokens)
    assert (fetch.outcome, fetch.committed_pages) == ("host_full", 24)
    assert cache.match_prefix(other).host_tokens == 0   # its host copy made the room (its device copy stays)
    match, served = serve(cache, model, tokens)
    assert served == 24
    cache.check()


def test_a_locked_host_prefix_is_never_evicted_for_a_prefetch(stored):
    tokens, cache, model = stored
    other = prompt(20 * P)
    serve(cache, model, other)
    cache.drain()
    cache.evict(device_pages=20)                    # host only now
    held = cache.match_prefix(other, lock=True)
    fetch = fetched(cache, tokens)
    assert (fetch.outcome, fetch.committed_pages) == ("host_full", 4)
    assert cache.stats()["prefetch_skipped.host_full"] == 36
    assert cache.match_prefix(other).host_tokens == 20 * P
    load_and_check(cache, model, other)
    cache.unlock(held)
    cache.check()
