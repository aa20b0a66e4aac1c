"""``cache.request(tokens)``: every step of a request (prefetch, match and lock, load-back, per-layer waits, allocate,
insert, close) on every runtime, bytes checked over poisoned pages; what a failing block gives back; the order of
steps; two threads; per-layer waits on the lazy emulator, where nothing lands unless someone waits for it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.cache import BOUND, HeldOps, P, build, close_all, prompt, serve
from helpers.hybrid import Hybrid

from kvtier.cache import CacheRequest, page_keys
from kvtier.cache.operation import LOAD
from kvtier.cache.tiers import CALLER, FREE
from kvtier.errors import BufferClosed, InvalidArgument
from kvtier.memory import CpuAddress
from kvtier.runtime import create
from kvtier.runtime.emulated_device import DeviceMemory
from kvtier.storage.memory import MemoryStore

POISON = 0xEE


def poison_free_pages(cache, model):
    """Every free device page holds POISON: a load that skips a byte leaves it there."""
    free = np.flatnonzero(cache.tiers.page_state == FREE)
    data = np.full(model.g.page_bytes, POISON, np.uint8)
    for _, _, address in model.pieces:
        for page in free:
            model.pool.runtime.memcpy(address + int(page) * model.g.page_bytes, CpuAddress(data.ctypes.data),
                                      data.nbytes)
    model.pool.runtime.legacy_stream(model.pool.device).synchronize()


def holdings(cache):
    """What requests may hold: free device pages, pages held by callers, locks on nodes."""
    with cache._lock:
        return (cache.device.free_pages, int(np.count_nonzero(cache.tiers.page_state == CALLER)),
                sum(node.lock for node in cache.index.all_nodes()))


def on_host_only(cache, model, tokens):
    serve(cache, model, tokens)
    cache.drain()
    cache.evict(device_pages=cache.device.pages)


def test_a_request_serves_device_and_host_hits_and_inserts_the_rest(made):
    cache, model = made
    tokens = prompt(8 * P)
    on_host_only(cache, model, tokens)
    serve(cache, model, tokens[:3 * P])                     # the first 3 pages back on the device
    longer = np.concatenate([tokens, prompt(2 * P + 1)])
    poison_free_pages(cache, model)
    free = cache.device.free_pages
    with cache.request(longer) as request:
        assert isinstance(request, CacheRequest) and not request.declined
        assert (request.device_tokens, request.match.host_tokens, request.loaded_tokens) == (3 * P, 5 * P, 5 * P)
        assert request.cached_tokens == 8 * P and len(request.prefix_pages) == 8
        request.wait()
        assert not model.mismatches(longer, request.prefix_pages), "the request served wrong KV"
        pages = request.allocate()
        assert len(pages) == 2 and not set(pages.tolist()) & set(request.prefix_pages.tolist())
        model.write(longer, pages, first_page=8)
        assert request.insert().new_tokens == 2 * P
    assert request.closed and holdings(cache) == (free - 7, 0, 0)
    match = cache.match_prefix(longer)
    assert match.device_tokens == 10 * P and not model.mismatches(longer, match.device_pages)
    cache.check()


@pytest.mark.parametrize("loaded", [False, True])
@pytest.mark.parametrize("inserted", [False, True])
def test_an_exception_in_the_block_gives_back_what_the_request_holds(made, loaded, inserted):
    cache, model = made
    tokens = prompt(4 * P)
    if loaded:
        on_host_only(cache, model, tokens)
    else:
        serve(cache, model, tokens)
    longer = np.concatenate([tokens, prompt(3 * P + 1)])
    free, _, _ = holdings(cache)
    with pytest.raises(RuntimeError, match="the model failed"):
        with cache.request(longer) as request:
            request.wait()
            pages = request.allocate(4)                     # 3 whole pages and the partial one
            model.write(longer, pages, first_page=4)
            if inserted:
                request.insert()
            raise RuntimeError("the model failed")
    assert request.closed
    cache.check()
    taken = (4 if loaded else 0) + (3 if inserted else 0)   # loaded and inserted pages are the tree's now
    assert holdings(cache) == (free - taken, 0, 0)
    cache.drain()
    assert cache.evict(device_pages=cache.device.pages)[0] == taken + (0 if loaded else 4)   # nothing stays locked
    assert cache.device.free_pages == cache.device.pages


def test_out_of_order_and_closed_use_is_refused_and_changes_nothing(made):
    cache, model = made
    tokens = prompt(4 * P)
    on_host_only(cache, model, tokens)
    longer = np.concatenate([tokens, prompt(2 * P)])
    request = cache.request(longer, load_back=False)
    before, lookups = holdings(cache), cache.stats()["lookups"]
    steps = {"allocate": request.allocate, "allocate_state": request.allocate_state, "fork_state": request.fork_state,
             "insert": request.insert, "load_back": request.load_back, "wait": request.wait,
             "stream_wait": request.stream_wait, "prefix_pages": lambda: request.prefix_pages}
    for name, step in steps.items():
        with pytest.raises(InvalidArgument, match=f"{name}: this cache request is not open yet"):
            step()
    assert holdings(cache) == before and cache.stats()["lookups"] == lookups
    assert request.open() is request
    with pytest.raises(InvalidArgument, match="open already"):
        request.open()
    with pytest.raises(InvalidArgument, match="6 whole pages, but the request has 0 cached and 0 allocated"):
        request.insert()
    with pytest.raises(InvalidArgument, match="layer 2 is not a layer"):
        request.wait(layer=2)
    opened = holdings(cache)
    assert request.load_back() is not None and request.cached_tokens == 4 * P
    with pytest.raises(InvalidArgument, match="asked for its load-back already"):
        request.load_back()
    pages = request.allocate()
    model.write(longer, pages, first_page=4)
    changed = longer.copy()
    changed[0] += 1
    with pytest.raises(InvalidArgument, match="differ from the request's within its cached prefix"):
        request.insert(changed)
    assert holdings(cache) == (opened[0] - 6, 2, opened[2])
    request.insert()
    for name, step in steps.items():
        if name not in ("wait", "stream_wait", "prefix_pages"):
            with pytest.raises(InvalidArgument, match=f"{name}.* after insert"):
                step()
    request.close()
    request.close()                                         # idempotent
    for name, step in steps.items():
        with pytest.raises(InvalidArgument, match=f"{name}: this cache request is closed"):
            step()
    assert holdings(cache) == (opened[0] - 6, 0, 0)
    cache.check()


def test_a_load_back_after_allocate_and_bad_arguments_are_refused(made):
    cache, model = made
    tokens = prompt(4 * P)
    on_host_only(cache, model, tokens)
    with pytest.raises(InvalidArgument, match="load_back must be True or False"):
        cache.request(tokens, load_back="yes")
    with pytest.raises(InvalidArgument, match="token"):
        cache.request([[1, 2]])
    with cache.request(tokens, load_back=False) as request:
        request.allocate(1)
        held = holdings(cache)
        with pytest.raises(InvalidArgument, match="load_back after allocate"):
            request.load_back()
        with pytest.raises(InvalidArgument, match="allocate count"):
            request.allocate(-1)
        assert holdings(cache) == held and request.load is None
    assert holdings(cache)[1:] == (0, 0)


def test_a_request_whose_host_part_another_request_loads_finds_it_on_the_device(made):
    """B matched while its pages were on the host only; A's load-back brought them to the device since: B matches
    again (rather than recomputing them) and waits for A's load."""
    cache, model = made
    tokens = prompt(4 * P)
    on_host_only(cache, model, tokens)
    poison_free_pages(cache, model)
    b = cache.request(np.concatenate([tokens, prompt(P - 1)]), load_back=False).open()
    a = cache.request(tokens).open()
    assert a.loaded_tokens == 4 * P and b.match.host_tokens == 4 * P
    assert b.load_back() is None and not b.declined
    assert (b.device_tokens, b.cached_tokens) == (4 * P, 4 * P)
    b.wait()
    assert not model.mismatches(tokens, b.prefix_pages)
    assert np.array_equal(b.prefix_pages, a.prefix_pages)
    a.close()
    b.close()
    assert holdings(cache)[1:] == (0, 0)
    cache.check()


