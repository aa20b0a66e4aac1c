"""Hybrid models in the cache (GQA KV in page pools, linear-attention state in state pools): a match ends only where
a state snapshot exists; backup, eviction and load-back move KV and state together, all or nothing; every write
policy backs up the snapshots it promises to, threads serving, evicting and closing at once included; a layer map
is checked strictly. Every byte served (KV and state) is checked against fresh random bytes, over poisoned
destinations."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
from helpers.cache import TINY, P, prompt
from helpers.hybrid import Hybrid

from kvtier.cache import CacheSettings, KVCache, Namespace, OutOfPages, token_array
from kvtier.cache.state_tier import interleaved_layers
from kvtier.errors import BufferClosed, InvalidArgument, KvtierError
from kvtier.pools import DevicePool, HostPool
from kvtier.runtime import create
from kvtier.runtime.emulated import EmulatedRuntime
from kvtier.storage import open_store

# TINY has 2 KV layers, STATE 6 state layers: a valid map names ("kv", 0..1) and ("state", 0..5) once each
GOOD_MAP = [("state", 0), ("state", 1), ("state", 2), ("kv", 0), ("state", 3), ("state", 4), ("state", 5), ("kv", 1)]


@pytest.fixture
def hybrid(runtime, request):
    made = Hybrid(runtime, **getattr(request, "param", {}))
    yield made
    made.close()


def serve_or_fall_back(h: Hybrid, tokens) -> int:
    """docs/hybrid.md's caller protocol ("What the caller does"): a declined load-back falls back to a device-only
    match. Checks every served byte (KV and state); returns the tokens served from the cache."""
    cache, model = h.cache, h.model
    tokens = np.asarray(tokens)
    match = cache.match_prefix(tokens, lock=True)
    try:
        load = cache.load_back(match, force=True)
        if load is None and (match.host_tokens or match.device_state is None):
            cache.unlock(match)
            match = cache.match_prefix(tokens, lock=True, device_only=True)
            assert match.host_tokens == 0
        for op in match.pending:
            op.wait()
        prefix, state = match.device_pages, match.device_state
        if load is not None:
            load.wait()
            prefix, state = load.prefix_pages, load.device_state
        served = len(prefix) * P
        assert served == match.cached_tokens
        assert not model.mismatches(tokens, prefix), "served wrong KV"
        if served:
            assert state is not None and model.state_ok(tokens[:served], state), "served a wrong state"
        slot = cache.allocate_state()
        try:
            new = cache.allocate(len(tokens) // P - len(prefix))
        except OutOfPages:
            cache.free_state(slot)
            raise
        model.write(tokens, new, first_page=len(prefix))
        model.write_state(tokens, slot)
        cache.insert(tokens, np.concatenate([prefix, new]), state=slot)
    finally:
        if match.locked:
            cache.unlock(match)
    return served


def test_insert_then_match_serves_kv_and_its_state(hybrid):
    tokens = prompt(5 * P)
    match, served = hybrid.serve(tokens)
    assert served == 0 and match.device_state is None
    match, served = hybrid.serve(tokens)
    assert served == 5 * P and match.device_state is not None
    hybrid.cache.check()


def test_a_match_never_ends_without_a_state(hybrid):
    cache, model = hybrid.cache, hybrid.model
    a = prompt(6 * P)
    hybrid.serve(a)
    assert cache.match_prefix(np.concatenate([a, prompt(3 * P)])).cached_tokens == 6 * P
    assert cache.match_prefix(a[:4 * P]).cached_tokens == 0                 # mid-node: KV yes, state no
    assert cache.index.match(token_array(a[:4 * P]), touch=False).cached_tokens == 4 * P  # the KV is there
    b = prompt(3 * P)
    pages = cache.allocate(3)
    model.write(b, pages)
    cache.insert(b, pages)                                                    # KV only: nothing to end on
    assert cache.match_prefix(b).cached_tokens == 0
    cache.check()


def test_a_branch_shares_kv_and_ends_on_its_own_state(hybrid):
    system = prompt(3 * P)
    a, b = np.concatenate([system, prompt(2 * P)]), np.concatenate([system, prompt(2 * P)])
    hybrid.serve(a)
    match, served = hybrid.serve(b)
    assert served == 0                                    # the system prompt has KV but no state of its own
    hybrid.serve(system)                                  # now it has one
    for tokens in (a, b, system):
        assert hybrid.serve(tokens)[1] == len(tokens)
    assert hybrid.cache.match_prefix(np.concatenate([system, prompt(P)])).cached_tokens == 3 * P
    hybrid.cache.check()


def test_backup_evict_and_load_back_restore_kv_and_state_byte_for_byte(hybrid):
    cache, model = hybrid.cache, hybrid.model
    tokens = prompt(6 * P)
    hybrid.serve(tokens)
    cache.drain()
    assert cache.stats()["host_states"] == 1 and cache.stats()["states.backup"] == 1
    cache.evict(device_pages=16)
    assert cache.stats()["device_states"] == 0               # the snapshot left with its pages
    match = cache.match_prefix(tokens)
    assert (match.device_tokens, match.host_tokens, match.device_state) == (0, 6 * P, None)
    assert match.host_state is not None
    model.poison_kv()
    model.poison_states()
    match, served = hybrid.serve(tokens)                     # checks the loaded bytes
    cache.drain()                                            # the controller counts a load when it completes it
    assert served == 6 * P and cache.stats()["states.load"] == 1
    cache.check()


def test_a_state_evicted_alone_is_loaded_back_alone(hybrid):
    cache, model = hybrid.cache, hybrid.model
    tokens = prompt(4 * P)
    hybrid.serve(tokens)
    cache.drain()
    assert cache.evict_states(device=1) == (1, 0)
    match = cache.match_prefix(tokens)
    assert (match.device_tokens, match.device_state) == (4 * P, None) and match.host_state is not None
    model.poison_states()
    load = cache.load_back(match, force=True)
    assert load is not None and load.transfer is None and load.state_transfer is not None
    load.wait()
    assert model.state_ok(tokens, load.device_state)
    assert not model.mismatches(tokens, load.prefix_pages)
    cache.check()


def test_without_any_state_left_the_match_falls_back_to_a_shorter_prefix(hybrid):
    cache = hybrid.cache
    system = prompt(2 * P)
    long = np.concatenate([system, prompt(3 * P)])
    hybrid.serve(system)
    hybrid.serve(long)
    cache.drain()
    cache.evict_states(host=8)
    assert cache.evict_states(device=1) == (1, 0)             # the least recent: the system prompt's
    assert cache.match_prefix(long).cached_tokens == 5 * P
    cache.evict_states(device=1)
    match = cache.match_prefix(long)
    assert match.cached_tokens == 0 and match.device_state is None     # KV alone is never served
    cache.check()


@pytest.mark.parametrize("hybrid", [{"host_states": 1}], indirect=True)
def test_a_backup_without_a_host_state_slot_moves_nothing(hybrid):
    cache = hybrid.cache
    a, b = prompt(3 * P), prompt(3 * P)
    hybrid.serve(a)
    cache.drain()
    held = cache.match_prefix(a, lock=True)                    # its host snapshot cannot be evicted
    free_host = cache.host.free_pages
    hybrid.serve(b)
    cache.drain()
    assert cache.stats()["skipped.host_state_full"] == 1
    assert cache.host.free_pages == free_host                  # no KV went to the host without its state
    node = cache.match_prefix(b).last_node
    assert (node.host, node.host_state) == (None, None)
    cache.unlock(held)
    cache.evict(device_pages=16)                               # b had no backup: gone; a is served from the host
    assert cache.match_prefix(b).cached_tokens == 0
    assert hybrid.serve(a)[1] == 3 * P
    cache.check()


@pytest.mark.parametrize("hybrid", [{"device_states": 2}], indirect=True)
def test_a_load_back_without_a_device_state_slot_moves_nothing(hybrid):
    cache = hybrid.cache
    tokens = prompt(4 * P)
    hybrid.serve(tokens)
    cache.drain()
    cache.evict(device_pages=16)
    held = [cache.allocate_state(), cache.allocate_state()]   # every device slot is a caller's
    free_pages = cache.device.free_pages
    match = cache.match_prefix(tokens, lock=True)
    assert cache.load_back(match, force=True) is None
    assert cache.stats()["decisions.no_device_state"] == 1
    assert cache.device.free_pages == free_pages and match.last_node.device is None
    cache.unlock(match)
    with pytest.raises(OutOfPages):
        cache.allocate_state()
    for slot in held:
        cache.free_state(slot)
    assert hybrid.serve(tokens)[1] == 4 * P
    cache.check()


@pytest.mark.parametrize("hybrid", [{"write_policy": "write_back", "device_pages": 8}], indirect=True)
def test_write_back_eviction_backs_up_kv_and_state_together(hybrid):
    cache, model = hybrid.cache, hybrid.model
    first, second = prompt(6 * P), prompt(6 * P)
    hybrid.serve(first)
    cache.drain()
    assert cache.index.host_tokens == 0 and cache.stats()["host_states"] == 0
    hybrid.serve(second)                                       # evicts `first` with a backup of both
    assert cache.stats()["host_states"] == 1
    model.poison_states()
    match, served = hybrid.serve(first)
    assert match.host_tokens == 6 * P and served == 6 * P
    cache.check()


@pytest.mark.parametrize("hybrid", [{"write_policy": "write_back", "device_states": 2}], indirect=True)
def test_write_back_backs_up_a_state_evicted_for_a_slot(hybrid):
    cache = hybrid.cache
    a, b, c = prompt(2 * P), prompt(2 * P), prompt(2 * P)
    hybrid.serve(a)
    hybrid.serve(b)
    hybrid.serve(c)                                            # a's device snapshot made room, saved first
    assert cache.stats()["states.evicted_device"] >= 1
    match = cache.match_prefix(a)
    assert match.device_state is None and match.host_state is not None
    assert hybrid.serve(a)[1] == 2 * P
    cache.check()


def test_load_back_waits_per_model_layer(hybrid, runtime):
    cache = hybrid.cache
    tokens = prompt(5 * P)
    hybrid.serve(tokens)
    cache.drain()
    cache.evict(device_pages=16)
    match = cache.match_prefix(tokens, lock=True)
    load = cache.load_back(match, force=True)
    assert load is not None and load.layer_map == interleaved_layers(2, 6)
    assert [kind for kind, _ in load.layer_map] == ["state", "state", "state", "kv"] * 2
    for layer in range(8):
        load.stream_wait(layer=layer)
        load.wait_layer(layer)
    with pytest.raises(InvalidArgument):
        load.stream_wait(layer=8)
    load.wait()
    assert hybrid.model.state_ok(tokens, load.device_state)
    cache.unlock(match)


def test_bad_state_arguments_change_nothing(hybrid):
    cache, model = hybrid.cache, hybrid.model
    tokens = prompt(3 * P + 1)
    slot = cache.allocate_state()
    pages = cache.allocate(3)
    with pytest.raises(InvalidArgument, match="whole pages"):
        cache.insert(tokens, pages, state=slot)             # the snapshot would sit past the cached prefix
    with pytest.raises(InvalidArgument, match="not a slot from allocate_state"):
        cache.insert(tokens[:3 * P], pages, state=(slot + 1) % 4)
    with pytest.raises(InvalidArgument):
        cache.insert(tokens[:3 * P], pages, state=True)
    assert cache.index.nodes == 0
    model.write(tokens, pages)
    model.write_state(tokens[:3 * P], slot)
    assert cache.insert(tokens[:3 * P], pages, state=slot).state_kept
    with pytest.raises(InvalidArgument):
        cache.free_state(slot)                              # the tree's now
    again = cache.allocate_state()
    assert not cache.insert(tokens[:3 * P], pages, state=again).state_kept     # had one: the slot is freed
    with pytest.raises(InvalidArgument):
        cache.free_state(again)
    cache.check()


def test_a_kv_only_cache_refuses_state_calls(runtime):
    from helpers.cache import build, close_all

    cache, _, dev, host = build(runtime)
    try:
        with pytest.raises(InvalidArgument, match="no state tier"):
            cache.allocate_state()
    finally:
        close_all(cache, dev, host)


def test_a_hybrid_cache_takes_a_storage_tier_and_writes_its_snapshots_through(runtime):
    """Once refused (snapshots were not stored); tests/cache/test_hybrid_storage.py serves them back after a
    restart on every backend."""
    made = Hybrid(runtime)
    try:
        made.cache.close()
        store = open_store("memory:", made.ns, layout="page_first")
        cache = KVCache(made.dev, made.host, made.ns, CacheSettings(calibrate=False, io_backend="kernel"),
                        storage=store, state=(made.sdev, made.shost))
        made.cache = cache
        made.serve(np.arange(3 * P))
        cache.drain()
        assert cache.stats()["states.stored"] == 1 and cache.stats()["storage_pages.written"] == 3
        cache.close()
        store.close()
    finally:
        made.close()


@pytest.mark.parametrize("hybrid", [{"device_pages": 48, "host_pages": 96, "device_states": 8, "host_states": 16}],
                         indirect=True)
def test_two_threads_insert_and_match_at_once(hybrid):
    system = prompt(2 * P)
    errors: list[BaseException] = []

    def user(seed):
        rng = np.random.default_rng(seed)
        history = system
        try:
            for _ in range(4):
                history = np.concatenate([history, prompt(P, rng)])
                hybrid.serve(history)
                hybrid.serve(system)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=user, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    hybrid.cache.drain()
    hybrid.cache.check()


def test_close_with_a_load_back_in_flight(runtime):
    made = Hybrid(runtime)
    try:
        tokens = prompt(6 * P)
        made.serve(tokens)
        made.cache.drain()
        made.cache.evict(device_pages=16)
        match = made.cache.match_prefix(tokens, lock=True)
        load = made.cache.load_back(match, force=True)
        assert load is not None
        made.cache.close()                                    # waits for the load, returns every page and slot
        assert load.done()
        assert made.cache.returned_caller_states == 0
        with pytest.raises(BufferClosed):
            made.cache.match_prefix(tokens)
    finally:
        made.close()


def test_close_returns_slots_callers_still_hold(runtime):
    made = Hybrid(runtime)
    try:
        made.cache.allocate_state()
        made.cache.close()
        assert made.cache.returned_caller_states == 1
    finally:
        made.close()


def test_locked_snapshots_are_never_evicted(hybrid):
    cache = hybrid.cache
    tokens = prompt(3 * P)
    hybrid.serve(tokens)
    cache.drain()
    match = cache.match_prefix(tokens, lock=True)
    assert cache.evict_states(device=4, host=8) == (0, 0)
    assert cache.evict(device_pages=16, host_pages=32) == (0, 0)
    cache.unlock(match)
    assert cache.evict_states(device=4, host=8) == (1, 1)
    assert cache.match_prefix(tokens).cached_tokens == 0
    cache.check()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_demo_runs_the_hybrid_geometry_and_checks_every_state(policy, tmp_path, capsys):
    import json

    from kvtier.cli import main

    out = tmp_path / "demo.json"
    code = main(["--runtime", "emulated:split", "demo", "--model", "qwen3.5-like", "--users", "3", "--turns", "3",
                 "--system-tokens", "128", "--user-tokens", "32", "--reply-tokens", "32",
                 "--hicache-write-policy", policy, "--json", "--save", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["hybrid"] and report["mismatched_states"] == 0 and report["mismatched_pages"] == 0
    assert report["states_checked"] > 0 and report["states_loaded"] > 0
    assert report["prefill_saved_tokens"] > 0


def test_arrays_a_load_back_returns_do_not_alias_the_tree(hybrid):
    """Regression: the hybrid load-back once gave the tree the same page array the caller gets in ``load``."""
    cache, model = hybrid.cache, hybrid.model
    tokens = prompt(4 * P)
    hybrid.serve(tokens)
    cache.drain()
    cache.evict(device_pages=16)
    match = cache.match_prefix(tokens, lock=True)
    load = cache.load_back(match, force=True)
    load.wait()
    load.device_pages[:] = load.device_pages[::-1].copy()
    load.prefix_pages[:] = 0
    load.state_device[:] = (load.state_device + 1) % 4
    cache.unlock(match)
    again = cache.match_prefix(tokens)
    assert not model.mismatches(tokens, again.device_pages)
    assert model.state_ok(tokens, again.device_state)
    cache.check()


def test_fork_state_copies_the_snapshot_and_the_tree_keeps_its_own(hybrid):
    """A request continues from a copy: writing the fork must leave the tree's snapshot as it was."""
    tokens = prompt(4 * P)
    hybrid.serve(tokens)
    cache, model = hybrid.cache, hybrid.model
    match = cache.match_prefix(tokens, lock=True)
    try:
        forked = cache.fork_state(match)
        assert forked != match.device_state
        hybrid.sdev.runtime.synchronize(0)
        assert model.state_ok(tokens, forked)
        model._put(forked, [np.full(size, 0x5A, np.uint8) for size, _, _ in model.items])
        assert model.state_ok(tokens, match.device_state), "writing the fork changed the tree's snapshot"
        cache.free_state(forked)
    finally:
        cache.unlock(match)
    cache.check()


