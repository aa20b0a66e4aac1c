"""The mooncake:: store against hostile input and timing: malformed specs, a hung master, close mid-read and in a
fork child, prefixes that look like patterns, objects of any size under a page key, every host layout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.cache import build, close_all, prompt, serve
from helpers.storage import GEOMETRY, namespace, random_pages, read_pages

from kvtier.address import CpuAddress
from kvtier.cache import page_keys
from kvtier.errors import InvalidArgument
from kvtier.storage import StorageError, open_store

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


# --------------------------------------------------------------------------------------------- specs (no server)
@pytest.mark.parametrize("spec", [
    "mooncake://127.0.0.1:\u00b2",                                       # superscript two: isdigit() but not int()
    "mooncake://[::1:50051",                                             # unclosed IPv6 bracket
    "mooncake://127.0.0.1:50051?metadata=http://[::1:8080/metadata",
])
def test_malformed_specs_are_invalid_argument_not_value_error(spec):
    with pytest.raises(InvalidArgument):
        open_store(spec, namespace())


@pytest.mark.parametrize("spec", [
    "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:80%0A80/metadata",   # newline inside the metadata URL
    "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/%00",            # NUL
    "mooncake://127.0.0.1:50051?metadata=%20http://127.0.0.1:8080/metadata",    # leading space
    "mooncake://127.0.0.1:50051?local_hostname=host%0A",                        # trailing newline passes `$`
])
def test_percent_encoded_control_characters_are_refused(spec):
    with pytest.raises(InvalidArgument):
        open_store(spec, namespace())


@pytest.mark.parametrize("spec", [
    "mooncake://127.0.0.1:\u0665\u0660\u0660\u0665\u0661",                   # Arabic-Indic digits "50051"
    "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:\uff18\uff10/metadata",   # fullwidth "80"
])
def test_non_ascii_ports_are_refused(spec):
    with pytest.raises(InvalidArgument):
        open_store(spec, namespace())


def test_admin_endpoint_with_a_query_is_refused():
    # docs: admin= is http://host:9003; with a query, ls builds ".../x?y=1/get_all_keys" and gets 404 later
    with pytest.raises(InvalidArgument):
        open_store("mooncake://127.0.0.1:50051?admin=http://127.0.0.1:9003/x?y=1", namespace())


# --------------------------------------------------------------------------------------------- a live store
def test_clear_of_one_prefix_never_removes_another_prefixs_pages(mooncake_spec):
    ns = namespace()
    keys = page_keys(ns, np.arange(4 * GEOMETRY.page_size))
    data = random_pages(4)
    with open_store(mooncake_spec, ns) as mine, open_store(mooncake_spec, ns, prefix="kvtie.") as other:
        assert mine.set(keys, [[p] for p in data]) == 4
        assert other.exists(keys) == 0                  # the other prefix holds nothing
        other.clear()                                   # "kvtie." is used unescaped in remove_by_regex
        assert mine.exists(keys) == 4, "clearing prefix 'kvtie.' removed prefix 'kvtier''s pages"


def test_clear_every_namespace_stays_within_its_prefix(mooncake_spec):
    ns = namespace()
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    with open_store(mooncake_spec, ns) as mine, open_store(mooncake_spec, None, prefix="x|.*") as other:
        assert mine.set(keys, [[p] for p in random_pages(2)]) == 2
        other.clear(every_namespace=True)
        assert mine.exists(keys) == 2


FROZEN = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    from helpers.storage import GEOMETRY, namespace, random_pages
    from kvtier.cache import page_keys
    from kvtier.storage import open_store
    spec, master_pid, when = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ns = namespace()
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    store = open_store(spec, ns, retry_interval=0.2, connect_timeout=0.5)
    if when == "mid_run":
        assert store.set(keys, [[p] for p in random_pages(2)]) == 2
    os.kill(master_pid, 19)                                   # SIGSTOP: a hung master, its port still accepts
    beats = []
    def heartbeat():                                          # another serving thread of the process
        end = time.monotonic() + 6
        while time.monotonic() < end:
            beats.append(time.monotonic()); time.sleep(0.05)
    threading.Thread(target=heartbeat, daemon=True).start()
    started = time.monotonic()
    found = store.exists(keys)
    took = time.monotonic() - started
    time.sleep(0.2)                                           # an answer at once leaves the heartbeat a beat or two
    gaps = max(b - a for a, b in zip(beats, beats[1:])) if len(beats) > 1 else 99
    print(f"RESULT found={found} took={took:.1f} max_heartbeat_gap={gaps:.1f}", flush=True)
    os._exit(0)
""")


