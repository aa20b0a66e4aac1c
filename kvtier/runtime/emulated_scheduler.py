"""When an emulated GPU runs the work queued on its streams, and what a fault does to it.

Two schedules:

- ``eager`` (the default): as on a GPU, every stream runs ahead as far as its event waits allow. Queued work runs at
  every enqueue and while anyone waits, one operation at a time, streams picked in a seeded random order. Code that
  forgets to order two streams (a helper stream that skips the caller's ``after`` event, a kernel that reads a table
  a non-blocking stream uploads) reads stale bytes here, as it does on a GPU — not only when the timing is unlucky.
- ``lazy``: work runs only when someone waits, and only what they wait for, in order. Deterministic; useful to show
  that reading a destination before synchronizing sees old bytes.

A fault (an illegal or misaligned address in a kernel or copy) poisons the device as an illegal address poisons a CUDA
context: the queued work of that device is dropped, the next call that observes the device raises the fault, and every
later operation on the device raises too.
"""

from __future__ import annotations

import os
import random
import threading
import types
import warnings
import weakref
from collections.abc import Callable

from kvtier.errors import IllegalAddress, InvalidArgument, RuntimeCallError
from kvtier.locks import ForkSafeLock
from kvtier.pause_points import reached
from kvtier.runtime.emulated_device import Busy, EmulatedStream, Running, WaitOp, WaitValueOp

SCHEDULES = ("eager", "lazy")
RUN_AHEAD = 0.75
"""At each enqueue the eager schedule keeps running ready operations with this probability per step."""


def stream_idle(stream: EmulatedStream) -> Callable[[], bool]:
    return lambda: not stream.pending


class _Fault:
    def __init__(self, error: BaseException) -> None:
        self.error, self.reported = error, False