def test_fork_state_of_a_host_only_snapshot_is_refused_and_allocates_nothing(hybrid):
    tokens = prompt(3 * P)
    hybrid.serve(tokens)
    cache = hybrid.cache
    match = cache.match_prefix(tokens)
    cache.backup(match)
    cache.drain()
    cache.evict_states(device=hybrid.sdev.units)
    match = cache.match_prefix(tokens)
    assert match.device_state is None and match.host_state is not None
    free = cache.states.device.free_pages
    with pytest.raises(InvalidArgument, match="load_back"):
        cache.fork_state(match)
    assert cache.states.device.free_pages == free
    cache.check()


@pytest.mark.parametrize("seed", range(4))
def test_fork_state_right_after_a_load_back_copies_the_loaded_snapshot(runtime, seed):
    """The copy is ordered after the load that brings the snapshot: without that it copied whatever the slot held."""
    if runtime.name.startswith("emulated"):
        from kvtier.runtime.emulated import EmulatedRuntime

        runtime = EmulatedRuntime(runtime.mode, schedule="lazy", seed=seed)
    hybrid = Hybrid(runtime)
    try:
        tokens = prompt(3 * P)
        hybrid.serve(tokens)
        cache, model = hybrid.cache, hybrid.model
        cache.backup(cache.match_prefix(tokens))
        cache.drain()
        cache.evict_states(device=hybrid.sdev.units)
        model.poison_states()
        match = cache.match_prefix(tokens, lock=True)
        assert match.device_state is None and match.host_state is not None
        load = cache.load_back(match, force=True)
        assert load is not None
        forked = cache.fork_state(match)
        runtime.current_stream(0).synchronize()         # what reads the fork on this stream runs now
        load.wait()
        assert model.state_ok(tokens, forked), "the fork copied the slot before the snapshot landed"
        cache.free_state(forked)
        cache.unlock(match)
    finally:
        hybrid.close()


