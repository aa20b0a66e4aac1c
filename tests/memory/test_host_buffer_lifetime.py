"""HostBuffer lifetime: a view is never handed out of a closed buffer (as_tensor racing close() from another thread,
a signal handler or many viewers), close() waits for its users without blocking their threads' as_tensor() and
without deadlocking a finalizer or a fork child, closes asked for during a garbage collection are completed once the
last view is collected, and neither interpreter exit nor a with-block unmaps memory a live view still reads.
(Found adversarially, issue #15.) Anything that can deadlock, wedge the collector or leave a view over unmapped
memory runs in a child interpreter with a timeout, so a failure is reported instead of hanging (or crashing) the
suite.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import pytest
import torch
from helpers.compat import BYTE_ITEM, Engine, buffer_with_closing_cleanup
from helpers.compat import byte_operands as Mem
from helpers.operands import POISON
from helpers.paths import TESTS

import kvtier
from kvtier.compat.sglang import kvcacheio
from kvtier.errors import BufferClosed, BufferInUse, KvtierError
from kvtier.memory import HostBuffer
from kvtier.pause_points import armed
from kvtier.runtime import create


def run_child(code: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (kvtier importable, tests/ on the path); a hang past ``timeout`` fails.
    The bound only catches hangs: a fresh interpreter importing torch takes tens of seconds on a loaded machine."""
    root = Path(kvtier.__file__).resolve().parents[1]      # the kvtier this test imported, not another checkout's
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(TESTS), env.get("PYTHONPATH", "")])
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=str(root))
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the child interpreter hung for {timeout}s (deadlock); output so far: {expired.stdout!r}")


# -- as_tensor against close() -----------------------------------------------------------------------------------------
def test_as_tensor_racing_close_never_hands_out_a_view_of_a_closed_buffer():
    """Thread A calls buffer.as_tensor() while thread B calls buffer.close(). as_tensor checks the buffer is open,
    then does more work (dtype, item size) before torch.frombuffer takes its reference; close() counts views
    (none yet), unregisters and unmaps with no lock between the two. If B runs in that window (forced here at a
    pause point in as_tensor, a thread switch the interpreter may make at any line), A gets a tensor over unmapped
    memory while buffer.closed is True: its next read or write crashes the process. Expected: as_tensor raises
    BufferClosed, or close() raises BufferInUse; never a live view of a closed buffer."""
    runtime = create("emulated:split")
    buffer = HostBuffer.allocate(1 << 16, runtime=runtime)
    outcome: dict = {}

    def closer():
        try:
            buffer.close()
            outcome["close"] = "closed"
        except BufferInUse:
            outcome["close"] = "in use"

    def switch():
        if "close" not in outcome:
            thread = threading.Thread(target=closer)
            thread.start()
            thread.join()

    view = None
    with armed("host_buffer.as_tensor_checked", switch), contextlib.suppress(BufferClosed):
        view = buffer.as_tensor()
    dangling = view is not None and buffer.closed
    if dangling:
        _leaked.append(view)    # never touch (or repr) it: its memory is unmapped
    view = None
    if not buffer.closed:
        buffer.close()
    assert not dangling, "as_tensor returned a live view of a buffer close() has unmapped"


_leaked: list = []


def test_a_signal_handler_closing_the_buffer_inside_as_tensor_cannot_leave_a_dangling_view():
    """as_tensor and close share an RLock, so the thread inside as_tensor can re-enter close(): a signal handler
    (a SIGTERM/SIGUSR1 shutdown handler closing the cache) runs in the main thread between two lines of
    as_tensor, after _check_open() and before torch.frombuffer takes its reference. close() finds no view, unmaps,
    returns; as_tensor resumes and hands out a tensor over the unmapped memory: buffer.closed is True while
    live_views() is 1, and the next read crashes. (The signal is raised there through a pause point, as the test
    above forces a thread switch.) Expected: as_tensor raises BufferClosed (it re-checks after taking its
    reference, or close() refuses while a view is being made); never a live view of a closed buffer."""
    result = run_child("""
        import signal
        from kvtier.errors import BufferClosed, BufferInUse
        from kvtier.memory import HostBuffer
        from kvtier.pause_points import armed
        from kvtier.runtime import create

        buffer = HostBuffer.allocate(1 << 16, runtime=create("emulated:split"))
        outcome = {}

        def shutdown(signum, frame):
            try:
                buffer.close()
                outcome["close"] = "closed"
            except BufferInUse:
                outcome["close"] = "in use"

        signal.signal(signal.SIGUSR1, shutdown)

        def interrupt():
            if "signal" not in outcome:
                outcome["signal"] = True
                signal.raise_signal(signal.SIGUSR1)

        with armed("host_buffer.as_tensor_viewing", interrupt):
            try:
                view = buffer.as_tensor()
            except BufferClosed:
                view = None
        # never read the view: its memory may be unmapped
        print("DANGLING" if view is not None and buffer.closed else "safe", outcome, buffer.live_views(), flush=True)
        import os; os._exit(0)
    """)
    assert "signal" in result.stdout, result.stdout + result.stderr
    assert "DANGLING" not in result.stdout, f"as_tensor returned a view of a buffer close() unmapped: {result.stdout}"


