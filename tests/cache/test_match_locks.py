"""Locks belong to matches: only a match can lock and unlock, exactly once, so one request's unlock can never give
back another request's lock (its pages would be evicted and handed to a new caller while it still reads them)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from helpers.cache import P, build, close_all, prompt, serve

from kvtier.cache import OutOfPages
from kvtier.errors import InvalidArgument
from kvtier.runtime import create


def test_unlocking_a_node_after_the_match_cannot_release_another_requests_lock(small_cache):
    cache, model, _ = small_cache
    tokens = prompt(8 * P)
    serve(cache, model, tokens)                     # the whole device pool, no host copy yet
    mine = cache.match_prefix(tokens, lock=True)
    theirs = cache.match_prefix(tokens, lock=True)  # another request on the same prefix
    cache.unlock(mine)
    with pytest.raises(InvalidArgument, match="takes the Match"):
        cache.unlock(mine.last_node)
    with pytest.raises(InvalidArgument, match="not locked"):
        cache.unlock(mine)
    with pytest.raises(OutOfPages):                 # theirs still pins every page
        cache.allocate(1)
    assert cache.match_prefix(tokens).device_tokens == 8 * P
    assert not model.mismatches(tokens, theirs.device_pages)
    cache.unlock(theirs)
    assert len(cache.allocate(8)) == 8
    cache.check()


def test_a_copy_of_a_locked_match_cannot_unlock_it_a_second_time(small_cache):
    cache, model, _ = small_cache
    tokens = prompt(8 * P)
    serve(cache, model, tokens)
    mine = cache.match_prefix(tokens, lock=True)
    twin = copy.copy(mine)
    theirs = cache.match_prefix(tokens, lock=True)
    cache.unlock(mine)
    with pytest.raises(InvalidArgument, match="given back already"):
        cache.unlock(twin)
    with pytest.raises(OutOfPages):
        cache.allocate(1)
    cache.unlock(theirs)
    cache.check()


def test_lock_takes_only_a_match_and_locks_it_once(small_cache):
    cache, model, _ = small_cache
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    match = cache.match_prefix(tokens)
    with pytest.raises(InvalidArgument, match="takes a Match"):
        cache.lock(match.last_node)
    cache.lock(match)
    with pytest.raises(InvalidArgument, match="already locked"):
        cache.lock(match)
    cache.unlock(match)
    cache.lock(match)                               # a match unlocked may be locked again, and unlocked again
    cache.unlock(match)
    assert all(n.lock == 0 for n in match.last_node.path() if n.parent is not None)
    cache.check()


def test_a_match_built_by_hand_is_refused(small_cache):
    cache, model, _ = small_cache
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    real = cache.match_prefix(tokens, lock=True)
    forged = copy.replace(real, locked=True, lock_token=object()) if hasattr(copy, "replace") else \
        type(real)(**{**real.__dict__, "lock_token": object()})
    with pytest.raises(InvalidArgument, match="given back already"):
        cache.unlock(forged)
    cache.unlock(real)
    assert np.all([n.lock == 0 for n in real.last_node.path() if n.parent is not None])


def test_an_extra_unlock_of_a_match_is_refused_while_another_request_holds_the_path():
    cache, model, dev, host = build(create("emulated:split"))
    shared = prompt(2 * P)
    longer = np.concatenate([shared, prompt(2 * P)])
    serve(cache, model, longer)
    a = cache.match_prefix(shared, lock=True)
    b = cache.match_prefix(longer, lock=True)
    cache.unlock(a)
    with pytest.raises(InvalidArgument, match="not locked"):
        cache.unlock(a)
    cache.check()
    cache.unlock(b)
    cache.check()
    close_all(cache, dev, host)
