"""``KVCache``: the radix index over a device pool and a host pool, with write policies, eviction, layer-wise
load-back, a background controller and metrics.

How an engine uses it, per request (:mod:`kvtier.cache.request`)::

    with cache.request(tokens) as request:      # matched and locked; host part loading, one event per layer
        pages = request.allocate()              # device pages for the rest; evicts as needed
        ... layer i: request.stream_wait(layer=i), reads request.prefix_pages, writes KV into pages ...
        request.insert()                        # the tree takes the pages (duplicates are freed)
    # unlocked; pages not inserted went back (on an exception too)

Underneath are the steps a request takes: ``match_prefix(tokens, lock=True)``, ``load_back(match)``,
``allocate(n)``, ``insert(tokens, pages)``, ``free(pages)``, ``unlock(match)``.

The cache owns every page of both pools: device pages are handed out by ``allocate`` and come back through
``insert`` (kept), ``free`` (returned) or eviction. It never touches a device address: pages are numbers, and the
transfer engines move them.

A hybrid model's cache (``state=(StateDevicePool, StateHostPool)``) also owns every state slot: ``allocate_state``
hands one out for a request's recurrent state, ``insert(..., state=slot)`` takes it as the snapshot after the
prompt's last token, and a match ends only where such a snapshot exists (:mod:`kvtier.cache.state_tier`).
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np

from kvtier import closings
from kvtier.cache.allocator import PageAllocator, distinct, take_pages
from kvtier.cache.controller import Controller
from kvtier.cache.index import Match, Node, RadixIndex
from kvtier.cache.metrics import CacheMetrics
from kvtier.cache.operation import BACKUP, LOAD, LoadBack, Operation
from kvtier.cache.rates import H200_TABLE, RateTable, read_beats_recompute, storage_read_gbps
from kvtier.cache.request import CacheRequest
from kvtier.cache.settings import AUTO, COPY_ENGINE_BACKENDS, CacheSettings, WritePolicy
from kvtier.cache.state_tier import StateTier
from kvtier.cache.storage_tier import Prefetch, StorageTier
from kvtier.cache.tiers import CALLER, FREE, HELD, TREE, Completed, MustWait, Tiers, TierSettings
from kvtier.checks import index_array, integer, positive_number
from kvtier.errors import BufferClosed, InvalidArgument, KvtierError, OutOfMemory
from kvtier.keys import Namespace, token_array
from kvtier.locks import named_lock
from kvtier.pools import DevicePool, HostPool, payload_order
from kvtier.pools.state import StateDevicePool, StateHostPool
from kvtier.storage import StorageBackend
from kvtier.transfer import TransferEngine
from kvtier.transfer.engine import CURRENT
from kvtier.transfer.ordering import after_events

_T = TypeVar("_T")
_CLAIMED: weakref.WeakKeyDictionary[Any, KVCache] = weakref.WeakKeyDictionary()
"""Pools a cache owns: two caches over one pool would hand out the same pages."""


class OutOfPages(OutOfMemory):
    """No device pages could be had even after evicting everything evictable and waiting for backups in flight."""


@dataclass(frozen=True)
class Inserted:
    """``existing_tokens`` were already cached (their caller pages that differ from the tree's were freed:
    ``freed``); ``new_tokens`` are new to the tree; ``node`` is the deepest node of the prompt. ``state_kept``: the
    state slot given was taken as the node's snapshot (False: the node had one already, and the slot was freed)."""

    existing_tokens: int
    new_tokens: int
    freed: np.ndarray
    node: Node
    state_kept: bool = False


