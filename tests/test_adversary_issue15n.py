"""Adversary round 14 (issue #15): the one close rule of round 13 (``Users.close``: deferred inside a user's call,
reopened on a refused wait), the engine's ``_closing`` flag, ``CapturedLoad.close`` and the releases
``Runtime.after_device_work`` keeps while a capture refuses its wait (``_KEPT_RELEASES``), attacked with refusals
that come at the deferred moment, a kept release that fails when it is retried, a captured load closed while another
stream captures, a viewed host buffer released during a capture that nothing releases later, and a release kept
by another thread while the shared list is rewritten. Attacks that held:
a pool and its engine closed in one handler (either order), a deferred close whose call then raises
KeyboardInterrupt, a pool close deferred inside a call while another thread closes the same pool, a refused pool
close retried after the capture, and a host buffer whose close a capture refused keeping its views consistent.
Tests not named ``test_ok_*`` fail on a defect (each docstring says what goes wrong, why it matters and a fix);
``test_ok_*`` tests document attacks that held. Races are forced with hooks that pick the moment they happen (never
with sleeps); every destination is poisoned first and checked byte for byte against fresh random data."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.pools import (
    at_first_event,
    fill_host,
    host_page,
    landed_or_untouched,
    poison_device,
    read_device,
    small_engine,
)

from kvtier.errors import BufferClosed, KvtierError, RuntimeCallError
from kvtier.memory.host_buffer import HostBuffer
from kvtier.runtime import base, create
from kvtier.runtime.base import Runtime

POISON = 0xEE
PAGES = np.arange(6)


class _Fake:
    """A runtime whose host wait a capture refuses (only what ``Runtime.after_device_work`` uses)."""

    def __init__(self):
        self.capturing = True

    def device_count(self):
        return 1

    def synchronize(self, device=None):
        if self.capturing:
            raise RuntimeCallError("cudaDeviceSynchronize", "cudaErrorStreamCaptureUnsupported", "capturing")


def _forget(fake):
    base._KEPT_RELEASES[:] = [(r, k) for r, k in base._KEPT_RELEASES if r is not fake]


# -- defects -------------------------------------------------------------------------------------------------------
def test_a_captured_load_whose_close_a_capture_refuses_stays_open():
    """``CapturedLoad.close()`` while another stream of the device captures (engine.py:120-131): it sets
    ``self.closed = True`` first, then ``_close_now`` waits on its stream — refused (cudaErrorStreamCaptureUnsupported)
    — and its ``finally: self._free()`` destroys the graph, the index ring and the stream anyway, with a replay
    possibly still in flight over the ring (on CUDA: the ring's memory handed out again under the DMA). Every other
    close (engine, pools, host buffer) now reopens on a refused wait; this one raises *and* frees, so the caller can
    neither retry after the capture nor replay. Fix: treat it like ``PoolUser.close`` — on ``capture_refused(error)``
    set ``closed`` back to False and re-raise without freeing; free only after a wait that was made."""
    rt = create("emulated:split:lazy")
    g, dev, host_pool, engine = small_engine(rt)
    stream = None
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POISON)
        captured = engine.capture_load([4, 5], [0, 1], layer=1)
        rt.synchronize(0)
        captured.replay()                      # lazy: still queued when the close comes
        stream = rt.create_stream(0)
        stream.begin_capture()
        try:
            captured.close()
            raised = None
        except KvtierError as error:
            raised = error
        finally:
            stream.end_capture()
        rt.synchronize(0)
        landed = sum(np.array_equal(read_device(dev, t, 1)[d], host_page(host_pool, host_data, t, 1, p))
                     for t in range(g.tensors) for p, d in ((4, 0), (5, 1)))
        assert landed == 2 * g.tensors
        if raised is not None:
            assert not captured.closed, f"close() raised {raised!r} and yet closed (and freed) the captured load"
            poison_device(dev, POISON)
            captured.replay()
            rt.synchronize(0)
            captured.close()
            assert captured.closed
    finally:
        if stream is not None:
            stream.close()
        engine.close(), host_pool.close(), dev.close()


def test_a_deferred_engine_close_refused_at_the_calls_end_leaves_the_engine_usable_or_closed():
    """``engine.close()`` asked for inside the engine's own call (a handler) sets ``_closing`` and defers
    (job.py:322-326). If a capture begins on another stream before the call returns (the same handler starting the
    model's graph warm-up, or another thread), the deferred close's wait is refused (job.py:333-334: re-raised, nothing
    undone): ``_closing`` stays True for good, so ``engine.closed`` says True and every call raises BufferClosed, yet
    the streams, tables and rings are never freed and the engine is still a user of both pools — a caller that trusts
    ``closed`` never closes it again (leak); the docstring promises "Refused while a stream captures: the engine stays
    open". The refusal also escapes from the *load* call whose transfer was queued and lands, so its caller believes
    the load failed. Fix: on a refused deferred close, clear ``_closing`` (as ``Users.close`` reopens pools) and keep
    the refusal out of the finished call (or keep the close for a later retry)."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt)
    stream = rt.create_stream(0)
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POISON)

        def handler():
            engine.close()
            stream.begin_capture()

        undo, fired = at_first_event(rt, handler)
        try:
            engine.load([0, 1, 2], [0, 1, 2])
            raised = None
        except KvtierError as error:
            raised = error
        finally:
            undo()
            if stream.capturing:
                stream.end_capture()
        assert fired
        rt.synchronize(0)
        landed, _ = landed_or_untouched(g, dev, host_pool, host_data, [0, 1, 2], [0, 1, 2])
        assert landed == 3 * g.tensors * g.layers
        assert engine.closed == engine._closed, "engine reports closed but was never closed (nor reopened)"
        assert raised is None, f"the load was queued and landed, yet the call raised {raised!r}"
    finally:
        stream.close()
        engine.close(), host_pool.close(), dev.close()


def test_kept_releases_survive_a_kept_release_that_fails_on_retry():
    """``Runtime.after_device_work`` (base.py:242-255) takes every kept release of the runtime out of
    ``_KEPT_RELEASES`` first and then runs them in a loop with no guard: when one raises (``HostBuffer._give_back`` →
    ``unregister_chunks`` failing, a finalizer's error), the exception leaves the loop and every later kept release —
    and the new ``release`` itself — is dropped from the list without having run: their pinned memory stays
    registered and mapped for the life of the process. Fix: run each in its own try, re-keep (or still run) the rest,
    and raise the first error after all were made."""
    fake = _Fake()
    ran = []

    def failing():
        ran.append("failing")
        raise KvtierError("unregister failed")

    try:
        Runtime.after_device_work(fake, failing)
        Runtime.after_device_work(fake, lambda: ran.append("second"))
        assert ran == []
        fake.capturing = False
        with pytest.raises(KvtierError):
            Runtime.after_device_work(fake, lambda: ran.append("third"))
        Runtime.after_device_work(fake, lambda: ran.append("fourth"))   # any later call makes the rest
        assert "second" in ran and "third" in ran, f"releases lost after one failed: ran {ran}"
    finally:
        _forget(fake)


def test_a_release_kept_during_a_capture_is_made_once_the_capture_ends():
    """A viewed host buffer closed while a stream captures: ``_Resources.release`` hands ``_give_back`` to
    ``after_device_work`` (host_buffer.py:71-72), whose wait is refused, so it is kept in ``_KEPT_RELEASES``
    (base.py:252-253) — and made only at the *next* ``after_device_work`` of the same runtime, i.e. when some other
    viewed buffer is released. Nothing does that when the capture ends or at a later synchronize: the buffer says
    closed, but its chunks stay registered and mapped (and the kept closure holds the runtime) for as long as no other
    viewed buffer is freed — for a serving process that captures its graphs once at start-up, forever. Fix: make the
    kept releases when the waits are allowed again (at ``end_capture`` of the last capturing stream, or in
    ``Runtime.synchronize`` after a successful wait), not only at the next release."""
    rt = create("emulated:split")
    buffer = HostBuffer.allocate(1 << 16, runtime=rt)
    address = buffer.cpu_address.value
    view = buffer.as_tensor()
    view[:] = 7
    del view
    stream = rt.create_stream(0)
    try:
        stream.begin_capture()
        try:
            buffer.close()
        finally:
            stream.end_capture()
        assert buffer.closed
        rt.synchronize(0)
        assert rt.host_range(address) is None, "the buffer's memory is still held after the capture ended"
    finally:
        stream.close()
        rt.after_device_work(lambda: None)     # make what was kept


def test_a_release_kept_by_another_thread_meanwhile_is_not_dropped(monkeypatch):
    """``_KEPT_RELEASES`` is one module-level list shared by every runtime and thread, rewritten without a lock
    (base.py:242-243: read the runtime's kept releases, then ``_KEPT_RELEASES[:] = [...]`` from a list built before).
    A release another thread keeps between the build and the assignment (a viewed buffer collected on another thread
    while its stream captures — a second runtime, or the same one) is overwritten and lost: its memory stays
    registered and mapped for good. Forced here by running the other thread when the filtered list is about to be
    stored (a list whose slice assignment runs it first: the same moment on every Python, whether a comprehension
    has a frame of its own or is inlined, as from 3.12). Fix: guard every read-modify-write of the list with a lock
    (and pop under it)."""
    first, second = _Fake(), _Fake()
    first.capturing = False
    ran: list = []
    started: list = []
    other = threading.Thread(target=lambda: Runtime.after_device_work(second, lambda: ran.append("kept")))

    class Stored(list):
        def __setitem__(self, key, value):
            if isinstance(key, slice) and not started:
                started.append(1)
                other.start()
                other.join(1.0)   # since the fix it waits on the list's lock until this thread leaves it
            super().__setitem__(key, value)

    monkeypatch.setattr(base, "_KEPT_RELEASES", Stored(base._KEPT_RELEASES))
    try:
        Runtime.after_device_work(first, lambda: ran.append("first"))
        other.join(60)
        assert started, "the hook never ran"
        second.capturing = False
        Runtime.after_device_work(second, lambda: ran.append("later"))
        assert "kept" in ran, f"the release kept by the other thread was dropped: ran {ran}"
    finally:
        _forget(first), _forget(second)


# -- attacks that held -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["pool_first", "engine_first"])
@pytest.mark.parametrize("which", ["device", "host"])
def test_ok_a_pool_and_its_engine_closed_in_one_handler_land_the_call_then_free(order, which):
    """Both closes are deferred to the call's end; the pool's drains the engine before giving memory back."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt)
    pool = dev if which == "device" else host_pool
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POISON)
        closes = [pool.close, engine.close] if order == "pool_first" else [engine.close, pool.close]
        undo, fired = at_first_event(rt, lambda: [c() for c in closes])
        try:
            engine.load([0, 1, 2], [0, 1, 2]).wait()
            refused = False
        except BufferClosed:
            refused = True
        finally:
            undo()
        assert fired and engine.closed and pool.closed and engine._closed
        rt.synchronize(0)
        if which == "host":     # the device pool stays open: the load landed whole or not at all
            landed, untouched = landed_or_untouched(g, dev, host_pool, host_data, [0, 1, 2], [0, 1, 2])
            assert (landed, untouched) in ((3 * g.tensors * g.layers, 0), (0, 3 * g.tensors * g.layers))
            assert refused == (landed == 0)
        with pytest.raises(BufferClosed):
            engine.load([0], [0])
    finally:
        engine.close(), host_pool.close(), dev.close()


def test_ok_a_deferred_close_whose_call_then_raises_keyboard_interrupt_still_closes():
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt)
    try:
        fill_host(host_pool)
        poison_device(dev, POISON)

        def handler():
            dev.close()
            engine.close()
            raise KeyboardInterrupt

        undo, fired = at_first_event(rt, handler)
        try:
            with pytest.raises(KeyboardInterrupt):
                engine.load([0, 1, 2], [0, 1, 2])
        finally:
            undo()
        assert engine._closed and dev.closed and engine.closed
        assert len(host_pool.buffer._users) == 0
        rt.synchronize(0)
        host_pool.close()
        assert host_pool.closed
    finally:
        engine.close(), host_pool.close(), dev.close()


def test_ok_a_pool_close_deferred_in_a_call_while_another_thread_closes_it():
    """The deferred close marks the pool closed first: the other thread's close returns at once."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt)
    try:
        fill_host(host_pool)
        poison_device(dev, POISON)
        errors = []

        def handler():
            dev.close()
            t = threading.Thread(target=lambda: errors.append(dev.close()))
            t.start()
            t.join()

        undo, fired = at_first_event(rt, handler)
        try:
            engine.load([0, 1, 2], [0, 1, 2]).wait()
            refused = False
        except BufferClosed:
            refused = True
        finally:
            undo()
        assert fired and dev.closed and errors == [None] and not refused
        rt.synchronize(0)       # the device pool was freed only after the load finished: nothing faults
        assert dev.layers == [] and engine._closed is False
    finally:
        engine.close(), host_pool.close(), dev.close()


@pytest.mark.parametrize("which", ["device", "host"])
def test_ok_a_pool_close_refused_during_a_capture_then_retried_frees_everything(which):
    rt = create("emulated:split:lazy")
    g, dev, host_pool, engine = small_engine(rt)
    pool = dev if which == "device" else host_pool
    stream = rt.create_stream(0)
    address = host_pool.buffer.cpu_address.value
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POISON)
        transfer = engine.load(PAGES, PAGES)
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeCallError):
                pool.close()
        finally:
            stream.end_capture()
        assert not pool.closed
        transfer.wait()
        landed, _ = landed_or_untouched(g, dev, host_pool, host_data, PAGES, PAGES)
        assert landed == 6 * g.tensors * g.layers
        pool.close()
        assert pool.closed
        with pytest.raises(BufferClosed):
            engine.load([0], [0])
        if which == "host":
            rt.synchronize(0)
            assert rt.host_range(address) is None
    finally:
        stream.close()
        engine.close(), host_pool.close(), dev.close()


def test_ok_a_host_buffer_close_refused_during_a_capture_keeps_views_usable():
    rt = create("emulated:split:lazy")
    g, dev, host_pool, engine = small_engine(rt)
    stream = rt.create_stream(0)
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POISON)
        engine.load(PAGES, PAGES)
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeCallError):
                host_pool.buffer.close()
        finally:
            stream.end_capture()
        view = host_pool.buffer.as_tensor()
        assert np.array_equal(view.numpy(), host_data)
        fresh = np.random.default_rng(5).integers(0, 256, host_pool.buffer.nbytes, dtype=np.uint8)
        view.numpy()[:] = fresh
        engine.synchronize()
        poison_device(dev, POISON)
        engine.load(PAGES, PAGES).wait()
        landed, _ = landed_or_untouched(g, dev, host_pool, fresh, PAGES, PAGES)
        assert landed == 6 * g.tensors * g.layers
        del view
        engine.close()
        host_pool.close()
        assert host_pool.closed
    finally:
        stream.close()
        engine.close(), host_pool.close(), dev.close()
