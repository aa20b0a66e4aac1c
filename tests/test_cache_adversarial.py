"""Regressions for defects an adversarial review found through the public API; each failed before its fix."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.cache import TINY, AsyncKVModel, build, close_all, serve

from kvtier.cache import CacheSettings, KVCache, Namespace, RateTable
from kvtier.cli import main
from kvtier.errors import InvalidArgument
from kvtier.runtime import create

P = TINY.page_size


def prompt(n):
    return np.random.default_rng().integers(0, 128256, n)


def test_free_copies_the_callers_page_array():
    cache, model, dev, host = build(create("emulated:split"))
    pages = cache.allocate(4)
    cache.free(pages)
    pages[:] = 7                                       # the caller reuses its array
    again = cache.allocate(4)
    assert sorted(again.tolist()) == [0, 1, 2, 3]
    cache.free(again)
    close_all(cache, dev, host)                        # raised "pages leaked" before the fix


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


def test_an_impossible_allocation_evicts_nothing():
    cache, model, dev, host = build(create("emulated:split"))
    serve(cache, model, prompt(10 * P))
    before = cache.index.device_tokens
    with pytest.raises(Exception, match="cannot allocate 17"):
        cache.allocate(17)
    assert cache.index.device_tokens == before
    close_all(cache, dev, host)


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


def test_close_without_cancel_waits_for_backups_not_yet_started():
    cache, model, dev, host = build(create("emulated:split:2:lazy"), device_pages=32, host_pages=64)
    prompts = [prompt(6 * P) for _ in range(4)]
    for tokens in prompts:
        serve(cache, model, tokens)                     # four write-through backups asked for
    cache.close(cancel=False)
    assert cache.stats()["pages.backup"] == 24
    assert "skipped.cancelled_at_close" not in cache.stats()
    host.close()
    dev.close()


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


def test_a_rate_table_with_bad_fields_is_refused(tmp_path, capsys):
    path = tmp_path / "rates.json"
    path.write_text('{"rows": [{"load": "kernel", "backup": "kernel", "load_gbps": "fast", "backup_gbps": 48}]}')
    with pytest.raises(InvalidArgument, match="bad row"):
        RateTable.load(path)
    assert main(["--runtime", "emulated:split", "demo", "--hicache-rate-table", str(path)]) == 2
    assert "rate table" in capsys.readouterr().err


def test_a_refused_insert_does_not_split_the_tree():
    cache, model, dev, host = build(create("emulated:split"))
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    nodes = cache.index.nodes
    other = np.concatenate([tokens[:2 * P], prompt(2 * P)])
    with pytest.raises(InvalidArgument, match="not allocated"):
        cache.insert(other, np.concatenate([cache.match_prefix(tokens).device_pages[:2], [15, 14]]))
    assert cache.index.nodes == nodes
    close_all(cache, dev, host)


def test_namespace_fields_are_typed():
    for bad in ({"tp_rank": True, "tp_size": 2}, {"tp_size": 2.0}, {"tenant": 5}, {"adapter": object()}):
        with pytest.raises(InvalidArgument):
            Namespace("m", TINY, "bfloat16", **bad)


def test_one_cache_per_pool():
    runtime = create("emulated:split")
    cache, model, dev, host = build(runtime)
    with pytest.raises(InvalidArgument, match="one cache per pool"):
        KVCache(dev, host, model.namespace, CacheSettings(calibrate=False))
    cache.close()
    again = KVCache(dev, host, model.namespace, CacheSettings(calibrate=False))    # free once the first is closed
    close_all(again, dev, host)


def test_a_failed_load_back_is_undone_and_nothing_it_touched_is_served(monkeypatch):
    """A load whose transfer fails (a device fault) is completed as failed: the loaded nodes lose their device pages
    (and any device pages inserted below them), the error is counted, the locks stay balanced, a retry is right."""
    from kvtier.cache import Operation
    from kvtier.errors import RuntimeCallError

    cache, model, dev, host = build(create("emulated:split"))
    tokens = prompt(6 * P)
    serve(cache, model, tokens)
    cache.drain()
    cache.evict(device_pages=16)
    real_wait = Operation.wait

    def failing_wait(op):
        real_wait(op)
        if op.kind == "load":
            raise RuntimeCallError("cudaEventSynchronize", "cudaErrorIllegalAddress")

    monkeypatch.setattr(Operation, "wait", failing_wait)
    match = cache.match_prefix(tokens, lock=True)
    assert cache.load_back(match) is not None
    cache.drain()
    monkeypatch.setattr(Operation, "wait", real_wait)
    assert cache.stats()["errors.load"] == 1
    cache.check()
    again = cache.match_prefix(tokens)
    assert (again.device_tokens, again.host_tokens) == (0, 6 * P)
    cache.unlock(match)
    assert serve(cache, model, tokens)[1] == 6            # the retry loads and checks every byte
    close_all(cache, dev, host)


# -- a second review, on the fixed code ---------------------------------------------------------------------------


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


def test_returned_arrays_do_not_alias_the_cache_s_own():
    cache, model, dev, host = build(create("emulated:split"))
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    dup = cache.allocate(4)
    model.write(tokens, dup)
    inserted = cache.insert(tokens, dup)
    inserted.freed[:] = cache.match_prefix(tokens).device_pages
    cache.check()
    cache.free(cache.allocate(12))
    cache.drain()
    cache.evict(device_pages=16)
    match = cache.match_prefix(tokens, lock=True)
    load = cache.load_back(match)
    load.wait()
    load.device_pages[:] = load.device_pages[::-1].copy()
    assert not model.mismatches(tokens, cache.match_prefix(tokens).device_pages)
    cache.unlock(match)
    cache.check()
    close_all(cache, dev, host)


def test_a_refused_evict_evicts_nothing():
    cache, model, dev, host = build(create("emulated:split"))
    serve(cache, model, prompt(4 * P))
    for bad in (-1, "2", 1.5):
        with pytest.raises(InvalidArgument):
            cache.evict(device_pages=4, host_pages=bad)
    assert cache.index.device_tokens == 4 * P
    close_all(cache, dev, host)


def test_a_second_close_returns_only_once_the_cache_is_closed(monkeypatch):
    import time

    from kvtier.cache import Operation

    cache, model, dev, host = build(create("emulated:split:1:lazy"))
    real_wait = Operation.wait

    def slow_wait(op):
        time.sleep(0.5)
        real_wait(op)

    tokens = prompt(4 * P)
    pages = cache.allocate(4)
    model.write(tokens, pages)
    monkeypatch.setattr(Operation, "wait", slow_wait)
    cache.insert(tokens, pages)
    first = threading.Thread(target=cache.close)
    first.start()
    time.sleep(0.1)
    cache.close()
    assert cache.closed and cache.device.free_pages == cache.device.pages
    first.join()
    registry = cache.metrics.registry
    assert registry.get_sample_value("kvtier_cache_tokens", {"tier": "device"}) == 0
    assert registry.get_sample_value("kvtier_cache_free_pages", {"tier": "device"}) == cache.device.pages
    host.close()
    dev.close()
