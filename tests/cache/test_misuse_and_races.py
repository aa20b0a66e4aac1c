"""The cache misused and raced from several threads: pools closed under waiting calls, bad ``after`` lists, clones of
locked matches, interrupts and faults during a wait with the lock released, hybrid caches under write_back."""

from __future__ import annotations

import copy
import dataclasses
import threading

import numpy as np
import pytest
from helpers.cache import (
    HeldOps,
    P,
    build,
    close_all,
    counting_events,
    joined,
    load_and_check,
    prompt,
    serve,
    spawn,
)
from helpers.hybrid import Hybrid

from kvtier.cache import CacheSettings, KVCache
from kvtier.cache.operation import BACKUP, LOAD
from kvtier.errors import BufferClosed, InvalidArgument, KvtierError, RuntimeCallError
from kvtier.runtime import create


# -- closed pools ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("closed", ["device", "host"])
@pytest.mark.parametrize("call", ["record_prefill", "decide"])
def test_every_public_call_after_a_pool_closed_raises_buffer_closed(rt, closed, call):
    """docs/cache.md: after a pool closed every call except close() and stats() raises BufferClosed naming the pool."""
    cache, model, dev, host = build(rt, device_pages=8, host_pages=16)
    serve(cache, model, prompt(4 * P))
    cache.drain()
    (dev if closed == "device" else host).close()
    calls = {"record_prefill": lambda: cache.record_prefill(1000, 0.5), "decide": lambda: cache.decide(64)}
    try:
        with pytest.raises(BufferClosed, match=f"{closed} pool"):
            calls[call]()
        assert cache.stats()["prefill_tokens_per_s"] is None
    finally:
        cache.close()
        host.close()
        dev.close()


def test_a_cache_closed_while_an_allocation_waits_for_a_write_back_backup(rt, monkeypatch):
    """The allocating thread waits with the lock released; another thread closes the cache meanwhile. The waiter
    gets BufferClosed (never pages), close returns every page, nothing hangs."""
    cache, model, dev, host = build(rt, device_pages=8, host_pages=32, write_policy="write_back")
    held = HeldOps(monkeypatch)
    victim = prompt(8 * P)
    serve(cache, model, victim)
    allocator, got = spawn("allocator", lambda: cache.allocate(4))
    try:
        held.until_waiting("allocator")
        closer, closed = spawn("closer", cache.close)
        held.release()
        joined(closer)
        joined(allocator)
        assert closed == [("ok", None)], closed
        assert got and got[0][0] == "raised" and isinstance(got[0][1], BufferClosed), got
        assert cache.device.free_pages == cache.device.pages and cache.host.free_pages == cache.host.pages
    finally:
        held.release()
        joined(allocator)
        cache.close()
        host.close()
        dev.close()


def test_the_device_pool_closed_while_an_allocation_waits_names_the_pool(rt, monkeypatch):
    cache, model, dev, host = build(rt, device_pages=8, host_pages=32, write_policy="write_back")
    held = HeldOps(monkeypatch)
    serve(cache, model, prompt(8 * P))
    allocator, got = spawn("allocator", lambda: cache.allocate(4))
    try:
        held.until_waiting("allocator")
        closer, _ = spawn("closer", dev.close)
        held.release()
        joined(closer)
        joined(allocator)
        assert got and got[0][0] == "raised" and isinstance(got[0][1], BufferClosed), got
        assert "device pool" in str(got[0][1])
        with pytest.raises(BufferClosed, match="device pool"):
            cache.match_prefix(prompt(4 * P))
    finally:
        held.release()
        joined(allocator)
        cache.close()
        host.close()
        dev.close()
    assert cache.device.free_pages == cache.device.pages and cache.host.free_pages == cache.host.pages


# -- arguments checked before any work -----------------------------------------------------------------------------
def refusal_free(cache, model, rt):
    mine = cache.allocate(2)
    return (lambda after: cache.free(mine, after=after)), lambda: cache.free(mine)


def refusal_insert(cache, model, rt):
    tokens = prompt(2 * P)
    mine = cache.allocate(2)
    model.write(tokens, mine)
    return (lambda after: cache.insert(tokens, mine, after=after)), lambda: cache.insert(tokens, mine)


def refusal_load_back(cache, model, rt):
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    cache.drain()
    cache.evict(device_pages=8)
    match = cache.match_prefix(tokens, lock=True)

    def then():
        cache.unlock(match)
        load_and_check(cache, model, tokens)

    return (lambda after: cache.load_back(match, after=after, force=True)), then


