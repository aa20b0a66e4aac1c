"""Ordering a transfer after the caller's work: ``after=`` (by default the caller's current stream) as events that
every stream a transfer uses waits for. Every engine, and the cache, order through here."""

from __future__ import annotations

from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.runtime import Event, Runtime, Stream
from kvtier.transfer.completion import Transfer

CURRENT = "current"
"""``after=CURRENT`` (the default): order the transfer after the caller's current stream."""


def after_events(runtime: Runtime, device: int, after: Any, *, skip: Stream | None = None,
                 snapshot: Stream | None = None) -> list[Event] | None:
    """``after`` as events recorded now (None for None): ``CURRENT`` (the caller's current stream of ``device``), a
    :class:`Transfer` (its end), an event or stream (kvtier's or torch's), or a list of them; a stream that is
    ``skip`` itself needs no event. What every engine and the cache order transfers after. With ``snapshot`` (a
    stream of kvtier's), the caller's own events are replaced by one event of kvtier's recorded on it after them, for
    holders that keep the events past the call (the caller may close or re-record theirs)."""
    if after is None:
        return None
    if isinstance(after, str):
        if after != CURRENT:
            raise InvalidArgument(f"after={after!r}: use {CURRENT!r}, a Transfer, an event, a stream, a list or None")
        current = runtime.current_stream(device)       # the default, on every insert: one event, no list walk
        if current is skip:
            return []
        marker = runtime.create_event(device)
        marker.record(current)
        return [marker]
    theirs, sources = [], []
    for item in after if isinstance(after, (list, tuple)) else [after]:   # every item checked before any is used
        if isinstance(item, Transfer):
            item = item.finished
        if isinstance(item, Event) or hasattr(item, "cuda_event"):
            theirs.append(runtime.as_event(item))
        else:
            sources.append(runtime.as_stream(item))
    events = []
    for source in sources:
        if source is skip:
            continue
        marker = runtime.create_event(source.device)  # an event records only on a stream of its own device
        marker.record(source)
        events.append(marker)
    if theirs and snapshot is not None:
        for event in theirs:
            snapshot.wait(event)
        marker = runtime.create_event(device)
        marker.record(snapshot)
        theirs = [marker]
    return events + theirs


def order_after(runtime: Runtime, stream: Stream, after: Any) -> None:
    """Make ``stream`` wait for ``after`` (see :func:`after_events`). Every engine orders through here."""
    for event in after_events(runtime, stream.device, after, skip=stream) or []:
        stream.wait(event)
