"""The file store's own promises: atomic pages under SIGKILL, a size bound with LRU eviction (processes sharing a
bounded directory converge on it), sharing a directory between processes, fsync policies, I/O threads of its own in a
fork child. Damage from outside (a removed namespace directory, a directory or FIFO at a page path, a page cut inside
its header, a file where a page directory should be) is a miss or a counted failure, and failing writes never take
reads down."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from helpers.paths import TESTS
from helpers.storage import GEOMETRY, namespace, random_pages, read_pages

from kvtier.cache import page_keys
from kvtier.storage import FileStore
from kvtier.storage import file as file_module

CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from helpers.storage import GEOMETRY
    from kvtier.cache import Namespace, page_keys
    from kvtier.storage import FileStore
    ns = Namespace("test-model", GEOMETRY, "bfloat16", tenant={tenant!r})
    store = FileStore({root!r}, ns, overwrite=True)
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    page = np.frombuffer(bytes.fromhex({payload!r}), np.uint8)
    if {kill!r} == "before_rename":
        real = os.replace
        def replace(src, dst):
            if str(src).endswith(".tmp") and "namespace" not in str(src):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(src, dst)
        os.replace = replace
    elif {kill!r} == "mid_write":
        real_pwritev = os.pwritev
        def pwritev(fd, buffers, offset):
            real_pwritev(fd, [memoryview(buffers[0])[:100]], offset)
            os.kill(os.getpid(), signal.SIGKILL)
        os.pwritev = pwritev
    store.set(keys[1:], [[page]])
""")


@pytest.mark.parametrize("kill", ["before_rename", "mid_write"])
@pytest.mark.parametrize("previous", [True, False])
def test_a_writer_killed_mid_page_leaves_the_old_page_or_a_miss(tmp_path, kill, previous):
    ns = namespace()
    store = FileStore(tmp_path, ns)
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    old = random_pages(2)
    if previous:
        store.set(keys, [[p] for p in old])
    new = random_pages(1)[0]
    script = CHILD.format(tests=str(TESTS), tenant=ns.tenant, root=str(tmp_path),
                          payload=new.tobytes().hex(), kill=kill)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert child.returncode == -9, child.stderr.decode()
    assert list(tmp_path.glob("*/*/.*.tmp")), "the killed writer left its temporary file"
    count, out = read_pages(FileStore(tmp_path, ns), keys)    # a new store sweeps the dead writer's temporaries
    assert not list(tmp_path.glob("*/*/.*.tmp"))
    if previous:
        assert count == 2 and np.array_equal(out[1], old[1]), "the old page survives intact"
    else:
        assert count == 0


def test_size_bound_evicts_least_recently_used_pages(tmp_path):
    ns = namespace()
    stored = FileStore(tmp_path, namespace()).stored_bytes
    store = FileStore(tmp_path, ns, max_bytes=10 * stored)
    keys = page_keys(ns, np.arange(30 * GEOMETRY.page_size))
    pages = random_pages(30)
    store.set(keys[:8], [[p] for p in pages[:8]])
    os.utime(store.path(keys[0]), ns=(1, 1))        # make the LRU order unambiguous: page 0 is oldest by mtime ...
    assert read_pages(store, keys[:1])[0] == 1           # ... but a hit refreshes it
    for i in range(8, 30):
        store.set(keys[i:i + 1], [[pages[i]]])
    files = list(tmp_path.glob("*/*/*.kvp"))
    assert len(files) * stored <= 10 * stored
    assert store.stats()["evicted_pages"] >= 20
    assert read_pages(store, keys[29:30])[0] == 1, "the newest page stays"
    assert store.used_bytes <= 10 * stored


def test_two_processes_share_a_directory_and_namespaces_stay_apart(tmp_path):
    ns = namespace()
    payload = random_pages(1)[0]
    script = CHILD.format(tests=str(TESTS), tenant=ns.tenant, root=str(tmp_path),
                          payload=payload.tobytes().hex(), kill="no")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    store = FileStore(tmp_path, ns)
    count, out = read_pages(store, keys[1:])
    assert count == 1 and np.array_equal(out[0], payload)
    other = namespace()
    assert FileStore(tmp_path, other).exists(page_keys(other, np.arange(2 * GEOMETRY.page_size))[1:]) == 0