@pytest.mark.parametrize("setup, bad", [(refusal_free, "not a stream"), (refusal_insert, object()),
                                        (refusal_load_back, 5)], ids=["free", "insert", "load_back"])
def test_a_call_with_a_bad_after_records_no_event_and_changes_nothing(rt, monkeypatch, setup, bad):
    """A bad item late in an ``after`` list is refused before any event is recorded for the good ones before it;
    the same call with no bad item then works."""
    cache, model, dev, host = build(rt, device_pages=8, host_pages=16)
    try:
        call, then = setup(cache, model, rt)
        before = (cache.device.free_pages, cache.index.nodes, dict(cache.stats()))
        made = counting_events(monkeypatch, rt)
        with pytest.raises(KvtierError):
            call([rt.current_stream(0), bad])
        assert made == [], "a refused call recorded an event on the caller's stream"
        assert (cache.device.free_pages, cache.index.nodes, dict(cache.stats())) == before
        then()
        cache.check()
    finally:
        close_all(cache, dev, host)


def test_load_back_of_another_caches_dead_match_is_refused_and_counts_nothing(rt):
    """A match of cache A whose node A evicted since, handed to cache B: B must refuse it as another cache's (as it
    does while the node lives), not count a stale_match decision of its own."""
    a = build(rt, device_pages=8, host_pages=16)
    b = build(rt, device_pages=8, host_pages=16)
    try:
        tokens = prompt(4 * P)
        serve(a[0], a[1], tokens)
        a[0].drain()
        match = a[0].match_prefix(tokens)
        alive = match.last_node.alive
        with pytest.raises(InvalidArgument):
            b[0].load_back(match)
        a[0].evict(device_pages=8, host_pages=16)
        assert alive and not match.last_node.alive
        before = dict(b[0].stats())
        with pytest.raises(InvalidArgument, match="not in this cache|another cache"):
            b[0].load_back(match)
        assert dict(b[0].stats()) == before
    finally:
        close_all(*[a[0], a[2], a[3]])
        close_all(*[b[0], b[2], b[3]])


# -- locks belong to matches -------------------------------------------------------------------------------------
@pytest.mark.parametrize("clone", [copy.copy, dataclasses.replace, copy.deepcopy])
def test_a_clone_of_a_locked_match_cannot_give_its_lock_back_twice(rt, clone):
    cache, model, dev, host = build(rt, device_pages=8, host_pages=16)
    try:
        tokens = prompt(4 * P)
        serve(cache, model, tokens)
        cache.drain()
        mine = cache.match_prefix(tokens, lock=True)
        other = cache.match_prefix(tokens, lock=True)      # another request on the same prefix
        twin = clone(mine)
        cache.unlock(mine)
        with pytest.raises(InvalidArgument):
            cache.unlock(twin)
        assert cache.evict(device_pages=8) == (0, 0), "the other request's lock was given back"
        cache.unlock(other)
        assert cache.evict(device_pages=8)[0] == 4
        cache.check()
    finally:
        close_all(cache, dev, host)


def test_a_locked_match_split_by_a_divergent_prompt_unlocks_cleanly(rt):
    cache, model, dev, host = build(rt, device_pages=16, host_pages=32)
    try:
        tokens = prompt(8 * P)
        serve(cache, model, tokens)
        cache.drain()
        held = cache.match_prefix(tokens, lock=True)
        fork = np.concatenate([tokens[:3 * P], prompt(3 * P)])
        serve(cache, model, fork)                        # splits the locked node after 3 pages
        cache.drain()
        cache.unlock(held)
        cache.check()
        assert cache.evict(device_pages=16)[0] == 11     # nothing stays pinned
        load_and_check(cache, model, tokens)
        load_and_check(cache, model, fork)
        cache.check()
    finally:
        close_all(cache, dev, host)


