"""A process forked while another of its threads holds one of kvtier's module locks: the child can take it."""

from __future__ import annotations

import os
import threading

import pytest

from kvtier.compat import operands
from kvtier.compat.sglang import direct
from kvtier.locks import ForkSafeLock
from kvtier.memory import registration
from kvtier.runtime import create


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
            done.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(5)
        pid = os.fork()
        if pid == 0:
            took = lock.acquire(timeout=2)
            os._exit(0 if took else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        done.set()
        thread.join(10)
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
        thread.join(5)
        assert seen == [True]
    assert not lock.locked()
