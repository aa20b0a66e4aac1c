"""kvtier's locks: all made by role through ``kvtier.locks`` (plain locks unless the lock-order mode records them),
and a process forked while another of its threads holds one of kvtier's locks (a module lock, or the emulated
runtime's, inside a call running queued work) can take it in the child; a lock the forking thread itself holds stays
its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from helpers.operands import (
    at_point,
    collections_only_when_asked,  # noqa: F401 (a fixture)
    dev_idx,
    device,
    run_in_fork,
)
from helpers.paths import ROOT

from kvtier import locks
from kvtier.compat import operands
from kvtier.compat.sglang import direct
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument
from kvtier.lock_order import RecordingLock
from kvtier.locks import ForkSafeLock, named_condition, named_lock
from kvtier.memory import registration
from kvtier.runtime import create


def _env_with_kvtier() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _per_runtime_lock():
    return operands._per_runtime(create("emulated:split")).lock


LOCKS = {
    "compat state": lambda: operands._state_lock,
    "compat per runtime": _per_runtime_lock,
    "direct index memo": lambda: direct._indexed_lock,
    "registration spans": lambda: registration._spans_lock,
    "a new ForkSafeLock": ForkSafeLock,
    "a named fork-safe lock": lambda: named_lock("test.fork_safe", fork_safe=True),
    "a runtime's lock": lambda: create("emulated:split")._lock,
}


@pytest.mark.parametrize("name", sorted(LOCKS))
def test_a_fork_child_takes_a_lock_a_parent_thread_held_at_fork(name):
    lock = LOCKS[name]()
    held, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            done.wait(60)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(60)
        pid = os.fork()
        if pid == 0:
            took = lock.acquire(timeout=2)
            os._exit(0 if took else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        done.set()
        thread.join(60)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child could not take the {name} lock"
    assert not lock.locked(), "the parent's lock is released by its holder, as before"


def test_a_lock_the_forking_thread_holds_stays_its_own_in_the_child():
    """The child's only thread is the one that forked: a lock it held is still held, by it (reentrantly), and its
    ``with`` block releases it there as in the parent."""
    lock = ForkSafeLock()
    with lock:
        pid = os.fork()
        if pid == 0:
            try:
                with lock:
                    pass
                held = lock.locked()
                lock.release()
                freed = not lock.locked() and lock.acquire(timeout=2)
                os._exit(0 if held and freed else 1)
            except BaseException:  # noqa: BLE001
                os._exit(2)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not lock.locked()


def test_locked_says_whether_any_thread_holds_it():
    lock = ForkSafeLock()
    assert not lock.locked()
    with lock:
        assert lock.locked()
        seen = []
        thread = threading.Thread(target=lambda: seen.append(lock.locked()))
        thread.start()
        thread.join(60)
        assert seen == [True]
    assert not lock.locked()


def test_a_fork_child_refuses_a_view_of_a_buffer_a_parent_thread_was_closing_at_once():
    """A parent thread is inside ``close()`` (draining a user) when the process forks; in the child the close is
    finished and ``as_tensor()`` raises BufferClosed. It must do so before importing torch: a first torch import in
    the child takes seconds on a loaded machine, long enough for a watchdog to take it for a hang. Runs in a fresh
    interpreter, where torch is not imported yet."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, sys, threading
        from kvtier.errors import BufferClosed
        from kvtier.memory import HostBuffer
        from kvtier.runtime import create

        buffer = HostBuffer.allocate(1 << 16, runtime=create("emulated:split"))
        parent, inside, release = os.getpid(), threading.Event(), threading.Event()

        class Engine:
            def drain(self):
                if os.getpid() == parent:
                    inside.set()
                    release.wait()

        engine = Engine()
        buffer.add_user(engine)
        closer = threading.Thread(target=buffer.close)
        closer.start()
        inside.wait()
        pid = os.fork()
        if pid == 0:
            try:
                buffer.as_tensor()
                os._exit(1)
            except BufferClosed:
                os._exit(3 if "torch" in sys.modules else 0)
        _, status = os.waitpid(pid, 0)
        release.set()
        closer.join()
        sys.exit(os.waitstatus_to_exitcode(status))
    """)], env=_env_with_kvtier(), timeout=120)
    assert result.returncode != 1, "the child got a view of a buffer whose close had begun"
    assert result.returncode != 3, "as_tensor imported torch before refusing a closed buffer"
    assert result.returncode == 0


@pytest.mark.usefixtures("collections_only_when_asked")
def test_a_fork_child_does_not_hang_when_a_parent_thread_is_inside_a_call_running_queued_work():
    """A parent thread is inside a compat call whose first use of new operands builds a kernel table, and the
    table's synchronous upload runs the kernel queued before it on the legacy stream: the thread holds the emulated
    runtime's lock (``Runtime._lock``, a plain ``threading.RLock``, base.py:156) and the scheduler's ``_depth`` is 1
    with any deferred frees pending. The main thread forks. The compat module's locks are
    ``ForkSafeLock``s, and docs/sglang.md promises 'a process forked while another thread is inside a call gets the
    module's locks unheld in the child, so no child hangs on them', yet the child's first call blocks on the copied,
    held runtime lock for good (on CUDA a fork child's call fails with an error, it does not hang); were that lock
    fresh, ``_depth`` 1 would still refuse every wait in the child and defer every free forever. Fix: re-create the
    emulated runtime's lock and reset the scheduler's ``_depth`` and ``_deferred`` (and drop the parent's queued
    work) in the child (``os.register_at_fork``), or fail the child's calls with a clear error as CUDA does."""
    rt = create("emulated:split:lazy")
    n, row = 8, 32
    a, b, si = device(rt, (n, row)), device(rt, (n, row), data=False), dev_idx(rt, list(range(n)))
    other = device(rt, (n, row), data=False)
    io.transfer_kv_per_layer_mla(a, b, si, si, row)          # queued, runs inside the next call's table upload
    inside, go = threading.Event(), threading.Event()

    def park():
        inside.set()
        go.wait(60)

    def worker():
        io.transfer_kv_per_layer_mla(a, other, si, si, row)

    def child_call():
        out = device(rt, (n, row), data=False)
        io.transfer_kv_per_layer_mla(a, out, si, si, row)
        return "ok" if torch.equal(out.cpu(), a.cpu()) else "wrong bytes"

    with at_point("reference.copy_chunk", park, thread="worker"):
        thread = threading.Thread(target=worker, name="worker")
        thread.start()
        assert inside.wait(60)
        hung, result = run_in_fork(child_call, meanwhile=lambda: (go.set(), thread.join(60)))
    rt.synchronize(0)
    assert torch.equal(other.cpu(), a.cpu())
    assert not hung, "the fork child hangs on the emulated runtime's lock a parent thread held at fork"
    assert result == "ok"


def _fork_holding(lock):
    with lock:
        pid = os.fork()
        if pid == 0:    # the child leaves the with block the forking thread entered
            code = 0
            try:
                lock.release()
                lock.acquire()
            except BaseException:  # noqa: BLE001
                code = 1
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_fork_safe_lock_held_by_the_forking_thread_stays_held_in_the_child():
    """``ForkSafeLock`` replaces its lock in every fork child (locks.py:42-43), also when the thread that forks is the
    one holding it (a signal handler or finalizer that forks inside a compat call's ``with state.lock``). In the
    child that thread goes on and leaves its ``with`` block: ``release()`` of the fresh, unheld lock raises
    RuntimeError('release unlocked lock'). A ``threading.Lock`` stays held by the forking thread in the child and
    releases fine (checked first), so the drop-in is not one. Fix: remember the owner's thread id on acquire and,
    in the child, re-create the lock held when the owner was the forking thread (it lives on in the child)."""
    assert _fork_holding(threading.Lock()) == 0
    assert _fork_holding(ForkSafeLock()) == 0, "the child could not release the lock its thread held at fork"


def test_every_lock_in_kvtier_is_made_by_role_through_kvtier_locks():
    """A lock made any other way is one the lock-order mode cannot see."""
    package = ROOT / "kvtier"
    made = re.compile(r"\b(Lock|RLock|Condition|ForkSafeLock|allocate_lock|Semaphore|BoundedSemaphore)\(")
    for path in package.rglob("*.py"):
        if path.name in ("locks.py", "lock_order.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not made.search(line), f"{path}:{number} makes a lock outside kvtier.locks: {line.strip()}"


@pytest.mark.parametrize("name", ["", None, 3])
def test_a_lock_needs_a_role_name(name):
    with pytest.raises(InvalidArgument, match="role name"):
        named_lock(name)
    with pytest.raises(InvalidArgument, match="role name"):
        named_condition(name)


def test_out_of_the_mode_the_factories_give_plain_locks(monkeypatch):
    monkeypatch.setattr(locks, "RECORDING", False)
    assert type(named_lock("a")) is type(threading.Lock())
    assert type(named_lock("a", reentrant=True)) is type(threading.RLock())
    assert type(named_lock("a", fork_safe=True)) is ForkSafeLock
    condition = named_condition("a")
    assert type(condition) is threading.Condition and type(condition._lock) is type(threading.RLock())


def test_in_the_mode_the_factories_give_recording_locks_over_the_same_kinds(monkeypatch):
    monkeypatch.setattr(locks, "RECORDING", True)
    plain, reentrant, fork_safe = named_lock("a"), named_lock("b", reentrant=True), named_lock("c", fork_safe=True)
    assert all(isinstance(lock, RecordingLock) for lock in (plain, reentrant, fork_safe))
    assert (plain.name, plain.reentrant, reentrant.reentrant, fork_safe.reentrant) == ("a", False, True, True)
    assert type(plain._inner) is type(threading.Lock()) and type(fork_safe._inner) is ForkSafeLock
    condition = named_condition("d")
    assert isinstance(condition._lock, RecordingLock) and condition._lock.name == "d"


def test_the_environment_variable_decides_when_kvtier_is_imported():
    """Read once, at import: the module-level locks follow it as the others do."""
    probe = ("from kvtier import locks; from kvtier.memory import registration; "
             "print(locks.RECORDING, type(registration._spans_lock).__name__)")
    seen = {}
    for value in ("0", "1"):
        done = subprocess.run([sys.executable, "-c", probe], env={**_env_with_kvtier(), locks.ENV_VAR: value},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        seen[value] = done.stdout.split()
    assert seen == {"0": ["False", "ForkSafeLock"], "1": ["True", "RecordingLock"]}
