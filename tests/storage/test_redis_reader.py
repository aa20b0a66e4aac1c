"""RedisStore's direct read path (kvtier.storage.redis_reader): replies parsed from the connection's socket, each
payload received straight into the host page's pieces, the checksum verified there. On real servers: every host
layout and page kind round trips, both ways of asking (one GET per page, or STRLEN + GETRANGE ranges); a damaged,
foreign, resized, emptied or missing value is a counted miss that never overruns the page's buffers; a connection
killed mid-reply is a storage failure that leaves no dirty connection in the pool; two threads read at once; pieces
of odd sizes at odd offsets. Over a socket pair: replies RESP2 does not give to these commands are clear errors."""

from __future__ import annotations

import shutil
import socket
import threading
import types

import numpy as np
import pytest
import redis
from helpers.storage import GEOMETRY, PAGE, RedisServer, namespace, random_pages, read_pages
from redis._parsers import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.cache import page_keys
from kvtier.pools import HostPool, KVGeometry
from kvtier.storage import HostPages, RedisStore, open_store, redis_reader, redis_store
from kvtier.storage.format import HEADER_BYTES, PageFormat, PageRejected

RANGE_BYTES = 100
"""PART_BYTES in the ``ranges`` runs: a test page (132 + 1024 bytes) comes in 12 ranges, its header across two."""


@pytest.fixture(params=["get", "ranges"])
def asked(request, monkeypatch) -> str:
    """How pages are asked for: one GET each, or STRLEN and GETRANGE ranges (PART_BYTES made small)."""
    if request.param == "ranges":
        monkeypatch.setattr(redis_reader, "PART_BYTES", RANGE_BYTES)
    return request.param


@pytest.fixture
def direct_reads(monkeypatch) -> list[int]:
    """Pages per call of the direct reader (redis-py's pipeline, the other path, leaves nothing here)."""
    calls: list[int] = []
    real = redis_store.read_pages

    def counted(connection, sock, plan, format, names, keys, pages, read):
        calls.append(len(keys))
        return real(connection, sock, plan, format, names, keys, pages, read)

    monkeypatch.setattr(redis_store, "read_pages", counted)
    return calls


def guarded(sizes: list[int], offset: int = 3, guard: int = 5) -> tuple[np.ndarray, list[memoryview]]:
    """Pieces of ``sizes`` bytes, each ``guard`` bytes after the last in one buffer (the first at ``offset``), all
    of it 0x5A: (the buffer, the pieces). What a read writes outside its pieces shows in the buffer."""
    whole = np.full(offset + sum(sizes) + guard * len(sizes), 0x5A, np.uint8)
    pieces, at = [], offset
    for size in sizes:
        pieces.append(memoryview(whole[at:at + size]))
        at += size + guard
    return whole, pieces


def outside(whole: np.ndarray, pieces: list[memoryview]) -> np.ndarray:
    """The bytes of ``whole`` that no piece covers."""
    mask = np.ones(whole.size, bool)
    base = whole.ctypes.data
    for piece in pieces:
        start = np.frombuffer(piece, np.uint8).ctypes.data - base
        mask[start:start + piece.nbytes] = False
    return whole[mask]


