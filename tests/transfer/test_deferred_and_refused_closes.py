"""The close rule of engines, pools, host buffers and captured loads (``Users.close``, the engine's lock): a close
asked for on the thread that is inside one of an engine's own calls (a finalizer, a signal handler) is deferred
until the call returns, so the call lands whole or is refused before queuing, never runs over freed memory, and no
new call is taken meanwhile; a close whose wait a capture on another stream refuses leaves the object open and
usable, to be closed again once the capture ends. Races are forced with hooks that pick the moment they happen
(never with sleeps); every destination is poisoned first and checked byte for byte against fresh random data.
(Found adversarially, issue #15.)
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.pools import (
    at_first_event,
    fill_device,
    fill_host,
    host_bytes,
    host_page,
    landed_or_untouched,
    poison_device,
    read_device,
    small_engine,
)

from kvtier.errors import BufferClosed, InvalidArgument, KvtierError, RuntimeCallError
from kvtier.pools import DevicePool
from kvtier.runtime import create
from kvtier.transfer import TransferEngine

POOL_POISON = 0xEE
"""The poison helpers.pools writes and recognises by default."""
SIX_PAGES = np.arange(6)
"""More pages than small_engine's staging holds: a transfer of them runs in pieces."""


def _check_runtime_healthy(rt):
    """The device is not faulted: a fresh engine over fresh pools still moves fresh bytes exactly."""
    rt.synchronize(0)
    g, dev, host_pool, engine = small_engine(rt, "kernel")
    try:
        data = fill_host(host_pool)
        poison_device(dev, POOL_POISON)
        engine.load([1, 2], [3, 4]).wait()
        landed, _ = landed_or_untouched(g, dev, host_pool, data, [1, 2], [3, 4])
        assert landed == 2 * g.tensors * g.layers
    finally:
        engine.close(), host_pool.close(), dev.close()


# -- closes asked for inside an engine's own call ----------------------------------------------------------------------
@pytest.mark.parametrize("which,backend", [("device", "kernel"), ("device", "staged"), ("host", "kernel")])
@pytest.mark.parametrize("direction", ["load", "backup"])
def test_a_pool_closed_inside_an_engines_own_call_is_not_freed_under_it(which, backend, direction):
    """``DevicePool.close()`` / ``HostPool.close()`` reached on the thread that is inside ``engine.load``/``backup``
    (a finalizer such as ``weakref.finalize(owner, pool.close)`` — the very case collector.py describes — or a
    SIGTERM handler) drains the engine through ``Users.drain`` → ``PoolUser.drain`` (job.py:283: the engine's lock is
    reentrant, so it gets in) and then frees the pool's memory (device_pool.py:60-72; host_buffer.py close →
    ``_finalizer``), while the call goes on queuing over it: the kernel backend launches over the pointer tables
    built at construction (kernel.py:95-99) and the staged backend relayouts into the freed pool, so the emulated
    device faults with IllegalAddress at an address no allocation holds and is poisoned for good (on CUDA: a sticky
    illegal-address error that kills the context, or — if the allocator handed the memory out again — silent writes
    into another tensor). The engine's lock deferred only the engine's own close (job.py:226 ``_EngineLock``); a
    pool's close is not deferred. Fix: have ``DevicePoolLifetime.close`` / ``HostBuffer.close`` ask each user whether
    this thread is inside one of its calls (``user._lock.held_here()``) and, if so, mark the pool closing and hand the
    rest of the close to the user's ``pending`` (run as the call returns), or have the engine re-check its pools just
    before it queues (after the last point a finalizer can run) and raise BufferClosed having queued nothing."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt, backend)
    target = dev if which == "device" else host_pool
    undo = lambda: None  # noqa: E731
    try:
        device_data = fill_device(dev)
        host_data = fill_host(host_pool)
        if direction == "load":
            poison_device(dev, POOL_POISON)
        else:
            host_pool.buffer.as_tensor().numpy()[:] = POOL_POISON
        undo, fired = at_first_event(rt, target.close)
        try:
            transfer = engine.load(SIX_PAGES, SIX_PAGES) if direction == "load" else engine.backup(SIX_PAGES, SIX_PAGES)
            transfer.wait()
            refused = False
        except BufferClosed:
            refused = True
        undo()
        assert fired and target.closed
        rt.synchronize(0)   # raises IllegalAddress when the call queued over the freed pool
        survivor_is_destination = (direction == "load") == (which == "host")
        if survivor_is_destination and direction == "load":
            landed, untouched = landed_or_untouched(g, dev, host_pool, host_data, SIX_PAGES, SIX_PAGES)
            assert (landed, untouched) in ((0, 6 * g.tensors * g.layers), (6 * g.tensors * g.layers, 0))
            assert refused == (landed == 0)
        elif survivor_is_destination:
            after = host_bytes(host_pool)
            for t in range(g.tensors):
                for layer in range(g.layers):
                    for p in SIX_PAGES:
                        got = host_page(host_pool, after, t, layer, p)
                        assert (got == POOL_POISON).all() if refused else \
                            np.array_equal(got, device_data[(t, layer)][p])
        _check_runtime_healthy(rt)
    finally:
        undo()
        engine.close(), host_pool.close(), dev.close()


@pytest.mark.parametrize("which,backend", [("device", "direct"), ("device", "batch"), ("host", "direct"),
                                           ("host", "batch"), ("host", "staged")])
def test_ok_a_pool_closed_inside_a_dma_engines_call_is_refused_before_queuing(which, backend):
    """The DMA backends read the pools' addresses through their open checks (``layer_device_addresses``,
    ``cpu_address``) as they queue, so a pool closed by a handler inside the call makes it raise BufferClosed; the
    surviving destination is untouched and the device healthy."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt, backend)
    target = dev if which == "device" else host_pool
    undo = lambda: None  # noqa: E731
    try:
        fill_device(dev)
        host_data = fill_host(host_pool)
        if which == "host":
            poison_device(dev, POOL_POISON)
        undo, fired = at_first_event(rt, target.close)
        direction = "backup" if which == "device" else "load"
        with pytest.raises(BufferClosed):
            (engine.backup if direction == "backup" else engine.load)(SIX_PAGES, SIX_PAGES).wait()
        undo()
        assert fired and target.closed
        rt.synchronize(0)
        if which == "host":
            landed, untouched = landed_or_untouched(g, dev, host_pool, host_data, SIX_PAGES, SIX_PAGES)
            assert landed == 0
        _check_runtime_healthy(rt)
    finally:
        undo()
        engine.close(), host_pool.close(), dev.close()


