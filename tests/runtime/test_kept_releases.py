"""Releases ``Runtime.after_device_work`` keeps while a capture refuses its wait (``_KEPT_RELEASES``): memory a
viewed host buffer gives back is never released while the device may still read it, and every kept release is made
once a wait is allowed again, even when another one fails or another thread keeps one meanwhile.
(Found adversarially, issue #15.)
"""

from __future__ import annotations

import threading

import pytest

from kvtier.errors import KvtierError, RuntimeCallError
from kvtier.memory.host_buffer import HostBuffer
from kvtier.runtime import base, create
from kvtier.runtime.base import Runtime


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
