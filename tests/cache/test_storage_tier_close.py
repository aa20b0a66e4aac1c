"""Closing a cache with a storage tier: ``close(cancel=False)`` stores every page queued before it returns, backups
that complete while it closes included; ``close(cancel=True)`` accounts for every page it does not store under a
documented reason; a failed write is counted once."""

from __future__ import annotations

import pytest
from helpers.cache import P, build, prompt, serve
from helpers.storage import Hooked, slow_cache

from kvtier.cache import page_keys
from kvtier.storage import SharedPages, StorageError

PAGES = 4                                           # per prompt: one node each (prompts share nothing)


def stored_pages(store, cache, tokens) -> int:
    return store.exists(page_keys(cache.namespace, tokens))


def test_a_non_cancelling_close_stores_everything_queued_and_everything_backed_up_while_closing(rt):
    shared = SharedPages()
    cache, model, dev, host, store = slow_cache(rt, shared)
    prompts = [prompt(PAGES * P) for _ in range(8)]
    for tokens in prompts:
        serve(cache, model, tokens)                 # no drain: backups and writes are still coming
    cache.close(cancel=False)
    try:
        assert [stored_pages(store, cache, t) for t in prompts] == [PAGES] * len(prompts)
        stats = cache.stats()
        assert stats["storage_pages.written"] == PAGES * len(prompts)
        assert not {k: v for k, v in stats.items() if k.startswith(("storage_skipped.", "skipped.")) and v}
    finally:
        host.close()
        dev.close()
        store.close()


def test_a_cancelling_close_counts_every_page_it_does_not_store(rt):
    shared = SharedPages()
    cache, model, dev, host, store = slow_cache(rt, shared)
    prompts = [prompt(PAGES * P) for _ in range(8)]
    for tokens in prompts:
        serve(cache, model, tokens)
    cache.close(cancel=True)
    try:
        stats = cache.stats()
        written = sum(stored_pages(store, cache, t) for t in prompts)
        assert stats["storage_pages.written"] == written
        skipped = {k: v for k, v in stats.items() if k.startswith(("storage_skipped.", "skipped.")) and v}
        assert set(skipped) <= {"storage_skipped.cancelled_at_close", "skipped.cancelled_at_close"}
        accounted = written + skipped.get("storage_skipped.cancelled_at_close", 0) + \
            PAGES * skipped.get("skipped.cancelled_at_close", 0)
        assert accounted == PAGES * len(prompts)
    finally:
        host.close()
        dev.close()
        store.close()


class Refusing(Hooked):
    """A store whose writes fail past its own error handling (as when it is closed under the writer)."""

    def _set(self, keys, pages):
        raise StorageError("the store was closed during the call")


@pytest.mark.parametrize("store_class", [Refusing, Hooked])
def test_a_failed_write_is_counted_once_under_store_failed(rt, store_class):
    made = []

    def storage(ns):
        made.append(store_class(ns, shared=SharedPages()))
        if store_class is Hooked:
            made[-1].fail = "set"                   # absorbed by the store: down, counted there too
        return made[-1]

    cache, model, dev, host = build(rt, device_pages=64, host_pages=128, storage=storage)
    try:
        serve(cache, model, prompt(PAGES * P))
        cache.drain()
        skipped = {k: v for k, v in cache.stats().items() if k.startswith("storage_skipped.") and v}
        assert skipped == {"storage_skipped.store_failed": PAGES}
    finally:
        cache.close()
        host.close()
        dev.close()
        made[0].close()
