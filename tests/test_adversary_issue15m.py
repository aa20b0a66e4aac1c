"""Adversary round 13 (issue #15): the engine's lock after round 12 (a close asked for inside one of the engine's own
calls on this thread is deferred until the call returns) attacked from the things it does not cover: a device or host
pool closed from inside an engine's call on the queuing thread (a finalizer or a signal handler), a captured load or
shape closed from inside its own replay or load, a second call made in the same handler after the deferred close, a
close of an engine or a pool while another stream of the device captures (the emulator now refuses host waits there,
as CUDA does), and a viewed host buffer released while a capture runs on the CUDA runtime's path
(``Runtime.after_device_work``). Attacks that held: pools closed inside the DMA backends' calls, a deferred close
whose call then raises, a second engine over the same pools used inside the first one's call, captures used after a
deferred close, and captures made while other engines' loads are still in flight.
Tests not named ``test_ok_*`` fail on a defect (each docstring says what goes wrong, why it matters and a fix);
``test_ok_*`` tests document attacks that held. Races are forced with hooks that pick the moment they happen (never
with sleeps); every destination is poisoned first and checked byte for byte against fresh random data."""

from __future__ import annotations

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
from kvtier.runtime.base import Runtime
from kvtier.transfer import TransferEngine

POISON = 0xEE
PAGES = np.arange(6)


def _check_runtime_healthy(rt):
    """The device is not faulted: a fresh engine over fresh pools still moves fresh bytes exactly."""
    rt.synchronize(0)
    g, dev, host_pool, engine = small_engine(rt, "kernel")
    try:
        data = fill_host(host_pool)
        poison_device(dev, POISON)
        engine.load([1, 2], [3, 4]).wait()
        landed, _ = landed_or_untouched(g, dev, host_pool, data, [1, 2], [3, 4])
        assert landed == 2 * g.tensors * g.layers
    finally:
        engine.close(), host_pool.close(), dev.close()


# -- defects -------------------------------------------------------------------------------------------------------
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
    into another tensor). Round 12 deferred only the engine's own close (job.py:226 ``_EngineLock``); a pool's close
    is not deferred. Fix: have ``DeviceMemory.close`` / ``HostBuffer.close`` ask each user whether this thread is
    inside one of its calls (``user._lock.held_here()``) and, if so, mark the pool closing and hand the rest of the
    close to the user's ``pending`` (run as the call returns), or have the engine re-check its pools just before it
    queues (after the last point a finalizer can run) and raise BufferClosed having queued nothing."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt, backend)
    target = dev if which == "device" else host_pool
    undo = lambda: None  # noqa: E731
    try:
        device_data = fill_device(dev)
        host_data = fill_host(host_pool)
        if direction == "load":
            poison_device(dev, POISON)
        else:
            host_pool.buffer.as_tensor().numpy()[:] = POISON
        undo, fired = at_first_event(rt, target.close)
        try:
            transfer = engine.load(PAGES, PAGES) if direction == "load" else engine.backup(PAGES, PAGES)
            transfer.wait()
            refused = False
        except BufferClosed:
            refused = True
        undo()
        assert fired and target.closed
        rt.synchronize(0)   # raises IllegalAddress when the call queued over the freed pool
        survivor_is_destination = (direction == "load") == (which == "host")
        if survivor_is_destination and direction == "load":
            landed, untouched = landed_or_untouched(g, dev, host_pool, host_data, PAGES, PAGES)
            assert (landed, untouched) in ((0, 6 * g.tensors * g.layers), (6 * g.tensors * g.layers, 0))
            assert refused == (landed == 0)
        elif survivor_is_destination:
            after = host_bytes(host_pool)
            for t in range(g.tensors):
                for layer in range(g.layers):
                    for p in PAGES:
                        got = host_page(host_pool, after, t, layer, p)
                        assert (got == POISON).all() if refused else np.array_equal(got, device_data[(t, layer)][p])
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
        poison_device(dev, POISON)
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
    ``engine.close()`` and then uses the engine again. Round 12 made that close a pending action
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
        poison_device(dev, POISON)
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
        assert landed == 3 * g.tensors * g.layers   # the call under way lands whole (round 12's promise)
        assert engine.closed
        assert seen == {"closed": True, "second": "refused"}, seen
    finally:
        engine.close(), host_pool.close(), dev.close()


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
        poison_device(dev, POISON)
        transfer = engine.load(PAGES, PAGES)      # lazy: still queued when the close comes
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
            landed, _ = landed_or_untouched(g, dev, host_pool, host_data, PAGES, PAGES)
            assert landed == 6 * g.tensors * g.layers
        target.close()
        assert target.closed
    finally:
        if stream is not None:
            stream.close()
        engine.close(), host_pool.close(), dev.close()