@pytest.mark.parametrize("made", [{"prefill_tokens_per_s": 1e15}], indirect=True)
def test_a_declined_load_back_leaves_the_host_part_to_compute(made):
    cache, model = made
    cache.load_gbps = 1.0                                   # loading is slower than recomputing
    tokens = prompt(5 * P)
    on_host_only(cache, model, tokens)
    with cache.request(tokens) as request:
        assert request.declined and request.load is None and request.cached_tokens == 0
        pages = request.allocate()
        assert len(pages) == 5
        model.write(tokens, pages)
        request.insert()
    assert cache.stats()["decisions.slower_than_recompute"] == 1
    match = cache.match_prefix(tokens)
    assert match.device_tokens == 5 * P and not model.mismatches(tokens, match.device_pages)
    cache.check()


def test_a_request_settles_its_prefetch_and_loads_what_storage_had(runtime):
    cache, model, dev, host = build(runtime, storage=lambda ns: MemoryStore(ns), prefetch_policy="wait_complete")
    try:
        tokens = prompt(4 * P)
        serve(cache, model, tokens)
        cache.drain()
        cache.evict(device_pages=dev.pages, host_pages=host.pages)   # in storage only
        assert cache.match_prefix(tokens).cached_tokens == 0
        poison_free_pages(cache, model)
        with cache.request(tokens) as request:
            assert request.fetched_tokens == 4 * P and request.loaded_tokens == 4 * P
            request.wait()
            assert not model.mismatches(tokens, request.prefix_pages)
        cache.evict(device_pages=dev.pages, host_pages=host.pages)
        never = cache.request(tokens)
        never.close()                                        # never opened: its prefetch is stopped
        assert never.prefetch is not None and never.prefetch.cancelled and never.prefetch.wait(BOUND)
        with pytest.raises(InvalidArgument, match="closed"):
            never.open()
        assert holdings(cache)[1:] == (0, 0)
        cache.check()
    finally:
        store = cache.storage
        close_all(cache, dev, host)
        store.close()