def test_a_deeper_match_dropped_with_a_failed_load_unlocks_once_and_pins_nothing(rt, monkeypatch):
    """Request A loads a host-only prefix T back; before the load fails, request B inserts T+U under the loading
    pages and locks it. The failure drops T's device pages and U with them (U had no host copy). B's unlock just
    ends it, A's unlock gives A's lock back, a second unlock of either is refused, and nothing stays pinned."""
    cache, model, dev, host = build(rt, device_pages=16, host_pages=32, write_policy="write_back")

    def fail(op, thread):
        if op.kind == LOAD:
            raise RuntimeCallError("cudaEventSynchronize", "cudaErrorIllegalAddress")

    try:
        t = prompt(4 * P)
        serve(cache, model, t)
        cache.evict(device_pages=16)                 # write_back: backed up first, host only now
        cache.drain()
        assert cache.match_prefix(t).host_tokens == 4 * P
        held = HeldOps(monkeypatch, kind=LOAD, then=fail)
        a = cache.match_prefix(t, lock=True)
        load = cache.load_back(a, force=True)
        assert load is not None
        held.until_waiting("kvtier-cache-loads")
        tu = np.concatenate([t, prompt(4 * P)])
        new = cache.allocate(4)
        model.write(tu, new, first_page=4)
        cache.insert(tu, np.concatenate([load.prefix_pages, new]))
        b = cache.match_prefix(tu, lock=True)
        assert b.cached_tokens == 8 * P
        held.release()
        cache.drain()
        monkeypatch.undo()
        assert cache.stats()["errors.load"] == 1
        cache.check()
        cache.unlock(b)
        with pytest.raises(InvalidArgument):
            cache.unlock(b)
        cache.unlock(a)
        with pytest.raises(InvalidArgument):
            cache.unlock(a)
        cache.check()
        assert cache.evict(device_pages=16, host_pages=32) == (0, 4)
        assert cache.index.nodes == 0
        assert serve(cache, model, tu)[1] == 0
    finally:
        close_all(cache, dev, host)


# -- no wait under the lock ----------------------------------------------------------------------------------------
def test_two_allocations_waiting_for_write_back_backups_get_distinct_pages(rt, monkeypatch):
    cache, model, dev, host = build(rt, device_pages=8, host_pages=32, write_policy="write_back")
    held = HeldOps(monkeypatch)
    first, second = prompt(4 * P), prompt(4 * P)
    serve(cache, model, first)
    serve(cache, model, second)
    one, got1 = spawn("allocator-1", lambda: cache.allocate(4))
    two, got2 = spawn("allocator-2", lambda: cache.allocate(4))
    try:
        held.until_waiting("allocator-1")
        held.until_waiting("allocator-2")
        held.release()
        joined(one)
        joined(two)
        assert got1[0][0] == "ok" and got2[0][0] == "ok", (got1, got2)
        pages = np.concatenate([got1[0][1], got2[0][1]])
        assert len(np.unique(pages)) == 8
        cache.check()
        cache.free(pages)
        for tokens in (first, second):
            match = load_and_check(cache, model, tokens)
            assert match.cached_tokens == 4 * P
        cache.check()
    finally:
        held.release()
        close_all(cache, dev, host)


def test_an_interrupt_during_the_wait_leaves_the_cache_whole(rt, monkeypatch):
    """A KeyboardInterrupt while the allocating thread waits for a write_back backup: it propagates, the backup still
    completes, nothing is leaked or held, and the victim's bytes are served right afterwards."""
    cache, model, dev, host = build(rt, device_pages=8, host_pages=32, write_policy="write_back")

    def interrupt(op, thread):
        if thread == "allocator" and op.kind == BACKUP:
            raise KeyboardInterrupt

    held = HeldOps(monkeypatch, then=interrupt)
    victim = prompt(8 * P)
    serve(cache, model, victim)
    allocator, got = spawn("allocator", lambda: cache.allocate(4))
    try:
        held.until_waiting("allocator")
        held.release()
        joined(allocator)
        assert got and got[0][0] == "raised" and isinstance(got[0][1], KeyboardInterrupt), got
        cache.drain()
        monkeypatch.undo()
        cache.check()
        assert cache.device.free_pages + cache.index.device_tokens // P == cache.device.pages
        pages = cache.allocate(4)
        cache.free(pages)
        match = load_and_check(cache, model, victim)
        assert match.cached_tokens == 8 * P
        cache.check()
    finally:
        held.release()
        close_all(cache, dev, host)