@pytest.mark.parametrize("fsync", ["none", "data", "full"])
def test_fsync_policies_store_the_same_bytes(tmp_path, fsync):
    ns = namespace()
    store = FileStore(tmp_path, ns, fsync=fsync)
    keys = page_keys(ns, np.arange(3 * GEOMETRY.page_size))
    pages = random_pages(3)
    assert store.set(keys, [[p] for p in pages]) == 3
    count, out = read_pages(store, keys)
    assert count == 3 and all(np.array_equal(a, b) for a, b in zip(out, pages, strict=False))
    assert oct(store.path(keys[0]).stat().st_mode & 0o777) == "0o600"


def test_an_unwritable_directory_degrades_to_counted_failures(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns, retry_interval=0)
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    for sub in {store.path(k).parent for k in keys}:
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text("not a directory")            # makes every write to these pages fail
    assert store.set(keys, [[p] for p in random_pages(2)]) == 0
    assert store.stats()["errors.set"] >= 1
    assert store.exists(keys) == 0


def test_a_stored_page_is_written_once_and_a_damaged_one_is_replaced(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns)
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    first, second = random_pages(2), random_pages(2)
    store.set(keys, [[p] for p in first])
    inode = store.path(keys[0]).stat().st_ino
    assert store.set(keys, [[p] for p in second]) == 2              # stored already: a key names its content
    assert store.path(keys[0]).stat().st_ino == inode and store.stats()["set.already_stored"] == 2
    assert np.array_equal(read_pages(store, keys)[1][0], first[0])
    blob = bytearray(store.path(keys[0]).read_bytes())
    blob[-1] ^= 0xFF
    store.path(keys[0]).write_bytes(bytes(blob))
    assert read_pages(store, keys)[0] == 0 and store.stats()["removed_bad_pages"] == 1
    store.set(keys[:1], [[second[0]]])                            # the next write replaces the damaged page
    count, out = read_pages(store, keys)
    assert count == 2 and np.array_equal(out[0], second[0])


def _version_1_page(fmt, key: bytes, payload: bytes) -> bytes:
    """A page as format version 1 wrote it: no payload order (zeros where it now is), checksummed as v1 did."""
    import struct

    import xxhash

    from kvtier.storage.format import _FIELDS

    fields = bytearray(fmt.sealed(key, bytes(16))[:_FIELDS.size])
    struct.pack_into("<H", fields, 4, 1)
    struct.pack_into("<H", fields, 10, 0)
    digest = xxhash.xxh3_128(bytes(fields))
    digest.update(payload)
    return bytes(fields) + digest.digest()


@pytest.mark.parametrize("damage", ["version_1", "order_bit"])
def test_a_page_this_store_would_not_read_is_replaced_by_the_next_write(tmp_path, damage):
    """Regression: write-once skipped any existing file, so a version-1 page left by an upgrade (or one whose payload
    order field was damaged) stayed a miss forever while set() reported the page stored."""
    from helpers.storage import namespace, random_pages

    from kvtier.cache import page_keys
    from kvtier.storage import FileStore

    ns = namespace()
    store = FileStore(tmp_path, ns)
    keys = page_keys(ns, np.arange(store.format.geometry.page_size))
    old = random_pages(1)[0]
    path = store.path(keys[0])
    if damage == "version_1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_version_1_page(store.format, keys[0], old.tobytes()).ljust(4096, b"\0") + old.tobytes())
    else:
        store.set(keys, [[old]])
        raw = bytearray(path.read_bytes())
        raw[10] ^= 0x01                                     # the payload order field
        path.write_bytes(bytes(raw))
    out = np.zeros_like(old)
    assert store.get(keys, [[out]]) == 0                    # a miss: a v1 page is left, a damaged one removed
    assert path.exists() == (damage == "version_1")
    assert store.stats()[f"miss.{'format' if damage == 'version_1' else 'corrupt'}"] == 1
    new = random_pages(1)[0]
    assert store.set(keys, [[new]]) == 1
    assert store.get(keys, [[out]]) == 1 and np.array_equal(out, new)
    assert store.set(keys, [[random_pages(1)[0]]]) == 1 and store.stats()["set.already_stored"] == 1
    store.close()


