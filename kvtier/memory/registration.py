"""Chunked registration of host memory, all-or-nothing.

Drivers have failed single registrations of 96–512 GiB, so large buffers are registered in chunks. A chunk boundary
never splits a KV page (``granularity``), because separately registered neighbours can get non-adjacent device
aliases: a page that straddled them would have no single device address.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from kvtier.errors import RegistrationError
from kvtier.locks import named_lock
from kvtier.runtime import Runtime

DEFAULT_REGISTER_CHUNK_BYTES = 64 << 30

_spans_lock = named_lock("registration.spans", fork_safe=True)
_spans: weakref.WeakKeyDictionary[Runtime, dict[int, tuple[int, int]]] = weakref.WeakKeyDictionary()
_span_versions: weakref.WeakKeyDictionary[Runtime, int] = weakref.WeakKeyDictionary()


def span_generation(runtime: Runtime) -> tuple[int, int]:
    """Changes whenever kvtier's host ranges or the spans joining chunks into buffers change: what
    :func:`registered_span` and the resolver said at one generation holds while it is unchanged."""
    with _spans_lock:
        version = _span_versions.get(runtime, 0)
    return runtime.host_generation, version


def _spans_changed(runtime: Runtime) -> None:
    _span_versions[runtime] = _span_versions.get(runtime, 0) + 1


def registered_span(runtime: Runtime, address: int) -> tuple[int, int] | None:
    """[start, end) of the one registration call (all its chunks) holding ``address``, or None outside kvtier's host
    ranges. Separate registrations can sit side by side in memory; only chunks of one call make one
    buffer, so only they may be read as one span."""
    found = runtime.host_range(address)
    if found is None:
        return None
    with _spans_lock:
        return _spans.get(runtime, {}).get(found.start, (found.start, found.end))


def plan_chunks(nbytes: int, chunk_bytes: int, granularity: int) -> list[tuple[int, int]]:
    """(offset, size) chunks covering ``nbytes``; every boundary is a multiple of ``granularity``."""
    if nbytes <= 0:
        raise RegistrationError(f"cannot register {nbytes} bytes")
    if granularity <= 0:
        raise RegistrationError(f"registration granularity must be positive, got {granularity}")
    if chunk_bytes < granularity:
        raise RegistrationError(
            f"register_chunk_bytes={chunk_bytes} is smaller than the granularity {granularity}: a page would span "
            f"two registrations")
    step = chunk_bytes - chunk_bytes % granularity
    return [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)]


def register_chunks(runtime: Runtime, address: int, nbytes: int, *, chunk_bytes: int = DEFAULT_REGISTER_CHUNK_BYTES,
                    granularity: int = 1) -> list[tuple[int, int]]:
    """Register [address, +nbytes) chunk by chunk; on a failure, unregister what was done and raise.

    Returns the (CPU address, size) of each registered chunk, which is also what unregistering needs.
    """
    plan = plan_chunks(nbytes, chunk_bytes, granularity)
    clash = runtime.host_overlap(address, nbytes)
    if clash is not None:
        raise RegistrationError(f"0x{address:x} (+{nbytes}) is already registered (range at 0x{clash.start:x})")
    done: list[tuple[int, int]] = []
    for index, (offset, size) in enumerate(plan):
        try:
            runtime.host_register(address + offset, size)
        except BaseException as exc:
            unregister_chunks(runtime, done)
            if not isinstance(exc, Exception):
                raise
            raise RegistrationError(
                f"registering chunk {index} of {len(plan)} ({size} bytes at offset {offset}) failed: {exc}; "
                f"the {len(done)} chunk(s) before it were unregistered") from exc
        done.append((address + offset, size))
    if len(done) > 1:
        with _spans_lock:
            spans = _spans.setdefault(runtime, {})
            for start, _ in done:
                spans[start] = (address, address + nbytes)
            _spans_changed(runtime)
    return done


def unregister_chunks(runtime: Runtime, chunks: list[tuple[int, int]]) -> None:
    """Unregister each chunk by its own CPU address, last first; keeps going past failures and reports them."""
    failures = []
    with _spans_lock:   # what is left of a span given back in part is chunks of their own, not one buffer
        spans = _spans.get(runtime, {})
        gone = {spans[start] for start, _ in chunks if start in spans}
        for start in [start for start, span in spans.items() if span in gone]:
            del spans[start]
        _spans_changed(runtime)
    while chunks:
        start, _ = chunks.pop()
        try:
            runtime.host_unregister(start)
        except Exception as exc:
            failures.append(f"0x{start:x}: {exc}")
    if failures:
        raise RegistrationError("unregistering failed for " + "; ".join(failures))


def split_at_boundaries(starts: np.ndarray, sizes: np.ndarray, boundaries: Sequence[int]
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut each span [start, start + size) at every registration boundary inside it.

    A copy may not span two registrations (the copy APIs refuse it: cudaErrorInvalidValue), so every DMA over a host
    buffer registered in chunks goes through here. Returns (starts, sizes, origin, shift): piece i comes from span
    ``origin[i]`` and begins ``shift[i]`` bytes into it, so the other side of the copy moves by the same amount.
    """
    starts, sizes = np.asarray(starts, np.int64), np.asarray(sizes, np.int64)
    origin, shift = np.arange(starts.size, dtype=np.int64), np.zeros(starts.size, np.int64)
    for boundary in boundaries:
        inside = np.flatnonzero((starts < boundary) & (boundary < starts + sizes))
        if not inside.size:
            continue
        head = boundary - starts[inside]
        starts = np.concatenate((starts, np.full(inside.size, boundary, np.int64)))
        sizes = np.concatenate((sizes, sizes[inside] - head))
        origin = np.concatenate((origin, origin[inside]))
        shift = np.concatenate((shift, shift[inside] + head))
        sizes[inside] = head
    order = np.lexsort((shift, origin))
    return starts[order], sizes[order], origin[order], shift[order]