@pytest.mark.parametrize("what", ["shape_load", "replay"])
def test_a_captured_load_closed_inside_its_own_call_is_not_used_after_close(what):
    """``CapturedShape.close()`` / ``CapturedLoad.close()`` reached on the thread inside ``shape.load`` /
    ``captured.replay`` (a finalizer dropping the object that owns the capture, a signal handler) re-enters the
    engine's reentrant lock (engine.py:111 ``CapturedLoad.close``: ``with self._engine._lock``) and frees the graph, its
    index ring, its stream and the shape's pinned staging (``_free``) under the call, which then carries on: a shape
    load orders and uploads on the destroyed capture stream (RuntimeCallError 'stream ... is destroyed', not
    BufferClosed; at a later point, ``memcpy_async`` into the freed index ring: on CUDA the ring's memory may already
    hold another allocation, which the upload overwrites; the H200 segfaulted on destroyed stream handles), and
    a replay launches the closed graph, which the emulator takes as a launch of nothing (emulated_device.py:279
    ``EmulatedGraph.close`` empties the ops and ``launch`` accepts it): the replay returns as if it had run while not
    one byte was copied (on CUDA, cudaGraphLaunch of a destroyed graph exec is undefined). The engine's deferral
    (job.py:226) only covers the engine's own close. Fix: route ``CapturedLoad.close`` through the same
    ``_EngineLock.pending`` when the lock is held on this thread (a list of pending closes, run as the call returns),
    or re-check ``self.closed`` right before queuing; and make the emulator's closed graph refuse ``launch``."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt, "kernel")
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POOL_POISON)
        captured = engine.capture_shape(3) if what == "shape_load" else engine.capture_load([4, 5], [0, 1], layer=1)
        rt.synchronize(0)
        fired = []

        def check_open():   # engine._check_open asks the device pool: inside the call, under the engine's lock
            if not fired:
                fired.append(1)
                captured.close()
            DevicePool.check_open(dev)

        dev.check_open = check_open
        try:
            if what == "shape_load":
                captured.load([4, 5, 6], [0, 1, 2]).wait()
            else:
                captured.replay()
            refused = False
        except BufferClosed:
            refused = True
        finally:
            del dev.check_open
        assert fired and captured.closed
        rt.synchronize(0)
        if what == "shape_load":
            landed, untouched = landed_or_untouched(g, dev, host_pool, host_data, [4, 5, 6], [0, 1, 2])
            total = 3 * g.tensors * g.layers
        else:
            landed = sum(np.array_equal(read_device(dev, t, 1)[d], host_page(host_pool, host_data, t, 1, p))
                         for t in range(g.tensors) for p, d in ((4, 0), (5, 1)))
            total = 2 * g.tensors
        assert landed in (0, total), f"{landed} of {total} pages landed"
        assert refused or landed == total, "the call returned normally but its pages never landed"
        assert not refused or landed == 0
    finally:
        engine.close(), host_pool.close(), dev.close()


def test_a_call_made_after_a_deferred_close_in_the_same_handler_is_refused():
    """A handler on the queuing thread (signal handler doing a graceful shutdown, a finalizer) calls
    ``engine.close()`` and then uses the engine again. The engine's lock made that close a pending action
    (job.py:306-308: ``self._lock.pending = self.close; return``) without marking the engine closing, so after
    ``close()`` has returned ``engine.closed`` is still False and a new ``engine.load`` is accepted and queued —
    docs/design.md "Lifetimes and threads" promises that after close "every call ... raises BufferClosed before
    anything is queued or allocated". Code that checks ``engine.closed`` after asking for the close (or relies on the
    refusal to stop a worker) keeps queuing. Fix: set a ``_closing`` flag when the close is deferred, have
    ``_check_open`` refuse new calls when it is set (only the call already under way finishes), and report
    ``closed`` as True from then on."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt, "kernel")
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POOL_POISON)
        seen = {}

        def handler():
            engine.close()
            seen["closed"] = engine.closed
            try:
                engine.load([7], [7])
                seen["second"] = "accepted"
            except BufferClosed:
                seen["second"] = "refused"

        undo, fired = at_first_event(rt, handler)
        try:
            engine.load([0, 1, 2], [0, 1, 2]).wait()
        finally:
            undo()
        rt.synchronize(0)
        landed, _ = landed_or_untouched(g, dev, host_pool, host_data, [0, 1, 2], [0, 1, 2])
        assert landed == 3 * g.tensors * g.layers   # the call under way lands whole (the deferral's promise)
        assert engine.closed
        assert seen == {"closed": True, "second": "refused"}, seen
    finally:
        engine.close(), host_pool.close(), dev.close()