def test_a_failed_write_back_backup_lets_the_allocation_go_on_and_serves_nothing_wrong(rt, monkeypatch):
    cache, model, dev, host = build(rt, device_pages=8, host_pages=32, write_policy="write_back")

    def fault(op, thread):
        if op.kind == BACKUP:
            raise RuntimeCallError("cudaEventSynchronize", "cudaErrorIllegalAddress")

    held = HeldOps(monkeypatch, then=fault)
    victim = prompt(8 * P)
    serve(cache, model, victim)
    allocator, got = spawn("allocator", lambda: cache.allocate(4))
    try:
        held.until_waiting("allocator")
        lookup, looked = spawn("looker", lambda: cache.match_prefix(victim).cached_tokens)
        joined(lookup)
        assert looked == [("ok", 8 * P)]
        held.release()
        joined(allocator)
        assert got and got[0][0] == "ok" and len(got[0][1]) == 4, got
        cache.drain()
        monkeypatch.undo()
        assert cache.stats()["errors.backup"] == 1
        cache.check()
        cache.free(got[0][1])
        match = cache.match_prefix(victim, lock=True)
        try:
            assert not model.mismatches(victim, match.device_pages)
            assert match.host_tokens == 0, "a host copy from a failed backup is served"
        finally:
            cache.unlock(match)
        cache.check()
    finally:
        held.release()
        close_all(cache, dev, host)


def test_close_from_two_threads_while_a_load_back_waits_for_device_room(rt, monkeypatch):
    """load_back needs device pages that only a write_back backup frees; two threads close the cache meanwhile."""
    cache, model, dev, host = build(rt, device_pages=8, host_pages=32, write_policy="write_back")
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    cache.evict(device_pages=8)                 # write_back: backed up, then evicted: host only
    cache.drain()
    serve(cache, model, prompt(8 * P))          # the device is full of unsaved pages again
    held = HeldOps(monkeypatch)
    match = cache.match_prefix(tokens, lock=True)
    assert match.host_tokens == 4 * P
    loader, loaded = spawn("loader", lambda: cache.load_back(match, force=True))
    try:
        held.until_waiting("loader")
        c1, r1 = spawn("closer-1", cache.close)
        c2, r2 = spawn("closer-2", cache.close)
        held.release()
        for thread in (c1, c2, loader):
            joined(thread)
        assert r1 == [("ok", None)] and r2 == [("ok", None)], (r1, r2)
        assert loaded and loaded[0][0] == "raised" and isinstance(loaded[0][1], BufferClosed), loaded
        assert cache.device.free_pages == cache.device.pages and cache.host.free_pages == cache.host.pages
    finally:
        held.release()
        joined(loader)
        close_all(cache, dev, host)


# -- hybrid caches --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("closed", ["sdev", "shost"])
def test_every_state_call_after_a_state_pool_closed_raises_buffer_closed(rt, closed):
    made = Hybrid(rt)
    cache = made.cache
    try:
        tokens = prompt(4 * P)
        made.serve(tokens)
        made.serve(tokens)
        cache.drain()
        match = cache.match_prefix(tokens, lock=True)
        slot = cache.allocate_state()
        getattr(made, closed).close()
        name = "device state pool" if closed == "sdev" else "host state pool"
        calls = {
            "allocate_state": cache.allocate_state,
            "free_state": lambda: cache.free_state(slot),
            "fork_state": lambda: cache.fork_state(match),
            "evict_states": lambda: cache.evict_states(device=1, host=1),
            "insert": lambda: cache.insert(prompt(2 * P), cache.allocate(2), state=slot),
            "load_back": lambda: cache.load_back(match),
            "match_prefix": lambda: cache.match_prefix(tokens),
            "unlock": lambda: cache.unlock(match),
        }
        for what, call in calls.items():
            with pytest.raises(BufferClosed, match=name):
                call()
                pytest.fail(f"{what} ran on a closed {name}")
    finally:
        made.close()


def test_a_hybrid_allocate_state_waiting_for_a_write_back_state_backup_serves_right_states(rt, monkeypatch):
    """write_back: the only device state slots hold unsaved snapshots; allocate_state waits (lock released) for
    their backup while another thread matches; afterwards the evicted snapshot comes back byte for byte."""
    made = Hybrid(rt, device_pages=32, host_pages=64, device_states=2, host_states=8, write_policy="write_back")
    cache = made.cache
    held = HeldOps(monkeypatch)
    try:
        a, b = prompt(4 * P), prompt(4 * P)
        made.serve(a)
        made.serve(b)                               # both device slots hold unsaved snapshots
        allocator, got = spawn("allocator", cache.allocate_state)
        held.until_waiting("allocator")
        looker, looked = spawn("looker", lambda: cache.match_prefix(b).cached_tokens)
        joined(looker)
        assert looked == [("ok", 4 * P)]
        held.release()
        joined(allocator)
        assert got and got[0][0] == "ok", got
        cache.free_state(got[0][1])
        cache.drain()
        cache.check()
        for tokens in (a, b):
            _, served = made.serve(tokens)
            assert served == 4 * P
        cache.check()
    finally:
        held.release()
        made.close()


