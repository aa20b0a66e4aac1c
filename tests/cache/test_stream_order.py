"""The cache orders its copies after the caller's writes on whichever stream they ran: a backup asked for later (a
write_back eviction, a selective hit, from another thread) waits for the stream the KV was written on, and pages the
cache frees or hands out again while a write to them is still queued are not copied into or reused before it lands.
(found adversarially)"""

from __future__ import annotations

import threading

import pytest
from helpers.cache import AsyncKVModel, P, build, close_all, prompt

from kvtier.runtime import create


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
@pytest.mark.parametrize("where", ["legacy", "thread"])
def test_a_later_backup_waits_for_the_stream_the_kv_was_written_on(policy, where):
    """KV written asynchronously on stream S and inserted there; the backup happens later, triggered from another
    stream or thread (a write_back eviction, a selective hit). It must still wait for S (it did not)."""
    runtime = create("emulated:split:1:lazy")
    cache, _, dev, host = build(runtime, device_pages=8, write_policy=policy, write_through_threshold=1)
    model = AsyncKVModel(dev, cache.namespace)
    s = runtime.create_stream(0)
    tokens = prompt(4 * P)
    with runtime.use_stream(s):
        pages = cache.allocate(4)
        model.write(tokens, pages)
        cache.insert(tokens, pages)

    def trigger():
        if policy == "write_through_selective":
            cache.match_prefix(tokens)                 # the hit that asks for the backup
            cache.drain()
        cache.free(cache.allocate(8))                  # evicts the prompt's device pages

    if where == "thread":
        worker = threading.Thread(target=trigger)
        worker.start()
        worker.join()
    else:
        trigger()
    cache.drain()
    match = cache.match_prefix(tokens, lock=True)
    assert match.host_tokens == 4 * P
    load = cache.load_back(match, force=True)
    load.wait()
    assert not model.mismatches(tokens, load.prefix_pages)
    cache.unlock(match)
    model.close()
    s.close()
    close_all(cache, dev, host)


def test_pages_freed_as_duplicates_are_not_overwritten_by_their_late_write():
    """Request 2 prefilled a prompt the tree already had, on a stream that has not run yet; its pages are freed as
    duplicates at insert. A load-back that gets them must land after that late write, not before it."""
    runtime = create("emulated:split:1:lazy")
    cache, _, dev, host = build(runtime)
    model = AsyncKVModel(dev, cache.namespace)
    s1, s2 = runtime.create_stream(0), runtime.create_stream(0)
    q, r = prompt(4 * P), prompt(4 * P)
    for tokens in (q, r):
        pages = cache.allocate(4)
        model.write(tokens, pages)
        runtime.synchronize(0)
        cache.insert(tokens, pages)
        cache.drain()
        if tokens is q:
            cache.evict(device_pages=4)
    with runtime.use_stream(s1):
        late = cache.allocate(4)
        model.write(r, late)
        assert cache.insert(r, late).freed.size == 4
    with runtime.use_stream(s2):
        match = cache.match_prefix(q, lock=True)
        load = cache.load_back(match, force=True)
        load.wait()
    runtime.synchronize(0)
    assert not model.mismatches(q, cache.match_prefix(q).device_pages)
    cache.unlock(match)
    model.close()
    close_all(cache, dev, host)


def test_a_dropped_node_s_pages_wait_for_its_write_before_reuse():
    runtime = create("emulated:split:1:lazy")
    cache, _, dev, host = build(runtime, device_pages=4, write_policy="write_through_selective",
                                write_through_threshold=99)
    model = AsyncKVModel(dev, cache.namespace)
    s1 = runtime.create_stream(0)
    r, q = prompt(4 * P), prompt(4 * P)
    with runtime.use_stream(s1):
        pages = cache.allocate(4)
        model.write(r, pages)
        cache.insert(r, pages)                         # never backed up; its write still queued on s1
    again = cache.allocate(4)                          # drops r, hands its pages out on the legacy stream
    model.write(q, again)
    cache.insert(q, again)
    runtime.synchronize(0)
    assert not model.mismatches(q, cache.match_prefix(q).device_pages)
    model.close()
    close_all(cache, dev, host)
