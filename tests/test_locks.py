"""A process forked while another of its threads holds one of kvtier's module locks: the child can take it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kvtier.compat import operands
from kvtier.compat.sglang import direct
from kvtier.locks import ForkSafeLock
from kvtier.memory import registration
from kvtier.runtime import create

ROOT = Path(__file__).resolve().parents[1]


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