def test_hybrid_threads_allocating_under_write_back_keep_the_index_whole(rt):
    """Several threads serve prompts sharing a system prefix on a tiny write_back hybrid cache (eviction, backups and
    state waits on every request); every byte and state served is checked, the index stays whole."""
    made = Hybrid(rt, device_pages=24, host_pages=64, device_states=3, host_states=16, write_policy="write_back")
    cache = made.cache
    system = prompt(2 * P)
    errors: list = []
    lock = threading.Lock()

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(6):
            tokens = np.concatenate([system, rng.integers(0, 128256, int(rng.integers(1, 4)) * P)])
            try:
                made.serve(tokens)
            except KvtierError as exc:
                if "OutOfPages" not in type(exc).__name__:
                    with lock:
                        errors.append(exc)
            except AssertionError as exc:
                with lock:
                    errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,), daemon=True) for seed in range(3)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            joined(thread)
        assert not errors, errors
        cache.drain()
        cache.check()
    finally:
        made.close()


def test_evict_under_write_back_returns_what_it_freed_across_its_wait(rt):
    """evict() returns the pages freed per tier. Under write_back the first attempt evicts a saved leaf, starts the
    backup of an unsaved one and waits; the retry evicts again. What the first attempt freed must be in the count
    (and the retry must not evict the full amount a second time)."""
    cache, model, dev, host = build(rt, device_pages=8, host_pages=32, write_policy="write_back")
    try:
        saved, unsaved = prompt(2 * P), prompt(4 * P)
        serve(cache, model, saved)
        cache.backup(cache.match_prefix(saved))
        cache.drain()
        serve(cache, model, unsaved)                 # more recent: the saved leaf is evicted first
        free = cache.device.free_pages
        assert free == 2
        freed = cache.evict(device_pages=4)
        assert freed[0] == cache.device.free_pages - free, (freed, free, cache.device.free_pages)
        cache.drain()
        cache.check()
        for tokens in (saved, unsaved):
            load_and_check(cache, model, tokens)
    finally:
        close_all(cache, dev, host)


@pytest.mark.parametrize("tokens, seconds", [(10**400, 1.0), (100, 10**400), (1e308, 1e-308), (5e-324, 1e300)],
                         ids=["huge-int-tokens", "huge-int-seconds", "rate-overflows", "rate-underflows"])
def test_record_prefill_refuses_numbers_whose_rate_is_not_a_finite_positive_number(rt, tokens, seconds):
    """record_prefill takes finite positive numbers only: an int too large for a float is InvalidArgument (not an
    OverflowError), and a pair whose rate is infinite or zero teaches the cache nothing."""
    cache, model, dev, host = build(rt, device_pages=8, host_pages=16)
    try:
        with pytest.raises(InvalidArgument, match="record_prefill"):
            cache.record_prefill(tokens, seconds)
        assert cache.stats()["prefill_tokens_per_s"] is None
    finally:
        close_all(cache, dev, host)


def test_a_match_of_another_cache_is_refused():
    runtime = create("emulated:split")
    a, model_a, dev_a, host_a = build(runtime)
    b, model_b, dev_b, host_b = build(runtime)
    tokens = prompt(8 * P)
    serve(a, model_a, tokens)
    a.drain()
    a.evict(device_pages=16)
    match = a.match_prefix(tokens, lock=True)
    for call in (lambda: b.load_back(match), lambda: b.lock(match), lambda: b.unlock(match),
                 lambda: b.backup(match), lambda: b.page_keys(match)):
        with pytest.raises(InvalidArgument, match="not in this cache"):
            call()
    a.unlock(match)
    a.check()
    b.check()
    close_all(a, dev_a, host_a)
    close_all(b, dev_b, host_b)


def test_one_cache_per_pool():
    runtime = create("emulated:split")
    cache, model, dev, host = build(runtime)
    with pytest.raises(InvalidArgument, match="one cache per pool"):
        KVCache(dev, host, model.namespace, CacheSettings(calibrate=False))
    cache.close()
    again = KVCache(dev, host, model.namespace, CacheSettings(calibrate=False))    # free once the first is closed
    close_all(again, dev, host)
