"""Bad arguments are refused with InvalidArgument before the cache does any work: no event recorded on the caller's
stream, no page, lock or count changed. Settings and namespace fields are checked when they are small_cache."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers.cache import TINY, P, build, close_all, prompt, serve

from kvtier.cache import CacheSettings, Namespace
from kvtier.errors import InvalidArgument
from kvtier.runtime import create


@pytest.mark.parametrize("tokens, seconds", [("100", 1), (100, "1"), (True, 1), (100, None), (math.nan, 1),
                                             (100, math.inf), (0, 1), (100, -1), ([100], 1)])
def test_record_prefill_refuses_what_is_not_a_finite_positive_number(small_cache, tokens, seconds):
    cache, _, _ = small_cache
    with pytest.raises(InvalidArgument, match="record_prefill"):
        cache.record_prefill(tokens, seconds)
    assert cache.stats()["prefill_tokens_per_s"] is None


def test_record_prefill_takes_numpy_numbers(small_cache):
    cache, _, _ = small_cache
    cache.record_prefill(np.int64(1000), np.float32(0.5))
    assert cache.stats()["prefill_tokens_per_s"] == pytest.approx(2000)


def test_refused_calls_record_no_event_and_change_nothing(small_cache, monkeypatch):
    cache, model, rt = small_cache
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    cache.drain()
    mine = cache.allocate(2)
    before = (cache.device.free_pages, cache.host.free_pages, cache.index.nodes, dict(cache.stats()))
    made_events = []
    create_event = rt.create_event
    monkeypatch.setattr(rt, "create_event", lambda *a, **k: made_events.append(a) or create_event(*a, **k))
    cases = [
        (lambda: cache.load_back("not a match"), "takes a Match"),
        (lambda: cache.free([mine[0], mine[0]]), "twice"),
        (lambda: cache.free([99]), "out of range"),
        (lambda: cache.insert(prompt(4 * P), mine), "only 2"),
        (lambda: cache.insert(prompt(2 * P), [mine[0], 7 if 7 not in mine else 6]), "not allocated"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            call()
    assert made_events == []
    after = (cache.device.free_pages, cache.host.free_pages, cache.index.nodes, dict(cache.stats()))
    assert after == before
    cache.free(mine)
    cache.check()


@pytest.mark.parametrize("after", ["garbage", 123, object()])
def test_a_bad_after_is_refused_at_the_call(after):
    cache, model, dev, host = build(create("emulated:split"))
    tokens = prompt(4 * P)
    pages = cache.allocate(4)
    model.write(tokens, pages)
    with pytest.raises((InvalidArgument, TypeError)):
        cache.insert(tokens, pages, after=after)
    assert cache.index.device_tokens == 0
    cache.insert(tokens, pages)
    match = cache.match_prefix(tokens, lock=True)
    with pytest.raises((InvalidArgument, TypeError)):
        cache.backup(match, after=after)
    cache.unlock(match)
    close_all(cache, dev, host)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0])
def test_record_prefill_refuses_non_finite_or_non_positive_reports(bad):
    cache, _, dev, host = build(create("emulated:split"))
    cache.record_prefill(1000, 0.1)
    with pytest.raises(InvalidArgument):
        cache.record_prefill(1000, bad)
    assert cache.stats()["prefill_tokens_per_s"] == pytest.approx(10000)
    close_all(cache, dev, host)


@pytest.mark.parametrize("field", [{"hicache_size": float("nan")}, {"hicache_size": float("inf")},
                                   {"hicache_ratio": float("inf")}, {"prefill_tokens_per_s": float("nan")}])
def test_settings_refuse_non_finite_numbers(field):
    with pytest.raises(InvalidArgument):
        CacheSettings(**field)


def test_namespace_fields_are_typed():
    for bad in ({"tp_rank": True, "tp_size": 2}, {"tp_size": 2.0}, {"tenant": 5}, {"adapter": object()}):
        with pytest.raises(InvalidArgument):
            Namespace("m", TINY, "bfloat16", **bad)


def test_a_refused_evict_evicts_nothing():
    cache, model, dev, host = build(create("emulated:split"))
    serve(cache, model, prompt(4 * P))
    for bad in (-1, "2", 1.5):
        with pytest.raises(InvalidArgument):
            cache.evict(device_pages=4, host_pages=bad)
    assert cache.index.device_tokens == 4 * P
    close_all(cache, dev, host)


def test_the_freed_pages_an_insert_returns_are_the_callers_own_array(rt):
    """An insert's ``freed`` and a miss's ``device_pages`` are arrays of the caller's own, even when empty: one
    shared empty array, retyped by a caller, changed every cache's root pages and refused the next insert.
    (Found adversarially.)"""
    cache, model, dev, host = build(rt, device_pages=16)
    tokens = prompt(4 * P)
    mine = cache.allocate(4)
    model.write(tokens, mine)
    freed = cache.insert(tokens, mine).freed
    assert freed.size == 0
    freed.dtype = np.float64                          # the caller's array: theirs to change
    try:
        assert cache.match_prefix(prompt(4 * P)).device_pages.dtype == np.int64
        serve(cache, model, prompt(4 * P))
    finally:
        freed.dtype = np.int64
    cache.close()
    host.close()
    dev.close()
