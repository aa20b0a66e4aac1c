"""What SGLang (or a user wiring kvtier by hand) can get wrong, and what a shared store can do underneath a deployment:
host indices that are not one run of a page's slots, keys that look alike, a pool registered twice, a DCP MLA
deployment, a fork, a writer killed mid-write, a store cleared or deleted under a running instance, threads racing on
one key. Every page read back is byte-exact or a miss (destinations poisoned first, bytes compared), nothing raises,
and a bad call fails whole with nothing read or written.

Tests marked ``DEFECT`` fail on the code they were written against; each names what a user would hit."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time

import pytest
import torch
from helpers import sglang as sg
from helpers.paths import ROOT

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


@pytest.fixture(autouse=True)
def _host_memory_budget():
    """SGLang's host pools refuse to allocate when the machine's free memory is under its reserve (several GB), even
    for the few hundred KiB these pools take; on a busy machine that fails every test before kvtier runs. Book the
    pools against a budget of their own (SGLang's host_memory_budget_scope), as its launcher does."""
    sg.import_host_pools()
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    with host_memory_budget_scope(1 << 40):
        yield


@pytest.fixture
def threads_of_one():
    """torch at one intra-op thread while a test forks: a fork child of a process whose OpenMP pool ran waits for
    its threads for ever (torch's doing, not kvtier's)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
def test_host_indices_that_are_not_integers_fail_whole(file_spec, backends, kind):
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


@pytest.mark.parametrize("indices", ["a list", "a numpy array", "a meta tensor", "int64 max", "NaN"])
def test_index_containers_that_are_no_cpu_index_tensor_fail_whole(file_spec, backends, indices):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(file_spec, pool)
    backends.append(backend)
    keys, at, _ = sg.store_pages(backend, pool, pages=2, salt="containers")
    bad = {"a list": lambda: at.tolist(), "a numpy array": lambda: at.numpy(), "a meta tensor": lambda: at.to("meta"),
           "int64 max": lambda: torch.full_like(at, 2**63 - 1), "NaN": lambda: torch.full((at.numel(),), float("nan"))}
    before = _whole_pool(pool)
    assert backend.batch_get_v1(keys, bad[indices]()) == [False, False]
    assert _whole_pool(pool) == before
    assert backend.batch_set_v1(sg.page_keys(2, "containers-set"), bad[indices]()) == [False, False]
    assert backend.batch_exists(sg.page_keys(2, "containers-set")) == 0


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


# DEFECT: a read whose destinations overlap (one stored key named twice, or two keys read into one page's slots) is
# verified in the destination after the bytes landed, where the other page's bytes may have landed too: the page
# is judged corrupt, and the store *deletes the good page* (then every page after it is a miss). On Mooncake every
# time (the batch lands whole before any page is checked); on a file store now and then (its 4 I/O threads race).
# Overlapping destinations should be refused, or read one after the other; never cost a stored page.
def test_a_read_naming_one_key_twice_fills_both_and_keeps_the_page(spec, backends):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(spec, pool)
    backends.append(backend)
    keys, indices, written = sg.store_pages(backend, pool, pages=3, salt="read-twice")
    ps = pool.page_size
    sg.restore_pages(pool, indices, written)
    pages = [sg.page_bytes(pool, indices[i * ps:(i + 1) * ps]) for i in range(3)]
    into = sg.pages_at(pool, 4)
    for _ in range(40):
        sg.poison_pages(pool, into)
        answer = backend.batch_get_v1([keys[0], keys[1], keys[1], keys[2]], into)
        assert backend.batch_exists(keys) == 3, "a good page was deleted"
        assert answer == [True] * 4
        got = [sg.page_bytes(pool, into[i * ps:(i + 1) * ps]) for i in range(4)]
        assert got == [pages[0], pages[1], pages[1], pages[2]]
    flats = [pool.get_dummy_flat_data_page() for _ in range(2)]
    assert [t is not None for t in backend.batch_get(keys[:1] * 2, flats)] == [True, True]
    assert backend.batch_exists(keys) == 3


# DEFECT: the same, two different pages read into one page's slots: a hit may hold either page, but the stored pages
# must survive the read.
def test_two_pages_read_into_the_same_slots_never_cost_a_stored_page(spec, backends):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(spec, pool)
    backends.append(backend)
    keys, at = sg.page_keys(2, "same-slots"), sg.pages_at(pool, 2)
    sg.fill_pages(pool, at, seed=3)
    ps = pool.page_size
    pages = [sg.page_bytes(pool, at[:ps]), sg.page_bytes(pool, at[ps:])]
    assert backend.batch_set_v1(keys, at) == [True, True]
    into = sg.pages_at(pool, 1)
    for _ in range(40):
        sg.poison_pages(pool, into)
        answer = backend.batch_get_v1(keys, torch.cat([into, into]))
        assert backend.batch_exists(keys) == 2, "a good page was deleted"
        assert answer in ([True, True], [False, False])     # refused as overlapping, or both read
        if answer == [True, True]:
            assert sg.page_bytes(pool, into) in pages
    sg.poison_pages(pool, at)
    assert backend.batch_get_v1(keys, at) == [True, True]
    assert [sg.page_bytes(pool, at[:ps]), sg.page_bytes(pool, at[ps:])] == pages


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
    assert sg.reads_back(backend, pool, keys, indices, written)


@pytest.mark.parametrize("where", ["file", "redis"])
def test_a_writer_killed_mid_write_leaves_whole_pages_or_misses(where, tmp_path, request, backends, threads_of_one):
    """SIGKILL a process in the middle of a stream of writes: every page read back afterwards is one the writer
    meant, byte for byte, or a miss. The writer is a fork of this process. (Not Mooncake: its client does not
    survive fork, and a writer process of its own takes most of this test's time budget just to import SGLang.)"""
    spec = f"file:{tmp_path / 'store'}" if where == "file" else request.getfixturevalue("redis_url")
    big = dict(tokens=2048, layers=4, heads=8, head_dim=128, page_size=16)
    pool = sg.mha_host_pool("page_first", **big)
    backend = sg.create_backend(spec, pool, skip_existing=False)
    backends.append(backend)
    indices = sg.pages_at(pool, 16)
    ps = pool.page_size
    meant = []
    for round_ in range(4):
        sg.fill_pages(pool, indices, seed=round_)
        meant.append([sg.page_bytes(pool, indices[i * ps:(i + 1) * ps]) for i in range(16)])
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
    time.sleep(0.4)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    hits = 0
    for round_ in range(4):
        sg.poison_pages(pool, indices)
        answer = backend.batch_get_v1(sg.page_keys(16, f"killed-{round_}"), indices)
        for i, hit in enumerate(answer):
            if hit:
                hits += 1
                assert sg.page_bytes(pool, indices[i * ps:(i + 1) * ps]) == meant[round_][i], (round_, i)
    assert hits > 0                                     # the writer got pages in before it was killed


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


# --- deployments that differ a little, sharing one store -----------------------------------------------------------


def _mamba_pool(temporal_dtype: torch.dtype, *, layers: int = 2, slots: int = 16):
    """SGLang's real MambaPoolHost whose temporal (SSM) state has ``temporal_dtype``: SGLang picks it per deployment
    (SGLANG_MAMBA_SSM_DTYPE or the model config's mamba_ssm_dtype), the KV beside it unchanged."""
    sgp = sg.import_host_pools()
    temporal = torch.zeros(layers, slots, 4, 8, 8, dtype=temporal_dtype)
    conv = (torch.zeros(layers, slots, 64, 3, dtype=torch.bfloat16),)
    info = sgp.info.MambaStateBufferInfo(temporal=temporal, conv=conv)
    return sgp.Mamba(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")


# DEFECT: two deployments of one model whose Mamba SSM state dtypes differ (SGLANG_MAMBA_SSM_DTYPE) share the KV
# namespace, so each finds the other's state snapshots: batch_exists_v2 counts them as restorable, the read is a
# `state.miss.geometry`, and the reader *deletes* the other deployment's good snapshot. The two wipe each other's
# states for as long as both run; a KV page of another layout, by contrast, is a miss that stays.
def test_a_state_of_another_ssm_dtype_is_a_miss_that_stays_for_its_owner(file_spec, backends):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    kv = sg.mha_host_pool("page_first")
    owner = sg.create_backend(file_spec, kv, tenant="ssm")
    other = sg.create_backend(file_spec, kv, tenant="ssm")
    backends += [owner, other]
    fp32, bf16 = _mamba_pool(torch.float32), _mamba_pool(torch.bfloat16)
    owner.register_mem_host_pool_v2(fp32, PoolName.MAMBA)
    other.register_mem_host_pool_v2(bf16, PoolName.MAMBA)
    keys, kv_at = sg.page_keys(2, "ssm-dtype"), sg.pages_at(kv, 2)
    sg.fill_pages(kv, kv_at, seed=4)
    slot, other_slot = fp32.alloc(1), bf16.alloc(1)
    sg.fill_pages(fp32, slot, seed=5)
    state = sg.page_bytes(fp32, slot)
    trailing = [PoolTransfer(PoolName.MAMBA, host_indices=slot, keys=keys[-1:],
                             hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    assert owner.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=kv_at, keys=keys), *trailing]) == \
        {PoolName.KV: [True, True], PoolName.MAMBA: [True]}

    theirs = [PoolTransfer(PoolName.MAMBA, host_indices=other_slot, keys=keys[-1:],
                           hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    assert other.batch_get_v2(theirs) == {PoolName.MAMBA: [False]}      # a state of another format: a miss
    sg.poison_pages(fp32, slot)
    assert owner.batch_get_v2(trailing) == {PoolName.MAMBA: [True]}, "the other deployment deleted the owner's state"
    assert sg.page_bytes(fp32, slot) == state
    assert other.batch_exists_v2(keys, theirs).kv_hit_pages == 0, "a state it cannot read counted as restorable"


# DEFECT: page_first and layer_first deployments of one model share a namespace (the layout is checked in the page
# header, not the key). The second one's reads are layout misses; its writes report success and store nothing
# (skip_existing sees the page there; without it the store keeps the page it has); batch_exists counts the pages.
# So it never gets a hit on any page the other wrote first, while SGLang is told they are stored and prefetches
# them on every request (a rolling change of --hicache-mem-layout loses the whole cache for good).
@pytest.mark.parametrize("skip_existing", [True, False])
def test_a_deployment_of_another_byte_order_can_read_what_it_stores(file_spec, backends, skip_existing):
    first_pool, second_pool = sg.mha_host_pool("page_first"), sg.mha_host_pool("layer_first")
    first = sg.create_backend(file_spec, first_pool, tenant="orders")
    second = sg.create_backend(file_spec, second_pool, tenant="orders", skip_existing=skip_existing)
    backends += [first, second]
    keys, _, _ = sg.store_pages(first, first_pool, pages=2, salt="orders")
    at = sg.pages_at(second_pool, 2)
    sg.fill_pages(second_pool, at, seed=6)
    written = sg.page_bytes(second_pool, at)
    stored = second.batch_set_v1(keys, at)
    sg.poison_pages(second_pool, at)
    read = second.batch_get_v1(keys, at)
    if stored == [True, True]:
        assert read == [True, True], "pages reported stored cannot be read back"
        assert sg.page_bytes(second_pool, at) == written
    assert second.batch_exists(keys) == sum(read), "batch_exists counts pages batch_get never reads"


# DEFECT: an MLA rank that is not the storage writer answers every write with success before looking at it: a write
# with more keys than host indices, or indices past the pool, is [True, ...] there (not refused, not logged, not
# counted), where the writer rank refuses the same call.
@pytest.mark.parametrize("bad", ["too few host indices", "indices past the pool"])
def test_a_bad_write_is_refused_on_an_mla_rank_that_does_not_write_too(file_spec, backends, bad):
    pool = sg.mla_host_pool("page_first")
    reader = sg.create_backend(file_spec, pool, config=sg.storage_config(is_mla_model=True, tp_rank=1, tp_size=2))
    backends.append(reader)
    keys, indices = sg.page_keys(3, "mla-bad"), sg.pages_at(pool, 3)
    args = (keys, indices[:-1]) if bad == "too few host indices" else (keys, indices + 10_000_000)
    assert reader.batch_set_v1(*args) == [False] * 3
    assert reader.stats()["calls"]["set.refused"] == 1


# DEFECT: docs/sglang.md says the "model" option names the model "when SGLang gives none", but it replaces the name
# SGLang gives: two deployments of different models (same geometry and dtype, e.g. a base model and its fine-tune)
# launched with one extra-config file that sets "model" share every page, and read each other's KV.
def test_two_models_launched_with_one_extra_config_never_share_pages(file_spec, backends):
    pool = sg.mha_host_pool("page_first")
    base = sg.create_backend(file_spec, pool, config=sg.storage_config(model_name="org/base-8b"),
                             tenant="shared-config", model="llama")
    tuned = sg.create_backend(file_spec, pool, config=sg.storage_config(model_name="org/base-8b-instruct"),
                              tenant="shared-config", model="llama")
    backends += [base, tuned]
    keys, indices, _ = sg.store_pages(base, pool, pages=2, salt="two-models")
    assert tuned.batch_exists(keys) == 0
    assert tuned.batch_get_v1(keys, indices) == [False, False]


# DEFECT (minor): the pipeline / context-parallel shard is appended to the model name as text ("|pp1of2"), so a model
# whose name ends in that text is that shard of another model: a 16-layer model served as "llama|pp1of2" and
# stage 1 of 2 of a 32-layer "llama" share pages.
def test_a_model_name_that_spells_a_shard_is_not_that_shard(file_spec, backends):
    pool = sg.mha_host_pool("page_first")
    stage = sg.create_backend(file_spec, pool, config=sg.storage_config(model_name="llama", pp_rank=1, pp_size=2),
                              tenant="shards")
    named = sg.create_backend(file_spec, pool, config=sg.storage_config(model_name="llama|pp1of2"), tenant="shards")
    backends += [stage, named]
    keys, _, _ = sg.store_pages(stage, pool, pages=2, salt="spelt")
    assert named.batch_exists(keys) == 0


def test_mooncake_close_unregisters_the_kv_and_the_state_pools(mooncake_spec, backends):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv, mamba = sg.mha_host_pool("page_first"), sg.mamba_host_pool()
    backend = sg.create_backend(mooncake_spec, kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    store = backend.store
    starts = {address.value for address, _ in store.registered}
    assert kv.kv_buffer.data_ptr() in starts and mamba.temporal_buffer.data_ptr() in starts
    backend.close()
    assert store.registered == []
    again = sg.create_backend(mooncake_spec, kv)         # the same memory registers again after close
    backends.append(again)
    keys, indices, written = sg.store_pages(again, kv, pages=2, salt="registered-again")
    assert again.batch_get_v1(keys, indices) == [True, True]
    assert sg.page_bytes(kv, indices) == written


def test_a_conv_only_state_pool_round_trips(spec, backends):
    """A linear-attention model with conv state only (no SSM state): SGLang's pool has an empty temporal buffer."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    kv, conv_only = sg.mha_host_pool("page_first"), sg.mamba_host_pool(temporal_shape=(0,))
    backend = sg.create_backend(spec, kv)
    backends.append(backend)
    backend.register_mem_host_pool_v2(conv_only, PoolName.MAMBA)
    keys, kv_at, slot = sg.page_keys(1, "conv-only"), sg.pages_at(kv, 1), conv_only.alloc(1)
    sg.fill_pages(kv, kv_at, seed=1)
    sg.fill_pages(conv_only, slot, seed=2)
    state = sg.page_bytes(conv_only, slot)
    transfer = [PoolTransfer(PoolName.MAMBA, host_indices=slot, keys=keys)]
    assert backend.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=kv_at, keys=keys), *transfer]) == \
        {PoolName.KV: [True], PoolName.MAMBA: [True]}
    sg.poison_pages(conv_only, slot)
    assert backend.batch_get_v2(transfer) == {PoolName.MAMBA: [True]}
    assert sg.page_bytes(conv_only, slot) == state


def test_a_miss_early_in_a_long_read_stops_every_write_into_the_pool_before_it_returns(spec, backends):
    """150 pages of 512 KiB (Mooncake moves them in parts of 64 MiB, the next part in flight while one is checked)
    with page 5 missing: 5 hits, and once the call has returned nothing lands in the slots of the pages after."""
    big = dict(tokens=2560, layers=8, heads=8, head_dim=128, page_size=16)
    pool = sg.mha_host_pool("page_first", **big)
    backend = sg.create_backend(spec, pool)
    backends.append(backend)
    n, ps = 150, pool.page_size
    keys, at = sg.page_keys(n, "long-read"), sg.pages_at(pool, n)
    sg.fill_pages(pool, at, seed=1)
    keep = [i for i in range(n) if i != 5]
    assert all(backend.batch_set_v1([keys[i] for i in keep], torch.cat([at[i * ps:(i + 1) * ps] for i in keep])))
    sg.poison_pages(pool, at)
    assert backend.batch_get_v1(keys, at) == [True] * 5 + [False] * (n - 5)
    tail = at[6 * ps:]
    sg.poison_pages(pool, tail)
    time.sleep(0.3)
    assert sg.page_bytes(pool, tail) == [bytes([0xA5]) * len(b) for b in sg.page_bytes(pool, tail)]
    backend.clear()


# DEFECT (docs): docs/sglang.md gives `{"max_bytes": 500e9}` as the file store's store_options; JSON reads 500e9 as a
# float, and the file store takes only an int, so a deployment launched as documented fails to attach.
def test_the_store_options_example_in_the_docs_attaches(tmp_path, backends):
    text = (ROOT / "docs" / "sglang.md").read_text()
    example = re.search(r"`(\{\"max_bytes\": [^`]+\})`", text)
    assert example, "the docs' store_options example moved"
    options = json.loads(example.group(1))
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(f"file:{tmp_path / 'store'}", pool, store_options=options)
    backends.append(backend)
    keys, indices, written = sg.store_pages(backend, pool, pages=1, salt="documented")
    assert backend.batch_get_v1(keys, indices) == [True]
