"""Adversarial tests of the hybrid cache (KV + state snapshots), the model-family pools / FamilyEngine and the HiSparse
HotBuffer, written against the public docs (README.md, docs/hybrid.md, docs/families.md, docs/cache.md).

Tests whose docstring starts "Regression" failed on the commit they were written against (8ac3588), each for the
reason the docstring states, and pass since the fix; the others held up there and stay as coverage.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
from helpers.cache import TINY, prompt
from helpers.hisparse import host_offset, setup
from helpers.hybrid import Hybrid

from kvtier.cache import CacheSettings, KVCache, Namespace, OutOfPages
from kvtier.errors import BufferClosed, InvalidArgument, KvtierError
from kvtier.pools import DevicePool, HostPool
from kvtier.runtime.emulated import EmulatedRuntime

P = TINY.page_size
# TINY has 2 KV layers, STATE 6 state layers: a valid map names ("kv", 0..1) and ("state", 0..5) once each
GOOD_MAP = [("state", 0), ("state", 1), ("state", 2), ("kv", 0), ("state", 3), ("state", 4), ("state", 5), ("kv", 1)]


@pytest.fixture
def hybrid(runtime, request):
    made = Hybrid(runtime, **getattr(request, "param", {}))
    yield made
    made.close()


def serve(h: Hybrid, tokens) -> int:
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


# =====================================================================================================================
# Hybrid cache: defects
# =====================================================================================================================
@pytest.mark.parametrize("bad", [
    pytest.param(["kv"] * 8, id="strings-not-pairs"),
    pytest.param([("kv",)] * 8, id="one-tuples"),
    pytest.param(5, id="an-int"),
    pytest.param({"kv": 0, "state": 1}, id="a-dict"),
])
def test_malformed_layer_map_raises_a_kvtier_error(runtime, bad):
    """Regression. ``KVCache(..., layer_map=...)`` with a malformed map raises a raw ValueError / TypeError from
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
    """Regression. A layer map entry whose index is not an integer (0.7, "0", False) is silently coerced with ``int()``
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
    """Regression. ``layer_map`` only means something with ``state=``; on a KV-only cache any value (even 12345) is
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
    """Regression. docs/hybrid.md: "Write policies apply to both [KV and state]"; docs/cache.md: write_through_selective
    backs up "after write_through_threshold matches hit it". A system prompt whose KV reached the host as part of a
    longer prompt's backup, and which later gets its own snapshot, is hit again and again, yet its snapshot is never
    backed up: ``match_prefix`` only picks nodes with ``n.host is None`` as hot (cache.py, the
    WRITE_THROUGH_SELECTIVE branch of match_prefix), ignoring a device-only snapshot. A device eviction then loses the
    snapshot and the hot prefix is no longer servable at all (write_through and write_back both keep it)."""
    cache = hybrid.cache
    system = prompt(2 * P)
    longer = np.concatenate([system, prompt(2 * P)])
    serve(hybrid, longer)
    serve(hybrid, longer)                                  # hit: backed up, KV of `system` included
    cache.drain()
    for _ in range(4):
        serve(hybrid, system)                              # `system` gets its own snapshot, then is hit 3 times
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
    """Regression. docs/hybrid.md: "write_through backs up a snapshot with its KV when inserted". If the KV backup
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


# =====================================================================================================================
# Hybrid cache: attacks that held up (coverage)
# =====================================================================================================================
def test_bad_slots_and_counts_are_refused_and_change_nothing(hybrid):
    cache, model = hybrid.cache, hybrid.model
    tokens = prompt(4 * P)
    serve(hybrid, tokens)
    serve(hybrid, tokens)
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
    assert serve(hybrid, tokens) == 4 * P
    cache.check()


def test_an_insert_ending_mid_node_gets_its_own_snapshot_and_both_survive_a_round_trip(hybrid):
    cache, model = hybrid.cache, hybrid.model
    tokens = prompt(6 * P)
    serve(hybrid, tokens)
    cache.drain()    # (was flaky without it: test_write_through_backs_up_a_snapshot_adopted_during_a_backup)
    assert serve(hybrid, tokens[:3 * P]) == 0              # mid-node: KV yes, state no
    assert serve(hybrid, tokens[:3 * P]) == 3 * P
    assert serve(hybrid, tokens) == 6 * P
    cache.drain()
    cache.evict(device_pages=16)
    model.poison_kv()
    model.poison_states()
    assert serve(hybrid, tokens) == 6 * P
    assert serve(hybrid, tokens[:3 * P]) == 3 * P
    cache.check()


def test_stale_or_repeated_load_backs_move_nothing(hybrid):
    cache, _model = hybrid.cache, hybrid.model
    tokens = prompt(4 * P)
    serve(hybrid, tokens)
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
        serve(hybrid, prompt(4 * P))                       # host pages and slots reused by others
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
                            serve(made, history)
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
                        serve(made, history)
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


# =====================================================================================================================
# HiSparse HotBuffer: defects
# =====================================================================================================================
def test_hotbuffer_int64_topk_entries_outside_int32_get_row_minus_one(runtime):
    """Regression. docs/families.md: "Entries outside [0, seq_len) (padding -1) get row -1". An int64 top-k array is
    accepted (``np.issubdtype(top.dtype, np.integer)``) and then truncated with ``top.astype(np.int32)``
    (hisparse.py, HotBuffer._upload), so 2**32 + 1 becomes token 1 and 2**33 token 0: both get the rows of real
    tokens instead of -1 (or a refusal)."""
    with setup(runtime, "mla", "page_first", requests=1, slots=4, top_k=4, max_tokens=12) as s:
        top = np.array([[2**32 + 1, 2**33, -1, 3]], np.int64)
        try:
            out = s.hb.swap_in(0, [0], top, [10])
        except KvtierError:
            return                                          # a refusal is fine too
        s.hb.synchronize()
        got = np.frombuffer(out.download(0, 4 * 8), np.int64)
        assert got.tolist()[:3] == [-1, -1, -1], f"out-of-range top-k entries got rows {got.tolist()[:2]}"


def test_hotbuffer_refuses_device_rows_another_request_holds(runtime):
    """Regression. ``assign`` checks that a request's rows are distinct and in range, but not that they are free of
    other requests' rows: two requests sharing rows overwrite each other's hot tokens (request 0's swap-in copies
    token 7 into the row that request 1 serves as its token 0). Shown here with the bytes request 1 is served."""
    with setup(runtime, "mla", "page_first", requests=2, slots=4, top_k=4, max_tokens=12) as s:
        shared = s.dev_locs[0]
        try:
            s.hb.assign(1, s.host_locs[1], shared)
        except KvtierError:
            return                                          # refused: fine
        # request 1 holds tokens 0..3 in rows shared[0..3] (its prefill wrote them there)
        before = {t: s.device[(0, 0)][shared[t]].copy() for t in range(4)}
        s.hb.swap_in(0, [0], np.array([[7, 8, -1, -1]], np.int32), [10])   # request 0: two misses
        out = s.hb.swap_in(0, [1], np.array([[0, 1, 2, 3]], np.int32), [4])  # request 1: all resident
        s.hb.synchronize()
        rows = np.frombuffer(out.download(0, 4 * 8), np.int64)
        from helpers.pools import read_device
        now = read_device(s.dev, 0, 0)
        served = [t for t in range(4) if not np.array_equal(now[rows[t]], before[t])]
        assert not served, f"request 1 was served other bytes for tokens {served}: its rows were request 0's"


def test_hotbuffer_backup_newest_refuses_a_request_named_twice(runtime):
    """Regression. ``swap_in`` refuses a request twice in one batch; ``backup_newest`` does not, so
    ``backup_newest([0, 0], [9, 10])`` copies the one newest-token row over the host KV of token 8 as well as token 9
    (hisparse.py, backup_newest: no duplicate check), destroying token 8's only full copy; a later miss of token 8
    swaps the wrong bytes in."""
    with setup(runtime, "mla", "page_first", requests=1, slots=4, top_k=4, max_tokens=12) as s:
        unit = int(s.host_locs[0][8])                       # token 8: not the newest at seq_len 10
        offsets = [host_offset(s.host, t, layer, unit) for t in range(s.g.tensors) for layer in range(s.L)]
        try:
            s.hb.backup_newest([0, 0], [9, 10]).wait()
        except KvtierError:
            return                                          # refused: fine
        from helpers.pools import host_bytes
        after = host_bytes(s.host)
        clobbered = [o for o in offsets if not np.array_equal(after[o:o + s.g.row_bytes],
                                                              s.host_data[o:o + s.g.row_bytes])]
        assert not clobbered, "backup_newest overwrote token 8's host KV with the newest-token row"


def test_hotbuffer_fast_path_after_swaps_serves_rows_that_hold_other_tokens(runtime):
    """Regression (contract gap). docs/families.md: "A sequence no longer than slots is wholly resident (token t in row
    t)". After the request's sequence grew past ``slots`` and swap-ins replaced tokens 0 and 1 with 7 and 8, a step
    with seq_len <= slots (a rollback, or a reused request without ``assign``) takes the fast path and returns row t
    for token t, although the buffer's own state says those rows hold tokens 7 and 8: wrong KV rows, silently. The
    kernel's fast path (reference.hot_swap_in: ``if seq <= n_slots: result = dloc[top]``) ignores slot_tokens; the
    host-side check in _upload could refuse it or the buffer could reset."""
    with setup(runtime, "mla", "page_first", requests=1, slots=4, top_k=4, max_tokens=12) as s:
        s.hb.swap_in(0, [0], np.array([[7, 8, -1, -1]], np.int32), [10])
        try:
            out = s.hb.swap_in(0, [0], np.array([[0, 1, 2, 3]], np.int32), [4])
        except KvtierError:
            return                                          # refused: fine
        s.hb.synchronize()
        rows = np.frombuffer(out.download(0, 4 * 8), np.int64).tolist()
        state = s.hb.read_state(0, 0)
        held = {int(row): int(token) for row, token in zip(state["device_rows"][:s.N], state["slot_tokens"][:s.N],
                                                            strict=True)}
        wrong = {t: held.get(rows[t]) for t in range(4) if held.get(rows[t]) != t}
        assert not wrong, f"token -> token the returned row holds: {wrong}"


# =====================================================================================================================
# HiSparse HotBuffer: attacks that held up (coverage)
# =====================================================================================================================
def test_hotbuffer_bad_inputs_are_refused(runtime):
    with setup(runtime, "mla", "page_first", requests=1, slots=4, top_k=4, max_tokens=12) as s:
        good = np.array([[7, 8, -1, -1]], np.int32)
        cases = [
            (lambda: s.hb.swap_in(0, [0], good.astype(np.float64), [10]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [0], good.astype(bool), [10]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [0], good[:, :3], [10]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [0], good, [0]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [0], good, [13]), InvalidArgument),
            (lambda: s.hb.swap_in(2, [0], good, [10]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [0, 0], np.repeat(good, 2, 0), [10, 10]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [1], good, [10]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [0], good, [10], out=np.zeros(4, np.int64)), KvtierError),
            (lambda: s.hb.backup_newest([0], [4]), InvalidArgument),
            (lambda: s.hb.assign(0, np.arange(13)), InvalidArgument),
            (lambda: s.hb.assign(0, [-1, 2]), InvalidArgument),
            (lambda: s.hb.assign(0, [10**6]), InvalidArgument),
            (lambda: s.hb.assign(0, [0, 1], [0, 1, 2, 3, 99]), InvalidArgument),
            (lambda: s.hb.assign(0, [0, 1], [0, 1, 2, 3, 3]), InvalidArgument),
            (lambda: s.hb.assign(1, [0, 1]), InvalidArgument),
        ]
        for call, error in cases:
            with pytest.raises(error):
                call()
        s.check_memory()
        s.hb.close()
        with pytest.raises(BufferClosed):
            s.hb.swap_in(0, [0], good, [10])


# =====================================================================================================================
# FamilyEngine: attacks that held up (coverage)
# =====================================================================================================================
def test_family_backup_with_more_entries_than_the_device_pool_and_odd_calls(runtime):
    """Sources may repeat on a backup, so a backup may name far more units than the index ring was sized for
    (two transfers of the whole device pool): the bytes still land. Empty and layer-subset calls behave."""
    from helpers.families import STATES, DeviceImage, fill_host, host_bytes, state_backup_expected, state_pools

    g = STATES["fp32"](2)
    with state_pools(runtime, g, slots=2, host_slots=300) as (dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        device = image.fill()
        before = fill_host(host)
        src, dst = np.array([0, 1] * 150), np.arange(300)
        engine.backup(src, dst).wait()
        np.testing.assert_array_equal(host_bytes(host), state_backup_expected(model, device, before, src, dst))
        assert engine.load([0], [0], layers=[]).layer_events == {}
        assert sorted(engine.load([0], [0], layers=np.array([1])).layer_events) == [1]
        engine.load([], [], per_layer=False).wait()
        engine.capture_load([], [], layer=0).close()
        for call in (lambda: engine.load([True], [False]), lambda: engine.load(np.array([2**63], np.uint64), [0]),
                     lambda: engine.load([0], [0], unit="bogus"), lambda: engine.capture_load([0], [0], layer=-1)):
            with pytest.raises(InvalidArgument):
                call()