# -- round trips --------------------------------------------------------------------------------------------------
KINDS = {"mha": KVGeometry.mha(layers=2, kv_heads=2, head_dim=16, itemsize=2, page_size=4),
         "mla": KVGeometry.mla(layers=3, latent_bytes=80, page_size=4),
         "k_only": KVGeometry.k_only(layers=2, heads=2, head_dim=16, itemsize=2, page_size=4)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_every_host_layout_and_page_kind_round_trips_through_the_socket(redis_url, runtime, layout, kind, asked,
                                                                         direct_reads):
    geometry, count = KINDS[kind], 6
    ns = namespace(geometry)
    pool = HostPool.allocate(geometry, layout, pages=2 * count, runtime=runtime)
    view = pool.buffer.as_tensor().numpy()
    view[:] = np.random.default_rng().integers(1, 256, view.size, dtype=np.uint8)
    del view
    pages = HostPages(pool)
    keys = page_keys(ns, np.arange(count * geometry.page_size))
    try:
        with open_store(redis_url, ns, layout=layout) as store, pages.batch(np.arange(2 * count)) as io:
            source = [io.pieces(i) for i in range(count)]
            target = [io.pieces(i) for i in range(count, 2 * count)]
            for piece in (p for page in target for p in page):
                np.frombuffer(piece, np.uint8)[:] = 0xA5
            assert store.set(keys, source) == count
            assert store.get(keys, target) == count
            assert all(bytes(a) == bytes(b) for x, y in zip(source, target, strict=True)
                       for a, b in zip(x, y, strict=True))
            assert sum(direct_reads) == count and store.stats().get("errors.get", 0) == 0
            store.clear()
    finally:
        pages.close()
        pool.close()


def test_pieces_of_odd_sizes_at_odd_offsets_are_filled_and_nothing_around_them(redis_url, asked):
    """A page of many pieces, some a byte long, starting at odd addresses: what came with a length line is spread
    over several of them, the rest goes straight in; a float16 piece is taken as its bytes."""
    ns = namespace()
    keys = page_keys(ns, np.arange(4 * GEOMETRY.page_size))
    data = random_pages(4)
    sizes = [1, 3, 130, 1, 7, 250, 2, PAGE - 394]
    with open_store(redis_url, ns) as store:
        assert store.set(keys, [[p] for p in data]) == 4
        outs = [guarded(sizes, offset=1 + 2 * i) for i in range(3)]
        half = np.zeros(PAGE // 2, np.float16)                    # a buffer of another item size
        pages = [pieces for _, pieces in outs] + [[np.zeros(0, np.uint8), half]]
        assert store.get(keys, pages) == 4
        for (whole, pieces), page in zip(outs, data, strict=False):
            assert b"".join(bytes(p) for p in pieces) == page.tobytes()
            assert (outside(whole, pieces) == 0x5A).all()
        assert half.tobytes() == data[3].tobytes()


def test_a_cluster_is_read_node_by_node_through_the_socket(redis_cluster_url, asked, direct_reads):
    ns = namespace()
    with open_store(redis_cluster_url, ns) as store:
        keys = page_keys(ns, np.arange(60 * GEOMETRY.page_size))
        pages = random_pages(60)
        assert store.set(keys, [[p] for p in pages]) == 60
        count, out = read_pages(store, keys)
        assert count == 60 and all(np.array_equal(a, b) for a, b in zip(out, pages, strict=True))
        assert len(direct_reads) == 6 and sum(direct_reads) == 60          # per batch of 32, a read per node
        store.clear()


def test_two_threads_read_at_once_each_on_its_own_connection(redis_url, asked, monkeypatch):
    monkeypatch.setattr(redis_reader, "WINDOW_BYTES", 1)      # two pages in flight: the reads interleave
    ns = namespace()
    keys = page_keys(ns, np.arange(40 * GEOMETRY.page_size))
    data = random_pages(40)
    wrong: list[str] = []
    with open_store(redis_url, ns) as store:
        assert store.set(keys, [[p] for p in data]) == 40

        def reader(first: int) -> None:
            for round_ in range(15):
                chosen = slice(first, first + 20) if round_ % 2 else slice(0, 40)
                count, out = read_pages(store, keys[chosen])
                if count != len(out) or any(not np.array_equal(a, b) for a, b in zip(out, data[chosen], strict=True)):
                    wrong.append(f"reader {first}, round {round_}: {count} pages, {store.last_error}")

        threads = [threading.Thread(target=reader, args=(first,)) for first in (0, 20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert wrong == [] and store.stats().get("errors.get", 0) == 0


@pytest.mark.parametrize("where", ["unix", "tls"])
def test_unix_and_tls_sockets_are_read_directly(tmp_path, where, asked, direct_reads):
    if where == "tls" and shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make a certificate)")
    path = tmp_path / "redis.sock"
    server = RedisServer(tls=True) if where == "tls" else RedisServer("--unixsocket", str(path), "--unixsocketperm",
                                                                       "700")
    try:
        ns = namespace()
        keys = page_keys(ns, np.arange(5 * GEOMETRY.page_size))
        pages = random_pages(5)
        with open_store(server.url if where == "tls" else f"unix://{path}", ns) as store:
            assert store.set(keys, [[p] for p in pages]) == 5
            count, out = read_pages(store, keys)
            assert count == 5 and all(np.array_equal(a, b) for a, b in zip(out, pages, strict=True))
            assert direct_reads == [5]
    finally:
        server.close()


def test_the_store_speaks_resp2_and_a_resp3_connection_is_left_to_redis_py(redis_url, direct_reads):
    """RESP3 may put push messages between replies, which only redis-py's parser hands on: such a connection is
    read the old way (one ``bytes`` per page), with the same outcomes."""
    ns = namespace()
    keys = page_keys(ns, np.arange(3 * GEOMETRY.page_size))
    pages = random_pages(3)
    with open_store(redis_url, ns) as store:
        assert store.set(keys, [[p] for p in pages]) == 3
        connection = store.client().connection_pool.get_connection()
        try:
            assert connection.protocol == 2 and redis_reader.direct_socket(connection) is connection._sock
        finally:
            store.client().connection_pool.release(connection)
        resp3 = redis.Redis.from_url(redis_url, protocol=3)
        connection = resp3.connection_pool.get_connection()
        try:
            assert redis_reader.direct_socket(connection) is None
        finally:
            resp3.connection_pool.release(connection)
        store._client = resp3                              # a client the store did not make: RESP3
        count, out = read_pages(store, keys)
        assert count == 3 and all(np.array_equal(a, b) for a, b in zip(out, pages, strict=True))
        assert direct_reads == []


# -- values that are not this page --------------------------------------------------------------------------------
DAMAGES = {"payload": "corrupt", "header": "geometry", "longer": "short", "shorter": "short", "empty": "short",
           "absent": "absent", "wrong type": "corrupt", "other key": "key"}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_value_that_is_not_this_page_is_a_counted_miss_never_served_nor_overrunning(redis_url, asked, damage,
                                                                                    direct_reads):
    ns = namespace()
    keys = page_keys(ns, np.arange(3 * GEOMETRY.page_size))
    data = random_pages(3)
    with open_store(redis_url, ns, retry_interval=0) as store:
        assert store.set(keys, [[p] for p in data]) == 3
        client, name = store.client(), store.key(keys[1])
        value = bytearray(client.get(name))
        if damage == "payload":
            value[HEADER_BYTES + 500] ^= 0x10
        elif damage == "header":
            value[20] ^= 0x01                              # a geometry field
        elif damage == "longer":
            value += b"more bytes than a page"
        elif damage == "shorter":
            del value[-7:]
        elif damage == "empty":
            value = bytearray()
        elif damage == "other key":
            value = bytearray(client.get(store.key(keys[2])))
        if damage == "absent":
            client.delete(name)
        elif damage == "wrong type":
            client.delete(name)
            client.rpush(name, b"not a page")
        else:
            client.set(name, bytes(value))
        outs = [guarded([PAGE // 2, PAGE - PAGE // 2]) for _ in range(3)]
        assert store.get(keys, [pieces for _, pieces in outs]) == 1, store.last_error
        assert b"".join(bytes(p) for p in outs[0][1]) == data[0].tobytes()
        assert all((outside(whole, pieces) == 0x5A).all() for whole, pieces in outs), "a read ran past a piece"
        stats = store.stats()
        assert stats[f"miss.{DAMAGES[damage]}"] == 1 and stats.get("errors.get", 0) == 0 and stats["up"]
        assert sum(direct_reads) == 3
        count, out = read_pages(store, keys[2:])          # the replies after the bad one were read right
        assert count == 1 and np.array_equal(out[0], data[2])
        if damage not in ("absent",):
            assert store.set(keys[1:2], [[data[1]]]) == 1  # removed or replaced: written again, then served
            count, out = read_pages(store, keys)
            assert count == 3 and all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        store.clear()


# -- a connection that breaks -------------------------------------------------------------------------------------
BIG = KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=16)
"""2 MiB pages: two in flight are more than the socket buffers hold, so a kill lands inside a reply."""


def test_a_connection_killed_mid_reply_is_a_storage_failure_and_leaves_no_dirty_connection(own_server, monkeypatch,
                                                                                        asked):
    if asked == "ranges":
        monkeypatch.setattr(redis_reader, "PART_BYTES", 700 << 10)
    monkeypatch.setattr(redis_reader, "WINDOW_BYTES", 1)
    ns = namespace(BIG)
    keys = page_keys(ns, np.arange(4 * BIG.page_size))
    data = random_pages(4, BIG)
    killer = redis.Redis(port=own_server.port)
    real_recv = redis_reader.Replies.recv
    kills = []

    def recv(self, target):
        if not kills:                                  # the first read of a reply: every other client goes
            kills.append(killer.client_kill_filter(_type="normal", skipme=True))
        return real_recv(self, target)

    store = RedisStore(own_server.url, ns, retry_interval=0)
    try:
        assert store.set(keys, [[p] for p in data]) == 4
        client = store.client()
        monkeypatch.setattr(redis_reader.Replies, "recv", recv)
        assert read_pages(store, keys, BIG)[0] == 0
        monkeypatch.setattr(redis_reader.Replies, "recv", real_recv)
        assert kills and kills[0] >= 1
        assert store.stats()["errors.get"] == 1
        assert "closed by the server in the middle of a reply" in store.last_error, store.last_error
        pool = client.connection_pool
        assert pool._in_use_connections == set()
        assert all(c._sock is None for c in pool._available_connections), "a connection went back with a reply in it"
        assert client.get(store.key(keys[3]))[HEADER_BYTES:] == data[3].tobytes()   # the same pool, afterwards
        count, out = read_pages(store, keys, BIG)      # and the store, on a new client
        assert count == 4 and all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        assert store.stats()["reconnects"] == 1
    finally:
        store.close()
        killer.close()


# -- replies RESP2 does not give: over a socket pair ----------------------------------------------------------------
FORMAT = PageFormat.of(namespace())
KEY = bytes(range(32))
PAYLOAD = bytes(np.random.default_rng(7).integers(0, 256, PAGE, dtype=np.uint8))
VALUE = FORMAT.header(KEY, [PAYLOAD]) + PAYLOAD


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


@pytest.fixture
def socket_replies():
    """A factory of readers over a socket pair whose peer wrote ``stream`` (and then closed, unless told):
    ``make(stream, close=True, timeout=5.0)`` -> (the reader, the peer's socket). Both ends close afterwards."""
    made: list[socket.socket] = []

    def make(stream: bytes, close: bool = True, timeout: float = 5.0):
        ours, theirs = socket.socketpair()
        made.extend((ours, theirs))
        ours.settimeout(timeout)
        theirs.sendall(stream)
        if close:
            theirs.close()
        return redis_reader.Replies(types.SimpleNamespace(_parser=BaseParser), ours), theirs

    yield make
    for end in made:
        end.close()


def read_one(replies: redis_reader.Replies, ranges=None) -> tuple[object, bytes]:
    """The next page's outcome over a socket pair, its checksum verified, and the bytes read into it."""
    out = bytearray(PAGE)
    outcome = replies.page(KEY, [memoryview(out)], FORMAT, ranges)
    if isinstance(outcome, redis_reader.Read):
        FORMAT.check_payload(outcome.header, outcome.checksum, [out])
    return outcome, bytes(out)


def test_a_page_a_missing_key_and_an_error_reply_over_a_socket_pair(socket_replies):
    replies, _ = socket_replies(bulk(VALUE) + b"$-1\r\n" + b"-WRONGTYPE Operation against a key\r\n" + bulk(VALUE))
    outcome, out = read_one(replies)
    assert isinstance(outcome, redis_reader.Read) and out == PAYLOAD
    assert read_one(replies)[0] is None
    error = read_one(replies)[0]
    assert type(error) is redis.exceptions.ResponseError and str(error).startswith("WRONGTYPE")
    assert read_one(replies)[1] == PAYLOAD
    replies.done()


def test_a_value_changed_between_strlen_and_its_ranges_is_a_miss_and_the_next_page_reads(socket_replies):
    ranges = [(0, 600), (600, len(VALUE))]
    stream = (b":%d\r\n" % len(VALUE) + bulk(VALUE[:600]) + b"$0\r\n\r\n"          # went after its first range
              + b":%d\r\n" % len(VALUE) + bulk(VALUE[:600]) + bulk(VALUE[600:]))
    replies, _ = socket_replies(stream)
    outcome = read_one(replies, ranges)[0]
    assert isinstance(outcome, PageRejected) and outcome.reason == "absent" and "changed" in str(outcome)
    assert read_one(replies, ranges)[1] == PAYLOAD
    replies.done()


@pytest.mark.parametrize("stream, message", [
    (b"_\r\n", "type b'_'"),                              # RESP3's null
    (b">3\r\n$10\r\ninvalidate\r\n", "type b'>'"),        # a RESP3 push message
    (b"+OK\r\n", "type b'\\+'"),
    (b"*1\r\n$3\r\nabc\r\n", "type b'\\*'"),
    (b"$12x\r\n", "not a number"),
    (b"$-7\r\n", "a negative length"),
    (bulk(VALUE)[:-2] + b"!!\r\n", "longer than its length"),
    (b"$%d\r\n" % len(VALUE) + VALUE[:600], "closed by the server in the middle of a reply"),
    (b"$%d\r\n" % len(VALUE), "closed by the server in the middle of a reply"),
    (b"$1" + b"2" * 70000, "a line longer than any of these replies"),
])
def test_a_reply_that_is_not_resp2s_answer_is_a_clear_error(socket_replies, stream, message):
    replies, _ = socket_replies(stream)
    with pytest.raises((InvalidResponse, RedisConnectionError), match=message):
        read_one(replies)


def test_bytes_after_the_last_reply_are_an_error(socket_replies):
    replies, _ = socket_replies(bulk(VALUE) + b"+OK\r\n")
    assert read_one(replies)[1] == PAYLOAD
    with pytest.raises(InvalidResponse, match="after the last reply"):
        replies.done()


def test_a_silent_server_is_a_timeout(socket_replies):
    replies, _ = socket_replies(b"$%d\r\n" % len(VALUE) + VALUE[:300], close=False, timeout=0.2)
    with pytest.raises(RedisTimeoutError):
        read_one(replies)