def test_ok_threads_viewing_while_one_closes_never_get_a_view_of_a_closed_buffer():
    runtime = create("emulated:split")
    for _ in range(20):
        buffer = HostBuffer.allocate(1 << 14, runtime=runtime)
        dangling, stop = [], threading.Event()

        def viewer(buffer=buffer, dangling=dangling, stop=stop):
            while not stop.is_set():
                try:
                    view = buffer.as_tensor()
                except KvtierError:
                    return
                if buffer.closed:
                    dangling.append(view)       # never read: unmapped
                del view

        threads = [threading.Thread(target=viewer, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        closed = False
        for _ in range(200):
            try:
                buffer.close()
                closed = True
                break
            except BufferInUse:
                pass
        stop.set()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a viewer thread hung"
        assert not dangling, "a view was handed out of a closed buffer"
        if not closed:
            buffer.close()
        assert buffer.closed


def test_ok_a_view_alive_in_another_thread_blocks_close_and_the_buffer_stays_usable():
    runtime = create("emulated:split")
    m = Mem(runtime)
    buffer = m._own(HostBuffer.allocate(8 * BYTE_ITEM, runtime=runtime))
    hold, release = threading.Event(), threading.Event()

    def holder():
        view = buffer.as_tensor()[BYTE_ITEM:].view(-1, BYTE_ITEM)[2:]    # views of views
        hold.set()
        release.wait()
        del view

    thread = threading.Thread(target=holder)
    thread.start()
    hold.wait()
    try:
        with pytest.raises(BufferInUse):
            buffer.close()
        assert not buffer.closed
        dst = buffer.as_tensor().view(8, BYTE_ITEM)
        dst.fill_(POISON)
        src = m.device((8, BYTE_ITEM))
        kvcacheio.transfer_kv_per_layer_mla(src, dst, m.indices([1, 6]), m.indices([7, 0]), BYTE_ITEM)
        runtime.synchronize(0)
        assert torch.equal(dst[7], src.cpu()[1]) and torch.equal(dst[0], src.cpu()[6])
        del dst
    finally:
        release.set()
        thread.join()
    buffer.close()
    assert buffer.closed


# -- the lock close() holds while it drains its users ------------------------------------------------------------------
def test_close_draining_a_user_whose_worker_makes_a_view_does_not_deadlock():
    """close() now holds the buffer's lock while it drains its users (add_user). A user's drain waits for its worker
    to finish the job in hand; that job calls buffer.as_tensor() (a host-side read of the pages it moved). Before,
    as_tensor saw the buffer closing and raised BufferClosed at once, the job ended and the drain returned. Now
    as_tensor blocks on the lock close() holds, close() waits in drain for the worker: both threads hang forever
    (and the buffer is never released). Expected: as_tensor raises BufferClosed while close() drains (no view is
    handed out of a closing buffer), the worker finishes, close() completes."""
    result = run_child("""
        import threading
        from kvtier.errors import BufferClosed
        from kvtier.memory import HostBuffer
        from kvtier.runtime import create

        buffer = HostBuffer.allocate(1 << 16, runtime=create("emulated:split"))
        draining, finished = threading.Event(), threading.Event()
        outcome = {}

        class Engine:                  # a Drainable: its drain waits for the job its worker is running
            def drain(self):
                draining.set()
                finished.wait()

        engine = Engine()
        buffer.add_user(engine)

        def worker():
            draining.wait()            # close() is in drain()
            try:
                view = buffer.as_tensor()
                outcome["view"] = "handed out"
                del view
            except BufferClosed:
                outcome["view"] = "BufferClosed"
            finished.set()

        def closer():
            buffer.close()
            outcome["close"] = "closed"

        threads = [threading.Thread(target=worker, daemon=True), threading.Thread(target=closer, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)         # long enough for a loaded machine: only a deadlock stays
        print("DEADLOCK" if any(t.is_alive() for t in threads) else "done", outcome, buffer.closed, flush=True)
        import os; os._exit(0)
    """)
    assert "DEADLOCK" not in result.stdout, f"close() and the user's worker deadlocked: {result.stdout}"
    assert "'close': 'closed'" in result.stdout, result.stdout + result.stderr


def test_a_finalizer_closing_the_buffer_in_the_draining_users_thread_does_not_deadlock():
    """The case _Collections was written for: an engine's cleanup (weakref.finalize -> buffer.close()) runs inside
    a garbage collection. Collections run in whatever thread allocates; here that is the worker of another user of
    the same buffer. Thread A is in buffer.close(), holding the lock, draining that user, which waits for its
    worker; the worker's collection runs the finalizer, whose close() blocks on the lock A holds. A waits for the
    worker, the worker waits for A: both hang, and the collector stays 'collecting' in that thread, so no garbage
    collection ever runs again in the process. Expected: no deadlock (a close called while another close is
    draining must not block the collecting thread: defer it, or return since the first will finish); the buffer
    ends closed."""
    result = run_child("""
        import gc, threading, weakref
        from kvtier.memory import HostBuffer
        from kvtier.runtime import create

        gc.disable()            # the collection below runs in the worker, not at some allocation elsewhere
        buffer = HostBuffer.allocate(1 << 16, runtime=create("emulated:split"))
        draining, finished = threading.Event(), threading.Event()

        class Engine:
            def drain(self):
                draining.set()
                finished.wait()

        engine = Engine()
        buffer.add_user(engine)

        class OtherEngine:
            pass

        other = OtherEngine()
        other.me = other                                          # a cycle: only the collector frees it
        weakref.finalize(other, lambda b=buffer: b.close())       # its cleanup closes the shared buffer
        del other

        def worker():
            draining.wait()     # close() is in drain()
            gc.collect()        # what any allocation in the worker may trigger
            finished.set()

        def closer():
            buffer.close()

        threads = [threading.Thread(target=worker, daemon=True), threading.Thread(target=closer, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)         # long enough for a loaded machine: only a deadlock stays
        print("DEADLOCK" if any(t.is_alive() for t in threads) else "done", buffer.closed, flush=True)
        import os; os._exit(0)
    """)
    assert "DEADLOCK" not in result.stdout, f"close() and a finalizer's close() deadlocked: {result.stdout}"
    assert "done True" in result.stdout, result.stdout + result.stderr


def test_a_fork_child_can_use_and_close_a_buffer_whose_lock_a_parent_thread_held():
    """A thread of the parent is inside buffer.close() (holding the buffer's new RLock while it drains an engine)
    when the main thread forks (a multiprocessing/DataLoader worker start). The child inherits the lock in the held
    state, owned by a thread that does not exist there: buffer.as_tensor() and buffer.close() in the child block
    forever (no at-fork reinitialisation of the lock). _Resources documents that a fork child may close its copy
    (it then only marks it closed). Expected: in the child, as_tensor() raises BufferClosed at once (the buffer was
    being closed, as it did before the lock) and close() returns (it should leave the child's copy closed)."""
    result = run_child("""
        import os, signal, threading, time
        from kvtier.errors import KvtierError
        from kvtier.memory import HostBuffer
        from kvtier.runtime import create

        buffer = HostBuffer.allocate(1 << 16, runtime=create("emulated:split"))
        parent, inside, release = os.getpid(), threading.Event(), threading.Event()

        class Engine:
            def drain(self):                          # the child's copy of the engine has nothing in flight
                if os.getpid() == parent:
                    inside.set()
                    release.wait()

        engine = Engine()
        buffer.add_user(engine)
        closer = threading.Thread(target=buffer.close, daemon=True)
        closer.start()
        inside.wait()
        for what in ("as_tensor", "close"):
            pid = os.fork()
            if pid == 0:
                signal.alarm(30)                      # a hang ends the child with SIGALRM
                try:
                    if what == "as_tensor":
                        buffer.as_tensor()
                        os.write(1, b"child as_tensor: a view\\n")
                    else:
                        buffer.close()
                        os.write(1, f"child close: closed={buffer.closed}\\n".encode())
                except KvtierError as error:
                    os.write(1, f"child {what}: {type(error).__name__}\\n".encode())
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            print(what, "HUNG" if os.WIFSIGNALED(status) else "returned", flush=True)
        release.set()
        closer.join(60)
        print("parent closed", buffer.closed, flush=True)
        os._exit(0)
    """)
    assert "HUNG" not in result.stdout, f"the fork child hung on the inherited lock: {result.stdout}"
    assert "child as_tensor: BufferClosed" in result.stdout and "child close:" in result.stdout, \
        result.stdout + result.stderr


def test_ok_a_fork_child_closes_its_copy_and_the_parent_keeps_using_the_buffer():
    result = run_child("""
        import os
        import torch
        from kvtier.memory import HostBuffer
        from kvtier.runtime import create

        buffer = HostBuffer.allocate(1 << 16, runtime=create("emulated:split"))
        view = buffer.as_tensor()
        view.fill_(7)
        del view
        pid = os.fork()
        if pid == 0:
            buffer.close()
            os._exit(0 if buffer.closed else 3)
        _, status = os.waitpid(pid, 0)
        view = buffer.as_tensor()
        print("child", os.waitstatus_to_exitcode(status), "parent sees", int(view[:8].sum()), flush=True)
        del view
        buffer.close()
        print("closed", buffer.closed, flush=True)
    """)
    assert "child 0 parent sees 56" in result.stdout and "closed True" in result.stdout, \
        result.stdout + result.stderr


# -- closes asked for during a garbage collection ----------------------------------------------------------------------
def test_close_from_a_finalizer_of_the_cycle_holding_the_last_view_closes_the_buffer():
    """An engine object holds a view of its host buffer and is in a reference cycle; weakref.finalize(obj,
    buffer.close) is its cleanup. gc collects the cycle and runs the finalizer while the cycle's objects (the view)
    still exist; close() sees a live view, its own gc.collect() is a no-op inside a collection, and it raises
    BufferInUse, which the finalizer machinery swallows. After the collection the view is gone but the buffer stays
    open, registered and pinned (leaked until the HostBuffer itself dies). HostBuffer.close: 'views only garbage
    holds (a reference cycle ...) are collected first and do not count' — here only garbage holds the view.
    Expected: after gc.collect() the buffer is closed (e.g. a close refused during a collection completes when
    its last view goes)."""
    buffer, errors, cleanup = buffer_with_closing_cleanup()

    engine = Engine()
    weakref.finalize(engine, cleanup)
    engine.kv = buffer.as_tensor()
    engine.kv.copy_(torch.randint(0, 256, engine.kv.shape, dtype=torch.uint8))
    engine.me = engine
    del engine
    gc.collect()
    try:
        assert buffer.live_views() == 0 if not buffer.closed else True
        assert buffer.closed, f"the buffer stayed open after its last view was collected ({errors})"
    finally:
        buffer.close()


def test_a_close_deferred_in_a_young_collection_is_not_lost_when_old_garbage_holds_the_view():
    """An engine's cleanup (weakref.finalize -> buffer.close()) runs in an automatic young (generation 0)
    collection; the buffer's last view is held only by garbage: the engine, and an older garbage cycle (a caught
    exception's traceback from earlier, in generation 2). close() sees a live view, defers, and the retry at the
    end of that collection still sees the view (the old cycle is not collected by a young collection), so the
    close is dropped. A full gc.collect() then frees the view, but nothing retries: the buffer stays open,
    registered and pinned, although close() was called and returned without an error. HostBuffer.close: 'views
    only garbage holds ... are collected first and do not count'. Expected: once the views are gone (here: after
    gc.collect()), the buffer is closed."""
    buffer, errors, cleanup = buffer_with_closing_cleanup()

    gc.disable()
    try:
        old = [buffer.as_tensor()]
        old.append(old)
        gc.collect()                                # the cycle survives into the oldest generation ...
        view = old[0]
        del old                                     # ... and is garbage from here on
        engine = Engine()
        engine.kv, engine.me = view, engine
        del view
        weakref.finalize(engine, cleanup)
        del engine
        gc.collect(0)                               # a young collection: the cleanup runs, the close is deferred
    finally:
        gc.enable()
    gc.collect()                                    # frees the old cycle, and the last view with it
    try:
        assert buffer.live_views() == 0
        assert buffer.closed, f"close() returned but the buffer stayed open after its last view went ({errors})"
    finally:
        buffer.close()


def test_one_failing_deferred_close_does_not_drop_the_others(monkeypatch):
    """Two buffers, each closed from an engine's __del__ during a collection while its view is still in the cycle:
    both closes are deferred to the end of the collection. The first retry's drain raises (its engine user failed:
    a RuntimeError, not a KvtierError); _Collections.phase lets it escape the gc callback (printed as unraisable),
    and the second buffer, already taken off the pending list, is never closed: it stays registered and pinned
    with no view left. Expected: every deferred close is attempted; the second buffer ends closed."""
    runtime = create("emulated:split")
    first = HostBuffer.allocate(1 << 16, runtime=runtime)
    second = HostBuffer.allocate(1 << 16, runtime=runtime)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: unraisable.append(info.exc_value))

    class FailingEngine:
        def drain(self):
            raise RuntimeError("engine drain failed")

    failing = FailingEngine()
    first.add_user(failing)

    class Owner:
        def __init__(self):
            self.views = [first.as_tensor(), second.as_tensor()]
            self.me = self

        def __del__(self):
            first.close()       # deferred: its view is in this cycle
            second.close()      # deferred too, after the first

    Owner()
    gc.collect()
    try:
        assert first.closed
        assert second.live_views() == 0
        assert second.closed, f"the second deferred close was dropped after the first raised ({unraisable})"
    finally:
        second.close()


def test_ok_a_finalizer_closing_the_buffer_during_closes_own_collection_closes_it_once():
    runtime = create("emulated:split")
    buffer = HostBuffer.allocate(1 << 16, runtime=runtime)
    drains = []

    class Engine:
        def drain(self):
            drains.append(1)

    engine = Engine()
    buffer.add_user(engine)

    class Owner:
        pass

    owner = Owner()
    owner.kv, owner.me = buffer.as_tensor(), owner
    weakref.finalize(owner, buffer.close)
    del owner
    buffer.close()          # its gc.collect() runs the finalizer, whose close is deferred, then retried
    assert buffer.closed and buffer.live_views() == 0
    buffer.close()
    assert buffer.closed


def test_ok_a_view_held_only_by_a_caught_exceptions_traceback_cycle_does_not_block_close():
    runtime = create("emulated:split")
    buffer = HostBuffer.allocate(1 << 16, runtime=runtime)

    def work():
        view = buffer.as_tensor()[100:200].view(torch.int16)    # a view of a view
        view.fill_(3)
        raise ValueError("boom")

    try:
        work()
    except ValueError as error:
        box = [error]
        box.append(box)                                         # garbage in a cycle: box -> error -> traceback
    del box                                                     # -> work's frame -> the view
    assert buffer.live_views() == 1
    gc.disable()
    try:
        buffer.close()
    finally:
        gc.enable()
    assert buffer.closed


# -- exit and with-blocks ----------------------------------------------------------------------------------------------
def test_process_exit_does_not_unmap_a_buffer_whose_views_are_still_alive():
    """HostBuffer's module docs: it 'outlives every torch view made of it ... because unmapping under a live tensor
    turns the next read into a crash'. Its weakref.finalize runs at interpreter exit (atexit=True) and unmaps the
    buffer even though a view is still alive (a module-level KV view); an atexit handler registered earlier (it
    runs after kvtier's) that persists the cache by reading the view then crashes the process with SIGSEGV.
    Expected: at exit, a buffer with live views is not unmapped (left to the OS); the handler reads the data and
    the process exits 0."""
    result = run_child("""
        import atexit

        def persist():                          # registered first, so it runs after kvtier's exit finalizers
            print("persisted", int(view[:4096].sum()), flush=True)

        atexit.register(persist)
        from kvtier.memory import HostBuffer
        from kvtier.runtime import create

        buffer = HostBuffer.allocate(1 << 20, runtime=create("emulated:split"))
        view = buffer.as_tensor()
        view.fill_(1)
        print("ready", flush=True)
    """)
    assert result.returncode == 0, f"the process crashed at exit (rc {result.returncode}): {result.stdout!r}"
    assert "persisted 4096" in result.stdout


def test_ok_a_buffer_with_block_keeps_the_bodys_exception_and_closes_later():
    runtime = create("emulated:split")

    class BodyFailed(Exception):
        pass

    with pytest.raises(BodyFailed):
        with HostBuffer.allocate(1 << 12, runtime=runtime) as buffer:
            view = buffer.as_tensor()
            raise BodyFailed
    assert not buffer.closed
    del view
    buffer.close()
    assert buffer.closed