def test_fork_state_orders_its_copy_after_the_load_in_flight(hybrid, monkeypatch):
    """White-box: the GPU must not copy the snapshot slot before the load-back writing it lands; the emulator's
    completion thread finishes loads too early for an end-to-end check to catch a missing wait."""
    tokens = prompt(3 * P)
    hybrid.serve(tokens)
    cache = hybrid.cache
    cache.backup(cache.match_prefix(tokens))
    cache.drain()
    cache.evict_states(device=hybrid.sdev.units)
    match = cache.match_prefix(tokens, lock=True)
    calls = []
    engine = cache.states.engine
    original = engine.copy
    monkeypatch.setattr(engine, "copy", lambda *a, **k: (calls.append(k), original(*a, **k))[1])
    load = cache.load_back(match, force=True)
    assert load is not None and load.state_transfer is not None
    forked = cache.fork_state(match)
    assert calls and calls[0]["after"] is not None and load.state_transfer.finished in calls[0]["after"]
    load.wait()
    cache.free_state(forked)
    cache.unlock(match)


def test_a_locked_match_pins_the_snapshot_it_ends_on_not_every_snapshot_on_its_path(runtime):
    """A request uses the state at the end of its match only; the snapshots of shorter prefixes on the same path
    may go while it runs (their KV stays). Pinning them all ran two threads of growing conversations out of device
    state slots (OutOfPages with 7 of 8 slots held by locked path snapshots)."""
    made = Hybrid(runtime, device_pages=32, host_pages=64, device_states=4, host_states=8)
    try:
        tokens = prompt(4 * P)
        for pages in range(1, 5):                        # snapshots after 1, 2, 3 and 4 pages: all 4 slots
            made.serve(tokens[:pages * P])
        match = made.cache.match_prefix(tokens, lock=True)
        assert match.device_tokens == 4 * P and match.device_state is not None
        slots = [made.cache.allocate_state() for _ in range(3)]   # the 3 shorter prefixes' snapshots give way
        assert match.device_state not in slots
        assert made.model.state_ok(tokens, match.device_state), "the locked snapshot was taken"
        with pytest.raises(OutOfPages):
            made.cache.allocate_state()                  # the one the match ends on stays
        for slot in slots:
            made.cache.free_state(slot)
        made.cache.unlock(match)
        made.cache.check()
    finally:
        made.close()