class KVCache:
    def __init__(self, device_pool: DevicePool, host_pool: HostPool, namespace: Namespace,
                 settings: CacheSettings | None = None, *, rates: RateTable | None = None,
                 storage: StorageBackend | None = None,
                 state: tuple[StateDevicePool, StateHostPool] | None = None,
                 layer_map: Any = None) -> None:
        """The cache takes every page of both pools. ``rates``: a measured table to choose backends from
        (``io_backend="auto"``) and estimate load time with; default: the H200 table of :mod:`kvtier.cache.rates`,
        refined by a calibration transfer when ``settings.calibrate``. ``storage``: a backend of the same namespace,
        opened for the host pool's layout (:func:`kvtier.storage.open_store`) to prefetch from and write through to;
        it stays the caller's to close. ``state``: a hybrid model's state pools (the KV pools then hold only its
        attention layers; with ``storage``, its state snapshots are stored and prefetched with their KV);
        ``layer_map``: which model layer is which (default
        :func:`~kvtier.cache.state_tier.interleaved_layers`), for per-layer waits on load-backs."""
        settings = settings or CacheSettings()
        if state is None and layer_map is not None:
            raise InvalidArgument("layer_map maps a hybrid model's layers: it needs state=(StateDevicePool, "
                                  "StateHostPool)")
        state_pools = self._check_state(state, device_pool)
        if storage is not None and (not isinstance(storage, StorageBackend) or storage.namespace != namespace
                                    or storage.closed):
            raise InvalidArgument(f"storage must be an open StorageBackend of this cache's namespace, got "
                                  f"{storage!r}")
        if device_pool.geometry != namespace.geometry or host_pool.geometry != namespace.geometry:
            raise InvalidArgument(f"the namespace's geometry {namespace.geometry} differs from the pools' "
                                  f"({device_pool.geometry}, {host_pool.geometry})")
        if storage is not None and storage.format.order != payload_order(namespace.geometry, host_pool.layout):
            raise InvalidArgument(f"storage was opened for {storage.layout.value} pages, whose bytes come in another "
                                  f"order than this host pool's ({host_pool.layout.value}): open it with "
                                  f"open_store(spec, namespace, layout={host_pool.layout.value!r})")
        device_pool.check_open()
        host_pool.check_open()
        for pool in (device_pool, host_pool, *state_pools):
            owner = _CLAIMED.get(pool)
            if owner is not None and not owner.closed:
                raise InvalidArgument(f"{pool!r} already belongs to {owner!r}: one cache per pool (close it first)")
        self.device_pool, self.host_pool, self.namespace, self.settings = device_pool, host_pool, namespace, settings
        self._pools = (device_pool, host_pool, *state_pools)
        self._held: dict[object, Node] = {}
        """The locks matches hold, by token: a lock is given back once, by the match that took it."""
        self.geometry, self.page_size = namespace.geometry, namespace.page_size
        self.rates = rates or H200_TABLE
        self.load_backend, self.backup_backend = self._choose_backends()
        self._lock = named_lock("cache", reentrant=True)
        self._closing = self._closed = False
        self._open_at = -1
        self._done = threading.Event()
        self.metrics = CacheMetrics()
        self._engines: dict[str, TransferEngine] = {}
        self._fence_lock = named_lock("cache.fence")
        self._fence_stream: Any = None
        tier_settings = TierSettings(self.geometry, device_pool.pages, host_pool.pages, settings.write_policy,
                                     contiguous_device=self.load_backend in COPY_ENGINE_BACKENDS)
        self.states = StateTier(*state_pools, kv_layers=self.geometry.layers, layer_map=layer_map,
                                max_blocks=settings.max_blocks) if state_pools else None
        self._prefill_rate: float | None = None
        try:
            self._engines[LOAD] = TransferEngine(device_pool, host_pool, backend=self.load_backend,
                                                 max_blocks=settings.max_blocks)
            self._engines[BACKUP] = self._engines[LOAD] if self.backup_backend == self.load_backend else \
                TransferEngine(device_pool, host_pool, backend=self.backup_backend, max_blocks=settings.max_blocks)
            self.load_gbps = self.rates.rate(self.load_backend, "load")
            self.backup_gbps = self.rates.rate(self.backup_backend, "backup")
            if settings.calibrate:
                self._calibrate()
        except BaseException:
            self._close_engines()
            raise
        self._controller = Controller(self._submit_backup, self._complete, self._set_depth,
                                      lambda: device_pool.runtime.set_device(device_pool.device))
        self.tiers = Tiers(tier_settings, index=RadixIndex(self.page_size, namespace.digest), metrics=self.metrics,
                           backup_engine=self._engines[BACKUP], controller=self._controller, markers=self._markers,
                           states=self.states)
        self.storage = storage
        self._storage = StorageTier(storage, host_pool, self.tiers, self.metrics, self._lock, settings,
                                    self._decide_storage) if storage is not None else None
        for pool in self._pools:
            _CLAIMED[pool] = self
        tiers = self.tiers                          # close() gives it a fresh index
        self.metrics.tokens.live("device", lambda: tiers.index.device_tokens)
        self.metrics.tokens.live("host", lambda: tiers.index.host_tokens)
        self.metrics.free_pages.live("device", lambda: tiers.device.free_pages)
        self.metrics.free_pages.live("host", lambda: tiers.host.free_pages)
        self._controller.start()

    @staticmethod
    def _check_state(state: Any, device_pool: DevicePool) -> tuple[Any, ...]:
        if state is None:
            return ()
        if not isinstance(state, tuple) or len(state) != 2 or not isinstance(state[0], StateDevicePool) \
                or not isinstance(state[1], StateHostPool):
            raise InvalidArgument(f"state must be (StateDevicePool, StateHostPool), got {state!r}")
        if state[0].runtime is not device_pool.runtime or state[0].device != device_pool.device:
            raise InvalidArgument(f"the state pools must be on the KV pools' runtime and device "
                                  f"({device_pool.runtime.name}, device {device_pool.device})")
        state[0].check_open()
        state[1].check_open()
        return tuple(state)

    @property
    def index(self) -> RadixIndex:
        return self.tiers.index

    @property
    def device(self) -> PageAllocator:
        """The device pages' allocator (read its counts; take pages with ``allocate``)."""
        return self.tiers.device

    @property
    def host(self) -> PageAllocator:
        return self.tiers.host

    # -- lookups ----------------------------------------------------------------------------------------------------
    def match_prefix(self, tokens: Any, *, lock: bool = False, device_only: bool = False) -> Match:
        """The longest cached prefix (whole pages): ``device_tokens`` on the device, then ``host_tokens`` in host
        memory only. Moves no bytes. ``lock=True`` locks the match in the same step (with other threads evicting,
        a match locked later may already have lost its pages); ``unlock(match)`` when the request is done.
        ``match.pending`` lists load-backs still landing in the device part: wait for them (``wait_for``) before
        reading those pages. ``device_only``: the longest prefix that needs no load-back.

        Hybrid caches: the deepest prefix with its KV *and* a state snapshot at its end (``match.device_state`` or
        ``match.host_state``), shorter than the KV alone when the snapshot there is gone."""
        tokens = token_array(tokens, copy=False)
        with self._lock:
            self._check_open()
            usable: Callable[[Node], bool] | None
            if self.states is not None:
                usable = StateTier.on_device if device_only else StateTier.usable
            else:
                usable = (lambda n: n.device is not None) if device_only else None
            match = self.index.match(tokens, usable=usable)
            if lock:
                self._take_lock(match, match.last_node)
            whole = len(tokens) // self.page_size * self.page_size
            self.metrics.lookup(whole, match.device_tokens, match.host_tokens)
            if self.settings.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
                threshold = self.settings.write_through_threshold
                node = match.last_device_node            # the deepest node hit often enough that lacks a backup
                while node.parent is not None:
                    if node.hits >= threshold and (node.host is None or Tiers.state_unsaved(node)):
                        self._controller.request_backup([node], self._markers(CURRENT))
                        break
                    node = node.parent
            return match

    @staticmethod
    def wait_for(match: Match, stream: Any = None, *, layer: int | None = None) -> None:
        """Make ``stream`` (default: the current one) wait on the GPU for the load-backs a match depends on."""
        for op in match.pending:
            op.stream_wait(stream, layer=layer)

    def prefetch(self, tokens: Any) -> Prefetch:
        """Start reading the prompt's stored pages past its host-resident prefix into host memory, off this thread;
        each verified batch joins the host tier the moment it lands (``match_prefix`` then sees it). Call early (when
        the request arrives) and ``settle()`` it when the request is about to run. Without a storage backend the
        prefetch is finished at once (outcome ``no_storage``)."""
        tokens = token_array(tokens)
        with self._lock:
            self._check_open()
            if self._storage is None:
                prefetch = Prefetch(self.index.whole_pages(tokens), 0, self.page_size, self.settings)
                prefetch.finish("no_storage")
                return prefetch
            return self._storage.prefetch(tokens)

    def request(self, tokens: Any, *, load_back: bool = True, device_only: bool = False, force: bool = False,
                prefetch: bool = True) -> CacheRequest:
        """One request's use of the cache, as a context manager (:class:`~kvtier.cache.request.CacheRequest`):
        entering settles its storage prefetch (started here, when the cache has storage and ``prefetch``), matches
        and locks ``tokens`` and queues the load-back of the host part (``load_back=False``: later, with
        ``request.load_back()``; ``force``: past the recompute estimate); leaving gives back its lock and the pages
        it did not insert. ``device_only``: match only what needs no load-back."""
        with self._lock:
            self._check_open()
        return CacheRequest(self, tokens, load_back=load_back, device_only=device_only, force=force,
                            prefetch=prefetch)

    def lock(self, match: Match) -> None:
        """Pin a match (prefer ``match_prefix(..., lock=True)``: between the two calls another thread may evict)."""
        with self._lock:
            self._check_open()
            if not isinstance(match, Match):
                raise InvalidArgument(f"lock takes a Match from match_prefix, got {type(match).__name__} (a lock is "
                                      f"given back with unlock(match), so only a match can hold one)")
            node = self._own(match)
            if match.locked:
                raise InvalidArgument("this match is already locked")
            self._take_lock(match, node)

    def unlock(self, match: Match) -> None:
        """Give back the lock ``match`` holds, exactly once. A node a failed transfer dropped since has lost its locks
        already: its match's unlock just ends it."""
        with self._lock:
            self._check_open()
            if not isinstance(match, Match):
                raise InvalidArgument(f"unlock takes the Match that holds the lock, got {type(match).__name__} (a "
                                      f"node's lock may be another request's)")
            token = match.lock_token
            if token is None or not match.locked:
                raise InvalidArgument("unlock of a match that is not locked (locked with lock=True or lock(), "
                                      "unlocked once)")
            node = self._held.pop(token, None)
            if node is None:
                if match.last_node.alive and not self.index.owns(match.last_node):
                    raise InvalidArgument(f"{match.last_node} is not in this cache (another cache's match)")
                raise InvalidArgument("unlock of a match whose lock was given back already (a copy of it was "
                                      "unlocked)")
            match.locked, match.lock_token = False, None
            if node.alive:
                self.index.unlock(node)

    def _take_lock(self, match: Match, node: Node) -> None:
        self.index.lock(node)
        token = object()
        self._held[token] = node
        match.locked, match.lock_token = True, token

    def page_keys(self, match: Match | Node) -> list[bytes]:
        """The storage keys of every page of the matched prefix (SHA-256 chain, see :mod:`kvtier.keys`)."""
        with self._lock:
            self._check_open()
            node = self._own(match)
            return [key for n in reversed(list(node.path())) for key in self.index.keys(n)]

    # -- device pages for the caller --------------------------------------------------------------------------------
    def allocate(self, count: int) -> np.ndarray:
        """``count`` device pages for new KV; evicts least recently used pages as needed, then waits for backups
        in flight and evicts again; raises OutOfPages when still short. The caller's current stream is made to wait
        (on the GPU) for writes still queued to pages freed before (duplicates, dropped nodes, ``free``)."""
        count = integer(count, "count", low=0)
        return self._locked(lambda: self._allocate(count))

    def _allocate(self, count: int) -> np.ndarray:
        pages = self.tiers.allocate_device(count)
        if pages is None:
            locked = self.index.device_tokens - self.tiers.evictable_tokens("device")
            raise OutOfPages(f"cannot allocate {count} device pages: {self.device.free_pages} free of "
                             f"{self.device.pages}, nothing more is evictable ({locked} cached tokens are locked "
                             f"or in flight; caller-held pages: {self._caller_pages()})")
        self.tiers.page_state[pages] = CALLER
        self._after_fences()
        return pages

    def _after_fences(self) -> None:
        """On the GPU: the caller's writes to pages (or slots) freed before land after the writes still queued there."""
        stream = self.device_pool.runtime.current_stream(self.device_pool.device)
        for fence in self.tiers.pending_fences():
            stream.wait(fence)

    def free(self, pages: Any, *, after: Any = CURRENT) -> None:
        """Give back device pages from ``allocate`` that were not inserted; whoever gets them next waits for
        ``after`` (default: what is queued on the caller's current stream now, where it may still write them)."""
        pages = index_array(pages, "pages")
        with self._lock:
            self._check_open()
            self._take_caller_pages(pages, "free", FREE)
            self.tiers.fence(self._markers_or_give_back(after, pages))
            self.device.release(pages.copy())

    def allocate_state(self) -> int:
        """A device state slot for a request's recurrent state (hybrid caches); evicts least recently used snapshots
        as needed; raises OutOfPages when none can be had. The caller's current stream waits (on the GPU) for writes
        still queued to slots freed before."""
        return self._locked(self._allocate_state)

    def _allocate_state(self) -> int:
        states = self._need_states("allocate_state")
        slots = self.tiers.allocate_device_states(1)
        if slots is None:
            callers = int(np.count_nonzero(states.slots == CALLER))
            raise OutOfPages(f"no device state slot free of {states.device.pages}: {callers} held by callers, "
                             f"the rest by snapshots that are locked or in flight")
        states.slots[slots] = CALLER
        self._after_fences()
        return int(slots[0])

    def fork_state(self, match: Match | Node, *, stream: Any = None) -> int:
        """A new slot of the caller's (as from :meth:`allocate_state`) holding a copy of the snapshot at the end of
        ``match``, copied on ``stream`` (default: the caller's current stream, so compute queued after it sees the
        copy) after the load-back that brings the snapshot, if one is in flight. A request continues from the copy:
        its state changes every step, and the tree's snapshot must not. The snapshot must be on the device
        (``load_back`` a host one first)."""
        return self._locked(lambda: self._fork_state(match, stream))

    def _fork_state(self, match: Match | Node, stream: Any) -> int:
        states = self._need_states("fork_state")
        node = self._own(match)
        if node.device_state is None:
            where = "on the host only: load_back(match) first" if node.host_state is not None else "gone"
            raise InvalidArgument(f"fork_state: the snapshot at the end of {node} is {where}")
        self.index.lock(node)                        # its snapshot stays while a slot is found for the copy
        try:
            slot = self._allocate_state()
        finally:
            self.index.unlock(node)
        loading = node.loading.state_transfer if node.loading is not None else None
        try:
            copied = states.engine.copy([node.device_state], [slot], stream=stream,
                                        after=[loading.finished] if loading is not None else None)
        except BaseException:
            states.give_back(slot)
            raise
        node.state_written = [*(node.state_written or []), copied.finished]
        self.metrics.states.inc(1, "forked")
        return slot

    def free_state(self, slot: int, *, after: Any = CURRENT) -> None:
        """Give back a slot from ``allocate_state`` that was not inserted; whoever gets it next waits for ``after``."""
        with self._lock:
            self._check_open()
            states = self._need_states("free_state")
            slot = states.check_caller_slot(slot, "free_state")
            self.tiers.fence(self._markers(after))
            states.give_back(slot)

    def _need_states(self, what: str) -> StateTier:
        if self.states is None:
            raise InvalidArgument(f"{what}: this cache has no state tier (build it with state=(device, host) pools)")
        return self.states

    # -- insert -----------------------------------------------------------------------------------------------------
    def insert(self, tokens: Any, device_pages: Any, *, after: Any = CURRENT, state: int | None = None) -> Inserted:
        """Hand the KV of ``tokens`` (one device page per whole page; pages past the last whole page stay the
        caller's) to the cache. Pages for positions the device tier already holds are freed unless they are the
        tree's own. ``after``: what the write-through backup waits for (default: the caller's current stream, where
        the model wrote this KV).

        Hybrid caches: ``state`` is a slot from ``allocate_state`` holding the recurrent state after the last of
        ``tokens`` (whole pages only: a snapshot must sit at a node's end). The cache takes it (freed at once when the
        prefix has a device snapshot already); without it the prefix is cached as KV that no match can end on."""
        tokens = token_array(tokens)
        pages = index_array(device_pages, "device_pages")
        with self._lock:
            self._check_open()
            if state is not None:
                state = self._need_states("insert").check_caller_slot(state, "insert")
                if not len(tokens) or len(tokens) % self.page_size:
                    raise InvalidArgument(f"insert with a state needs whole pages: {len(tokens)} tokens are not a "
                                          f"positive multiple of the page size {self.page_size} (the snapshot would "
                                          f"sit past the end of the cached prefix)")
            whole = self.index.whole_pages(tokens)
            count = len(whole) // self.page_size
            if len(pages) < count:
                raise InvalidArgument(f"{len(tokens)} tokens fill {count} whole pages but only {len(pages)} device "
                                      f"pages were given")
            pages = np.array(pages[:count])
            walked = self.index.walk(whole)
            taken = self._take_insert_pages(walked, pages)
            written = self._markers_or_give_back(after, taken)
            placed = self.index.place(whole, pages, walked)
            for node in placed.revived + ([placed.new_node] if placed.new_node else []):
                node.written = written
            freed = placed.duplicates.copy()             # the caller's to keep (and change)
            if freed.size:
                self.tiers.page_state[freed] = FREE
                self.device.release(freed.copy())
                self.tiers.fence(written)            # the caller may still be writing them
            kept = state is not None and self._adopt_state(placed.last_node, state, written)
            if (placed.new_node is not None or kept) and self.settings.write_policy is WritePolicy.WRITE_THROUGH:
                self._controller.request_backup([placed.last_node], None)
            return Inserted(placed.existing_tokens, len(whole) - placed.existing_tokens, freed, placed.last_node, kept)

    def _adopt_state(self, node: Node, slot: int, written: list[Any] | None) -> bool:
        """The caller's snapshot becomes ``node``'s device snapshot, unless it has one (then the slot is freed, and
        whoever gets it next waits for the caller's writes)."""
        assert self.states is not None
        if node.device_state is not None:
            self.tiers.fence(written)
            self.states.give_back(slot)
            return False
        self.states.put(node, "device", slot)
        node.state_written = written
        return True

    def backup(self, match: Match | Node, *, after: Any = CURRENT) -> None:
        """Ask for a backup of a cached prefix now, whatever the write policy (off the caller's thread)."""
        with self._lock:
            self._check_open()
            self._controller.request_backup([self._own(match)], self._markers(after))

    # -- load-back --------------------------------------------------------------------------------------------------
    def on_device_now(self, match: Match) -> bool:
        """Whether ``match``'s last node is still in the tree with none of its path on the host only (another
        request's load-back or insert brought it since the match) and, on a hybrid cache, its state on the device."""
        node = match.last_node
        with self._lock:
            return node.alive and not self.index.host_chain(node) and (self.states is None
                                                                      or node.device_state is not None)

    def loads_over(self, match: Match) -> list[Operation]:
        """The loads still bringing ``match``'s prefix to the device: those the match listed, and those another
        request started over its path since (their per-layer events are what a reader of the prefix waits on)."""
        loads = {id(op): op for op in match.pending}
        with self._lock:
            for node in match.last_node.path():
                if node.loading is not None and node.device is not None:
                    loads.setdefault(id(node.loading), node.loading)
        return list(loads.values())

    def load_back(self, match: Match, *, after: Any = CURRENT, force: bool = False) -> LoadBack | None:
        """Load the host-only part of ``match`` into new device pages, all or nothing, with one event per layer.

        Returns None (and counts why) when there is nothing to load, when it is shorter than
        ``load_back_min_tokens``, when its estimated time is not below the recompute estimate (unless ``force``),
        or when no device pages can be had. The load is queued on this thread (so it is ordered after ``after``,
        default the caller's current stream, and its events exist when this returns); the controller completes it.

        Hybrid caches: a host-only snapshot at the match's end comes along into a new device slot
        (``load.device_state``), in the same operation; without room for both nothing moves
        (``no_device_pages`` / ``no_device_state``). Declined, the caller recomputes from
        ``match_prefix(tokens, device_only=True)``: so the estimate counts every token past the last device snapshot.
        """
        if not isinstance(match, Match):
            raise InvalidArgument(f"load_back takes a Match, got {type(match).__name__}")
        return self._locked(lambda: self._load_back(match, after, force))

    def _load_back(self, match: Match, after: Any, force: bool) -> LoadBack | None:
        node = match.last_node
        if not self.index.grew(node):
            raise InvalidArgument(f"{node} is not in this cache (another cache's match)")
        if not node.alive:
            self.metrics.decisions.inc(1, "stale_match")
            return None
        self._own(match)
        order = self._markers(after)
        chain = self.index.host_chain(node)
        if self.states is not None and node.parent is not None and not StateTier.usable(node):
            self.metrics.decisions.inc(1, "no_state")       # its snapshot was evicted since the match
            return None
        with_state = self.states is not None and node.device_state is None and node.host_state is not None
        if not chain and not with_state:
            return None
        tokens = sum(len(n.tokens) for n in chain)
        nbytes = tokens // self.page_size * self.geometry.bytes_per_page + \
            (self.states.slot_bytes if with_state and self.states is not None else 0)
        decision = self.decide(self._recompute_tokens(node, tokens), force=force, nbytes=nbytes)
        if decision != "load":
            self.metrics.decisions.inc(1, decision)
            return None
        room = self._load_room(node, tokens // self.page_size, with_state)
        if room is None:
            return None
        pages, slots = room
        op = LoadBack(list(chain), pages.copy(), np.concatenate([n.host for n in chain]) if chain else pages[:0],
                      nbytes, tokens, self.states.layer_map if self.states is not None else None)
        self._queue_load(op, node, pages, slots, (order or []) + self.tiers.pending_fences())
        op.prefix_pages = np.concatenate([n.device for n in reversed(list(node.path()))])
        self.metrics.decisions.inc(1, "load")
        self._controller.track(op)
        return op

    def _recompute_tokens(self, node: Node, loaded: int) -> int:
        """What declining a load-back costs: the loaded tokens, or on a hybrid cache every token past the deepest
        device snapshot above ``node`` (without a state the model cannot start in between)."""
        if self.states is None:
            return loaded
        tokens = 0
        for n in node.path():
            if n.device_state is not None:
                break
            tokens += len(n.tokens)
        return tokens

    def _load_room(self, node: Node, count: int, with_state: bool) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Device pages (and a device state slot) for a load-back: both or neither (counted why)."""
        self.index.lock(node)
        try:
            pages = self.tiers.allocate_device(count)
            if pages is None:
                self.metrics.decisions.inc(1, "no_device_pages")
                return None
            try:
                slots = self.tiers.allocate_device_states(1) if with_state else None
            except MustWait:
                self.device.release(pages)
                raise
            if with_state and slots is None:
                self.device.release(pages)
                self.metrics.decisions.inc(1, "no_device_state")
                return None
            return pages, slots
        finally:
            self.index.unlock(node)

    def _queue_load(self, op: LoadBack, node: Node, pages: np.ndarray, slots: np.ndarray | None,
                    order: list[Any]) -> None:
        """Queue the copies of a load-back and give the nodes their device ``pages`` (the tree's own array, not the
        one the caller gets in ``op``) and ``node`` its snapshot; a copy that cannot be queued gives everything back
        once the part already queued has finished."""
        try:
            if len(pages):
                op.transfer = self._engines[LOAD].load(op.host_pages, pages, after=order or None)
            if slots is not None:
                assert self.states is not None and node.host_state is not None
                op.state_device, op.state_host = slots, np.array([node.host_state], dtype=np.int64)
                op.state_transfer = self.states.engine.load(op.state_host, slots.copy(), after=order or None)
        except BaseException as exc:
            self.tiers.page_state[pages] = HELD

            def give_back() -> None:
                self.tiers.page_state[pages] = FREE
                self.device.release(pages)
                if slots is not None and self.states is not None:
                    self.states.give_back(int(slots[0]))
            self.tiers.abandon(op, give_back, exc)
            raise
        chain = [n for n in op.nodes if n.device is None]
        self.tiers.assign(chain, "device", pages, op)
        self.tiers.page_state[pages] = TREE
        if slots is not None and self.states is not None:
            self.states.put(node, "device", int(slots[0]))
            if node.loading is not op:
                node.loading = op
                op.nodes.append(node)
        op.device_state = node.device_state

    def decide(self, tokens: int, *, force: bool = False, nbytes: int | None = None) -> str:
        """``"load"``, or why loading ``tokens`` from host memory is declined (``nbytes``: what the load moves, when
        that is not ``tokens`` of KV — a hybrid load-back saves more tokens than it moves)."""
        self._check_open()
        if tokens < self.settings.load_back_min_tokens:
            return "too_short"
        rate = self.settings.prefill_tokens_per_s or self._prefill_rate
        if force or not rate or not self.load_gbps or not math.isfinite(self.load_gbps):
            return "load"
        if nbytes is None:
            nbytes = tokens // self.page_size * self.geometry.bytes_per_page
        load_s = nbytes / (self.load_gbps * 1e9)
        return "load" if load_s < tokens / rate else "slower_than_recompute"

    def _decide_storage(self, tokens: int, extra_bytes: int = 0) -> str:
        """Whether reading ``tokens`` from storage (and then loading them to the device) beats recomputing them:
        bytes / the storage read rate (measured once 64 MiB were read, else ``storage_gbps``) plus the load.
        ``extra_bytes``: what else the read moves (a hybrid prefix's state snapshot)."""
        assert self.storage is not None
        gbps = storage_read_gbps(self.storage.stats(), self.settings.storage_gbps)
        nbytes = tokens // self.page_size * self.geometry.bytes_per_page + extra_bytes
        rate = self.settings.prefill_tokens_per_s or self._prefill_rate
        return "load" if read_beats_recompute(tokens, nbytes, rate, gbps, self.load_gbps) else "slower_than_recompute"

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """Report a prefill the caller ran, so the cache learns the recompute rate (a moving average)."""
        rate = positive_number(tokens, "record_prefill tokens") / positive_number(seconds, "record_prefill seconds")
        if not math.isfinite(rate) or rate <= 0:
            raise InvalidArgument(f"record_prefill: {tokens!r} tokens in {seconds!r} s is no usable rate ({rate!r} "
                                  f"tokens/s)")
        with self._lock:
            self._check_open()
            self._prefill_rate = rate if self._prefill_rate is None else 0.8 * self._prefill_rate + 0.2 * rate

    # -- eviction -----------------------------------------------------------------------------------------------
    def evict(self, *, device_pages: int = 0, host_pages: int = 0) -> tuple[int, int]:
        """Evict at least this many pages per tier where possible; returns the pages freed per tier."""
        device_pages = integer(device_pages, "device_pages", low=0)
        host_pages = integer(host_pages, "host_pages", low=0)
        freed = [0]                                  # device pages freed by earlier attempts (see _locked)

        def attempt() -> tuple[int, int]:
            try:
                freed[0] += self.tiers.evict_device(device_pages - freed[0])
            except MustWait as must:
                freed[0] += must.freed
                raise
            result = freed[0], self.tiers.evict_host(host_pages)
            return result

        return self._locked(attempt)

    def evict_states(self, *, device: int = 0, host: int = 0) -> tuple[int, int]:
        """Evict this many state snapshots per tier where possible (their nodes keep the KV); returns how many went.
        Under write_back a device snapshot is backed up first, with its KV."""
        device = integer(device, "device", low=0)
        host = integer(host, "host", low=0)
        self._need_states("evict_states")
        return self._locked(lambda: self._evict_states(device, host))

    def _evict_states(self, device: int, host: int) -> tuple[int, int]:
        freed = self.tiers.evict_device_states(device), self.tiers.evict_states("host", host)
        return freed

    # -- lifetime ---------------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait until every backup asked for so far is submitted and every transfer has completed (the controller
        completes them; this thread waits)."""
        self._check_open()
        self._controller.drain()
        if self._storage is not None:
            self._storage.drain()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def closing(self) -> bool:
        """Closed, or ``close`` has begun (every call but ``close``/``stats``/``check`` is refused from then on)."""
        return self._closing

    def close(self, *, cancel: bool = True) -> None:
        """Stop the controller (backups not yet started are dropped when ``cancel``), wait for transfers in flight,
        return every page of both tiers and check that none leaked; the pools stay open (they are the caller's).
        Idempotent."""
        with self._lock:
            first = not self._closing
            self._closing = True
        if not first:
            self._done.wait()                        # another thread is closing: return when it has
            return
        try:
            if self._storage is not None:
                self._storage.stop_prefetches()
            dropped = self._controller.close(cancel=cancel)
            if dropped:
                self.metrics.skipped.inc(dropped, "cancelled_at_close")
            if self._storage is not None:
                self._storage.close(cancel=cancel)
            with self._lock:
                self.returned_caller_pages = self.tiers.release_everything()
                self._held.clear()
                self.returned_caller_states = self.tiers.held_states
                for pool in self._pools:
                    if _CLAIMED.get(pool) is self:
                        del _CLAIMED[pool]
        finally:
            self._closed = True
            try:
                self._close_engines()
            finally:
                self._done.set()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """Metrics snapshot plus the state of both tiers."""
        with self._lock:
            snapshot = self.metrics.snapshot()
            snapshot.update({"device_tokens": self.index.device_tokens, "host_tokens": self.index.host_tokens,
                             "nodes": self.index.nodes, "device_free_pages": self.device.free_pages,
                             "host_free_pages": self.host.free_pages, "load_backend": self.load_backend,
                             "backup_backend": self.backup_backend, "load_gbps_estimate": self.load_gbps,
                             "prefill_tokens_per_s": self.settings.prefill_tokens_per_s or self._prefill_rate})
            if self.states is not None:
                snapshot.update({"device_states": len(self.states.held["device"]),
                                 "host_states": len(self.states.held["host"]),
                                 "device_free_states": self.states.device.free_pages,
                                 "host_free_states": self.states.host.free_pages})
        if self.storage is not None:
            snapshot.update({f"storage.{k}": v for k, v in self.storage.stats().items()})
        return snapshot

    def check(self) -> None:
        """Verify the index invariants and the page accounting of both tiers (raises IndexCorrupted)."""
        with self._lock:
            self.index.check()
            self.tiers.check()

    # -- internals: backups -----------------------------------------------------------------------------------------
    def _markers(self, after: Any) -> list[Any] | None:
        """``after`` as events recorded now, on the caller's thread: what a transfer queued later must wait for. The
        caller's own events are snapshotted into one of the cache's (it keeps them as fences after the call returns,
        and the caller may close or re-record theirs)."""
        runtime, device = self.device_pool.runtime, self.device_pool.device
        if after is None or isinstance(after, str):   # "current", every default insert: no caller event to snapshot
            return after_events(runtime, device, after)
        with self._fence_lock:
            if self._fence_stream is None:
                self._fence_stream = runtime.create_stream(device)
            return after_events(runtime, device, after, snapshot=self._fence_stream)

    def _submit_backup(self, targets: list[Node], after: Any) -> Operation | None:
        with self._lock:
            try:
                op = self.tiers.start_backup(targets, after)
            except KvtierError:
                self.metrics.errors.inc(1, BACKUP)
                return None
            return op

    # -- internals: completion, checks, gauges, teardown --------------------------------------------------------
    def _complete(self, op: Operation) -> None:
        with self._lock:
            self._hand_on(self.tiers.complete(op))

    def _hand_on(self, completed: Completed) -> None:
        """Under the lock: a finished backup's nodes go on to storage (``storage_write``), and under write_through
        the snapshots it left on the device only get a backup of their own."""
        if completed.backed_up and self._storage is not None and self.settings.storage_write:
            self._storage.write_through(completed.backed_up)
        if completed.state_left and self.states is not None and \
                self.settings.write_policy is WritePolicy.WRITE_THROUGH:
            self._controller.request_backup(completed.state_left, None)

    def _locked(self, attempt: Callable[[], _T]) -> _T:
        """``attempt()`` under the cache's lock, on an open cache. An attempt that can go on only once some transfers
        have finished (:class:`MustWait`: backups of write_back victims, or what is in flight when nothing is
        evictable) runs again after this thread waited for them with the lock released, so no ``match_prefix`` of
        another thread ever waits behind a copy. Attempts change nothing before they raise MustWait but the backups
        they start."""
        with self._lock:
            try:
                while True:
                    self._check_open()
                    try:
                        return attempt()
                    except MustWait as must:
                        ops = must.ops
                    self._lock.release()
                    try:
                        for op in ops:
                            try:
                                op.wait()
                            except Exception as exc:  # noqa: BLE001 - completed as failed below
                                op.error = op.error or exc
                    finally:
                        self._lock.acquire()
                    for op in ops:
                        self._hand_on(self.tiers.waited(op))
            finally:
                self.tiers.unsaved_ok.clear()

    def _check_open(self) -> None:
        """Every call that could hand out or read a page checks both pools too: a cache over a pool its caller
        closed would otherwise keep handing out page numbers in freed memory. The pools are asked only when
        something in the process closed since they last answered (``kvtier.closings``)."""
        if self._closing:
            raise BufferClosed("this KVCache is closed")
        seen = closings.count()
        if seen == self._open_at:
            return
        for i, pool in enumerate(self._pools):
            if pool.closed:
                what = ("device", "host", "device state", "host state")[i]
                raise BufferClosed(f"the cache's {what} pool {pool!r} was closed: close the cache before its pools")
        self._open_at = seen

    def _own(self, match: Match | Node) -> Node:
        """The node of ``match``, checked to be a live node of this cache's tree."""
        node = match.last_node if isinstance(match, Match) else match
        if not isinstance(node, Node):
            raise InvalidArgument(f"expected a Match or a Node, got {type(match).__name__}")
        if not self.index.owns(node):
            raise InvalidArgument(f"{node} is not in this cache (another cache's match, or evicted since)")
        return node

    def _caller_pages(self) -> int:
        return int(np.count_nonzero(self.tiers.page_state == CALLER))

    def _take_caller_pages(self, pages: np.ndarray, what: str, to: int) -> None:
        """Every page must be the caller's (from ``allocate``, in range, named once): each then moves to state
        ``to``. A bad page raises, naming it, with nothing changed."""
        if not pages.size or take_pages(pages, self.tiers.page_state, CALLER, to):
            return
        if int(pages.min()) < 0 or int(pages.max()) >= self.device.pages:
            bad = pages[(pages < 0) | (pages >= self.device.pages)]
            raise InvalidArgument(f"{what}: device page {int(bad[0])} is out of range (0..{self.device.pages - 1})")
        if not distinct(pages):
            raise InvalidArgument(f"{what}: a device page is named twice")
        state = self.tiers.page_state[pages]
        if not (state == CALLER).all():
            first = int(pages[state != CALLER][0])
            whose = "the cache's own" if self.tiers.page_state[first] == TREE else "not allocated"
            raise InvalidArgument(f"{what}: device page {first} is {whose}, not a page from allocate()")
        self.tiers.page_state[pages] = to

    def _take_insert_pages(self, walked: tuple[list[Node], int], pages: np.ndarray) -> np.ndarray:
        """Pages where the tree has device pages may be the tree's own; every other page must be the caller's, and
        becomes the tree's (a duplicate of the tree's own is freed once placed). Returns the pages taken."""
        if walked[0]:
            tree = self.index.device_pages_along(walked)
            covered = pages[: len(tree)]
            own = (covered == tree) & (tree >= 0)    # -1: a host-only node's position, never the tree's own
            pages = pages[len(tree):] if own.all() else np.concatenate([covered[~own], pages[len(tree):]])
        self._take_caller_pages(pages, "insert", TREE)
        return pages

    def _markers_or_give_back(self, after: Any, taken: np.ndarray) -> list[Any] | None:
        """``_markers(after)`` for a call that took the caller's ``taken`` pages: a bad ``after`` gives them back, so
        the refused call changed nothing."""
        try:
            return self._markers(after)
        except BaseException:
            self.tiers.page_state[taken] = CALLER
            raise

    def _set_depth(self, queue: str, depth: int) -> None:
        self.metrics.queue.set(depth, queue)

    def _close_engines(self) -> None:
        try:
            for engine in {id(e): e for e in self._engines.values()}.values():
                engine.close()
        finally:
            if self.states is not None:
                self.states.close()
            with self._fence_lock:
                if self._fence_stream is not None:
                    self._fence_stream.close()

    def _choose_backends(self) -> tuple[str, str]:
        s = self.settings
        if s.io_backend == AUTO:
            best = self.rates.best_pair()
            default_load, default_backup = best.load, best.backup
        else:
            default_load = default_backup = s.io_backend
        return s.load_backend or default_load, s.backup_backend or default_backup

    def _calibrate(self) -> None:
        """Measure the chosen backends on these pools (their first pages; nothing is cached yet)."""
        count = max(1, min(64, self.device_pool.pages, self.host_pool.pages))
        pages = np.arange(count)
        nbytes = count * self.geometry.bytes_per_page
        for kind in (LOAD, BACKUP):
            engine = self._engines[kind]
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                transfer = engine.load(pages, pages, per_layer=False, after=None) if kind == LOAD else \
                    engine.backup(pages, pages, after=None)
                transfer.wait()
                best = min(best, time.perf_counter() - start)
            rate = nbytes / best / 1e9
            if kind == LOAD:
                self.load_gbps = rate
            else:
                self.backup_gbps = rate

    def __repr__(self) -> str:
        return (f"KVCache({self.namespace.model}, {self.index.device_tokens} device / {self.index.host_tokens} host "
                f"tokens, {WritePolicy(self.settings.write_policy).value}, load={self.load_backend}, "
                f"backup={self.backup_backend})")