def test_ok_a_deferred_close_whose_call_then_raises_still_closes_and_queues_nothing():
    """A handler asks for the close inside a load whose page list is then refused (a repeated destination): the load
    raises InvalidArgument, nothing is queued, the deferred close runs as the call unwinds, later calls raise
    BufferClosed, and the pools serve a new engine."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt, "kernel")
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POOL_POISON)
        fired = []

        def check_open():
            if not fired:
                fired.append(1)
                engine.close()
                assert engine.closed    # closing: no new call is taken (the close itself runs as the call returns)
            DevicePool.check_open(dev)

        dev.check_open = check_open
        try:
            with pytest.raises(InvalidArgument):
                engine.load([1, 2, 3], [4, 4, 5])
        finally:
            del dev.check_open
        assert fired and engine.closed
        with pytest.raises(BufferClosed):
            engine.load([1], [1])
        rt.synchronize(0)
        landed, untouched = landed_or_untouched(g, dev, host_pool, host_data, [1, 2, 3], [4, 4, 5])
        assert landed == 0
        with TransferEngine(dev, host_pool, backend="direct") as again:
            again.load([1, 2], [4, 5]).wait()
        landed, _ = landed_or_untouched(g, dev, host_pool, host_data, [1, 2], [4, 5])
        assert landed == 2 * g.tensors * g.layers
    finally:
        engine.close(), host_pool.close(), dev.close()


def test_ok_a_deferred_close_whose_call_then_raises_keyboard_interrupt_still_closes():
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt)
    try:
        fill_host(host_pool)
        poison_device(dev, POOL_POISON)

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


@pytest.mark.parametrize("order", ["pool_first", "engine_first"])
@pytest.mark.parametrize("which", ["device", "host"])
def test_ok_a_pool_and_its_engine_closed_in_one_handler_land_the_call_then_free(order, which):
    """Both closes are deferred to the call's end; the pool's drains the engine before giving memory back."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt)
    pool = dev if which == "device" else host_pool
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POOL_POISON)
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


