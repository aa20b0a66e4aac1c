"""Hybrid models in the cache (GQA KV in page pools, linear-attention state in state pools): a match ends only where
a state snapshot exists; backup, eviction and load-back move KV and state together, all or nothing. Every byte
served (KV and state) is checked against fresh random bytes, over poisoned destinations."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.cache import P, prompt
from helpers.hybrid import Hybrid

from kvtier.cache import CacheSettings, KVCache, OutOfPages, token_array
from kvtier.cache.state_tier import interleaved_layers
from kvtier.errors import BufferClosed, InvalidArgument
from kvtier.storage import open_store


@pytest.fixture
def hybrid(runtime, request):
    made = Hybrid(runtime, **getattr(request, "param", {}))
    yield made
    made.close()


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


def test_a_kv_only_cache_refuses_state_calls_and_storage_refuses_hybrids(runtime):
    from helpers.cache import build, close_all

    cache, _, dev, host = build(runtime)
    try:
        with pytest.raises(InvalidArgument, match="no state tier"):
            cache.allocate_state()
    finally:
        close_all(cache, dev, host)
    made = Hybrid(runtime)
    try:
        made.cache.close()
        store = open_store("memory:", made.ns, layout="page_first")
        with pytest.raises(InvalidArgument, match="storage"):
            KVCache(made.dev, made.host, made.ns, CacheSettings(calibrate=False), storage=store,
                    state=(made.sdev, made.shost))
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