class Scheduler:
    def __init__(self, schedule: str, seed: int, lock: ForkSafeLock) -> None:
        if schedule not in SCHEDULES:
            raise InvalidArgument(f"emulated schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.schedule, self.seed, self.lock = schedule, seed, lock
        self._rng = random.Random(seed)
        self._streams: list[EmulatedStream] = []
        self._faults: dict[int, _Fault] = {}
        self._depth = 0
        self._runner: int | None = None
        self._deferred: list[Callable[[], None]] = []
        _schedulers.add(self)

    def add(self, stream: EmulatedStream) -> None:
        with self.lock:
            self._streams = [s for s in self._streams if not (s.closed and not s.pending)]
            self._streams.append(stream)

    def streams(self, device: int) -> list[EmulatedStream]:
        return [s for s in self._streams if s.device == device]

    def check_not_capturing(self, device: int, call: str) -> None:
        """A host wait (a stream, event or device synchronise, a synchronous copy) while a stream of the device
        captures is refused, as CUDA refuses it in the global capture mode torch uses: the wait could never see
        captured work run, and the capture is invalid on a GPU."""
        capturing = [s for s in self.streams(device) if s.capturing]
        if capturing:
            raise RuntimeCallError(call, "cudaErrorStreamCaptureUnsupported",
                                   f"{capturing[0]!r} is capturing: a host wait on emulated device {device} is not "
                                   f"allowed during a capture (read values back before capturing, or do without)")

    # -- faults ----------------------------------------------------------------------------------------------------
    def check_alive(self, device: int) -> None:
        fault = self._faults.get(device)
        if fault is None:
            return
        if not fault.reported:
            fault.reported = True
            raise fault.error
        raise IllegalAddress(f"emulated device {device} is unusable: an earlier fault poisoned it ({fault.error}); "
                             f"as with a CUDA context after an illegal address, restart the process")

    def faulted(self, device: int) -> bool:
        return device in self._faults

    def _fault(self, stream: EmulatedStream, error: BaseException) -> None:
        self._faults.setdefault(stream.device, _Fault(error))
        for other in self.streams(stream.device):
            other.pending.clear()

    # -- running work ----------------------------------------------------------------------------------------------
    def after_running(self, release: Callable[[], None]) -> None:
        """Run ``release`` (a free: it drains the device first) now, or once the operation running on this thread has
        ended and what it did is recorded (its fault, or a phased kernel put back on its stream).

        An emulated operation runs Python, so the garbage collector can run inside it, and with it the finalizer of
        any buffer in a reference cycle. A free there that drained the device would run the operations queued behind
        the running one before it ends: stream order broken, stale bytes read. On a GPU no host code runs inside a
        kernel; cudaFree from the host waits for it to end, which is what deferring to its end gives."""
        reached("scheduler.after_running")
        with self.lock:   # an op ending in another thread runs the deferred list under it: none is stranded
            if self._depth:
                reached("scheduler.deferring")
                self._deferred.append(release)
                return
        release()

    def _run(self, op: Callable[[], object]) -> object:
        if not self._depth:
            self._runner = threading.get_ident()
        self._depth += 1
        try:
            return op()
        finally:
            self._depth -= 1

    def _release_deferred(self) -> None:
        while not self._depth and self._deferred:
            release = self._deferred.pop(0)
            try:
                release()
            except Exception as error:  # noqa: BLE001 (a finalizer's free: nobody to raise to)
                warnings.warn(f"emulated: a free deferred past a running operation failed: {error}", RuntimeWarning,
                              stacklevel=1)

    def after_fork_in_child(self) -> None:
        """An operation another parent thread was running never ends in the child: it no longer counts as running."""
        if self._runner != threading.get_ident():
            self._depth = 0

    def _runnable(self, stream: EmulatedStream) -> bool:
        if not stream.pending:
            return False
        head = stream.pending[0]
        if isinstance(head, WaitValueOp):
            try:
                return head.ready
            except BaseException as error:  # the address faults: the wait's device is poisoned, as by a kernel
                self._fault(stream, error)
                return False
        return not isinstance(head, WaitOp) or head.marker.done

    def _pick(self, target: EmulatedStream | None) -> EmulatedStream | None:
        if self.schedule == "eager" or target is None:
            ready = [s for s in self._streams if self._runnable(s)]
            return self._rng.choice(ready) if ready else None
        stream = target
        while stream.pending and not self._runnable(stream):
            head = stream.pending[0]
            if isinstance(head, WaitValueOp):
                return next((s for s in self._streams if s is not stream and self._runnable(s)), None)
            if not isinstance(head, WaitOp):
                break
            stream = head.marker.stream
        return stream if self._runnable(stream) else None

    def _step(self, target: EmulatedStream | None = None) -> bool:
        stream = self._pick(target)
        if stream is None:
            return False
        head = stream.pending[0]
        if isinstance(head, Busy) and head.remaining > 0:
            head.remaining -= 1
            return True
        if isinstance(head, Running):
            try:
                self._run(head.phases.__next__)
            except StopIteration:
                stream.pending.popleft()
            except BaseException as error:
                self._fault(stream, error)
        else:
            op = stream.pending.popleft()
            try:
                result = self._run(op)
                if isinstance(result, types.GeneratorType):
                    stream.pending.appendleft(Running(result))
            except BaseException as error:
                self._fault(stream, error)
        self._release_deferred()
        return True

    def advance(self) -> None:
        """Called at every enqueue: the eager schedule runs some ready work, as a GPU would meanwhile (not from
        inside a running operation: that one has not ended)."""
        if self.schedule == "eager" and not self._depth:
            while self._rng.random() < RUN_AHEAD and self._step():
                pass

    def progress(self, stream: EmulatedStream) -> None:
        """Called when someone polls: eager runs at least one ready operation (none from inside a running one, whose
        stream cannot move on until it ends: a poll there just reports); lazy runs the stream dry."""
        if self.schedule == "eager":
            if not self._depth and self._step():
                self.advance()
        else:
            self.run_until(lambda: not stream.pending, stream, "cudaEventQuery")

    def run_until(self, condition: Callable[[], bool], stream: EmulatedStream, call: str) -> None:
        """Run work until ``condition`` holds; raise the fault of ``stream``'s device if there is one."""
        if self._depth:
            raise RuntimeCallError(call, "cudaErrorNotPermitted",
                                   "called from inside a running emulated operation (a finalizer the garbage "
                                   "collector ran there?): it cannot wait for the operation it interrupts")
        self.check_alive(stream.device)
        while not condition():
            progressed = self._step(stream)
            self.check_alive(stream.device)
            if not progressed and not condition():
                raise RuntimeCallError(call, "cudaErrorLaunchFailure",
                                       f"emulated {stream!r} waits on work that can never run (a wait on a memory "
                                       f"value nothing writes, or a stream of a faulted device; faults: "
                                       f"{sorted(self._faults)}); on a GPU this call would hang")

    def drain(self, device: int, call: str) -> None:
        """Run every queued operation of ``device``: what cudaDeviceSynchronize and cudaFree wait for."""
        for stream in self.streams(device):
            self.run_until(stream_idle(stream), stream, call)


_schedulers: weakref.WeakSet[Scheduler] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for scheduler in list(_schedulers):
        scheduler.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