def test_ok_a_pool_close_deferred_in_a_call_while_another_thread_closes_it():
    """The deferred close marks the pool closed first: the other thread's close returns at once."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt)
    try:
        fill_host(host_pool)
        poison_device(dev, POOL_POISON)
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


@pytest.mark.parametrize("inner", ["kernel", "direct", "staged"])
def test_ok_another_engine_over_the_same_pools_used_and_waited_for_inside_an_engines_call(inner):
    """A handler inside engine A's load uses engine B over the same pools (other pages), waits for it and closes
    it; both loads land exactly, and A still closes cleanly."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt, "kernel")
    other = TransferEngine(dev, host_pool, backend=inner, staging_bytes=3 * g.bytes_per_page)
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POOL_POISON)

        def handler():
            other.load([8, 9], [6, 7]).wait()
            other.close()

        undo, fired = at_first_event(rt, handler)
        try:
            engine.load([0, 1, 2], [0, 1, 2]).wait()
        finally:
            undo()
        assert fired and other.closed
        landed, _ = landed_or_untouched(g, dev, host_pool, host_data, [0, 1, 2, 8, 9], [0, 1, 2, 6, 7])
        assert landed == 5 * g.tensors * g.layers
    finally:
        other.close(), engine.close(), host_pool.close(), dev.close()