def test_processes_sharing_a_bounded_directory_converge_on_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(file_module, "RESCAN_SECONDS", 0.0)
    ns = namespace()
    stored = FileStore(tmp_path, ns).stored_bytes
    bound = 20 * stored
    one, two = FileStore(tmp_path, ns, max_bytes=bound), FileStore(tmp_path, ns, max_bytes=bound)
    keys = page_keys(ns, np.arange(60 * GEOMETRY.page_size))
    pages = random_pages(60)
    for i in range(0, 60, 2):                      # the two "processes" take turns
        one.set(keys[i:i + 1], [[pages[i]]])
        two.set(keys[i + 1:i + 2], [[pages[i + 1]]])
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*/*/*.kvp"))
    assert on_disk <= bound, f"{on_disk / bound:.0%} of the bound"


def test_a_removed_namespace_directory_is_made_again(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns, retry_interval=0)
    keys = page_keys(ns, np.arange(4 * GEOMETRY.page_size))
    pages = random_pages(4)
    assert store.set(keys[:2], [[p] for p in pages[:2]]) == 2
    shutil.rmtree(store.directory)                  # an operator's rm -rf, a tmp cleaner
    first = store.set(keys[2:], [[p] for p in pages[2:]])       # may fail part-way: counted, directory re-made
    assert store.set(keys[2:], [[p] for p in pages[2:]]) == 2
    assert first == 2 or store.stats()["errors.set"] == 1
    assert read_pages(store, keys[2:])[0] == 2 and (store.directory / "namespace.json").exists()


def test_a_directory_or_fifo_at_a_page_path_is_a_miss_not_an_error_or_a_hang(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns)
    keys = page_keys(ns, np.arange(3 * GEOMETRY.page_size))
    store.set(keys, [[p] for p in random_pages(3)])
    store.path(keys[1]).unlink()
    store.path(keys[1]).mkdir()
    assert read_pages(store, keys)[0] == 1
    assert store.stats()["miss.corrupt"] == 1 and store.up
    shutil.rmtree(store.path(keys[1]))
    os.mkfifo(store.path(keys[1]))
    done = []
    reader = threading.Thread(target=lambda: done.append(read_pages(store, keys)[0]), daemon=True)
    reader.start()
    reader.join(60)                                 # a hang is for good: the bound only has to end the test
    assert done == [1], "a FIFO at a page path hung the read"


def test_a_write_that_fails_part_way_counts_what_it_stored(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns, retry_interval=0)
    keys = page_keys(ns, np.arange(6 * GEOMETRY.page_size))
    blocked = store.path(keys[3]).parent
    if any(store.path(k).parent == blocked for k in keys[:3]):
        pytest.skip("this draw put an earlier page in the blocked directory")
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.write_text("not a directory")
    assert store.set(keys, [[p] for p in random_pages(6)]) == 3
    assert store.exists(keys) == 3


def test_reads_stay_up_while_writes_fail(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns, retry_interval=60)
    keys = page_keys(ns, np.arange(4 * GEOMETRY.page_size))
    store.set(keys[:2], [[p] for p in random_pages(2)])
    blocked = store.path(keys[2]).parent
    if blocked.exists():
        pytest.skip("this draw shares a directory with the stored pages")
    blocked.write_text("full disk, say")
    assert store.set(keys[2:3], [[random_pages(1)[0]]]) == 0
    assert read_pages(store, keys[:2])[0] == 2, "a failing write path does not take reads down"
    assert not store.up


def test_a_store_works_in_a_fork_child_after_its_threads_ran(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns, io_threads=4)
    keys = page_keys(ns, np.arange(8 * GEOMETRY.page_size))
    pages = random_pages(8)
    store.set(keys, [[p] for p in pages])
    assert read_pages(store, keys)[0] == 8             # the pool exists now
    pid = os.fork()
    if pid == 0:                                       # the child: its pool's threads do not exist
        import signal

        signal.alarm(20)
        count, out = read_pages(store, keys)
        os._exit(0 if count == 8 and all(np.array_equal(a, b) for a, b in zip(out, pages, strict=True)) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_page_file_cut_inside_its_header_block_is_short(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns)
    keys = page_keys(ns, np.arange(GEOMETRY.page_size))
    store.set(keys, [[random_pages(1)[0]]])
    os.truncate(store.path(keys[0]), 1000)
    assert read_pages(store, keys)[0] == 0 and store.stats()["miss.short"] == 1