def test_a_viewed_host_buffer_released_during_a_capture_waits_for_the_device_on_cuda():
    """A host buffer that handed out views gives its memory back through ``Runtime.after_device_work``, which
    ``CudaRuntime`` inherits (base.py:228-234): it calls ``synchronize(device)`` for every device with KvtierError
    suppressed and then releases. When the buffer is collected while a stream captures (gc runs on any allocation; a
    serving engine captures its CUDA graphs at start-up), cudaDeviceSynchronize fails with
    cudaErrorStreamCaptureUnsupported — which also invalidates the capture in global mode — the error is swallowed and
    the memory is unregistered and unmapped at once, while copies queued before the capture may still be reading it:
    exactly what the deferred release was added to prevent. The emulator hides it: its own ``after_device_work``
    (emulated.py:145) drains under its lock without the capture check the other host waits now have. Driven here on
    the base method with a device that refuses the wait while it captures and has work in flight. Fix: ask the
    runtime whether any stream captures (cudaStreamGetCaptureInfo / a capture count kept by ``begin_capture``) and,
    if so, keep the release until the capture ends (or hand it to a host callback queued on each device), never
    release on a refused wait; and make the emulator refuse (or defer) the same way."""
    state = {"capturing": True, "in_flight": True, "released_with_work_in_flight": None}

    class Capturing:
        def device_count(self):
            return 1

        def synchronize(self, device=None):
            if state["capturing"]:
                raise RuntimeCallError("cudaDeviceSynchronize", "cudaErrorStreamCaptureUnsupported",
                                       "operation not permitted when stream is capturing")
            state["in_flight"] = False

    def release():
        state["released_with_work_in_flight"] = state["in_flight"]

    Runtime.after_device_work(Capturing(), release)
    state["capturing"] = False      # the capture ends; a kept release may run now
    if state["released_with_work_in_flight"] is None:
        return                       # kept: fine (nothing to release it later in this fake is a different test)
    assert state["released_with_work_in_flight"] is False, \
        "the memory was given back while the device still had work queued over it"


# -- attacks that held -----------------------------------------------------------------------------------------------
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
            poison_device(dev, POISON)
        undo, fired = at_first_event(rt, target.close)
        direction = "backup" if which == "device" else "load"
        with pytest.raises(BufferClosed):
            (engine.backup if direction == "backup" else engine.load)(PAGES, PAGES).wait()
        undo()
        assert fired and target.closed
        rt.synchronize(0)
        if which == "host":
            landed, untouched = landed_or_untouched(g, dev, host_pool, host_data, PAGES, PAGES)
            assert landed == 0
        _check_runtime_healthy(rt)
    finally:
        undo()
        engine.close(), host_pool.close(), dev.close()


def test_ok_a_deferred_close_whose_call_then_raises_still_closes_and_queues_nothing():
    """A handler asks for the close inside a load whose page list is then refused (a repeated destination): the load
    raises InvalidArgument, nothing is queued, the deferred close runs as the call unwinds, later calls raise
    BufferClosed, and the pools serve a new engine."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt, "kernel")
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POISON)
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


@pytest.mark.parametrize("inner", ["kernel", "direct", "staged"])
def test_ok_another_engine_over_the_same_pools_used_and_waited_for_inside_an_engines_call(inner):
    """A handler inside engine A's load uses engine B over the same pools (other pages), waits for it and closes
    it; both loads land exactly, and A still closes cleanly."""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt, "kernel")
    other = TransferEngine(dev, host_pool, backend=inner, staging_bytes=3 * g.bytes_per_page)
    try:
        host_data = fill_host(host_pool)
        poison_device(dev, POISON)

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
        poison_device(dev, POISON)
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
        assert all((read_device(dev, t, layer)[3:8] == POISON).all()
                   for t in range(g.tensors) for layer in range(g.layers))
    finally:
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
        poison_device(dev, POISON), poison_device(dev2, POISON)
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
                    assert np.array_equal(got[d], want) if expected else (got[d] == POISON).all(), (t, layer, d)
                assert all((got[d] == POISON).all() for d in (4, 5, 6))
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