@pytest.mark.parametrize("when", ["mid_run", "first_use"])
def test_a_hung_master_costs_no_long_stall(mooncake_servers, when):
    """A master that hangs (SIGSTOP: its port still accepts, like a deadlocked or paused master) must not stall the
    caller like the Mooncake client's own timeouts (~4 s an RPC, ~90 s at set-up), nor the process's other threads."""
    servers = mooncake_servers
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), "MC_LOG_LEVEL": "ERROR"}
    child = subprocess.Popen([sys.executable, "-c", FROZEN, servers.spec, str(servers.master.pid), when], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        out, _ = child.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
    finally:
        os.kill(servers.master.pid, signal.SIGCONT)
    assert "RESULT" in out, f"exists() on a hung master had not returned after 40 s ({when}); output {out!r}"
    took = float(out.split("took=")[1].split()[0])
    gap = float(out.split("max_heartbeat_gap=")[1].split()[0])
    assert took < 5 and gap < 1, out           # one RPC timeout (3 s), then the HTTP probe refuses at once


CLOSE_MID_GET = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    from helpers.storage import GEOMETRY, namespace
    from kvtier.address import CpuAddress
    from kvtier.storage import StorageError, open_store
    spec = sys.argv[1]
    for trial in range(4):
        store = open_store(spec, namespace(), batch_pages=64)
        n = 256
        keys = [os.urandom(32) for _ in range(n)]
        pool = np.random.randint(1, 255, (n, GEOMETRY.bytes_per_page), dtype=np.uint8)
        out = np.zeros_like(pool)
        store.register_memory(CpuAddress(pool.ctypes.data), pool.nbytes)
        store.register_memory(CpuAddress(out.ctypes.data), out.nbytes)
        assert store.set(keys, [[pool[i]] for i in range(n)]) == n
        def reader():
            try:
                while True:
                    count = store.get(keys, [[out[i]] for i in range(n)])
                    assert (out[:count] == pool[:count]).all()
            except StorageError:
                pass
        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads: t.start()
        time.sleep(0.05 * (trial + 1))
        store.close()
        for t in threads: t.join(20)
        assert not any(t.is_alive() for t in threads)
    print("ok")
""")


def test_close_mid_get_on_registered_memory_never_crashes(mooncake_spec):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), "MC_LOG_LEVEL": "ERROR"}
    done = subprocess.run([sys.executable, "-c", CLOSE_MID_GET, mooncake_spec], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, f"rc={done.returncode}: {done.stderr[-800:]}"


def test_close_in_a_forked_child_is_not_a_crash(mooncake_spec):
    ns = namespace()
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    store = open_store(mooncake_spec, ns)
    assert store.set(keys, [[p] for p in random_pages(2)]) == 2
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ok = store.exists(keys) == 0 and "fork" in store.last_error   # a counted error: holds
            store.close()                                                  # dropping the parent's client: SIGSEGV
            code = 0 if ok else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    store.close()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, \
        f"child ended by signal {os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}"


def test_cli_with_p2phandshake_prints_no_mooncake_log_lines(mooncake_servers):
    servers = mooncake_servers
    spec = f"mooncake://{servers.master_address}?metadata=P2PHANDSHAKE&admin={servers.admin}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MC_LOG_LEVEL", None)
    for args in (["storage", "ls", spec], ["storage", "stats", spec]):
        done = subprocess.run([sys.executable, "-m", "kvtier", *args], env=env, capture_output=True, text=True,
                              timeout=60, cwd="/tmp")
        assert done.returncode == 0
        assert done.stderr == "", f"{args[:2]} printed on stderr: {done.stderr!r}"


# --------------------------------------------------------------------------------------------- attacks that held
@pytest.mark.parametrize("size", ["empty", "one", "short", "right_garbage", "long", "huge"])
def test_hand_written_objects_of_any_size_are_counted_misses(mooncake_spec, size):
    ns = namespace()
    keys = page_keys(ns, np.arange(3 * GEOMETRY.page_size))
    data = random_pages(3)
    with open_store(mooncake_spec, ns) as store:
        assert store.set(keys, [[p] for p in data]) == 3
        stored = store.stored_bytes
        payload = {"empty": b"", "one": b"x", "short": b"x" * (stored - 1), "right_garbage": b"x" * stored,
                   "long": b"x" * (stored + 1), "huge": b"x" * (4 << 20)}[size]
        client = store.client()
        client.remove(store.key(keys[1]), True)
        client.put(store.key(keys[1]), payload)
        count, out = read_pages(store, keys)
        assert count == 1 and np.array_equal(out[0], data[0])
        stats = store.stats()
        assert stats["up"] and not any(k.startswith("errors.") for k in stats)


def test_a_foreign_namespace_page_under_our_key_is_a_miss(mooncake_spec):
    ns, other_ns = namespace(), namespace()
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    with open_store(mooncake_spec, ns) as store, open_store(mooncake_spec, other_ns) as other:
        assert store.set(keys, [[p] for p in random_pages(2)]) == 2
        assert other.set(keys, [[p] for p in random_pages(2)]) == 2
        client = store.client()
        blob = bytes(client.get(other.key(keys[0])))
        client.remove(store.key(keys[0]), True)
        client.put(store.key(keys[0]), blob)
        assert read_pages(store, keys)[0] == 0 and store.stats()["miss.namespace"] == 1


def test_killed_master_is_fast_and_counted(mooncake_servers):
    servers = mooncake_servers
    ns = namespace()
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    data = random_pages(2)
    with open_store(servers.spec, ns, retry_interval=0.2) as store:
        assert store.set(keys, [[p] for p in data]) == 2
        servers.stop_master()
        started = time.monotonic()
        for _ in range(3):
            assert store.exists(keys) == 0 and read_pages(store, keys)[0] == 0
            assert store.set(keys, [[p] for p in data]) == 0
            time.sleep(0.25)
        assert time.monotonic() - started < 5
        assert store.stats()["errors.exists"] >= 1


def test_registered_memory_moves_without_copy_and_edges_bounce_correctly(mooncake_spec):
    import torch

    ns = namespace()
    n = 4
    keys = page_keys(ns, np.arange(n * GEOMETRY.page_size))
    page = GEOMETRY.bytes_per_page
    with open_store(mooncake_spec, ns) as store:
        pool = np.random.randint(1, 255, (n, page), dtype=np.uint8)
        store.register_memory(CpuAddress(pool.ctypes.data), pool.nbytes)
        assert store.set(keys, [[pool[i]] for i in range(n)]) == n and "bounced_pages" not in store.stats()
        out = np.zeros_like(pool)
        store.register_memory(CpuAddress(out.ctypes.data), out.nbytes)
        assert store.get(keys, [[out[i]] for i in range(n)]) == n and (out == pool).all()
        assert "bounced_pages" not in store.stats()
        edge = np.zeros(3 * page, np.uint8)                       # a piece crossing the end of a registered span
        store.register_memory(CpuAddress(edge.ctypes.data), 2 * page - 10)
        view = edge[page:2 * page]
        assert store.get(keys[:1], [[view]]) == 1 and (view == pool[0]).all()
        assert store.stats()["bounced_pages"] == 1
        tensor = torch.zeros(page // 2, dtype=torch.bfloat16)
        assert store.get(keys[:1], [[tensor]]) == 1 and (tensor.view(torch.uint8).numpy() == pool[0]).all()
        with pytest.raises(InvalidArgument):
            store.get(keys[:1], [[np.zeros(2 * page, np.uint8)[::2]]])      # strided
        with pytest.raises(InvalidArgument):
            ro = np.zeros(page, np.uint8)
            ro.flags.writeable = False
            store.get(keys[:1], [[ro]])
    with pytest.raises(StorageError):
        store.register_memory(CpuAddress(out.ctypes.data), 10)
    with pytest.raises(StorageError):
        store.exists(keys)


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_the_cache_round_trips_every_host_layout_zero_copy(mooncake_spec, runtime, layout):
    stores = []

    def storage(ns):
        stores.append(open_store(mooncake_spec, ns, layout=layout))
        return stores[-1]

    name = f"adv-{os.urandom(4).hex()}"
    prompts = [prompt(4 * n) for n in (5, 9)]
    cache, model, dev, host = build(runtime, device_pages=32, host_pages=64, storage=storage, layout=layout,
                                    model=name)
    salt = model.salt
    try:
        for p in prompts:
            serve(cache, model, p)
        cache.drain()
        assert cache.stats()["storage.set.pages"] == sum(len(p) // 4 for p in prompts)
    finally:
        close_all(cache, dev, host)
    cache, model, dev, host = build(runtime, device_pages=32, host_pages=64, storage=storage, layout=layout,
                                    model=name)
    model.salt = salt
    try:
        for p in prompts:
            fetch = cache.prefetch(p)
            assert fetch.settle("wait_complete") == len(p) and fetch.outcome == "complete"
            _, served = serve(cache, model, p)
            assert served == len(p) // 4
        stats = stores[-1].stats()
        assert stats["get.hit_pages"] == sum(len(p) // 4 for p in prompts) and "bounced_pages" not in stats
        assert "bounced_pages" not in stores[0].stats()
    finally:
        close_all(cache, dev, host)
    for s in stores:
        assert s.registered == []
        s.close()