def test_ok_captures_used_after_a_close_deferred_inside_a_shape_load_raise():
    """``engine.close()`` asked for inside ``shape.load`` (at its first index upload): the load lands whole, then
    the engine, the shape and a captured load are closed; both raise BufferClosed and write nothing more."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt, "kernel")
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POOL_POISON)
        shape = engine.capture_shape(3)
        captured = engine.capture_load([7, 8], [5, 6], layer=2)
        original = rt.memcpy_async
        fired = []

        def hooked(*args, **kwargs):
            if not fired:
                fired.append(1)
                engine.close()
            return original(*args, **kwargs)

        rt.memcpy_async = hooked
        try:
            shape.load([4, 5, 6], [0, 1, 2]).wait()
        finally:
            rt.memcpy_async = original
        assert fired and engine.closed and shape.closed and captured.closed
        landed, _ = landed_or_untouched(g, dev, host_pool, host_data, [4, 5, 6], [0, 1, 2])
        assert landed == 3 * g.tensors * g.layers
        with pytest.raises(BufferClosed):
            shape.load([1, 2, 3], [3, 4, 5])
        with pytest.raises(BufferClosed):
            captured.replay()
        rt.synchronize(0)
        assert all((read_device(dev, t, layer)[3:8] == POOL_POISON).all()
                   for t in range(g.tensors) for layer in range(g.layers))
    finally:
        engine.close(), host_pool.close(), dev.close()


# -- closes whose wait a capture refuses -------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["engine", "device_pool", "host_pool"])
def test_a_close_refused_during_another_streams_capture_leaves_the_object_open(which):
    """While a stream of the device captures (the model's CUDA graph warm-up on another thread), the emulator now
    refuses every host wait on that device, as CUDA's global capture mode does. ``close()`` of an engine or a pool
    must wait for the transfers queued over it, so it raises RuntimeCallError (cudaStreamSynchronize /
    cudaEventSynchronize: cudaErrorStreamCaptureUnsupported) — but its ``finally`` marks the object closed and frees
    it anyway (job.py:309-318 ``PoolUser.close``; device_pool.py:66-72; ``Users.drain`` raising inside
    ``HostBuffer.close`` before ``_finalizer``): the load still in flight over it was never waited for, the engine's
    rings and tables and the pool's memory are given back under it (the emulator's own frees drain the device
    regardless of the capture, emulated.py:130, so nothing faults here; on CUDA the frees fail or run under the DMA),
    and the caller cannot retry after the capture ends because the object is already closed. Fix: check for a
    capture on the device before marking anything closed and raise (BufferInUse / the runtime error) leaving the
    object open, or defer the close until the capture ends."""
    rt = create("emulated:split:lazy")
    g, dev, host_pool, engine = small_engine(rt, "kernel")
    target = {"engine": engine, "device_pool": dev, "host_pool": host_pool}[which]
    stream = None
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POOL_POISON)
        transfer = engine.load(SIX_PAGES, SIX_PAGES)      # lazy: still queued when the close comes
        stream = rt.create_stream(0)
        stream.begin_capture()
        try:
            target.close()
            raised = None
        except KvtierError as error:
            raised = error
        finally:
            stream.end_capture()
        if raised is not None:
            assert not target.closed, f"close() raised {raised!r} and yet closed the {which}"
        transfer.wait()
        if not dev.closed:
            landed, _ = landed_or_untouched(g, dev, host_pool, host_data, SIX_PAGES, SIX_PAGES)
            assert landed == 6 * g.tensors * g.layers
        target.close()
        assert target.closed
    finally:
        if stream is not None:
            stream.close()
        engine.close(), host_pool.close(), dev.close()


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
        poison_device(dev, POOL_POISON)
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
            poison_device(dev, POOL_POISON)
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
        poison_device(dev, POOL_POISON)

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


@pytest.mark.parametrize("which", ["device", "host"])
def test_ok_a_pool_close_refused_during_a_capture_then_retried_frees_everything(which):
    rt = create("emulated:split:lazy")
    g, dev, host_pool, engine = small_engine(rt)
    pool = dev if which == "device" else host_pool
    stream = rt.create_stream(0)
    address = host_pool.buffer.cpu_address.value
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POOL_POISON)
        transfer = engine.load(SIX_PAGES, SIX_PAGES)
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeCallError):
                pool.close()
        finally:
            stream.end_capture()
        assert not pool.closed
        transfer.wait()
        landed, _ = landed_or_untouched(g, dev, host_pool, host_data, SIX_PAGES, SIX_PAGES)
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
        poison_device(dev, POOL_POISON)
        engine.load(SIX_PAGES, SIX_PAGES)
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
        poison_device(dev, POOL_POISON)
        engine.load(SIX_PAGES, SIX_PAGES).wait()
        landed, _ = landed_or_untouched(g, dev, host_pool, fresh, SIX_PAGES, SIX_PAGES)
        assert landed == 6 * g.tensors * g.layers
        del view
        engine.close()
        host_pool.close()
        assert host_pool.closed
    finally:
        stream.close()
        engine.close(), host_pool.close(), dev.close()


@pytest.mark.parametrize("mode", ["emulated:split:lazy", "emulated:unified:lazy"])
def test_ok_captures_made_while_other_engines_loads_are_in_flight_replay_exactly(mode):
    """On a lazy emulator (nothing runs until waited for), another engine's load over other pages is still queued
    when ``capture_shape`` and ``capture_load`` capture (they synchronise their own stream before the capture, never
    during it); the queued load, the shape's loads and the replay all land byte for byte, and a capture asked for
    while a foreign stream of the device captures is refused with the engine still usable."""
    rt = create(mode)
    g, dev, host_pool, engine = small_engine(rt, "kernel")
    g2, dev2, host2, other = small_engine(rt, "direct")
    foreign = None
    try:
        host_data, other_data = fill_host(host_pool), fill_host(host2)
        poison_device(dev, POOL_POISON), poison_device(dev2, POOL_POISON)
        in_flight = other.load([0, 1, 2, 3], [4, 5, 6, 7])
        shape = engine.capture_shape(2, layers=[0, 2])
        captured = engine.capture_load([9], [7], layer=1)
        first = shape.load([5, 6], [0, 1])
        second = shape.load([7, 8], [2, 3], after=first)
        captured.replay()
        second.wait(), in_flight.wait()
        rt.synchronize(0)
        landed, _ = landed_or_untouched(g2, dev2, host2, other_data, [0, 1, 2, 3], [4, 5, 6, 7])
        assert landed == 4 * g.tensors * g.layers
        for t in range(g.tensors):
            for layer in range(g.layers):
                got = read_device(dev, t, layer)
                for p, d in ((5, 0), (6, 1), (7, 2), (8, 3), (9, 7)):
                    expected = (layer in (0, 2)) if d != 7 else layer == 1
                    want = host_page(host_pool, host_data, t, layer, p) if expected else None
                    assert np.array_equal(got[d], want) if expected else (got[d] == POOL_POISON).all(), (t, layer, d)
                assert all((got[d] == POOL_POISON).all() for d in (4, 5, 6))
        foreign = rt.create_stream(0)
        foreign.begin_capture()
        try:
            with pytest.raises(KvtierError):
                engine.capture_shape(1)
        finally:
            foreign.end_capture()
        shape.load([1, 2], [4, 5]).wait()
        landed, _ = landed_or_untouched(g, dev, host_pool, host_data, [1], [4])
        assert landed == g.tensors * g.layers - g.tensors   # layers 0 and 2 of the shape, not layer 1
    finally:
        if foreign is not None:
            foreign.close()
        engine.close(), other.close(), host_pool.close(), dev.close(), host2.close(), dev2.close()
