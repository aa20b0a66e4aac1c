"""Adversarial tests for HostBuffer lifetime (one lock for as_tensor/close, closes deferred past a collection) and the
SGLang ``*_direct`` copies cut at registration edges (issue 15, fourth round).

Each ``test_`` test fails against the code it was written for; its docstring says what is wrong and what is expected.
The ``test_ok_`` tests at the end are attacks that held, kept as regression guards.
Anything that can deadlock a thread, wedge the garbage collector or leave a view over unmapped memory runs in a
child interpreter with a timeout, so a failure is reported instead of hanging (or crashing) the suite.
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import pytest
import torch
from helpers.compat import Engine, all_poison, buffer_with_closing_cleanup, index_overwrite
from helpers.compat import byte_operands as Mem

from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio
from kvtier.errors import BufferInUse, KvtierError
from kvtier.memory import HostBuffer, get_device_accessible_ptr, register_chunks, unregister_chunks
from kvtier.pools import HostPool, KVGeometry
from kvtier.runtime import HostRegisterFlags, create

POISON = 0x5A
PAGE = 4096
ROOT = Path(__file__).resolve().parents[1]


def run_child(code: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (kvtier importable, tests/ on the path); a hang past ``timeout`` fails.
    The bound only catches hangs: a fresh interpreter importing torch takes tens of seconds on a loaded machine."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=str(ROOT))
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the child interpreter hung for {timeout}s (deadlock); output so far: {expired.stdout!r}")


# ======================================================================================================================
# Defects
# ======================================================================================================================

# -- HostBuffer: the lock close() holds while it drains ----------------------------------------------------------
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


# -- HostBuffer: closes from finalizers during a collection -------------------------------------------------------
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


def test_a_signal_handler_closing_the_buffer_inside_as_tensor_cannot_leave_a_dangling_view():
    """as_tensor and close share an RLock, so the thread inside as_tensor can re-enter close(): a signal handler
    (a SIGTERM/SIGUSR1 shutdown handler closing the cache) runs in the main thread between two lines of
    as_tensor, after _check_open() and before torch.frombuffer takes its reference. close() finds no view, unmaps,
    returns; as_tensor resumes and hands out a tensor over the unmapped memory: buffer.closed is True while
    live_views() is 1, and the next read crashes. (The signal is raised at that line with a line trace, as
    test_adversary_issue15c forces a thread switch.) Expected: as_tensor raises BufferClosed (it re-checks after
    taking its reference, or close() refuses while a view is being made); never a live view of a closed buffer."""
    result = run_child("""
        import inspect, signal, sys
        from kvtier.errors import BufferClosed, BufferInUse
        from kvtier.memory import HostBuffer
        from kvtier.runtime import create

        buffer = HostBuffer.allocate(1 << 16, runtime=create("emulated:split"))
        lines, first = inspect.getsourcelines(HostBuffer.as_tensor)
        window = first + next(i for i, text in enumerate(lines) if "torch.frombuffer" in text)
        outcome = {}

        def shutdown(signum, frame):
            try:
                buffer.close()
                outcome["close"] = "closed"
            except BufferInUse:
                outcome["close"] = "in use"

        signal.signal(signal.SIGUSR1, shutdown)

        def trace(frame, event, arg):
            if frame.f_code is not HostBuffer.as_tensor.__code__:
                return None

            def local(frame, event, arg):
                if event == "line" and frame.f_lineno == window and "signal" not in outcome:
                    outcome["signal"] = True
                    signal.raise_signal(signal.SIGUSR1)
                return local
            return local

        sys.settrace(trace)
        try:
            view = buffer.as_tensor()
        except BufferClosed:
            view = None
        finally:
            sys.settrace(None)
        # never read the view: its memory may be unmapped
        print("DANGLING" if view is not None and buffer.closed else "safe", outcome, buffer.live_views(), flush=True)
        import os; os._exit(0)
    """)
    assert "signal" in result.stdout, result.stdout + result.stderr
    assert "DANGLING" not in result.stdout, f"as_tensor returned a view of a buffer close() unmapped: {result.stdout}"


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


def test_host_pool_with_block_does_not_replace_the_bodys_exception_with_buffer_in_use():
    """HostBuffer.__exit__: 'a view still alive when the body raised must not hide the body's exception'. HostPool
    (HostMemory.__exit__) calls close() unconditionally: a body that made a view of the pool and then raised gets
    its exception replaced by BufferInUse (the view is alive in the frame while __exit__ runs). Expected: the
    body's exception propagates, as with a HostBuffer's own with block."""
    runtime = create("emulated:split")
    geometry = KVGeometry("mha", 2, 4, row_bytes=64)

    class BodyFailed(Exception):
        pass

    pool = None
    with pytest.raises(BodyFailed):
        with HostPool.allocate(geometry, "layer_first", pages=4, runtime=runtime) as pool:
            view = pool.buffer.as_tensor()
            view.fill_(POISON)
            raise BodyFailed("the body's own error")
    del view
    pool.close()


# -- *_direct: errors of the runtime named by operand --------------------------------------------------------------
@pytest.mark.parametrize("form", ["direct", "pf_lf"])
def test_direct_on_a_host_tensor_the_calls_device_cannot_reach_raises_a_kvtier_error(form):
    """Two devices; a host tensor over memory registered without PORTABLE (runtime.host_register(..., MAPPED), as
    cudaHostRegister without cudaHostRegisterPortable) is mapped for device 0 only; the call runs on device 1
    (its DeviceArrays are there). Resolving the host operand fails inside the runtime with RuntimeCallError
    (cudaHostGetDevicePointer cudaErrorInvalidValue); compat.operands.address re-raises it as
    type(error)(f'{what}: {error}'), but RuntimeCallError takes (call, error, detail): the caller gets a bare
    TypeError 'RuntimeCallError.__init__() missing 1 required positional argument' naming neither the operand nor
    the cause (the same pattern is in table_entries and the new table_room wrap in kvcacheio). Expected: a
    KvtierError naming dst_layers[0] / src_ptrs[0], nothing copied."""
    runtime = create("emulated:split:2")
    m = Mem(runtime)
    plain = m._own(HostBuffer.allocate(4 * PAGE, "pageable", runtime=runtime))
    runtime.host_register(plain.cpu_address.value, 4 * PAGE, HostRegisterFlags.MAPPED)    # device 0 only
    try:
        host = plain.as_tensor(torch.uint8)
        host.fill_(POISON)
        layers = [m.device((16, 64), device=1) for _ in range(2)]
        with pytest.raises(KvtierError):
            if form == "direct":
                kvcacheio.transfer_kv_direct(layers[:1], [host.view(-1, 64)], torch.arange(4), torch.arange(4), 1)
            else:
                kvcacheio.transfer_kv_per_layer_direct_pf_lf([host.view(16, 2, 8, 64)], layers, torch.arange(8),
                                                             torch.arange(8), 0, 8)
        runtime.synchronize(1)
        assert all_poison(host)
        assert not any(m.poisoned(x) for x in layers)
    finally:
        host = None
        runtime.host_unregister(plain.cpu_address.value)


# ======================================================================================================================
# Attacks that held (regression guards)
# ======================================================================================================================
def _direct_trial(rng: random.Random, mode: str) -> None:
    """One random *_direct call over host buffers registered in chunks (boundaries inside pages and token runs,
    offset views), both directions, K/V and MLA: every byte lands, or it is refused with nothing copied."""
    runtime = create(f"emulated:{mode}")
    m = Mem(runtime)
    item, page_size, layers = rng.choice([64, 256, 1024]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3])
    pages, chunk = rng.choice([2, 4, 8]), rng.choice([PAGE, 2 * PAGE, 3 * PAGE])
    tokens, offset = pages * page_size, rng.choice([0, 0, 64, 100, PAGE - 64])

    def host(nbytes, data):
        buffer = m._own(HostBuffer.allocate(-(-(nbytes + offset) // PAGE) * PAGE, runtime=runtime,
                                            register_chunk_bytes=chunk))
        t = buffer.as_tensor(torch.uint8)[offset:offset + nbytes]
        t.copy_(m.values(t.shape, data))
        return t

    func = rng.choice(["direct", "pf_lf", "lf_pf"])
    try:
        if func == "direct":
            n = min(rng.choice([1, 2, 3]) * page_size, tokens)
            start = rng.randrange(0, tokens - n + 1)
            h_idx = list(range(start, start + n)) if rng.random() < 0.5 else rng.sample(range(tokens), n)
            d_idx = rng.sample(range(tokens), n) if rng.random() < 0.5 else list(range(n))
            to_host = rng.random() < 0.5
            hosts = [host(tokens * item, not to_host).view(tokens, item) for _ in range(layers)]
            devs = [m.device((tokens, item)) for _ in range(layers)]
            before = [h.clone() for h in hosts] + [d.cpu() for d in devs]
            try:
                if to_host:
                    kvcacheio.transfer_kv_direct(devs, hosts, torch.tensor(d_idx), torch.tensor(h_idx), page_size)
                else:
                    kvcacheio.transfer_kv_direct(hosts, devs, torch.tensor(h_idx), torch.tensor(d_idx), page_size)
            except KvtierError:
                runtime.synchronize(0)
                assert mode == "split"
                assert all(torch.equal(a, b) for a, b in zip([*hosts, *[d.cpu() for d in devs]], before, strict=True))
                return
            runtime.synchronize(0)
            for h, d in zip(hosts, devs, strict=True):
                if to_host:
                    assert torch.equal(h[h_idx], d.cpu()[d_idx]) and all_poison(
                        h[[i for i in range(tokens) if i not in h_idx]])
                else:
                    assert torch.equal(d.cpu()[d_idx], h[h_idx])
            return
        mla = rng.random() < 0.5
        count = rng.choice([1, 2, pages])
        hp, dp = rng.sample(range(pages), count), rng.sample(range(pages), count)
        h_idx = torch.tensor([p * page_size + i for p in hp for i in range(page_size)])
        d_idx = torch.tensor([p * page_size + i for p in dp for i in range(page_size)])
        hosts = [host(pages * layers * page_size * item, func == "pf_lf").view(pages, layers, page_size, item)
                 for _ in range(1 if mla else 2)]
        lf = [m.device((tokens, item)) for _ in range(len(hosts) * layers)]
        before = [h.clone() for h in hosts] + [x.cpu() for x in lf]
        try:
            if func == "lf_pf":
                kvcacheio.transfer_kv_all_layer_direct_lf_pf(lf, hosts, d_idx, h_idx, page_size)
            else:
                kvcacheio.transfer_kv_per_layer_direct_pf_lf(hosts, lf, h_idx, d_idx, 0, page_size)
        except KvtierError:
            runtime.synchronize(0)
            assert mode == "split"
            assert all(torch.equal(a, b) for a, b in zip([*hosts, *[x.cpu() for x in lf]], before, strict=True))
            return
        runtime.synchronize(0)
        for t, h in enumerate(hosts):
            expected = before[t].clone()
            for layer in range(layers):
                src = before[len(hosts) + t * layers + layer]
                got = lf[t * layers + layer].cpu()
                for a, b in zip(hp, dp, strict=True):
                    if func == "lf_pf":
                        expected[a, layer] = src[b * page_size:(b + 1) * page_size]
                    else:
                        assert torch.equal(got[b * page_size:(b + 1) * page_size], h[a, layer])
            if func == "lf_pf":
                assert torch.equal(h, expected)
    finally:
        hosts = devs = lf = None  # noqa: F841
        gc.collect()


@pytest.mark.parametrize("mode", ["split", "unified"])
def test_ok_direct_copies_over_chunk_registered_hosts_land_exactly_or_are_refused_whole(mode):
    rng = random.Random(15_4)
    for _ in range(60):
        _direct_trial(rng, mode)


def test_ok_direct_host_to_host_with_different_chunk_boundaries_on_each_side_lands():
    """Unified: a layer whose source AND destination are host tensors (offset views) over buffers registered in
    chunks with different boundaries: every piece is cut on both sides and lands."""
    runtime = create("emulated:unified")
    m = Mem(runtime)
    a = m._own(HostBuffer.allocate(8 * PAGE, runtime=runtime, register_chunk_bytes=PAGE))
    b = m._own(HostBuffer.allocate(8 * PAGE, runtime=runtime, register_chunk_bytes=3 * PAGE))
    c = m._own(HostBuffer.allocate(8 * PAGE, runtime=runtime))
    src = a.as_tensor()[512:512 + 7 * PAGE].view(-1, 1024)
    dst = b.as_tensor()[1024:1024 + 7 * PAGE].view(-1, 1024)
    other = c.as_tensor()[:7 * PAGE].view(-1, 1024)
    src.copy_(m.values(src.shape))
    dst.fill_(POISON)
    other.fill_(POISON)
    dev = m.device(tuple(src.shape))
    n = src.shape[0]
    kvcacheio.transfer_kv_direct([dev, src], [other, dst], torch.arange(n), torch.arange(n), 1)
    runtime.synchronize(0)
    assert torch.equal(dst, src) and torch.equal(other, dev.cpu())


def test_ok_direct_into_two_touching_registrations_is_cut_between_them():
    runtime = create("emulated:unified")
    m = Mem(runtime)
    plain = m._own(HostBuffer.allocate(4 * PAGE, "pageable", runtime=runtime))
    base = plain.cpu_address.value
    first, second = register_chunks(runtime, base, PAGE), register_chunks(runtime, base + PAGE, 3 * PAGE)
    host = plain.as_tensor().view(-1, 64)
    try:
        host.fill_(POISON)
        dev = m.device((256, 64))
        kvcacheio.transfer_kv_direct([dev], [host], torch.arange(40, 100), torch.arange(30, 90), 1)
        runtime.synchronize(0)
        assert torch.equal(host[30:90], dev.cpu()[40:100])
        assert all_poison(host[:30]) and all_poison(host[90:])
    finally:
        host = None
        unregister_chunks(runtime, second)
        unregister_chunks(runtime, first)


@pytest.mark.parametrize("mode", ["unified:2", "split:2"])
def test_ok_direct_with_device_arrays_of_two_devices_is_refused_with_nothing_copied(mode):
    runtime = create(f"emulated:{mode}")
    m = Mem(runtime)
    hosts = [m.host((64, 256), data=False) for _ in range(2)]
    d0, d1 = m.device((64, 256), device=0), m.device((64, 256), device=1)
    with pytest.raises(KvtierError):
        kvcacheio.transfer_kv_direct([d0, d1], hosts, torch.arange(10, 30), torch.arange(5, 25), 1)
    for device in range(2):
        runtime.synchronize(device)
    assert all(all_poison(h) for h in hosts)
    kvcacheio.transfer_kv_direct([d1, d1], hosts, torch.arange(10, 30), torch.arange(5, 25), 1)
    runtime.synchronize(1)
    assert all(torch.equal(h[5:25], d1.cpu()[10:30]) and all_poison(h[:5]) and all_poison(h[25:]) for h in hosts)


def test_ok_compat_checks_wait_for_index_writes_ordered_from_another_stream(monkeypatch):
    """KVTIER_COMPAT_CHECKS=1, lazy: the pinned dst indices are written by a DMA on a second stream that the current
    stream waits for (an event); the new value 300 is out of range and is caught, the device stays alive."""
    monkeypatch.setenv("KVTIER_COMPAT_CHECKS", "1")
    runtime = create("emulated:split:2:lazy")
    m, dst, src, src_idx, dst_idx, computed, index_buffer = index_overwrite(runtime)
    side = runtime.create_stream(0)
    runtime.memcpy_async(get_device_accessible_ptr(index_buffer, 0, runtime=runtime), computed.address, 16,
                         stream=side)
    event = runtime.create_event(0)
    event.record(side)
    runtime.current_stream(0).wait(event)
    with pytest.raises(KvtierError):
        kvcacheio.transfer_kv_per_layer_mla(src, dst, src_idx, dst_idx, 16)
    runtime.synchronize(0)
    assert all_poison(dst)


def test_ok_device_array_copy_across_devices_of_one_runtime_and_refusal_of_another_runtimes_slice():
    runtime, other = create("emulated:split:2:lazy"), create("emulated:split:2")
    a = DeviceArray.from_tensor(torch.arange(16, dtype=torch.int64), device=0, runtime=runtime)
    b = DeviceArray.from_tensor(torch.arange(100, 116, dtype=torch.int64), device=1, runtime=runtime)
    a.copy_(b)
    assert torch.equal(a.cpu(), torch.arange(100, 116))
    foreign = DeviceArray.from_tensor(torch.arange(300, 332, dtype=torch.int64).view(2, 16), runtime=other)
    with pytest.raises(KvtierError):
        a.copy_(foreign[1])
    assert torch.equal(a.cpu(), torch.arange(100, 116))


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