def test_a_waited_load_back_does_not_keep_its_device_state_slot_pinned():
    """Found: after ``load_back`` of a host-only snapshot, ``load.wait()`` and ``unlock(match)``, the only device state
    slot could still not be had: ``allocate_state()`` raised OutOfPages ("the rest by snapshots that are locked or in
    flight") because the node stayed ``loading`` until the controller's load waiter thread got the cache lock to
    complete the operation, and the allocation waited for backups in flight but never for load-backs. The same
    happened with the next request's ``load_back`` (declined ``no_device_state``) and, for KV pages, with
    ``allocate()`` after a waited load-back. A snapshot whose load has finished (the caller waited for it) and which
    no lock pins is evictable (README: completions are handled the moment they complete). (Issue #13.)"""
    hybrid = Hybrid(create("emulated:split"), device_states=1, host_states=4)
    cache = hybrid.cache
    try:
        failures = 0
        for _ in range(20):
            tokens = prompt(2 * P)
            hybrid.serve(tokens)
            cache.backup(cache.match_prefix(tokens))
            cache.drain()
            cache.evict_states(device=1)
            hybrid.model.poison_states()
            match = cache.match_prefix(tokens, lock=True)
            assert match.device_state is None and match.host_state is not None
            load = cache.load_back(match, force=True)
            assert load is not None
            load.wait()
            assert hybrid.model.state_ok(tokens, load.device_state)
            cache.unlock(match)
            try:
                slot = cache.allocate_state()
            except OutOfPages:
                failures += 1
            else:
                cache.free_state(slot)
            cache.drain()
            cache.evict(device_pages=16, host_pages=32)
        cache.check()
        assert failures == 0, f"allocate_state() found no slot in {failures} of 20 rounds after a waited load-back"
    finally:
        hybrid.close()


