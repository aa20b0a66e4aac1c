"""What goes wrong between prefill and decode, and what each side then sees: a peer SIGKILLed mid-transfer (either
side), a peer gone before the handshake, KV that does not fit, a request id used twice, close() while a transfer is
in flight. In every case the waiting side gets a kvtier error naming the peer and the request, no page is reported
landed, and the surviving side's pools and receiver serve the next request."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from helpers.disagg import GEOMETRY, Peer, expected, make_pool, pair, read_kv, request_spec, write_kv

from kvtier import pause_points
from kvtier.disagg import KVReceiver, KVSender
from kvtier.errors import BufferClosed, HandshakeRefused, InvalidArgument, PeerLost, TransferFailed
from kvtier.pools import KVGeometry

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("mooncake_wheel")]


@pytest.mark.parametrize("pause", [["disagg.wire.batch", 3], ["disagg.sender.before_done", 1]],
                         ids=["mid-write", "written-not-done"])
def test_a_prefill_killed_mid_transfer_fails_the_request_and_the_receiver_serves_the_next(rt, pause):
    pool = make_pool(GEOMETRY, "layer_first", 48, rt)
    receiver = KVReceiver(pool, dtype="bfloat16")
    pages = list(range(40, 8, -1))                        # scattered runs: many batches of 4 entries
    doomed = Peer("prefill", address=receiver.address, runtime=rt.name, layout="page_first", pages=48,
                  batch_entries=4, pause=pause, requests=[request_spec("doomed", range(32), 1)])
    try:
        link = receiver.accept(60)
        landing = link.expect("doomed", pages)
        doomed.event("paused")
        assert not landing.done()
        started = time.monotonic()
        doomed.kill()
        with pytest.raises(PeerLost) as error:
            landing.wait(30)
        assert time.monotonic() - started < 10
        assert error.value.request_id == "doomed" and error.value.peer == link.peer
        assert "'doomed'" in str(error.value) and link.peer in str(error.value)
        assert not landing.landed and landing.done()
        with pytest.raises(PeerLost, match="'later'"):
            link.expect("later", [0])
        survivor = Peer("prefill", address=receiver.address, runtime=rt.name, layout="page_first", pages=48,
                        requests=[request_spec("next", range(32), 2)])
        try:
            assert receiver.accept(60).expect("next", pages).wait(60).tolist() == pages
            assert np.array_equal(read_kv(pool, pages), expected(2, 32))
            survivor.finish()
        finally:
            survivor.close()
    finally:
        doomed.close()
        receiver.close()
        pool.close()


def test_a_decode_killed_mid_transfer_fails_the_send_with_the_peer_and_request_named(rt):
    pool = make_pool(GEOMETRY, "page_first", 48, rt)
    write_kv(pool, range(32), expected(3, 32))
    peer = Peer("decode", runtime=rt.name, layout="layer_first", pages=48,
                requests=[request_spec("r", range(40, 8, -1), 0)])
    sender = None
    try:
        address = peer.event("ready")["address"]
        sender = KVSender(address, pool, dtype="bfloat16", staging_pages=4)
        peer.event("expecting")
        reached = []

        def kill_on_second_batch() -> None:
            reached.append(1)
            if len(reached) == 2:
                peer.kill()

        started = time.monotonic()
        with pause_points.armed("disagg.wire.batch", kill_on_second_batch), pytest.raises(TransferFailed) as error:
            sender.send("r", range(32))
        assert time.monotonic() - started < 15
        assert error.value.request_id == "r" and error.value.peer == address
        assert "'r'" in str(error.value) and address in str(error.value)
        with pytest.raises(PeerLost):
            sender.send("after", range(2), timeout=10)
    finally:
        if sender is not None:
            sender.close()
        peer.close()
        pool.close()


def test_a_peer_that_closes_before_the_handshake_is_reported_and_the_next_one_served(rt):
    src, dst = make_pool(GEOMETRY, "page_first", 8, rt), make_pool(GEOMETRY, "page_first", 8, rt)
    receiver = KVReceiver(dst)
    try:
        socket.create_connection(tuple(receiver.address.rsplit(":", 1)[0:1]) + (int(receiver.address.rsplit(":")[1]),
                                                                                 )).close()
        with pytest.raises(PeerLost, match="before the handshake"):
            receiver.accept(10)
        write_kv(src, [0], expected(4, 1))
        accepted = []
        thread = threading.Thread(target=lambda: accepted.append(receiver.accept(30)))
        thread.start()
        with KVSender(receiver.address, src) as sender:
            thread.join()
            landing = accepted[0].expect("r", [5])
            sender.send("r", [0])
            landing.wait(30)
        assert np.array_equal(read_kv(dst, [5]), expected(4, 1))
    finally:
        receiver.close()
        src.close()
        dst.close()


OTHER_PAGE = KVGeometry.mha(layers=4, kv_heads=2, head_dim=32, itemsize=2, page_size=8)
OTHER_LAYERS = KVGeometry.mha(layers=3, kv_heads=2, head_dim=32, itemsize=2, page_size=4)


@pytest.mark.parametrize("geometry, dtype, what", [(OTHER_PAGE, "bfloat16", "page_size 8"),
                                                   (OTHER_LAYERS, "bfloat16", "layers 3"),
                                                   (GEOMETRY, "float16", "dtype 'float16'")])
def test_kv_that_does_not_fit_is_refused_on_both_sides_before_any_byte_moves(rt, geometry, dtype, what):
    src = make_pool(geometry, "page_first", 8, rt)
    dst = make_pool(GEOMETRY, "page_first", 8, rt)
    receiver = KVReceiver(dst, dtype="bfloat16")
    refused: list[BaseException] = []

    def accept() -> None:
        try:
            receiver.accept(30)
        except HandshakeRefused as exc:
            refused.append(exc)

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        with pytest.raises(HandshakeRefused, match=what) as error:
            KVSender(receiver.address, src, dtype=dtype)
        thread.join()
        assert receiver.address in str(error.value) and len(refused) == 1 and what in str(refused[0])
        assert not read_kv(dst, range(8)).any()
        assert src.buffer.closed is False      # the sender gave everything back: the pool closes cleanly
    finally:
        receiver.close()
        src.close()
        dst.close()


def test_a_request_id_is_used_once_per_link(rt):
    src, dst = make_pool(GEOMETRY, "page_first", 8, rt), make_pool(GEOMETRY, "page_first", 8, rt)
    sender, link, receiver = pair(src, dst)
    try:
        landing = link.expect("r", [1, 2])
        with pytest.raises(InvalidArgument, match="'r' was used"):
            link.expect("r", [3])
        sender.send("r", [0, 1])
        landing.wait(30)
        with pytest.raises(InvalidArgument, match="'r' was sent"):
            sender.send("r", [0, 1])
        with pytest.raises(InvalidArgument, match="'r' was used"):
            link.expect("r", [3])
    finally:
        sender.close()
        receiver.close()
        src.close()
        dst.close()


def test_receiver_close_with_a_request_pending_fails_it_and_is_idempotent(rt):
    src, dst = make_pool(GEOMETRY, "page_first", 8, rt), make_pool(GEOMETRY, "page_first", 8, rt)
    sender, link, receiver = pair(src, dst)
    try:
        landing = link.expect("r", [1, 2])
        closers = [threading.Thread(target=receiver.close) for _ in range(2)]
        for t in closers:
            t.start()
        for t in closers:
            t.join()
        receiver.close()
        with pytest.raises(BufferClosed, match="'r'"):
            landing.wait(10)
        assert not landing.landed
        with pytest.raises(TransferFailed, match="'r'"):      # its want came before the close: the write is refused
            sender.send("r", [0, 1], timeout=10)
        with pytest.raises(BufferClosed):
            link.expect("s", [3])
    finally:
        sender.close()
        receiver.close()
        src.close()
        dst.close()


def test_sender_close_during_a_write_stops_it_and_the_receiver_hears_the_request_failed(rt):
    """One write, no staging (same layouts), scattered pages in batches of 4 runs: the close lands between two
    batches of the wire."""
    from kvtier.disagg import MooncakeWire

    src, dst = make_pool(GEOMETRY, "page_first", 32, rt), make_pool(GEOMETRY, "page_first", 32, rt)
    sender, link, receiver = pair(src, dst, sender_wire=MooncakeWire(batch_entries=4))
    assert not sender.converts
    try:
        landing = link.expect("r", range(31, -1, -1))
        closer = threading.Thread(target=sender.close)

        def close_now() -> None:
            if not closer.is_alive() and closer.ident is None:
                closer.start()
                while not sender._closing:
                    time.sleep(0.001)

        with pause_points.armed("disagg.wire.batch", close_now), pytest.raises(BufferClosed, match="'r'"):
            sender.send("r", range(32))
        closer.join(30)
        assert not closer.is_alive()
        with pytest.raises(TransferFailed, match="'r'.*closed"):
            landing.wait(10)
        assert not landing.landed
        sender.close()
        with pytest.raises(BufferClosed):
            sender.send("s", [0])
    finally:
        sender.close()
        receiver.close()
        src.close()
        dst.close()


def test_closing_the_pool_under_a_receiver_closes_the_receiver_first(rt):
    src, dst = make_pool(GEOMETRY, "page_first", 8, rt), make_pool(GEOMETRY, "page_first", 8, rt)
    sender, link, receiver = pair(src, dst)
    try:
        landing = link.expect("r", [1])
        dst.close()
        with pytest.raises(BufferClosed):
            landing.wait(10)
        with pytest.raises(TransferFailed, match="'r'"):      # unregistered: Mooncake refuses the write
            sender.send("r", [0], timeout=10)
    finally:
        sender.close()
        receiver.close()
        src.close()


def test_mooncake_gets_cpu_addresses_never_device_aliases(split):
    """In split mode a registered host pool's device alias differs from its CPU address; the wire is handed the CPU
    address, and refuses a device address outright (the non-CUDA wheel reaches host memory only)."""
    from kvtier.address import DeviceAddress
    from kvtier.errors import AddressDomainError
    from kvtier.memory import get_device_accessible_ptr

    src, dst = make_pool(GEOMETRY, "page_first_direct", 8, split), make_pool(GEOMETRY, "device", 8, split)
    sender, link, receiver = pair(src, dst)
    try:
        alias = get_device_accessible_ptr(src.buffer, 0)
        assert alias.value != src.buffer.cpu_address.value
        assert sender.wire._registered == [src.buffer.cpu_address.value]
        staging = receiver._staging.pool.buffer
        assert receiver.wire._registered == [staging.cpu_address.value]
        with pytest.raises(AddressDomainError, match="CPU address"):
            sender.wire.register(DeviceAddress(alias.value, 0), 64)
        assert link.receiver is receiver
    finally:
        sender.close()
        receiver.close()
        src.close()
        dst.close()
