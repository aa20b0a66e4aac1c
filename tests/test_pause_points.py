"""Pause points: an armed point runs its action in whichever thread reaches it, and a point no thread reached fails
the test that armed it (a renamed point must not disarm a race test silently)."""

from __future__ import annotations

import threading

import pytest

from kvtier.pause_points import armed, reached


def test_an_armed_point_runs_its_action_in_the_thread_that_reaches_it():
    seen: list[str] = []
    with armed("test.point", lambda: seen.append(threading.current_thread().name) or len(seen)) as results:
        thread = threading.Thread(target=reached, args=("test.point",), name="worker")
        thread.start()
        thread.join(10)
        reached("test.other")
    assert seen == ["worker"] and results == [1]
    reached("test.point")                      # disarmed: nothing runs
    assert seen == ["worker"]


def test_a_point_nobody_reached_fails_the_block():
    with pytest.raises(AssertionError, match="test.never"), armed("test.never", lambda: None):
        reached("test.elsewhere")
    with armed("test.never", lambda: None, must_reach=False) as results:
        pass
    assert results == []


def test_a_point_is_armed_once_at_a_time():
    with armed("test.once", lambda: None, must_reach=False), pytest.raises(RuntimeError, match="armed already"):
        with armed("test.once", lambda: None):
            pass
    with armed("test.once", lambda: 7) as results:    # the refused arming left the first one's release intact
        reached("test.once")
    assert results == [7]


def test_every_pause_point_in_kvtier_is_armed_by_a_test():
    """A point no test arms is a line of production code that proves nothing: name them."""
    import re

    from helpers.paths import ROOT, TESTS

    points = {name for path in (ROOT / "kvtier").rglob("*.py") if path.name != "pause_points.py"
              for name in re.findall(r'reached\("([\w.]+)"\)', path.read_text())}
    tests = "\n".join(path.read_text() for path in TESTS.rglob("*.py"))
    assert points and [name for name in sorted(points) if f'"{name}"' not in tests] == []