@pytest.mark.parametrize("bad", [
    pytest.param(["kv"] * 8, id="strings-not-pairs"),
    pytest.param([("kv",)] * 8, id="one-tuples"),
    pytest.param(5, id="an-int"),
    pytest.param({"kv": 0, "state": 1}, id="a-dict"),
])
def test_malformed_layer_map_raises_a_kvtier_error(runtime, bad):
    """Found: ``KVCache(..., layer_map=...)`` with a malformed map raises a raw ValueError / TypeError from
    ``state_tier.check_layer_map`` (``tuple((str(kind), int(index)) for kind, index in layer_map)``), not a kvtier
    InvalidArgument; the brief's contract is that bad input raises a clear kvtier error."""
    made = Hybrid(runtime)
    try:
        made.cache.close()
        with pytest.raises(KvtierError):
            KVCache(made.dev, made.host, made.ns, CacheSettings(calibrate=False), state=(made.sdev, made.shost),
                    layer_map=bad)
    finally:
        made.close()


@pytest.mark.parametrize("entry", [("kv", 0.7), ("kv", "0"), ("kv", False)], ids=["float", "str", "bool"])
def test_layer_map_indices_that_are_not_integers_are_refused(runtime, entry):
    """Found: a layer map entry whose index is not an integer (0.7, "0", False) is silently coerced with ``int()``
    (0.7 -> KV layer 0) and accepted; the cache checks integers everywhere else (``checks.integer`` refuses floats and
    bools) and should refuse these too."""
    made = Hybrid(runtime)
    try:
        made.cache.close()
        layer_map = [entry if item == ("kv", 0) else item for item in GOOD_MAP]
        with pytest.raises(InvalidArgument):
            cache = KVCache(made.dev, made.host, made.ns, CacheSettings(calibrate=False),
                            state=(made.sdev, made.shost), layer_map=layer_map)
            cache.close()
    finally:
        made.close()


