"""Bad arguments are refused with InvalidArgument before the cache does any work: no event recorded on the caller's
stream, no page, lock or count changed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers.cache import P, build, close_all, prompt, serve

from kvtier.errors import InvalidArgument


@pytest.fixture
def made(rt):
    cache, model, dev, host = build(rt, device_pages=8, host_pages=16)
    yield cache, model, rt
    close_all(cache, dev, host)


@pytest.mark.parametrize("tokens, seconds", [("100", 1), (100, "1"), (True, 1), (100, None), (math.nan, 1),
                                             (100, math.inf), (0, 1), (100, -1), ([100], 1)])
def test_record_prefill_refuses_what_is_not_a_finite_positive_number(made, tokens, seconds):
    cache, _, _ = made
    with pytest.raises(InvalidArgument, match="record_prefill"):
        cache.record_prefill(tokens, seconds)
    assert cache.stats()["prefill_tokens_per_s"] is None


def test_record_prefill_takes_numpy_numbers(made):
    cache, _, _ = made
    cache.record_prefill(np.int64(1000), np.float32(0.5))
    assert cache.stats()["prefill_tokens_per_s"] == pytest.approx(2000)


def test_refused_calls_record_no_event_and_change_nothing(made, monkeypatch):
    cache, model, rt = made
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
