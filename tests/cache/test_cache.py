"""The cache on every runtime: write policies, eviction order, load-back bytes and layers, decisions, bad input,
metrics, threads, a failed load-back undone, page arrays never shared with the caller, and close with work in flight
or queued (a second close waits for the first)."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
from helpers.cache import TINY, P, build, close_all, prompt, serve

from kvtier.cache import CacheSettings, KVCache, Namespace, OutOfPages, PageAllocator
from kvtier.errors import BufferClosed, InvalidArgument
from kvtier.runtime import create


def test_a_second_request_hits_the_device_and_gets_its_own_bytes(made):
    cache, model = made
    tokens = prompt(10 * P + 3)
    match, served = serve(cache, model, tokens)
    assert (match.device_tokens, match.host_tokens, served) == (0, 0, 0)
    match, served = serve(cache, model, tokens)
    assert match.device_tokens == 10 * P and served == 10
    cache.check()


@pytest.mark.parametrize("made", [{"write_policy": "write_through"}], indirect=True)
def test_write_through_backs_up_at_insert_and_loads_back_the_same_bytes(made):
    cache, model = made
    tokens = prompt(8 * P)
    serve(cache, model, tokens)
    cache.drain()
    assert cache.index.host_tokens == 8 * P
    cache.evict(device_pages=8)
    match = cache.match_prefix(tokens)
    assert (match.device_tokens, match.host_tokens) == (0, 8 * P)
    match, served = serve(cache, model, tokens)           # checks the loaded bytes
    assert served == 8 and cache.stats()["decisions.load"] == 1
    cache.check()


@pytest.mark.parametrize("made", [{"write_policy": "write_through_selective", "write_through_threshold": 3}],
                         indirect=True)
def test_write_through_selective_waits_for_hits(made):
    cache, model = made
    tokens = prompt(6 * P)
    serve(cache, model, tokens)                            # inserted: no hit yet
    for _ in range(2):
        cache.match_prefix(tokens)                         # hits 1, 2
        cache.drain()
        assert cache.index.host_tokens == 0
    cache.match_prefix(tokens)                             # hit 3: backed up
    cache.drain()
    assert cache.index.host_tokens == 6 * P
    cache.check()


@pytest.mark.parametrize("made", [{"write_policy": "write_back", "device_pages": 8}], indirect=True)
def test_write_back_backs_up_only_on_eviction(made):
    cache, model = made
    first, second = prompt(6 * P), prompt(6 * P)
    serve(cache, model, first)
    cache.drain()
    assert cache.index.host_tokens == 0
    serve(cache, model, second)                            # needs 6 of 8 pages: evicts `first` with a backup
    assert cache.index.host_tokens >= 6 * P
    match, served = serve(cache, model, first)             # loads `first` back, checking bytes
    assert match.host_tokens == 6 * P and served == 6
    cache.check()


@pytest.mark.parametrize("made", [{"device_pages": 12}], indirect=True)
def test_device_eviction_takes_the_least_recently_used_leaf(made):
    cache, model = made
    a, b, c = prompt(4 * P), prompt(4 * P), prompt(4 * P)
    for tokens in (a, b, c):
        serve(cache, model, tokens)
    cache.drain()
    cache.match_prefix(a)                                  # a is now more recent than b
    cache.evict(device_pages=4)
    assert cache.match_prefix(b).device_tokens == 0
    assert cache.match_prefix(a).device_tokens == 4 * P
    assert cache.match_prefix(c).device_tokens == 4 * P
    cache.check()


@pytest.mark.parametrize("made", [{"device_pages": 8, "host_pages": 8}], indirect=True)
def test_host_eviction_skips_locked_nodes(made):
    cache, model = made
    a, b = prompt(4 * P), prompt(4 * P)
    serve(cache, model, a)
    serve(cache, model, b)
    cache.drain()
    cache.evict(device_pages=8)
    held = cache.match_prefix(a)
    cache.lock(held)
    cache.evict(host_pages=8)
    assert cache.match_prefix(a).host_tokens == 4 * P      # locked: kept
    assert cache.match_prefix(b).cached_tokens == 0        # not locked: gone from every tier
    cache.unlock(held)
    cache.check()


def test_shared_prefix_splits_and_both_branches_are_right(made):
    cache, model = made
    system = prompt(3 * P)
    a, b = np.concatenate([system, prompt(2 * P)]), np.concatenate([system, prompt(2 * P)])
    serve(cache, model, a)
    match, served = serve(cache, model, b)
    assert match.device_tokens == 3 * P and served == 3
    cache.drain()
    cache.evict(device_pages=16)
    for tokens in (a, b):
        match, served = serve(cache, model, tokens)
        assert served == 5
    cache.check()


def test_load_back_has_one_event_per_layer_and_a_stream_can_wait(made, runtime):
    cache, model = made
    tokens = prompt(5 * P)
    serve(cache, model, tokens)
    cache.drain()
    cache.evict(device_pages=16)
    match = cache.match_prefix(tokens)
    load = cache.load_back(match)
    assert load is not None and sorted(load.transfer.layer_events) == list(range(TINY.layers))
    stream = runtime.create_stream(0)
    for layer in range(TINY.layers):
        load.stream_wait(stream, layer=layer)
    stream.synchronize()
    load.wait_layer(TINY.layers - 1)
    cache.drain()
    assert load.finished and not model.mismatches(tokens, load.prefix_pages)
    stream.close()
    cache.check()


@pytest.mark.parametrize("made", [{"prefill_tokens_per_s": 1e15, "load_back_min_tokens": 2 * P}], indirect=True)
def test_load_backs_slower_than_recompute_or_too_short_are_declined(made):
    cache, model = made
    cache.load_gbps = 1.0
    long, short = prompt(6 * P), prompt(P)
    serve(cache, model, long)
    serve(cache, model, short)
    cache.drain()
    cache.evict(device_pages=16)
    assert cache.load_back(cache.match_prefix(long)) is None
    assert cache.load_back(cache.match_prefix(short)) is None
    stats = cache.stats()
    assert stats["decisions.slower_than_recompute"] == 1 and stats["decisions.too_short"] == 1
    assert cache.load_back(cache.match_prefix(long), force=True) is not None
    cache.drain()
    cache.check()


def test_recompute_rate_is_learned_from_reported_prefills(made):
    cache, _ = made
    cache.load_gbps = 1.0
    assert cache.decide(1000) == "load"                    # nothing known: take it
    cache.record_prefill(1000, 1e-9)                       # an absurdly fast prefill
    assert cache.decide(1000) == "slower_than_recompute"


@pytest.mark.parametrize("made", [{"device_pages": 4}], indirect=True)
def test_allocation_failure_reports_and_changes_nothing(made):
    cache, model = made
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    held = cache.match_prefix(tokens)
    cache.lock(held)
    before = (cache.device.free_pages, cache.index.device_tokens)
    with pytest.raises(OutOfPages, match="locked"):
        cache.allocate(1)
    assert (cache.device.free_pages, cache.index.device_tokens) == before
    cache.unlock(held)
    assert len(cache.allocate(4)) == 4
    cache.check()


def test_bad_inserts_are_refused_and_change_nothing(made):
    cache, model = made
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    own = cache.match_prefix(tokens).device_pages
    mine = cache.allocate(3)
    other = prompt(4 * P)
    cases = [
        (other, mine, "only 3"),                                     # too few pages
        (other, np.array([mine[0], mine[0], mine[1], mine[2]]), "twice"),
        (other, np.concatenate([mine, [own[0]]]), "cache's own"),    # a tree page at a new position
        (other, np.concatenate([mine, [15 if 15 not in own and 15 not in mine else 14]]), "not allocated"),
        (other, np.concatenate([mine, [99]]), "out of range"),
        (np.stack([other, other]), mine, "one sequence"),
    ]
    for bad_tokens, bad_pages, message in cases:
        state = (cache.device.free_pages, cache.index.device_tokens, cache.index.nodes)
        with pytest.raises(InvalidArgument, match=message):
            cache.insert(bad_tokens, bad_pages)
        assert (cache.device.free_pages, cache.index.device_tokens, cache.index.nodes) == state
        cache.check()
    cache.free(mine)
    with pytest.raises(InvalidArgument, match="not allocated"):
        cache.free(mine)
    with pytest.raises(InvalidArgument, match="cache's own"):
        cache.free(own[:1])
    with pytest.raises(InvalidArgument, match="not locked"):
        cache.unlock(cache.match_prefix(tokens))
    with pytest.raises(InvalidArgument, match="takes the Match"):
        cache.unlock(cache.match_prefix(tokens).last_node)
    cache.check()


def test_inserting_the_same_prompt_twice_frees_the_duplicates(made):
    cache, model = made
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    free = cache.device.free_pages
    again = cache.allocate(4)
    model.write(tokens, again)
    result = cache.insert(tokens, again)
    assert result.existing_tokens == 4 * P and result.new_tokens == 0
    assert sorted(result.freed) == sorted(again) and cache.device.free_pages == free
    cache.check()


def test_metrics_reach_prometheus_and_the_snapshot(made):
    cache, model = made
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    serve(cache, model, tokens)
    cache.drain()
    registry = cache.metrics.registry
    assert registry.get_sample_value("kvtier_cache_hit_tokens_total", {"tier": "device"}) == 4 * P
    assert registry.get_sample_value("kvtier_cache_transfer_bytes_total", {"direction": "backup"}) == \
        4 * TINY.bytes_per_page
    snap = cache.stats()
    assert snap["hit_rate.device"] == 0.5 and snap["gbps.backup"] > 0
    assert registry.get_sample_value("kvtier_cache_queue_depth", {"queue": "backups_in_flight"}) == 0


def test_page_keys_of_a_match_are_the_prompt_keys(made):
    from kvtier.cache import page_keys

    cache, model = made
    system = prompt(2 * P)
    tokens = np.concatenate([system, prompt(3 * P)])
    serve(cache, model, tokens)
    serve(cache, model, np.concatenate([system, prompt(P)]))    # splits the first node
    assert cache.page_keys(cache.match_prefix(tokens)) == page_keys(model.namespace, tokens)


@pytest.mark.parametrize("made", [{"device_pages": 24, "host_pages": 64}], indirect=True)
def test_several_threads_serve_right_bytes(made):
    cache, model = made
    system = prompt(2 * P)
    prompts = [np.concatenate([system, prompt(int(n) * P)]) for n in np.random.default_rng().integers(1, 4, 12)]
    errors: list[BaseException] = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(15):
                with contextlib.suppress(OutOfPages):       # every page locked by the other threads just then
                    serve(cache, model, prompts[rng.integers(len(prompts))])
                if rng.random() < 0.2:
                    cache.evict(device_pages=int(rng.integers(1, 6)))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    cache.drain()
    cache.check()
    assert all(n.lock == 0 for n in cache.index.all_nodes())


def test_close_with_transfers_in_flight_returns_every_page():
    runtime = create("emulated:split:2:lazy")
    cache, model, dev, host = build(runtime)
    tokens = prompt(6 * P)
    serve(cache, model, tokens)                            # its backup is queued, not run (lazy)
    cache.evict(device_pages=0)
    leftover = cache.allocate(3)                           # held by the caller at close
    cache.close()
    assert cache.device.free_pages == cache.device.pages and cache.host.free_pages == cache.host.pages
    assert cache.returned_caller_pages == len(leftover)
    with pytest.raises(BufferClosed):
        cache.match_prefix(tokens)
    cache.close()                                          # idempotent
    # the pools are the caller's and still work: a new cache over them serves right bytes
    again = KVCache(dev, host, model.namespace, CacheSettings(io_backend="kernel", calibrate=False))
    serve(again, model, tokens)
    assert serve(again, model, tokens)[1] == 6
    close_all(again, dev, host)


def test_a_lazy_backup_in_flight_survives_a_split():
    runtime = create("emulated:unified:2:lazy")
    cache, model, dev, host = build(runtime)
    a = prompt(6 * P)
    serve(cache, model, a)                                 # backup of a's node queued (lazy: not run)
    b = np.concatenate([a[:2 * P], prompt(2 * P)])
    serve(cache, model, b)                                 # splits a's node while its backup is in flight
    cache.check()
    cache.drain()
    cache.check()
    cache.evict(device_pages=16)
    for tokens in (a, b):
        assert serve(cache, model, tokens)[1] == len(tokens) // P
    close_all(cache, dev, host)


def test_namespaces_isolate_two_caches_over_one_geometry(runtime):
    from kvtier.cache import page_keys

    a, model_a, dev_a, host_a = build(runtime, model="model-a")
    b, model_b, dev_b, host_b = build(runtime, model="model-b")
    tokens = prompt(4 * P)
    serve(a, model_a, tokens)
    serve(b, model_b, tokens)
    keys_a, keys_b = a.page_keys(a.match_prefix(tokens)), b.page_keys(b.match_prefix(tokens))
    assert keys_a == page_keys(model_a.namespace, tokens) and keys_b == page_keys(model_b.namespace, tokens)
    assert not set(keys_a) & set(keys_b)
    close_all(a, dev_a, host_a)
    close_all(b, dev_b, host_b)


def test_page_allocator_prefers_one_contiguous_run():
    alloc = PageAllocator(16, contiguous=True)
    first = alloc.allocate(10)
    alloc.free(first[2:4])                                 # free run of 2 at 2..3
    alloc.free(first[6:9])                                 # free run of 3 at 6..8
    assert alloc.allocate(3).tolist() == [6, 7, 8]         # best fit, not the first
    assert alloc.allocate(7).tolist() == [10, 11, 12, 13, 14, 15, 2]   # longest runs first when none fits
    assert alloc.allocate(2) is None and alloc.allocate(1).tolist() == [3]
    with pytest.raises(InvalidArgument, match="twice"):
        alloc.free([3, 3])


def test_settings_are_checked():
    for bad in ({"write_policy": "write_sometimes"}, {"io_backend": "nvlink"}, {"write_through_threshold": 0},
                {"prefill_tokens_per_s": -1.0}, {"hicache_ratio": 0}):
        with pytest.raises(InvalidArgument):
            CacheSettings(**bad)


def test_a_namespace_of_another_geometry_is_refused(runtime):
    from kvtier.pools import DevicePool, HostPool, KVGeometry

    dev = DevicePool.allocate(TINY, 4, 0, runtime=runtime)
    host = HostPool.allocate(TINY, "page_first", pages=4, kind="pinned", runtime=runtime)
    other = Namespace("m", KVGeometry.mha(layers=3, kv_heads=1, head_dim=32, itemsize=2, page_size=4), "bfloat16")
    with pytest.raises(InvalidArgument, match="geometry"):
        KVCache(dev, host, other)
    host.close()
    dev.close()


def test_nodes_with_transfers_in_flight_are_never_evicted(runtime, monkeypatch):
    """A backup or load-back the controller has not completed pins its nodes on both tiers (held open here by a
    transfer whose completion is delayed)."""
    from kvtier.cache import Operation

    cache, model, dev, host = build(runtime)
    gate, real_wait = threading.Event(), Operation.wait

    def slow_wait(op):
        gate.wait(30)
        real_wait(op)

    monkeypatch.setattr(Operation, "wait", slow_wait)
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    node = cache.match_prefix(tokens).last_node
    for _ in range(1000):                                  # the submitter thread queues the backup
        if node.writing is not None:
            break
        threading.Event().wait(0.005)
    assert node.writing is not None and node.host is not None
    assert cache.evict(device_pages=16, host_pages=32) == (0, 0)
    assert cache.match_prefix(tokens).device_tokens == 4 * P
    cache.check()
    gate.set()
    cache.drain()
    assert node.writing is None
    cache.evict(device_pages=16)
    gate.clear()
    match = cache.match_prefix(tokens)
    load = cache.load_back(match)
    assert load is not None and node.loading is load
    assert cache.evict(device_pages=16, host_pages=32) == (0, 0)
    again = cache.match_prefix(tokens)
    assert again.device_tokens == 4 * P and again.pending == [load]   # a device hit that must wait for the load
    cache.check()
    gate.set()
    cache.wait_for(again)
    real_wait(load)
    assert not model.mismatches(tokens, again.device_pages)
    cache.drain()
    close_all(cache, dev, host)


def test_a_match_locked_in_the_same_step_keeps_its_pages(made):
    """Regression: with match and lock as two calls, another thread could evict the match in between and hand its
    pages to a new request (the threads test then served wrong KV); ``lock=True`` makes them one step."""
    cache, model = made
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    cache.drain()
    match = cache.match_prefix(tokens, lock=True)
    assert cache.evict(device_pages=16, host_pages=32) == (0, 0)
    assert not model.mismatches(tokens, match.device_pages)
    cache.unlock(match)
    assert cache.evict(device_pages=16)[0] == 4


@pytest.mark.gpu
def test_a_torch_stream_waiting_on_one_layer_reads_that_layer_loaded(cuda):
    """Layer-wise overlap from torch: the load waits behind a long kernel on the current stream; a side stream that
    waits on layer 1's event (on the GPU, no CPU block) then reads exactly the loaded bytes of layer 1."""
    torch = pytest.importorskip("torch")
    from kvtier.pools import DevicePool, HostPool

    g, pages = TINY, 16
    tensors = [[torch.full((pages * g.page_bytes,), 0x5A, dtype=torch.uint8, device="cuda")
                for _ in range(g.layers)] for _ in range(g.tensors)]
    dev = DevicePool.from_tensors(g, tensors, runtime=cuda)
    host = HostPool.allocate(g, "page_first", pages=32, kind="pinned", runtime=cuda)
    cache = KVCache(dev, host, Namespace("torch", g, "bfloat16"),
                    CacheSettings(io_backend="kernel", calibrate=False, load_back_min_tokens=0))
    from helpers.cache import KVModel

    model = KVModel(dev, cache.namespace)
    tokens = prompt(6 * P)
    serve(cache, model, tokens)
    cache.drain()
    cache.evict(device_pages=pages)
    match = cache.match_prefix(tokens, lock=True)
    torch.cuda._sleep(200_000_000)                     # the current stream is busy; the load is queued behind it
    load = cache.load_back(match)
    side = torch.cuda.Stream()
    load.stream_wait(side, layer=1)
    with torch.cuda.stream(side):
        got = [[tensors[t][1][int(p) * g.page_bytes:(int(p) + 1) * g.page_bytes].clone() for p in load.prefix_pages]
               for t in range(g.tensors)]
    side.synchronize()
    keys = cache.page_keys(match)
    for t in range(g.tensors):
        for i, key in enumerate(keys):
            expected = model.page(key)[t * g.layers + 1]
            assert np.array_equal(got[t][i].cpu().numpy(), expected), f"tensor {t} page {i} of layer 1 not loaded"
    cache.unlock(match)
    cache.close()
    host.close()
    dev.close()