def test_a_request_on_a_closed_cache_is_refused(runtime):
    cache, model, dev, host = build(runtime)
    request, late = cache.request(prompt(2 * P)).open(), cache.request(prompt(2 * P))
    close_all(cache, dev, host)
    with pytest.raises(BufferClosed):
        cache.request(prompt(P))
    with pytest.raises(BufferClosed):
        late.open()
    assert late.closed
    request.close()                                         # the closed cache took its lock back already


def test_two_threads_with_their_own_requests(made):
    cache, model = made
    shared = prompt(2 * P)
    prompts = [np.concatenate([shared, prompt(2 * P + 1)]) for _ in range(2)]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(tokens):
        try:
            start.wait(BOUND)
            for _ in range(15):
                serve(cache, model, tokens)                  # checks every byte it is served
                cache.drain()
                cache.evict(device_pages=3)                  # the next one loads some back
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(tokens,)) for tokens in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND * 3)
        assert not thread.is_alive()
    assert not errors, errors
    assert cache.stats()["decisions.load"] > 0
    assert holdings(cache)[1:] == (0, 0)
    cache.check()


def layers_landed(runtime, model, tokens, pages):
    """Per KV layer: whether every page holds its bytes, read from the emulator's memory without running anything
    queued (a copy would)."""
    memory, keys = DeviceMemory(runtime._maps[model.pool.device]), page_keys(model.namespace, tokens)
    landed = [True] * model.g.layers
    for row, (_, layer, address) in enumerate(model.pieces):
        for key, page in zip(keys, pages, strict=False):
            held = memory.view((address + int(page) * model.g.page_bytes).value, model.g.page_bytes)
            landed[layer] &= bool(np.array_equal(held, model.page(key)[row]))
    return landed


@pytest.mark.parametrize("spec", ["emulated:split:2:lazy", "emulated:unified:2:lazy"])
@pytest.mark.parametrize("backend", ["kernel", "direct"])
def test_layer_i_waits_for_layer_i_of_every_load_the_prefix_needs(spec, backend, monkeypatch):
    """B's prefix is the shared pages A's load-back brings, then B's own: B's layer-i wait covers layer i of both
    loads, and only layer i. The lazy emulator runs queued work only when it is waited for, and the cache's own
    waits for loads are held, so what landed is what the request's waits ran."""
    runtime = create(spec)
    cache, model, dev, host = build(runtime, io_backend=backend, layout="layer_first")
    try:
        shared = prompt(3 * P)
        a_tokens, b_tokens = (np.concatenate([shared, prompt(2 * P)]) for _ in range(2))
        for tokens in (a_tokens, b_tokens):
            serve(cache, model, tokens)
        cache.drain()
        cache.evict(device_pages=dev.pages)
        poison_free_pages(cache, model)
        held = HeldOps(monkeypatch, kind=LOAD)
        b = cache.request(b_tokens, load_back=False).open()
        a = cache.request(a_tokens).open()                  # loads the shared pages and A's
        assert b.load_back() is not None and b.loaded_tokens == 2 * P   # B's own pages only
        assert layers_landed(runtime, model, b_tokens, b.prefix_pages) == [False, False]
        stream = runtime.create_stream(0)
        b.stream_wait(stream, layer=0)
        stream.synchronize()
        assert layers_landed(runtime, model, b_tokens, b.prefix_pages) == [True, False]
        b.wait(layer=1)
        assert layers_landed(runtime, model, b_tokens, b.prefix_pages) == [True, True]
        held.release()
        stream.close()
        a.close()
        b.close()
        cache.drain()
        assert holdings(cache)[1:] == (0, 0)
        cache.check()
    finally:
        close_all(cache, dev, host)


