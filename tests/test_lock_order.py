"""The lock-order test mode: the graph of "held A while taking B" between lock roles, and what it refuses.

Each test records into an order graph of its own, so what it plants does not reach the suite's (whose inversions
fail the run: the last test shows that on an inner pytest run)."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers.operands import no_automatic_collection

from kvtier.lock_order import LockOrder, LockOrderError, RecordingLock, _held

TESTS = Path(__file__).resolve().parent


def recording(order: LockOrder, name: str, *, reentrant: bool = False) -> RecordingLock:
    inner = threading.RLock() if reentrant else threading.Lock()
    return RecordingLock(inner, name, reentrant=reentrant, order=order)


def edge_pairs(order: LockOrder) -> set[tuple[str, str]]:
    return {(edge.held, edge.taken) for edge in order.edges()}


def free(lock: RecordingLock) -> bool:
    """Whether another thread can take ``lock`` now (an RLock has no ``locked()`` before Python 3.14)."""
    took = []

    def attempt() -> None:
        took.append(lock.acquire(blocking=False))
        if took[0]:
            lock.release()

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(60)
    return took == [True]


def take_b_then_a(a: RecordingLock, b: RecordingLock) -> None:
    with b:
        with a:
            pass


def test_a_planted_inversion_is_refused_naming_both_locks_and_where_the_first_order_was_seen():
    order = LockOrder()
    a, b = recording(order, "planted.a"), recording(order, "planted.b")
    with a:
        with b:
            pass
    with pytest.raises(LockOrderError) as caught:
        take_b_then_a(a, b)
    message = str(caught.value)
    assert "'planted.a' taken while holding 'planted.b'" in message
    assert "planted.a -> planted.b" in message
    assert "test_a_planted_inversion_is_refused" in message.split("now, in thread")[0], "the first order's stack"
    assert "take_b_then_a" in message.split("now, in thread")[1], "the inverting acquisition's stack"
    assert not a.locked() and not b.locked(), "the refused lock was not taken, the held one was let go"
    assert [(i.edge.held, i.edge.taken) for i in order.inversions] == [("planted.b", "planted.a")]
    assert _held() == []


def test_an_inversion_through_a_third_lock_is_refused_too():
    order = LockOrder()
    a, b, c = (recording(order, name) for name in "abc")
    for first, second in ((a, b), (b, c)):
        with first:
            with second:
                pass
    with c:
        with pytest.raises(LockOrderError, match=r"opposite order a -> b -> c"):
            a.acquire()
    assert not a.locked()


def test_an_order_taken_again_is_not_an_inversion_and_is_one_edge():
    order = LockOrder()
    a, b = recording(order, "a"), recording(order, "b")
    for _ in range(3):
        with a:
            with b:
                pass
    assert edge_pairs(order) == {("a", "b")} and not order.inversions


def test_reentrant_retaking_makes_no_edge():
    order = LockOrder()
    r, x = recording(order, "r", reentrant=True), recording(order, "x")
    with r:
        with x:
            with r:                 # already held: it cannot wait, so x -> r is no order
                pass
    assert edge_pairs(order) == {("r", "x")}
    assert not order.inversions and free(r)


def test_a_plain_lock_taken_again_by_its_holder_is_refused_instead_of_hanging():
    order = LockOrder()
    plain = recording(order, "plain")
    with plain:
        with pytest.raises(LockOrderError, match="taken again by the thread that holds it"):
            plain.acquire()
        assert plain.locked()
    assert not plain.locked()


def test_a_try_lock_makes_no_edge():
    order = LockOrder()
    a, b = recording(order, "a"), recording(order, "b")
    with b:
        assert a.acquire(blocking=False)
        a.release()
    with a:
        with b:
            pass
    assert edge_pairs(order) == {("a", "b")} and not order.inversions


def test_a_condition_wait_lets_go_of_its_lock_and_takes_it_back_without_an_edge():
    order = LockOrder()
    lock = recording(order, "cond", reentrant=True)
    cond, other = threading.Condition(lock), recording(order, "other")
    woken = []

    def notify():
        with other:                 # nothing of cond's held here: no edge, while the waiter waits
            pass
        with cond:
            woken.append(True)
            cond.notify_all()

    with cond:
        with cond:                  # two levels: the wait lets go of both
            thread = threading.Thread(target=notify)
            thread.start()
            assert cond.wait_for(lambda: woken, timeout=60)
            assert _held() == [lock, lock]
    thread.join(60)
    assert edge_pairs(order) == set() and _held() == [] and free(lock)


def test_a_wait_that_retakes_its_lock_under_another_is_recorded_but_returns_holding_it():
    """Condition lock first, then another, then a wait: the wait takes the condition's lock back while holding the
    other, the opposite order. The wait must still return holding its lock, so this is recorded, not raised."""
    order = LockOrder()
    lock = recording(order, "cond", reentrant=True)
    cond, other = threading.Condition(lock), recording(order, "other")
    with cond:
        other.acquire()
        try:
            cond.wait(0.01)
            assert lock._is_owned()
        finally:
            other.release()
    assert [(i.edge.held, i.edge.taken) for i in order.inversions] == [("other", "cond")]


def test_two_instances_of_one_role_are_ordered_by_instance_not_by_role():
    order = LockOrder()
    first, second = recording(order, "host_buffer"), recording(order, "host_buffer")
    with first:
        with second:
            pass
    assert edge_pairs(order) == {("host_buffer", "host_buffer")}
    with second:
        with pytest.raises(LockOrderError, match="'host_buffer' taken while holding 'host_buffer'"):
            first.acquire()
    third = recording(order, "host_buffer")
    with third:
        with first:                 # another pair of instances: no order between them yet
            pass


def test_a_cycle_through_a_finalizer_the_collector_ran_is_recorded_apart_and_not_refused():
    order = LockOrder()
    a, b = recording(order, "a"), recording(order, "b")

    class Garbage:
        def __del__(self):
            with b:
                pass

    with no_automatic_collection():
        garbage = Garbage()
        garbage.me = garbage
        del garbage
        with a:
            gc.collect()            # b is taken under a by the collector's finalizer
    assert [edge.collector for edge in order.edges()] == [True]
    take_b_then_a(a, b)
    assert not order.inversions
    assert [(i.edge.held, i.edge.taken) for i in order.collector_cycles] == [("b", "a")]
    assert "by a finalizer the garbage collector ran" in str(order.collector_cycles[0])


def test_a_fork_child_records_even_if_a_parent_thread_held_the_graphs_mutex():
    order = LockOrder()
    a, b = recording(order, "a"), recording(order, "b")
    inside, release = threading.Event(), threading.Event()

    def hold():
        with order._mutex:
            inside.set()
            release.wait(60)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert inside.wait(60)
        pid = os.fork()
        if pid == 0:
            try:
                with a:
                    with b:
                        pass
                os._exit(0 if ("a", "b") in edge_pairs(order) else 1)
            except BaseException:  # noqa: BLE001
                os._exit(2)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        thread.join(60)
    assert os.waitstatus_to_exitcode(status) == 0


INNER = '''
import threading
from kvtier.locks import named_lock

def test_swallows_an_inversion_in_a_thread():
    a, b = named_lock("planted.first"), named_lock("planted.second")
    with a:
        with b:
            pass
    def other():
        try:
            with b:
                with a:
                    pass
        except Exception:
            pass
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "two xdist workers"])
def test_an_inversion_anywhere_fails_the_run_and_names_both_locks(tmp_path, workers):
    """Alone or in an xdist worker (which reports what it saw to the controller)."""
    if os.environ.get("KVTIER_LOCK_ORDER") == "0":
        pytest.skip("the run has the lock-order mode off")
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS),
                                                         os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "--rootdir",
               str(tmp_path), str(tmp_path / "test_inner.py"), *workers]
    done = subprocess.run(command, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed" in done.stdout and "kvtier lock order inversions" in done.stdout
    assert "'planted.first' taken while holding 'planted.second'" in done.stdout