@pytest.mark.parametrize("made", [{"io_backend": "direct", "layout": "page_first_direct", "device_pages": 40,
                                   "host_pages": 64}], indirect=True)
def test_copy_engine_loads_take_runs_of_device_pages_and_serve_right_bytes(made):
    """With ``direct`` loads the device pages of a load-back are consecutive where free runs allow (one strided copy
    per layer and tensor), even after churn scattered the free pages; every loaded byte is checked."""
    cache, model = made
    assert cache.tiers.device.contiguous
    rng = np.random.default_rng()
    prompts = [prompt(int(rng.integers(2, 7)) * P, rng) for _ in range(12)]
    for tokens in prompts:                                 # churn: inserts, evictions, frees in between
        serve(cache, model, tokens)
    cache.drain()
    cache.evict(device_pages=40)
    tokens = prompts[-1]
    match = cache.match_prefix(tokens, lock=True)
    load = cache.load_back(match, force=True)
    assert load is not None
    assert (np.diff(load.device_pages) == 1).all(), load.device_pages
    cache.unlock(match)
    for tokens in prompts[-3:]:
        match, served = serve(cache, model, tokens)        # checks the loaded bytes
        assert served == len(tokens) // P
    cache.check()


def test_an_impossible_allocation_evicts_nothing():
    cache, model, dev, host = build(create("emulated:split"))
    serve(cache, model, prompt(10 * P))
    before = cache.index.device_tokens
    with pytest.raises(Exception, match="cannot allocate 17"):
        cache.allocate(17)
    assert cache.index.device_tokens == before
    close_all(cache, dev, host)


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


def test_free_copies_the_callers_page_array():
    cache, model, dev, host = build(create("emulated:split"))
    pages = cache.allocate(4)
    cache.free(pages)
    pages[:] = 7                                       # the caller reuses its array
    again = cache.allocate(4)
    assert sorted(again.tolist()) == [0, 1, 2, 3]
    cache.free(again)
    close_all(cache, dev, host)                        # raised "pages leaked" before the fix


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


def test_close_without_cancel_waits_for_backups_not_yet_started():
    cache, model, dev, host = build(create("emulated:split:2:lazy"), device_pages=32, host_pages=64)
    prompts = [prompt(6 * P) for _ in range(4)]
    for tokens in prompts:
        serve(cache, model, tokens)                     # four write-through backups asked for
    cache.close(cancel=False)
    assert cache.stats()["pages.backup"] == 24
    assert cache.stats()["skipped.cancelled_at_close"] == 0
    host.close()
    dev.close()


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