def test_a_hybrid_request_falls_back_to_the_device_snapshot_and_gives_back_its_slot(runtime):
    hybrid = Hybrid(runtime, load_back_min_tokens=3 * P)
    cache, model = hybrid.cache, hybrid.model
    try:
        a = prompt(2 * P)
        longer = np.concatenate([a, prompt(2 * P)])
        hybrid.serve(a)
        hybrid.serve(longer)
        cache.drain()
        cache.evict(device_pages=2)                         # the longer prompt's own pages go to the host only
        assert cache.match_prefix(longer).host_tokens == 2 * P
        slots = cache.states.device.free_pages
        with pytest.raises(RuntimeError, match="the model failed"):
            with cache.request(longer) as request:
                assert request.declined and request.cached_tokens == 2 * P   # too short to load: a's snapshot
                assert model.state_ok(a, request.state) and not model.mismatches(a, request.prefix_pages)
                forked = request.fork_state()
                runtime.synchronize(0)
                assert forked != request.state and model.state_ok(a, forked)
                request.allocate()
                raise RuntimeError("the model failed")
        assert cache.states.device.free_pages == slots
        assert holdings(cache)[1:] == (0, 0)
        cache.check()
    finally:
        hybrid.close()


# -- a load-back that fails, a cache that closes under a request (found adversarially) -------------------------------
@pytest.fixture
def failed_load(rt, monkeypatch):
    """(cache, model, tokens, request): the request's load-back of ``tokens`` (on the host only) failed, as a device
    fault seen when the controller completes it; the cache took the pages it was filling back."""
    from kvtier.cache import Operation
    from kvtier.errors import RuntimeCallError

    cache, model, dev, host = build(rt, device_pages=8, host_pages=16)
    tokens = prompt(4 * P)
    serve(cache, model, tokens)
    cache.drain()
    cache.evict(device_pages=dev.pages)
    real = Operation.wait

    def failing(op):
        real(op)
        if op.kind == LOAD:
            raise RuntimeCallError("cudaEventSynchronize", "cudaErrorIllegalAddress")

    monkeypatch.setattr(Operation, "wait", failing)
    request = cache.request(tokens, force=True, prefetch=False).open()
    assert request.load is not None
    cache.drain()
    monkeypatch.setattr(Operation, "wait", real)
    assert cache.stats()["errors.load"] == 1
    yield cache, model, tokens, request
    try:
        request.close()
    finally:
        close_all(cache, dev, host)


def test_a_request_whose_load_failed_serves_none_of_its_pages(failed_load):
    """The failed load's pages went back to the free list, so the next request may hold them: the failed request
    names none of them (waits, prefix_pages and insert raise LoadFailed), and another request that got them keeps
    them, inserts them and serves its own bytes; the failed tokens are never served with someone else's KV."""
    from kvtier.errors import LoadFailed

    cache, model, tokens, request = failed_load
    for call in (lambda: request.stream_wait(layer=0), request.wait, lambda: request.prefix_pages, request.insert):
        with pytest.raises(LoadFailed, match="failed"):
            call()
    other = cache.request(prompt(4 * P), prefetch=False).open()
    pages = other.allocate()
    model.write(other.tokens, pages)
    with pytest.raises(LoadFailed):
        request.insert()
    assert all(cache.tiers.page_state[p] == CALLER for p in pages), "the failed request handed B's pages to the tree"
    other.insert()
    other.close()
    request.close()
    assert not model.mismatches(other.tokens, cache.match_prefix(other.tokens).device_pages)
    again = cache.match_prefix(tokens)
    assert not model.mismatches(tokens[:again.device_tokens], again.device_pages)
    cache.check()


def test_a_request_closed_while_its_cache_is_closing_returns_quietly(rt, monkeypatch):
    """A block that raised nothing must not fail at its end because another thread began closing the cache (a closing
    cache takes everything back, as a closed one has)."""
    import time

    from helpers.cache import joined, spawn

    cache, model, dev, host = build(rt, device_pages=8, host_pages=16)
    held = HeldOps(monkeypatch)
    try:
        request = cache.request(prompt(2 * P), prefetch=False).open()
        request.allocate(1)
        serve(cache, model, prompt(2 * P))           # its write-through backup is in flight, held
        with held.changed:
            assert held.changed.wait_for(lambda: held.waiting, BOUND)
        closer, results = spawn("closer", cache.close)
        deadline = time.monotonic() + BOUND
        while not cache.closing and time.monotonic() < deadline:
            time.sleep(0.001)
        assert cache.closing and not cache.closed
        try:
            request.close()
        finally:
            held.release()
            joined(closer)
        assert results == [("ok", None)] and request.closed
    finally:
        held.release()
        close_all(cache, dev, host)


@pytest.mark.parametrize("count", ["cached_tokens", "device_tokens", "loaded_tokens"])
def test_a_request_closed_before_it_opened_counts_nothing(small_cache, count):
    cache, _, _ = small_cache
    request = cache.request(prompt(2 * P), prefetch=False)
    request.close()
    assert getattr(request, count) == 0
