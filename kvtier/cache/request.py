"""``CacheRequest``: one request's use of the cache, from match to insert, as a context manager.

Every engine runs the same sequence per request: settle the storage prefetch, match the prompt and lock the match,
load back what lives in host memory, wait per layer for that load, allocate device pages for the new tokens, let the
model write them, insert, unlock. Written out by hand in each caller, the cleanup drifts: a page allocated and not
inserted, or a lock not given back when the model raises, stays held until the cache closes. ``CacheRequest`` is the
sequence once, engine-agnostic (tokens in, device page numbers and per-layer waits out), so the demo, the
transformers integration, the test helpers and the engine connectors share it::

    with cache.request(tokens) as request:        # prefetch settled, matched and locked, host part loading
        pages = request.allocate()                # device pages for the whole pages past the cached prefix
        ...  # layer i: request.stream_wait(layer=i), then read request.prefix_pages, write pages
        request.insert()                          # the cache takes the pages
    # closed: pages not inserted go back, the lock is given back (on an exception too)

A request is used by one thread at a time; requests of different threads are independent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.cache.index import Match
from kvtier.cache.operation import LoadBack
from kvtier.cache.storage_tier import Prefetch
from kvtier.checks import integer
from kvtier.errors import BufferClosed, InvalidArgument, KvtierError, LoadFailed
from kvtier.keys import token_array
from kvtier.transfer.engine import CURRENT

if TYPE_CHECKING:
    from kvtier.cache.cache import Inserted, KVCache

NEW, OPEN, INSERTED, CLOSED = "new", "open", "inserted", "closed"


class CacheRequest:
    """One request's use of a :class:`~kvtier.cache.KVCache` (make it with ``cache.request(tokens)``).

    States: *new* (made; its storage prefetch, if any, runs), *open* (``open()`` or ``with``: the match is locked and
    the load-back queued), *inserted* (``insert()``: the new pages are the cache's; the match stays locked) and
    *closed* (``close()``: everything the request holds is given back). A call out of this order, or on a closed
    request, raises InvalidArgument naming it and changes nothing; ``close()`` may be called any number of times."""

    def __init__(self, cache: KVCache, tokens: Any, *, load_back: bool = True, device_only: bool = False,
                 force: bool = False, prefetch: bool = True) -> None:
        """Use ``cache.request``. Starts the storage prefetch (when the cache has storage and ``prefetch``), so that
        a request made when it arrives and opened when it is scheduled reads storage in between."""
        for name, value in (("load_back", load_back), ("device_only", device_only), ("force", force),
                            ("prefetch", prefetch)):
            if not isinstance(value, bool):
                raise InvalidArgument(f"cache.request: {name} must be True or False, got {value!r}")
        self.cache, self.tokens = cache, token_array(tokens)
        self._load_at_open, self.device_only, self.force = load_back, device_only, force
        self.prefetch: Prefetch | None = cache.prefetch(self.tokens) if prefetch and cache.storage is not None \
            else None
        """The storage prefetch this request started (None: no storage, or ``prefetch=False``)."""
        self.fetched_tokens = 0
        """Tokens the prefetch had committed to the host tier when the request opened."""
        self.match: Match | None = None
        """The locked match (after a re-match: the one the request holds now)."""
        self.load: LoadBack | None = None
        self.declined = False
        """A load-back was needed and the cache declined it (counted in ``stats()["decisions.*"]``): the prefix is
        the device part (on a hybrid cache: the deepest device snapshot, matched again with ``device_only``)."""
        self.inserted: Inserted | None = None
        self._phase = NEW
        self._load_asked = False
        self._held: list[np.ndarray] = []
        self._slot: int | None = None
        self._waits: list[LoadBack] = []

    # -- steps ------------------------------------------------------------------------------------------------------
    def open(self) -> CacheRequest:
        """Settle the prefetch (the cache's ``prefetch_policy``), match and lock, and (unless made with
        ``load_back=False``) queue the load-back of the host part. Nothing waits for the load here: see ``wait`` and
        ``stream_wait``. On an error the request is closed, holding nothing."""
        self._need((NEW,), "open")
        try:
            if self.prefetch is not None:
                self.fetched_tokens = self.prefetch.settle()
            self.match = self.cache.match_prefix(self.tokens, lock=True, device_only=self.device_only)
            self._phase = OPEN
            self._refresh_waits()
            if self._load_at_open:
                self._load_back()
        except BaseException:
            self.close()
            raise
        return self

    def load_back(self) -> LoadBack | None:
        """Queue the load-back of the match's host part (for a request made with ``load_back=False``; once, before
        ``allocate``). None when nothing needed loading or the cache declined (``declined``)."""
        self._need((OPEN,), "load_back")
        if self._load_asked:
            raise InvalidArgument("load_back: this request asked for its load-back already (at open, unless made "
                                  "with load_back=False)")
        if self._held or self._slot is not None:
            raise InvalidArgument("load_back after allocate: the pages allocated were counted past the prefix the "
                                  "load would extend")
        self._load_back()
        return self.load

    def allocate(self, count: int | None = None) -> np.ndarray:
        """``count`` device pages for new KV (default: the request's whole pages past the cached prefix and past what
        it allocated before). The request holds them until ``insert`` takes them or ``close`` gives them back. May
        raise OutOfPages (the request holds what it held before)."""
        self._need((OPEN,), "allocate")
        if count is None:
            have = len(self.prefix_pages) + sum(len(pages) for pages in self._held)
            count = max(0, len(self.tokens) // self.cache.page_size - have)
        else:
            count = integer(count, "allocate count", low=0)
        pages = self.cache.allocate(count)
        self._held.append(pages)
        return pages.copy()

    def allocate_state(self) -> int:
        """A device state slot for the request's recurrent state (hybrid caches), inserted with the pages."""
        self._need_no_slot("allocate_state")
        self._slot = self.cache.allocate_state()
        return self._slot

    def fork_state(self) -> int:
        """A slot holding a copy of the prefix's state snapshot (hybrid caches; ``KVCache.fork_state``), on the
        caller's current stream after the load that brings it: the request continues from the copy."""
        self._need_no_slot("fork_state")
        assert self.match is not None
        self._slot = self.cache.fork_state(self.match)
        return self._slot

    def insert(self, tokens: Any = None, *, after: Any = CURRENT) -> Inserted:
        """Hand the KV of ``tokens`` (default: the request's; a continuation of them, e.g. prompt and reply, too) to
        the cache: one page per whole page, the cached prefix's pages first, then those allocated, in order, and the
        state slot the request holds. Allocated pages past the last whole page stay the request's until ``close``.
        ``after``: where the KV was written (default: the caller's current stream). The match stays locked until
        ``close``; the inserted pages are the cache's now, so insert when done writing them."""
        self._need((OPEN,), "insert")
        page = self.cache.page_size
        tokens = self.tokens if tokens is None else token_array(tokens)
        prefix = self.prefix_pages
        held = np.concatenate(self._held) if self._held else prefix[:0]
        count = len(tokens) // page
        if count > len(prefix) + len(held):
            raise InvalidArgument(f"insert: {len(tokens)} tokens fill {count} whole pages, but the request has "
                                  f"{len(prefix)} cached and {len(held)} allocated (allocate more first)")
        covered = min(count, len(prefix)) * page
        if not np.array_equal(tokens[:covered], self.tokens[:covered]):
            raise InvalidArgument("insert: the tokens differ from the request's within its cached prefix, whose "
                                  "pages hold the KV of the request's tokens")
        self.inserted = self.cache.insert(tokens, np.concatenate([prefix, held])[:count], after=after,
                                          state=self._slot)
        used = max(0, count - len(prefix))
        self._held = [held[used:]] if used < len(held) else []
        self._slot = None
        self._phase = INSERTED
        return self.inserted

    def close(self) -> None:
        """Give back what the request holds: pages allocated and not inserted (whoever gets them next waits for what
        is queued on the caller's current stream now), its state slot, its lock; stop a prefetch of a request never
        opened. Idempotent. A closed cache took everything back already."""
        if self._phase == CLOSED:
            return
        phase, self._phase = self._phase, CLOSED
        self._waits = []
        held = np.concatenate(self._held) if self._held else None
        slot, self._held, self._slot = self._slot, [], None
        if phase == NEW:
            if self.prefetch is not None:
                self.prefetch.cancel()
            return
        if self.cache.closing:
            return
        try:
            self._give_back(held, slot)
        except BufferClosed:
            if not self.cache.closing:            # a cache that began closing meanwhile takes everything back
                raise

    def _give_back(self, held: np.ndarray | None, slot: int | None) -> None:
        try:
            if held is not None and held.size:
                self.cache.free(held)
        finally:
            try:
                if slot is not None:
                    self.cache.free_state(slot)
            finally:
                assert self.match is not None
                self.cache.unlock(self.match)

    # -- waits ------------------------------------------------------------------------------------------------------
    def wait(self, layer: int | None = None) -> None:
        """Block the CPU until the prefix's bytes have landed: every layer, or model layer ``layer`` only (what the
        load-back of this request and loads still landing in its device part bring)."""
        layer = self._check_layer(layer, "wait")
        self._check_loads("wait")
        for op in self._waits:
            try:
                op.wait() if layer is None else op.wait_layer(layer)
            except KvtierError as error:
                raise LoadFailed(f"wait: a load-back of this request's prefix failed ({error}); its pages hold no "
                                 f"KV of these tokens: close the request and make a new one") from error
        self._check_loads("wait")

    def stream_wait(self, stream: Any = None, *, layer: int | None = None) -> None:
        """Make ``stream`` (default: the caller's current one) wait on the GPU, not the CPU, for the prefix's bytes:
        every layer, or model layer ``layer`` only, so layer i's compute overlaps the load of later layers. A load
        found failed by then raises :class:`LoadFailed`; one that fails later on the GPU raises it at the next
        ``wait``, ``prefix_pages`` or ``insert``, so its pages are never inserted as this prefix."""
        layer = self._check_layer(layer, "stream_wait")
        self._check_loads("stream_wait")
        for op in self._waits:
            op.stream_wait(stream, layer=layer)

    # -- what the request holds -------------------------------------------------------------------------------------
    @property
    def prefix_pages(self) -> np.ndarray:
        """Device pages of the cached prefix: the match's device part, then what the load-back fills. The cache's
        own pages: read them (after the waits), never write them."""
        self._need((OPEN, INSERTED), "prefix_pages")
        self._check_loads("prefix_pages")
        assert self.match is not None
        return self.load.prefix_pages if self.load is not None else self.match.device_pages

    @property
    def state(self) -> int | None:
        """Hybrid caches: the device slot of the prefix's state snapshot (the cache's own: read it, or
        ``fork_state``)."""
        self._need((OPEN, INSERTED), "state")
        assert self.match is not None
        return self.load.device_state if self.load is not None else self.match.device_state

    @property
    def cached_tokens(self) -> int:
        """Tokens served from the cache: the device hit plus what the load-back brings."""
        return self.device_tokens + self.loaded_tokens

    @property
    def device_tokens(self) -> int:
        """Tokens of the match found on the device."""
        self._need((OPEN, INSERTED, CLOSED), "device_tokens")
        return self.match.device_tokens if self.match is not None else 0     # closed before it matched: none

    @property
    def loaded_tokens(self) -> int:
        return self.load.loaded_tokens if self.load is not None else 0

    @property
    def closed(self) -> bool:
        return self._phase == CLOSED

    def __enter__(self) -> CacheRequest:
        return self.open()

    def __exit__(self, kind: Any, error: BaseException | None, trace: Any) -> None:
        if error is None:
            self.close()
            return
        try:
            self.close()
        except Exception as failure:  # noqa: BLE001 - the block's own error is the one to see
            if hasattr(error, "add_note"):                      # Python 3.11+
                error.add_note(f"closing the cache request failed too: {failure!r}")

    def __repr__(self) -> str:
        cached = f", {self.cached_tokens} cached" if self.match is not None else ""
        return f"CacheRequest({len(self.tokens)} tokens{cached}, {self._phase})"

    # -- internals --------------------------------------------------------------------------------------------------
    def _load_back(self) -> None:
        """Load the host part; when another request's load (or insert) brought it to the device meanwhile, match
        again to find it there (its load then among the waits) and load what is still on the host only."""
        self._load_asked = True
        if not self._needs_load():
            return
        assert self.match is not None                          # open() matched before any load
        self.load = self.cache.load_back(self.match, force=self.force)
        if self.load is None and self._brought_meanwhile():
            self._rematch(self.device_only)
            if self._needs_load():
                self.load = self.cache.load_back(self.match, force=self.force)
        if self.load is None and self._needs_load():
            self.declined = True
            if self.cache.states is not None:          # the device part may end without a snapshot
                self._rematch(True)
        self._refresh_waits()

    def _needs_load(self) -> bool:
        match = self.match
        assert match is not None
        return bool(match.host_tokens) or (self.cache.states is not None and bool(match.cached_tokens)
                                           and match.device_state is None)

    def _brought_meanwhile(self) -> bool:
        """The match's node is live and none of its path is on the host only any more."""
        return self.match is not None and self.cache.on_device_now(self.match)

    def _rematch(self, device_only: bool) -> None:
        """Lock the new match before giving back the old lock, so the prefix is never unpinned in between."""
        stale = self.match
        assert stale is not None
        self.match = self.cache.match_prefix(self.tokens, lock=True, device_only=device_only)
        self.cache.unlock(stale)

    def _refresh_waits(self) -> None:
        """The loads the prefix's bytes come with: those the match listed, those over its path now (another
        request's load-back may have started over it after this match) and its own."""
        match = self.match
        assert match is not None
        ops: dict[int, Any] = {id(op): op for op in self.cache.loads_over(match)}
        if self.load is not None:
            ops.setdefault(id(self.load), self.load)
        self._waits = list(ops.values())

    def _check_loads(self, what: str) -> None:
        """Refuse to name pages a failed load was filling: the cache took them back, and another request may hold
        them already (it must never read, or insert, someone else's pages as this prefix)."""
        for op in self._waits:
            if op.error is not None:
                raise LoadFailed(f"{what}: a load-back of this request's prefix failed ({op.error}); its pages went "
                                 f"back to the cache: close the request and make a new one") from op.error

    def _check_layer(self, layer: int | None, what: str) -> int | None:
        self._need((OPEN, INSERTED), what)
        if layer is None:
            return None
        states = self.cache.states
        layers = len(states.layer_map) if states is not None else self.cache.geometry.layers
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < layers:
            raise InvalidArgument(f"{what}: layer {layer!r} is not a layer of this model (0..{layers - 1})")
        return int(layer)

    def _need(self, phases: tuple[str, ...], what: str) -> None:
        if self._phase in phases:
            return
        if self._phase == CLOSED:
            raise InvalidArgument(f"{what}: this cache request is closed")
        if self._phase == NEW:
            raise InvalidArgument(f"{what}: this cache request is not open yet (open it: with cache.request(tokens) "
                                  f"as request, or request.open())")
        if self._phase == INSERTED:
            raise InvalidArgument(f"{what} after insert: the request's pages are the cache's now (make a new "
                                  f"request for more)")
        raise InvalidArgument(f"{what}: this cache request is open already")

    def _need_no_slot(self, what: str) -> None:
        self._need((OPEN,), what)
        if self._slot is not None:
            raise InvalidArgument(f"{what}: this request holds state slot {self._slot} already (one per request)")