def test_layer_map_on_a_kv_only_cache_is_refused(runtime):
    """Found: ``layer_map`` only means something with ``state=``; on a KV-only cache any value (even 12345) is
    silently ignored (cache.py passes it to StateTier only when state pools exist) instead of being refused."""
    dev = DevicePool.allocate(TINY, 8, 0, runtime=runtime)
    host = HostPool.allocate(TINY, "page_first", pages=8, kind="pinned", runtime=runtime)
    try:
        with pytest.raises(InvalidArgument):
            cache = KVCache(dev, host, Namespace("kv-only", TINY, "bfloat16"), CacheSettings(calibrate=False),
                            layer_map=12345)
            cache.close()
    finally:
        host.close()
        dev.close()


@pytest.mark.parametrize("hybrid", [{"write_policy": "write_through_selective", "write_through_threshold": 1}],
                         indirect=True)
def test_selective_write_through_backs_up_a_hot_snapshot_whose_kv_is_on_the_host(hybrid):
    """Found: docs/hybrid.md: "Write policies apply to both [KV and state]"; docs/cache.md: write_through_selective
    backs up "after write_through_threshold matches hit it". A system prompt whose KV reached the host as part of a
    longer prompt's backup, and which later gets its own snapshot, is hit again and again, yet its snapshot is never
    backed up: ``match_prefix`` only picks nodes with ``n.host is None`` as hot (cache.py, the
    WRITE_THROUGH_SELECTIVE branch of match_prefix), ignoring a device-only snapshot. A device eviction then loses the
    snapshot and the hot prefix is no longer servable at all (write_through and write_back both keep it)."""
    cache = hybrid.cache
    system = prompt(2 * P)
    longer = np.concatenate([system, prompt(2 * P)])
    serve_or_fall_back(hybrid, longer)
    serve_or_fall_back(hybrid, longer)                                  # hit: backed up, KV of `system` included
    cache.drain()
    for _ in range(4):
        serve_or_fall_back(hybrid, system)                 # `system` gets its own snapshot, then is hit 3 times
        cache.drain()
    match = cache.match_prefix(system)
    assert match.last_node.hits >= 2 and match.device_state is not None
    cache.evict(device_pages=16)
    cache.drain()
    assert cache.match_prefix(system).cached_tokens == 2 * P, \
        "a hot prefix's snapshot was never backed up under write_through_selective and was lost with its device pages"
    cache.check()


def _gauge(cache, queue):
    return cache.metrics.registry.get_sample_value("kvtier_cache_queue_depth", {"queue": queue})


