"""Named points in kvtier's code where a test may act on the thread that reaches them.

A race test has to stop one thread at an exact place (a plan read but not yet stored, a registration looked up but
not yet used) while another thread acts. Tracing a line by its text breaks silently the day that line is reformatted;
a named point stays where the code says it is, and a test that arms a point no thread reaches fails (``armed`` checks
it on exit). The code marks the point with ``reached("module.what")``; unarmed, that costs one dict lookup.

The points are listed where they are reached (``grep -rn 'reached("' kvtier``); tests arm them by the same name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvtier.locks import named_lock

_actions: dict[str, Callable[[], object]] = {}
_guard = named_lock("pause_points")


def reached(name: str) -> None:
    """The thread running this line is at point ``name``: run the action a test armed there, if any."""
    action = _actions.get(name)
    if action is not None:
        action()


@contextmanager
def armed(name: str, action: Callable[[], object], *, must_reach: bool = True) -> Iterator[list[object]]:
    """Run ``action()`` in every thread that reaches point ``name`` while the block runs; yields the list of what the
    action returned, one entry per time it ran. ``must_reach`` fails the block if no thread reached the point (a
    renamed or removed point must not pass silently)."""
    results: list[object] = []

    def record() -> None:
        results.append(action())

    with _guard:
        if name in _actions:
            raise RuntimeError(f"pause point {name!r} is armed already")
        _actions[name] = record
    try:
        yield results
    finally:
        with _guard:
            del _actions[name]
    if must_reach and not results:
        raise AssertionError(f"no thread reached pause point {name!r}")
