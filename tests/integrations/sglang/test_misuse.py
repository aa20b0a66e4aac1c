"""What SGLang (or a user wiring kvtier by hand) can get wrong, and what a shared store can do underneath a deployment:
host indices that are not one run of a page's slots, keys that look alike, a pool registered twice, a DCP MLA
deployment, a fork, a writer killed mid-write, a store cleared or deleted under a running instance, threads racing on
one key. Every page read back is byte-exact or a miss (destinations poisoned first, bytes compared), nothing raises,
and a bad call fails whole with nothing read or written.

Tests marked ``DEFECT`` fail on the code they were written against; each names what a user would hit."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import torch
from helpers import sglang as sg
from helpers.paths import ROOT, TESTS

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


@pytest.fixture(autouse=True)
def _host_memory_budget():
    """SGLang's host pools refuse to allocate when the machine's free memory is under its reserve (several GB), even
    for the few hundred KiB these pools take; on a busy machine that fails every test before kvtier runs. Book the
    pools against a budget of their own (SGLang's host_memory_budget_scope), as its launcher does."""
    base = sg.import_host_pools() and __import__("sglang.srt.mem_cache.pool_host.base", fromlist=["_"])
    with base.host_memory_budget_scope(1 << 40):
        yield


def _slot(pool, slot: int) -> bytes:
    """Every byte of one token slot of an MHA host pool (K and V of every layer), whatever its layout."""
    buf = pool.kv_buffer.view(torch.uint8)
    if pool.layout == "layer_first":                   # [2, layers, size, heads, dim]
        row = buf[:, :, slot]
    elif pool.layout == "page_first":                  # [2, size, layers, heads, dim]
        row = buf[:, slot]
    else:                                              # page_first_direct: [2, pages, layers, page_size, heads, dim]
        row = buf[:, slot // pool.page_size, :, slot % pool.page_size]
    return row.clone().numpy().tobytes()


def _slots(pool, slots) -> list[bytes]:
    return [_slot(pool, int(s)) for s in slots]


def _whole_pool(pool) -> bytes:
    return pool.kv_buffer.view(torch.uint8).clone().numpy().tobytes()


# --- host indices -------------------------------------------------------------------------------------------------


# DEFECT: a page's host indices are taken at their first index only (as SGLang's get_page_buffer_meta does), never
# checked to be one run of consecutive slots. A page given as slots [3, 2, 1, 0], or one starting mid-page in
# page_first_direct, is read into slots the call never named (the next page's KV is overwritten) and reported as a hit.
@pytest.mark.parametrize("layout", MHA_LAYOUTS)
@pytest.mark.parametrize("shape", ["reversed", "shifted by one", "one slot of another page"])
def test_a_read_into_slots_that_are_not_one_run_touches_no_other_slot(file_spec, backends, layout, shape):
    """A read either fills exactly the slots it names, token j into slot j of the list, or fails; the slots of
    every other page stay as they were."""
    pool = sg.mha_host_pool(layout)
    backend = sg.create_backend(file_spec, pool)
    backends.append(backend)
    keys, indices, _ = sg.store_pages(backend, pool, pages=1, salt="run")
    # what the page holds, token by token: read it back the regular way first
    assert backend.batch_get_v1(keys, indices) == [True]
    tokens = _slots(pool, indices)
    others = sg.pages_at(pool, 2)                       # the next two pages, holding KV of their own
    sg.fill_pages(pool, others, seed=21)
    sg.poison_pages(pool, indices)
    if shape == "reversed":
        into = indices.flip(0)
    elif shape == "shifted by one":
        into = indices + 1
    else:
        into = torch.cat([indices[:-1], others[-1:]])
    named = {int(s) for s in into}
    untouched = [s for s in range(int(indices[0]), int(others[-1]) + 1) if s not in named]
    before = _slots(pool, untouched)

    answer = backend.batch_get_v1(keys, into)

    assert answer in ([True], [False])
    assert _slots(pool, untouched) == before, f"slots the call never named were written ({shape}, {layout})"
    if answer == [True]:
        assert _slots(pool, into) == tokens


# DEFECT: the same: a write whose page names slots [0, 1, 2] of one page and a slot of another stores slots 0..3
# (one slot the call never named) under the key, and says it stored the page.
@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_a_write_from_slots_that_are_not_one_run_stores_those_slots_or_nothing(file_spec, backends, layout):
    pool = sg.mha_host_pool(layout)
    backend = sg.create_backend(file_spec, pool)
    backends.append(backend)
    indices = sg.pages_at(pool, 2)
    sg.fill_pages(pool, indices, seed=5)
    ps = pool.page_size
    source = torch.cat([indices[:ps - 1], indices[-1:]])     # three slots of page 0, the last slot of page 1
    expected = _slots(pool, source)
    key = sg.page_keys(1, "mixed")

    answer = backend.batch_set_v1(key, source)

    assert answer in ([True], [False])
    if answer == [False]:
        assert backend.batch_exists(key) == 0
        return
    into = sg.pages_at(pool, 1)
    sg.poison_pages(pool, into)
    assert backend.batch_get_v1(key, into) == [True]
    assert _slots(pool, into) == expected, "the stored page holds a slot the write never named"


# DEFECT: float and bool index tensors are accepted: 0.5 is a byte offset of half a token, so a read lands KV across
# token boundaries and reports a hit; a bool tensor of True is slot 1, a page that starts mid-page.
@pytest.mark.parametrize("kind", ["fractional floats", "bools"])
def test_host_indices_that_are_not_integers_fail_whole(file_spec, backends, kind, caplog):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(file_spec, pool)
    backends.append(backend)
    keys, indices, _ = sg.store_pages(backend, pool, pages=2, salt="floats")
    bad = indices.double() + 0.5 if kind == "fractional floats" else torch.ones(indices.numel(), dtype=torch.bool)
    before = _whole_pool(pool)
    assert backend.batch_get_v1(keys, bad) == [False, False]
    assert _whole_pool(pool) == before
    fresh = sg.page_keys(2, "floats-set")
    assert backend.batch_set_v1(fresh, bad) == [False, False]
    assert backend.batch_exists(fresh) == 0


def test_int32_host_indices_round_trip_byte_exact(spec, backends):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(spec, pool)
    backends.append(backend)
    keys, indices = sg.page_keys(3, "int32"), sg.pages_at(pool, 3)
    sg.fill_pages(pool, indices, seed=32)
    written = sg.page_bytes(pool, indices)
    assert backend.batch_set_v1(keys, indices.to(torch.int32)) == [True] * 3
    sg.poison_pages(pool, indices)
    assert backend.batch_get_v1(keys, indices.to(torch.int32)) == [True] * 3
    assert sg.page_bytes(pool, indices) == written


def test_a_page_straddling_the_pools_end_is_refused(file_spec, backends):
    """The last page's indices pushed past the pool's end by one slot: refused whole, nothing stored."""
    for layout in MHA_LAYOUTS:
        pool = sg.mha_host_pool(layout)
        backend = sg.create_backend(file_spec, pool)
        backends.append(backend)
        last = torch.arange(pool.size - pool.page_size, pool.size)
        keys = sg.page_keys(2, "end-" + layout)
        assert backend.batch_set_v1(keys[:1], last) == [True]
        for shift in (1, pool.page_size - 1, pool.page_size):
            assert backend.batch_set_v1(keys[1:], last + shift) == [False], (layout, shift)
        assert backend.batch_exists(keys[1:]) == 0


def test_a_thousand_pages_in_one_call_round_trip(file_spec, backends):
    pool = sg.mha_host_pool("page_first", tokens=4096)
    backend = sg.create_backend(file_spec, pool)
    backends.append(backend)
    keys, indices = sg.page_keys(1200, "many"), sg.pages_at(pool, 1200)
    sg.fill_pages(pool, indices, seed=12)
    written = sg.page_bytes(pool, indices)
    assert backend.batch_set_v1(keys, indices) == [True] * 1200
    sg.poison_pages(pool, indices)
    assert backend.batch_exists(keys) == 1200
    assert backend.batch_get_v1(keys, indices) == [True] * 1200
    assert sg.page_bytes(pool, indices) == written


def test_one_key_written_twice_in_a_batch_stores_one_whole_page(spec, backends):
    """A write naming one key twice, with different bytes in the two pages: both answers are whole, and what is
    stored is one of the two pages, byte for byte."""
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(spec, pool, skip_existing=False)
    backends.append(backend)
    key, indices = sg.page_keys(1, "written-twice"), sg.pages_at(pool, 2)
    sg.fill_pages(pool, indices, seed=2)
    ps = pool.page_size
    first, second = sg.page_bytes(pool, indices[:ps]), sg.page_bytes(pool, indices[ps:])
    assert first != second
    assert backend.batch_set_v1(key * 2, indices) == [True, True]
    into = sg.pages_at(pool, 1)
    sg.poison_pages(pool, into)
    assert backend.batch_get_v1(key, into) == [True]
    assert sg.page_bytes(pool, into) in (first, second)


# DEFECT (mooncake): a read naming one stored key twice (two destinations for one page) gets misses for it and every
# page after it, counts the page as corrupt, and deletes the good page from the store: the next request that needs it
# recomputes it. On a file store or Redis both destinations get the page.
def test_a_read_naming_one_key_twice_fills_both_and_keeps_the_page(spec, backends):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(spec, pool)
    backends.append(backend)
    keys, indices, written = sg.store_pages(backend, pool, pages=3, salt="read-twice")
    ps = pool.page_size
    sg.restore_pages(pool, indices, written)
    pages = [sg.page_bytes(pool, indices[i * ps:(i + 1) * ps]) for i in range(3)]
    into = sg.pages_at(pool, 4)
    sg.poison_pages(pool, into)
    answer = backend.batch_get_v1([keys[0], keys[1], keys[1], keys[2]], into)
    assert backend.batch_exists(keys) == 3, "a good page was removed"
    assert answer == [True] * 4
    got = [sg.page_bytes(pool, into[i * ps:(i + 1) * ps]) for i in range(4)]
    assert got == [pages[0], pages[1], pages[1], pages[2]]
    flats = [pool.get_dummy_flat_data_page() for _ in range(2)]
    assert [t is not None for t in backend.batch_get(keys[:1] * 2, flats)] == [True, True]
    assert backend.batch_exists(keys) == 3


def test_two_pages_read_into_the_same_slots_leave_one_whole_page(spec, backends):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(spec, pool)
    backends.append(backend)
    keys, at = sg.page_keys(2, "same-slots"), sg.pages_at(pool, 2)
    sg.fill_pages(pool, at, seed=3)
    ps = pool.page_size
    pages = [sg.page_bytes(pool, at[:ps]), sg.page_bytes(pool, at[ps:])]
    assert backend.batch_set_v1(keys, at) == [True, True]
    sg.poison_pages(pool, at)
    answer = backend.batch_get_v1(keys, torch.cat([at[:ps], at[:ps]]))
    assert answer in ([True, True], [False, False])
    if answer == [True, True]:
        assert sg.page_bytes(pool, at[:ps]) in pages
    assert backend.batch_exists(keys) == 2


# --- keys ---------------------------------------------------------------------------------------------------------


# DEFECT: a 64-character hex key is stored under bytes.fromhex(key), which ignores case: "AB…" and "ab…" are one page.
# A key never stored hits another key's KV.
def test_keys_that_differ_only_in_hex_case_are_different_pages(file_spec, backends):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(file_spec, pool)
    backends.append(backend)
    keys, indices, _ = sg.store_pages(backend, pool, pages=1, salt="case")
    other = [keys[0].upper()]
    assert other != keys
    assert backend.batch_exists(other) == 0
    assert backend.batch_get_v1(other, indices) == [False]
    assert backend.exists(other[0]) is False


@pytest.mark.parametrize("key", ["é" * 64, "g" * 64, "x" * 100_000, "\x00" * 64, "k", "a" * 63, "ab" * 40],
                         ids=["unicode", "non-hex-64", "huge", "nul", "short", "odd-hex", "long-hex"])
def test_keys_of_any_shape_round_trip_and_stay_apart(spec, backends, key):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(spec, pool)
    backends.append(backend)
    indices = sg.pages_at(pool, 1)
    sg.fill_pages(pool, indices, seed=len(key))
    written = sg.page_bytes(pool, indices)
    neighbour = key[:-1] + ("b" if key[-1] != "b" else "c")
    assert backend.batch_set_v1([key], indices) == [True]
    assert backend.batch_exists([neighbour]) == 0
    sg.poison_pages(pool, indices)
    assert backend.batch_get_v1([key], indices) == [True]
    assert sg.page_bytes(pool, indices) == written


# --- registration -------------------------------------------------------------------------------------------------


# DEFECT: a second register_mem_host_pool_v2 under a name already registered, with another pool, is dropped without a
# word (SGLang's HiCacheStorage replaces the pool); the transfers that name it then read and write the first pool's
# memory and report success, so the pool SGLang hands indices of never gets its state.
def test_a_pool_registered_again_under_its_name_is_the_one_transfers_use(file_spec, backends):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    kv = sg.mha_host_pool("page_first")
    first, second = sg.mamba_host_pool(), sg.mamba_host_pool()
    backend = sg.create_backend(file_spec, kv)
    backends.append(backend)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(first, PoolName.MAMBA)
    backend.on_host_pools_registered()
    backend.register_mem_host_pool_v2(second, PoolName.MAMBA)      # a sidecar re-registered: the new pool

    keys, kv_at = sg.page_keys(1, "again"), sg.pages_at(kv, 1)
    sg.fill_pages(kv, kv_at, seed=1)
    slot = second.alloc(1)
    first_slot = first.alloc(1)
    sg.fill_pages(second, slot, seed=2)
    sg.fill_pages(first, first_slot, seed=3)
    state = sg.page_bytes(second, slot)
    transfer = [PoolTransfer(PoolName.MAMBA, host_indices=slot, keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    written = backend.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=kv_at, keys=keys), *transfer])
    sg.poison_pages(second, slot)
    sg.poison_pages(first, first_slot)
    first_before = sg.page_bytes(first, first_slot)
    read = backend.batch_get_v2(transfer)
    assert sg.page_bytes(first, first_slot) == first_before, "the pool that was replaced was written"
    if written[PoolName.MAMBA] == [True] and read[PoolName.MAMBA] == [True]:
        assert sg.page_bytes(second, slot) == state
    else:
        assert read[PoolName.MAMBA] == [False]


# --- namespaces ---------------------------------------------------------------------------------------------------


def _dcp_mla_pool(dcp_rank: int, *, dcp_size: int = 2, logical_page: int = 8, layers: int = 3, lora: int = 64,
                  rope: int = 32, tokens: int = 256):
    """SGLang's real MLATokenToKVPoolHost of one decode-context-parallel shard (page_size: the widened logical
    page; each rank keeps logical_page / dcp_size rows of it)."""
    sgp = sg.import_host_pools()
    dim = lora + rope
    buffers = tuple(torch.zeros(tokens, 1, dim, dtype=torch.bfloat16) for _ in range(layers))
    info = sgp.info.MLABufferInfo(buffers=buffers, data_ptrs=sg._pointer_table(buffers),
                                  layer_indices=tuple(range(layers)), device_layer_num=layers,
                                  page_size=logical_page, kv_lora_rank=lora, qk_rope_head_dim=rope,
                                  kv_cache_dim=dim, dtype=torch.bfloat16, device=torch.device("cpu"))
    return sgp.MLA(info, 2.0, 0, logical_page, "page_first", pin_memory=False, device="cpu",
                   device_capacity_tokens=tokens, start_layer=0, end_layer=layers, target_layer_num=layers,
                   dcp_size=dcp_size, dcp_rank=dcp_rank)


def _flat_pages(pool, indices) -> list[bytes]:
    """Each page at ``indices`` as SGLang's own get_data_page flattens it (DCP-aware)."""
    step = pool.logical_page_size
    return [pool.get_data_page(int(indices[i])).view(torch.uint8).clone().numpy().tobytes()
            for i in range(0, indices.numel(), step)]


def _fill_flat(pool, indices, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for i in range(0, indices.numel(), pool.logical_page_size):
        page = pool.get_dummy_flat_data_page()
        raw = page.view(torch.uint8)
        raw.copy_(torch.randint(1, 256, raw.shape, dtype=torch.uint8, generator=generator))
        pool.set_from_flat_data_page(int(indices[i]), page)


def _poison_flat(pool, indices) -> None:
    for i in range(0, indices.numel(), pool.logical_page_size):
        page = pool.get_dummy_flat_data_page()
        page.view(torch.uint8).fill_(0xA5)
        pool.set_from_flat_data_page(int(indices[i]), page)


# DEFECT: a decode-context-parallel MLA deployment (SGLang's dcp_size > 1: each rank keeps its shard of every logical
# page) cannot attach: registering its host pool raises a bare AssertionError from SGLang's get_page_buffer_meta
# (kvtier asks for one *physical* page of indices, SGLang's DCP pool takes logical pages). The docs promise the DCP
# shard in the namespace; a refusal would at least have to name DCP.
def test_a_dcp_mla_deployment_attaches_and_its_shards_never_share_pages(file_spec, backends):
    pools = [_dcp_mla_pool(rank) for rank in (0, 1)]
    ranks = []
    for rank, pool in enumerate(pools):
        config = sg.storage_config(is_mla_model=True, tp_rank=rank, tp_size=2, dcp_size=2, dcp_rank=rank,
                                   logical_page_size=8)
        assert config.is_storage_writer                 # each DCP shard has its own writer
        ranks.append(sg.create_backend(file_spec, pool, config=config, tenant="dcp"))
        backends.append(ranks[-1])
    assert ranks[0].store.namespace_id != ranks[1].store.namespace_id
    keys = sg.page_keys(2, "dcp")
    written = []
    for rank, pool in enumerate(pools):
        at = pool.alloc(2 * pool.logical_page_size)
        _fill_flat(pool, at, seed=rank)
        written.append((at, _flat_pages(pool, at)))
        assert ranks[rank].batch_set_v1(keys, at) == [True, True]
    for rank, pool in enumerate(pools):
        at, expected = written[rank]
        _poison_flat(pool, at)
        assert ranks[rank].batch_get_v1(keys, at) == [True, True]
        assert _flat_pages(pool, at) == expected


# DEFECT (minor): MLA's latent row is kv_lora_rank values then qk_rope_head_dim values; two MLA deployments of one
# model name whose rows split differently (same total width) share pages, and one reads the other's latent as rope.
def test_mla_rows_split_differently_are_another_namespace(file_spec, backends):
    config = sg.storage_config(is_mla_model=True)
    one = sg.create_backend(file_spec, sg.mla_host_pool("page_first", lora_rank=64, rope_dim=32),
                            config=config, tenant="split")
    backends.append(one)
    other = sg.create_backend(file_spec, sg.mla_host_pool("page_first", lora_rank=32, rope_dim=64),
                              config=sg.storage_config(is_mla_model=True), tenant="split")
    backends.append(other)
    keys, _, _ = sg.store_pages(one, one.mem_pool_host, pages=2, salt="split")
    assert other.batch_exists(keys) == 0


@pytest.mark.parametrize("dtypes", [(torch.float8_e4m3fn, torch.float8_e5m2), (torch.float8_e4m3fn, torch.uint8),
                                    (torch.float32, torch.int32)], ids=["e4m3-e5m2", "fp8-uint8", "f32-i32"])
def test_dtypes_of_one_width_never_share_pages(file_spec, backends, dtypes):
    writer_pool, reader_pool = (sg.mha_host_pool("page_first", dtype=dt) for dt in dtypes)
    writer = sg.create_backend(file_spec, writer_pool, tenant="dtypes")
    reader = sg.create_backend(file_spec, reader_pool, tenant="dtypes")
    backends += [writer, reader]
    keys, indices, written = sg.store_pages(writer, writer_pool, pages=2, salt="dtypes")
    assert reader.batch_exists(keys) == 0
    assert writer.batch_get_v1(keys, indices) == [True, True]          # fp8 pages themselves round trip
    assert sg.page_bytes(writer_pool, indices) == written


# --- processes, threads, a store changing underneath ----------------------------------------------------------------


# DEFECT (mooncake): a fork child closing the backend hangs for ever when the parent had a store call in flight at the
# fork: the store's close waits for the parent's in-flight count, which no thread of the child will ever lower.
# (SGLang's own processes are spawned; anything that forks after attach, a data loader, a profiler, a test harness,
# and closes in the child hangs.)
def test_close_in_a_fork_child_returns_while_the_parent_was_mid_call(spec, backends):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(spec, pool)
    backends.append(backend)
    keys, indices, _ = sg.store_pages(backend, pool, pages=8, salt="fork")
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            backend.batch_get_v1(keys, indices)

    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    hung = 0
    try:
        for _ in range(4):
            time.sleep(0.05)
            pid = os.fork()
            if pid == 0:                                # the child: close, nothing else (no torch, no pytest)
                signal.alarm(20)
                try:
                    backend.close()
                finally:
                    os._exit(0)
            deadline = time.monotonic() + 4
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    hung += 1
                    break
                time.sleep(0.02)
            if hung:
                break
    finally:
        stop.set()
        worker.join(10)
    assert hung == 0, "backend.close() in a fork child never returned"


def test_a_fork_child_reads_exact_pages_or_misses(spec, backends, threads_of_one):
    """A child forked after attach (no call in flight) reads the parent's pages byte-exact, or gets misses (Mooncake
    clients do not survive fork); it never hangs or raises, and the parent is unharmed."""
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(spec, pool)
    backends.append(backend)
    keys, indices, written = sg.store_pages(backend, pool, pages=3, salt="fork-read")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        try:
            os.close(read_end)
            answer = backend.batch_get_v1(keys, indices)
            exact = sg.page_bytes(pool, indices) == written
            ok = answer == [False] * 3 or (answer == [True] * 3 and exact)
            backend.close()
            os.write(write_end, b"ok" if ok else repr((answer, exact)).encode())
        except BaseException as exc:                    # noqa: BLE001
            os.write(write_end, repr(exc).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 15
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the fork child hung")
        time.sleep(0.02)
    said = os.read(read_end, 4096)
    os.close(read_end)
    assert said == b"ok"
    sg.poison_pages(pool, indices)
    assert backend.batch_get_v1(keys, indices) == [True] * 3
    assert sg.page_bytes(pool, indices) == written


@pytest.fixture
def threads_of_one():
    """torch at one intra-op thread while a test forks: a fork child of a process whose OpenMP pool ran waits for
    its threads for ever (torch, not kvtier)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_writer_killed_mid_write_leaves_whole_pages_or_misses(spec, backends, threads_of_one):
    """SIGKILL a process in the middle of a stream of writes: every page read back afterwards is one the writer
    meant, byte for byte, or a miss. (The writer is a fork of this process; a Mooncake client does not survive
    fork, so the Mooncake writer is a process of its own, which is slower to start.)"""
    big = dict(tokens=2048, layers=4, heads=8, head_dim=128, page_size=16)
    pool = sg.mha_host_pool("page_first", **big)
    tenant = "killed-" + os.urandom(4).hex()
    backend = sg.create_backend(spec, pool, tenant=tenant, skip_existing=False)
    backends.append(backend)
    indices = sg.pages_at(pool, 16)
    ps = pool.page_size
    meant = []
    for round_ in range(4):
        sg.fill_pages(pool, indices, seed=round_)
        meant.append([sg.page_bytes(pool, indices[i * ps:(i + 1) * ps]) for i in range(16)])
    if spec.startswith("mooncake"):
        writer = _writer_process(spec, tenant, big)
    else:
        pid = os.fork()
        if pid == 0:
            try:
                signal.alarm(30)
                n = 0
                while True:
                    sg.fill_pages(pool, indices, seed=n % 4)
                    backend.batch_set_v1(sg.page_keys(16, f"killed-{n % 4}"), indices)
                    n += 1
            finally:
                os._exit(0)
        writer = types.SimpleNamespace(pid=pid)
    time.sleep(0.4)
    os.kill(writer.pid, signal.SIGKILL)
    os.waitpid(writer.pid, 0)
    for round_ in range(4):
        sg.poison_pages(pool, indices)
        answer = backend.batch_get_v1(sg.page_keys(16, f"killed-{round_}"), indices)
        for i, hit in enumerate(answer):
            if hit:
                assert sg.page_bytes(pool, indices[i * ps:(i + 1) * ps]) == meant[round_][i], (round_, i)


def _writer_process(spec: str, tenant: str, big: dict) -> subprocess.Popen:
    child = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(TESTS)!r}, {str(TESTS / 'helpers' / 'placeholders')!r}]
        from helpers import sglang as sg
        sg.import_host_pools()
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
        host_memory_budget_scope(1 << 40).__enter__()
        pool = sg.mha_host_pool("page_first", **{big!r})
        backend = sg.create_backend({spec!r}, pool, tenant={tenant!r}, skip_existing=False)
        indices = sg.pages_at(pool, 16)
        print("ready", flush=True)
        n = 0
        while True:
            sg.fill_pages(pool, indices, seed=n % 4)
            backend.batch_set_v1(sg.page_keys(16, f"killed-{{n % 4}}"), indices)
            n += 1
    """)
    writer = subprocess.Popen([sys.executable, "-c", child], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
    if writer.stdout.readline() != b"ready\n":
        writer.kill()
        writer.wait()
        pytest.fail("the writer process did not start")
    return writer


def test_racing_writers_of_one_key_never_give_a_mixed_page(spec, backends):
    """Two threads write different bytes under the same keys while three read them: every hit is one writer's page
    whole."""
    big = dict(tokens=2048, layers=4, heads=8, head_dim=128, page_size=16)
    pool = sg.mha_host_pool("page_first", **big)
    backend = sg.create_backend(spec, pool, skip_existing=False)
    backends.append(backend)
    ps, n = pool.page_size, 4
    keys = sg.page_keys(n, "race")
    sources, pages = [], []
    for w in range(2):
        at = sg.pages_at(pool, n)
        sg.fill_pages(pool, at, seed=100 + w)
        sources.append(at)
        pages.append([sg.page_bytes(pool, at[i * ps:(i + 1) * ps]) for i in range(n)])
    stop, mixed, errors, hits = threading.Event(), [], [], [0]
    readers_at = [sg.pages_at(pool, n) for _ in range(3)]

    def write(w: int) -> None:
        while not stop.is_set():
            try:
                backend.batch_set_v1(keys, sources[w])
            except BaseException as exc:                # noqa: BLE001
                errors.append(exc)
                return

    def read(at) -> None:
        while not stop.is_set():
            sg.poison_pages(pool, at)
            try:
                answer = backend.batch_get_v1(keys, at)
            except BaseException as exc:                # noqa: BLE001
                errors.append(exc)
                return
            for i, hit in enumerate(answer):
                if hit:
                    hits[0] += 1
                    got = sg.page_bytes(pool, at[i * ps:(i + 1) * ps])
                    if got not in (pages[0][i], pages[1][i]):
                        mixed.append(i)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    threads += [threading.Thread(target=read, args=(at,)) for at in readers_at]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(10)
    assert errors == [] and mixed == [] and hits[0] > 0


def test_close_while_threads_read_gives_exact_pages_or_misses(spec):
    big = dict(tokens=2048, layers=4, heads=8, head_dim=128, page_size=16)
    pool = sg.mha_host_pool("page_first", **big)
    backend = sg.create_backend(spec, pool)
    ps, n = pool.page_size, 8
    keys, at = sg.page_keys(n, "closing"), sg.pages_at(pool, n)
    sg.fill_pages(pool, at, seed=8)
    pages = [sg.page_bytes(pool, at[i * ps:(i + 1) * ps]) for i in range(n)]
    assert backend.batch_set_v1(keys, at) == [True] * n
    stop, wrong, errors, after = threading.Event(), [], [], []
    closed = threading.Event()

    def read() -> None:
        into = sg.pages_at(pool, n)
        while not stop.is_set():
            sg.poison_pages(pool, into)
            try:
                answer = backend.batch_get_v1(keys, into)
            except BaseException as exc:                # noqa: BLE001
                errors.append(exc)
                return
            for i, hit in enumerate(answer):
                if hit and sg.page_bytes(pool, into[i * ps:(i + 1) * ps]) != pages[i]:
                    wrong.append(i)
            if closed.is_set():
                after.append(answer)

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    backend.close()
    closed.set()
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert errors == [] and wrong == []
    assert after and after[-1] == [False] * n            # after close: misses


def test_clear_by_another_instance_while_one_runs(spec, backends):
    """Instance B of a deployment clears the store while instance A writes and reads: A's hits stay exact, A's
    pages come back when it writes them again."""
    pool = sg.mha_host_pool("page_first")
    tenant = "clearing-" + os.urandom(4).hex()
    a = sg.create_backend(spec, pool, tenant=tenant, store_options={"retry_interval": 0.1})
    b = sg.create_backend(spec, pool, tenant=tenant, store_options={"retry_interval": 0.1})
    backends += [a, b]
    keys, indices, written = sg.store_pages(a, pool, pages=4, salt="clearing")
    ps = pool.page_size
    sg.restore_pages(pool, indices, written)
    pages = [sg.page_bytes(pool, indices[i * ps:(i + 1) * ps]) for i in range(4)]
    sg.poison_pages(pool, indices)
    stop, wrong, errors = threading.Event(), [], []

    def churn() -> None:
        into = sg.pages_at(pool, 4)
        while not stop.is_set():
            try:
                sg.restore_pages(pool, into, written)
                a.batch_set_v1(keys, into)
                sg.poison_pages(pool, into)
                answer = a.batch_get_v1(keys, into)
            except BaseException as exc:                # noqa: BLE001
                errors.append(exc)
                return
            for i, hit in enumerate(answer):
                if hit and sg.page_bytes(pool, into[i * ps:(i + 1) * ps]) != pages[i]:
                    wrong.append(i)

    def clear() -> None:
        while not stop.is_set():
            b.clear()

    threads = [threading.Thread(target=churn), threading.Thread(target=clear)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(10)
    assert errors == [] and wrong == []
    time.sleep(0.2)
    sg.restore_pages(pool, indices, written)
    deadline = time.monotonic() + 5
    while a.batch_set_v1(keys, indices) != [True] * 4:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    sg.poison_pages(pool, indices)
    assert a.batch_get_v1(keys, indices) == [True] * 4
    assert sg.page_bytes(pool, indices) == written


def test_a_store_directory_deleted_mid_run_is_misses_then_used_again(tmp_path, backends):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(f"file:{tmp_path / 'store'}", pool, store_options={"retry_interval": 0.1})
    backends.append(backend)
    keys, indices, written = sg.store_pages(backend, pool, pages=2, salt="deleted")
    shutil.rmtree(tmp_path / "store")
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, indices) == [False, False]
    sg.restore_pages(pool, indices, written)
    deadline = time.monotonic() + 5
    same_dirs = [keys[0][:2] + "0" * 62, keys[1][:2] + "1" * 62]      # keys under directories it made before
    while backend.batch_set_v1(same_dirs, indices) != [True, True]:
        assert time.monotonic() < deadline, "writes never came back"
        time.sleep(0.1)
    assert backend.batch_set_v1(keys, indices) == [True, True]
    sg.poison_pages(pool, indices)
    assert backend.batch_get_v1(keys, indices) == [True, True]
    assert sg.page_bytes(pool, indices) == written


def test_a_host_pool_destroyed_before_close_gives_failures_not_exceptions(spec):
    pool = sg.mha_host_pool("layer_first")
    backend = sg.create_backend(spec, pool)
    keys, indices, _ = sg.store_pages(backend, pool, pages=2, salt="destroyed")
    pool.destroy()
    assert backend.batch_get_v1(keys, indices) == [False, False]
    assert backend.batch_set_v1(sg.page_keys(2, "destroyed-2"), indices) == [False, False]
    backend.close()
    backend.close()
    assert not getattr(backend.store, "registered", [])


# --- hybrid v2: kvtier against SGLang's own reference backend --------------------------------------------------------


def _hicache_file(tmp_path, kv, mamba):
    """SGLang's own HiCacheFile, the reference for batch_exists_v2's prefix rules."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName

    config = sg.storage_config()
    config.extra_config = {"file_storage_path": str(tmp_path / "sglang-file")}
    reference = HiCacheFile(config)
    reference.register_mem_pool_host(kv)
    reference.register_mem_host_pool_v2(kv, PoolName.KV)
    reference.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    return reference


@pytest.mark.parametrize("seed", range(6))
def test_hybrid_prefixes_match_sglangs_own_backend(file_spec, backends, tmp_path, seed):
    """Random stored KV pages and Mamba states, random probes (trailing windows of 0 to past the prefix, prefix_keys,
    chains that leave the stored one): kvtier's batch_exists_v2 finds the prefixes SGLang's HiCacheFile finds."""
    import random

    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )

    rng = random.Random(seed)
    kv, mamba = sg.mha_host_pool("page_first"), sg.mamba_host_pool(slots=32)
    backend = sg.create_backend(file_spec, kv)
    backends.append(backend)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.on_host_pools_registered()
    reference = _hicache_file(tmp_path, kv, mamba)

    chain = sg.page_keys(10, f"hybrid-{seed}")
    kv_at = sg.pages_at(kv, 10)
    sg.fill_pages(kv, kv_at, seed=seed)
    stored_kv = [i for i in range(10) if rng.random() < 0.85]
    stored_state = [i for i in range(10) if rng.random() < 0.4]
    ps = kv.page_size
    slots = mamba.alloc(len(stored_state)) if stored_state else None
    for backend_ in (backend, reference):
        transfers = []
        if stored_kv:
            transfers.append(PoolTransfer(PoolName.KV, keys=[chain[i] for i in stored_kv],
                                          host_indices=torch.cat([kv_at[i * ps:(i + 1) * ps] for i in stored_kv])))
        if stored_state:
            transfers.append(PoolTransfer(PoolName.MAMBA, keys=[chain[i] for i in stored_state], host_indices=slots,
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES))
        answer = backend_.batch_set_v2(transfers)
        assert all(all(v) for v in answer.values()), answer

    for _ in range(8):
        start = rng.randrange(0, 4)
        length = rng.randrange(0, 10 - start + 1)
        probe_keys = chain[start:start + length]
        if rng.random() < 0.2 and probe_keys:
            probe_keys = probe_keys[:-1] + sg.page_keys(1, "elsewhere")
        window = rng.choice([None, 0, 1, 1, 2, 3, 12])
        policy = rng.choice([PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES])
        transfer = PoolTransfer(PoolName.MAMBA, host_indices=torch.zeros(1, dtype=torch.int64),
                                keys=None if window is None else chain[:window], hit_policy=policy)
        info = HiCacheStorageExtraInfo(prefix_keys=chain[:start])
        ours = backend.batch_exists_v2(probe_keys, [transfer], info)
        theirs = reference.batch_exists_v2(probe_keys, [transfer], info)
        where = (start, length, window, policy, stored_kv, stored_state)
        assert ours.kv_hit_pages == theirs.kv_hit_pages, where
        assert list(ours.restorable_prefix_pages or []) == list(theirs.restorable_prefix_pages or []), where
        assert ours.extra_pool_hit_pages.get(PoolName.MAMBA, 0) == theirs.extra_pool_hit_pages.get(
            PoolName.MAMBA, 0), where


def test_v2_calls_with_nothing_or_unknown_pools_answer_without_raising(file_spec, backends):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    kv = sg.mha_host_pool("page_first")
    backend = sg.create_backend(file_spec, kv)
    backends.append(backend)
    keys, indices, _ = sg.store_pages(backend, kv, pages=3, salt="v2-edges")
    unknown = PoolTransfer(PoolName.INDEXER, host_indices=torch.arange(3), keys=keys)
    never = PoolTransfer(PoolName.MAMBA, host_indices=torch.arange(1), keys=keys[-1:],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert backend.batch_exists_v2([]).kv_hit_pages == 0
    assert backend.batch_exists_v2([], [never]).kv_hit_pages == 0
    assert backend.batch_exists_v2(keys, []).kv_hit_pages == 3
    assert backend.batch_exists_v2(keys, [unknown]).kv_hit_pages == 0
    assert backend.batch_exists_v2(keys, [never]).kv_hit_pages == 0
    assert backend.batch_get_v2([]) == {} and backend.batch_set_v2([]) == {}
    before = sg.page_bytes(kv, indices)
    assert backend.batch_get_v2([unknown, never]) == {PoolName.INDEXER: [False] * 3, PoolName.MAMBA: [False]}
    assert sg.page_bytes(kv, indices) == before