@pytest.mark.parametrize("split_node", [False, True], ids=["same-prefix", "split-prefix"])
def test_write_through_backs_up_a_snapshot_adopted_during_a_backup(split_node):
    """Found: docs/hybrid.md: "write_through backs up a snapshot with its KV when inserted". If the KV backup
    is still in flight when the snapshot is adopted (a KV-only insert of the same prefix, or, as in a chat, the
    write-through of a longer prompt whose node ``match_prefix`` splits so that the prefix's own snapshot lands on
    the head), the write-through request finds ``node.writing`` set and backs up nothing:
    ``Tiers._backup_chain`` (tiers.py) skips a state when ``node.writing is not None`` and the KV is already
    assigned host pages, and nothing asks again when that backup completes. The snapshot is then never on the host,
    and a device eviction loses the prefix for good. The first backup is kept in flight by ordering it after a long
    kernel on the model's stream; the second insert uses ``after=None`` so this thread does not wait on the emulated
    device (the emulator's event record takes the lock a waiting thread holds; a GPU would not)."""
    import time

    for seed in range(3):
        runtime = EmulatedRuntime("split", seed=seed)
        made = Hybrid(runtime)
        try:
            cache, model = made.cache, made.model
            tokens = prompt(6 * P)
            prefix = tokens[:3 * P] if split_node else tokens
            pages, slot = cache.allocate(6), cache.allocate_state()
            model.write(tokens, pages)
            model.write_state(tokens, slot)
            again, again_slot = cache.allocate(len(prefix) // P), cache.allocate_state()
            model.write(prefix, again)
            model.write_state(prefix, again_slot)
            stream = runtime.create_stream(0)
            runtime.busy(stream, 300_000)                    # the model's long kernel: the backup waits for it
            with runtime.use_stream(stream):
                if split_node:
                    cache.insert(tokens, pages, state=slot)  # write-through backup of the whole prompt
                else:
                    cache.insert(tokens, pages)              # KV only (no snapshot yet): write-through of the KV
            deadline = time.monotonic() + 30
            while not (_gauge(cache, "backup_requests") == 0 and _gauge(cache, "backups_in_flight") == 1):
                assert time.monotonic() < deadline, "set-up: the first backup was never seen in flight"
                time.sleep(0.001)
            cache.match_prefix(prefix)                       # split_node: splits the node being backed up
            inserted = cache.insert(prefix, again, state=again_slot, after=None)
            assert inserted.state_kept
            in_flight = _gauge(cache, "backups_in_flight")
            cache.drain()
            assert in_flight == 1, "set-up: the first backup finished before the snapshot was adopted"
            match = cache.match_prefix(prefix)
            assert match.host_state is not None, \
                f"seed {seed}: write_through never backed up a snapshot adopted while its node's backup was in flight"
        finally:
            made.close()



def test_bad_slots_and_counts_are_refused_and_change_nothing(hybrid):
    cache, model = hybrid.cache, hybrid.model
    tokens = prompt(4 * P)
    serve_or_fall_back(hybrid, tokens)
    serve_or_fall_back(hybrid, tokens)
    match = cache.match_prefix(tokens, lock=True)
    tree_slot = match.device_state
    other = prompt(2 * P)
    pages = cache.allocate(2)
    model.write(other, pages)
    with pytest.raises(InvalidArgument, match="cache's own"):
        cache.insert(other, pages, state=tree_slot)        # the tree's snapshot handed back as a caller slot
    with pytest.raises(InvalidArgument, match="cache's own"):
        cache.free_state(tree_slot)
    for bad in (-1, 99, 1.0, "1", True, None):
        with pytest.raises(InvalidArgument):
            cache.free_state(bad)
    slot = cache.allocate_state()
    cache.free_state(np.int64(slot))
    with pytest.raises(InvalidArgument, match="not allocated"):
        cache.free_state(slot)
    with pytest.raises(InvalidArgument):
        cache.evict_states(device=-1)
    slot = cache.allocate_state()
    with pytest.raises(InvalidArgument, match="whole pages"):
        cache.insert([], [], state=slot)
    with pytest.raises(InvalidArgument):
        cache.insert(other, pages[:1], state=slot)          # too few pages: nothing taken, slot still the caller's
    cache.free_state(slot)
    cache.free(pages)
    cache.unlock(match)
    assert serve_or_fall_back(hybrid, tokens) == 4 * P
    cache.check()


def test_an_insert_ending_mid_node_gets_its_own_snapshot_and_both_survive_a_round_trip(hybrid):
    cache, model = hybrid.cache, hybrid.model
    tokens = prompt(6 * P)
    serve_or_fall_back(hybrid, tokens)
    cache.drain()    # (was flaky without it: test_write_through_backs_up_a_snapshot_adopted_during_a_backup)
    assert serve_or_fall_back(hybrid, tokens[:3 * P]) == 0              # mid-node: KV yes, state no
    assert serve_or_fall_back(hybrid, tokens[:3 * P]) == 3 * P
    assert serve_or_fall_back(hybrid, tokens) == 6 * P
    cache.drain()
    cache.evict(device_pages=16)
    model.poison_kv()
    model.poison_states()
    assert serve_or_fall_back(hybrid, tokens) == 6 * P
    assert serve_or_fall_back(hybrid, tokens[:3 * P]) == 3 * P
    cache.check()


def test_stale_or_repeated_load_backs_move_nothing(hybrid):
    cache, _model = hybrid.cache, hybrid.model
    tokens = prompt(4 * P)
    serve_or_fall_back(hybrid, tokens)
    cache.drain()
    cache.evict(device_pages=16)
    match = cache.match_prefix(tokens, lock=True)
    load = cache.load_back(match, force=True)
    assert cache.load_back(match, force=True) is None      # already loading: nothing more
    load.wait()
    cache.unlock(match)
    cache.evict(device_pages=16)
    stale = cache.match_prefix(tokens)                     # not locked
    cache.evict(host_pages=32)
    cache.evict_states(host=8)
    for _ in range(3):
        serve_or_fall_back(hybrid, prompt(4 * P))                       # host pages and slots reused by others
    cache.drain()
    assert cache.load_back(stale, force=True) is None
    cache.check()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_snapshot_written_asynchronously_is_backed_up_after_the_write(policy):
    """The state is written on the model's stream behind a long kernel; insert(state=) inside that stream; the backup
    (write-through at insert, write-back at eviction) must copy the written bytes, for every emulator seed."""
    from kvtier.memory import CpuAddress

    for seed in range(8):
        runtime = EmulatedRuntime("split", seed=seed)
        made = Hybrid(runtime, write_policy=policy)
        staged = []
        try:
            cache, model = made.cache, made.model
            tokens = prompt(4 * P)
            stream = runtime.create_stream(0)
            with runtime.use_stream(stream):
                pages = cache.allocate(4)
                slot = cache.allocate_state()
                runtime.busy(stream, 60)
                model.write(tokens, pages)
                for chunk, (_, base, stride) in zip(model.state(tokens), model.items, strict=True):
                    buffer = runtime.host_alloc(chunk.nbytes)
                    staged.append(buffer)
                    np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * chunk.nbytes).from_address(buffer))[:] = chunk
                    runtime.memcpy_async(base + slot * stride, CpuAddress(buffer), chunk.nbytes, stream=stream)
                cache.insert(tokens, pages, state=slot)
                if policy == "write_back":
                    cache.evict_states(device=4)
            cache.drain()
            stream.synchronize()
            cache.evict(device_pages=16)
            model.poison_states()
            match = cache.match_prefix(tokens, lock=True)
            load = cache.load_back(match, force=True)
            assert load is not None
            load.wait()
            assert model.state_ok(tokens, load.device_state), f"seed {seed}: a stale state was backed up"
            cache.unlock(match)
        finally:
            made.close()
            for buffer in staged:
                runtime.host_free(buffer)


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_three_threads_serve_evict_and_evict_states_under_pressure(policy):
    for seed in range(3):
        runtime = EmulatedRuntime("split", seed=seed)
        made = Hybrid(runtime, write_policy=policy, device_pages=12, host_pages=20, device_states=3, host_states=5)
        errors: list[BaseException] = []
        systems = [prompt(2 * P) for _ in range(2)]

        def user(s, made=made, errors=errors, systems=systems):
            rng = np.random.default_rng(s)
            history = systems[s % 2]
            try:
                for _ in range(30):
                    roll = rng.random()
                    if roll < 0.1:
                        made.cache.evict(device_pages=int(rng.integers(0, 8)), host_pages=int(rng.integers(0, 8)))
                    elif roll < 0.2:
                        made.cache.evict_states(device=int(rng.integers(0, 3)), host=int(rng.integers(0, 3)))
                    else:
                        if len(history) > 8 * P:
                            history = systems[s % 2]
                        history = np.concatenate([history, prompt(P, rng)])
                        with contextlib.suppress(OutOfPages):
                            serve_or_fall_back(made, history)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=user, args=(seed * 10 + i,)) for i in range(3)]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not errors, errors
            made.cache.drain()
            made.cache.check()
        finally:
            made.close()


def test_close_while_two_threads_serve():
    for seed in range(6):
        runtime = EmulatedRuntime("split", seed=seed)
        made = Hybrid(runtime, write_policy="write_back" if seed % 2 else "write_through", device_pages=12,
                      host_pages=20, device_states=3, host_states=5)
        errors: list[BaseException] = []
        started = threading.Event()

        def user(s, made=made, errors=errors, started=started):
            rng = np.random.default_rng(s)
            history = prompt(2 * P, rng)
            try:
                for i in range(200):
                    if i == 3:
                        started.set()
                    if len(history) > 8 * P:
                        history = history[:2 * P]
                    history = np.concatenate([history, prompt(P, rng)])
                    with contextlib.suppress(OutOfPages):
                        serve_or_fall_back(made, history)
                    made.cache.evict_states(device=1)
            except BufferClosed:
                pass
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                started.set()

        threads = [threading.Thread(target=user, args=(seed * 7 + i,)) for i in range(2)]
        try:
            for thread in threads:
                thread.start()
            started.wait()
            made.cache.close()
            for thread in threads:
                thread.join()
            assert not errors, errors
        finally:
            made.close()
