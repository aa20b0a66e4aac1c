"""The storage tier of the cache: prefetches of storage-hit chains into host pages, and write-through of backed-up
host pages to storage, both off the caller's thread.

**Prefetch.** ``KVCache.prefetch(tokens)`` finds where the prompt's host-resident prefix ends, pins it, and hands
the rest to a worker: ``exists`` gives the stored run, the worker decides whether reading it beats recomputing it,
then reads it in batches into newly allocated host pages. Each batch is committed into the index the moment it is
verified (a finished prefetch is usable at once: ``match_prefix`` sees it as a host hit, ``load_back`` moves it to
the device). The chain stops at the first page that fails verification or vanished since ``exists``: nothing after
a gap is committed. Pages the tree got meanwhile from the device side are kept and ours are freed.

**Write-through.** When a backup completes, its nodes' host pages are queued for storage (at most
``storage_queue_pages``; more are skipped and counted, never blocking a caller). While storage reads a node's host
pages they are not evicted from the host (its device pages may be).

**Hybrid caches** (:mod:`kvtier.cache.state_storage`). A write stores each node's host state snapshot with the KV pages
of that node. A prefetch reads KV only up to the deepest page of the stored chain whose snapshot the store holds
(pages past it are counted ``no_state``, and a chain with none is not read), then that snapshot into a host state
slot; one that fails verification or vanished falls back to the next shallower stored one (``truncated``). The
prefix's node gets the snapshot as its host state, so a match ends there and a load-back brings KV and state to the
device together; KV read without a verified snapshot at its end is never served (a match never ends on it).

Every storage error is the backend's to absorb (misses and counts, see :mod:`kvtier.storage.backend`); anything
else that goes wrong in a worker ends that prefetch or write as an ``error``, counted. Nothing here raises into the
caller's serving loop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvtier.cache.index import Node
from kvtier.cache.metrics import CacheMetrics
from kvtier.cache.settings import CacheSettings, PrefetchPolicy
from kvtier.cache.state_storage import StoredStates
from kvtier.errors import InvalidArgument
from kvtier.keys import chain_keys
from kvtier.locks import named_condition
from kvtier.storage.views import HostPages

if TYPE_CHECKING:
    from kvtier.cache.state_tier import StateTier
    from kvtier.cache.tiers import Tiers
    from kvtier.pools import HostPool
    from kvtier.storage import StorageBackend


class Prefetch:
    """A storage read of a prompt's pages past its host-resident prefix. ``outcome`` says how it ended:
    ``complete``, ``cached`` (nothing to read), ``miss`` (storage has none), ``truncated`` (stopped at a page that
    failed verification or vanished; hybrid caches: or its state snapshot did), ``cancelled``, ``host_full``,
    ``slower_than_recompute``, ``evicted`` (its prefix left the host), ``no_state`` (hybrid caches: storage holds KV
    pages but no state snapshot for any of them), ``closed`` or ``error``."""

    def __init__(self, tokens: np.ndarray, start_page: int, page_size: int, settings: CacheSettings) -> None:
        self.tokens, self.start_page, self.page_size, self.settings = tokens, start_page, page_size, settings
        self.stored_pages = 0
        self.committed_pages = 0
        self.outcome: str | None = None
        self.created = time.monotonic()
        self.finished_at: float | None = None
        self.anchor: Node | None = None
        self.parent_key = b""
        self._done = threading.Event()
        self._cancelled = False

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def committed_tokens(self) -> int:
        """Tokens read from storage and in the cache's host tier now (hybrid caches: with the state snapshot at their
        end, so a match can end there)."""
        return self.committed_pages * self.page_size

    @property
    def requested_tokens(self) -> int:
        return len(self.tokens) - self.start_page * self.page_size

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the prefetch has ended (True) or ``timeout`` seconds passed (False)."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Stop after the batch being read (what has been committed stays)."""
        self._cancelled = True

    def settle(self, policy: PrefetchPolicy | str | None = None) -> int:
        """What a request about to run does with this prefetch (default: the cache's ``prefetch_policy``):
        ``best_effort`` stops it now, ``wait_complete`` waits for it, ``timeout`` waits up to the policy's time
        (counted from when the prefetch started) and then stops it. Returns the tokens committed."""
        policy = PrefetchPolicy(policy or self.settings.prefetch_policy)
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            self.wait()
        elif policy is PrefetchPolicy.TIMEOUT:
            deadline = self.created + self.settings.prefetch_timeout(self.requested_tokens)
            self.wait(max(0.0, deadline - time.monotonic()))
        if not self.done:
            self.cancel()
        return self.committed_tokens

    def finish(self, outcome: str) -> None:
        """Settle with ``outcome`` (the first one given stays): the storage tier and the cache end a prefetch."""
        if self.outcome is None:
            self.outcome = outcome
        self.finished_at = time.monotonic()
        self._done.set()

    def __repr__(self) -> str:
        state = self.outcome or ("cancelling" if self._cancelled else "running")
        return (f"Prefetch({self.committed_tokens}/{self.requested_tokens} tokens from page {self.start_page}, "
                f"{state})")


class StoreJob:
    """Host pages of some nodes being written to storage, and (hybrid caches) the host state snapshots of
    ``state_nodes`` in ``state_slots``, each stored after its node's last page key (``state_keys``). ``nodes`` grows
    when one of them is split; ``orphans`` / ``state_orphans`` hold host pages / state slots the tree dropped while
    the write still reads them (freed when it is done)."""

    def __init__(self, nodes: list[Node], host: np.ndarray, keys: list[bytes], state_nodes: list[Node] | None = None,
                 state_keys: list[bytes] | None = None) -> None:
        self.nodes, self.host, self.keys = nodes, host, keys
        self.state_nodes = state_nodes or []
        self.state_slots = np.array([n.host_state for n in self.state_nodes], dtype=np.int64)
        self.state_keys = state_keys or []
        self.orphans: list[np.ndarray] = []
        self.state_orphans: list[int] = []

    @property
    def size(self) -> int:
        """What it takes of the write queue: its pages, a snapshot counting as one."""
        return len(self.keys) + len(self.state_keys)


class StorageTier:
    def __init__(self, backend: StorageBackend, host_pool: HostPool, tiers: Tiers, metrics: CacheMetrics,
                 lock: Any, settings: CacheSettings, decide: Callable[[int, int], str]) -> None:
        """``lock`` is the cache's lock (index and allocators); ``decide(tokens, extra_bytes)`` says whether reading
        that many tokens (and ``extra_bytes`` of state) from storage beats recomputing them. A hybrid cache's tiers
        (``tiers.states``) store their snapshots too."""
        if backend.namespace.digest != tiers.index.root_key:
            raise InvalidArgument(f"{backend!r} stores another namespace than the cache's")
        if backend.page_bytes != host_pool.geometry.bytes_per_page:
            raise InvalidArgument(f"{backend!r} stores pages of {backend.page_bytes} bytes; the host pool's are "
                                  f"{host_pool.geometry.bytes_per_page}")
        self.backend, self.tiers, self.metrics, self.lock, self.settings = backend, tiers, metrics, lock, settings
        self.decide = decide
        self.page_size = tiers.page_size
        self.host = HostPages(host_pool, backend)
        self.states: StateTier | None = tiers.states
        self.stored_states = StoredStates(backend, tiers.states.host_pool) if tiers.states is not None else None
        self._cond = named_condition("cache.storage_tier")
        self._jobs: deque[StoreJob] = deque()
        self._queued_pages = 0
        self._writing = False
        self._prefetch_stopped = False
        self._writes_closed = False
        self._cancel_writes = True
        self._active: set[Prefetch] = set()
        self._workers = ThreadPoolExecutor(max_workers=settings.storage_threads, thread_name_prefix="kvtier-prefetch")
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-storage-writes", daemon=True)
        self._writer.start()

    # -- prefetch ------------------------------------------------------------------------------------------------------
    def prefetch(self, tokens: np.ndarray) -> Prefetch:
        """Start reading the stored pages of ``tokens`` past its host-resident prefix (under the cache's lock)."""
        index, page = self.tiers.index, self.page_size
        whole = index.whole_pages(tokens)
        path = index.split_path(whole)
        on_host = 0
        while on_host < len(path) and path[on_host].host is not None:
            on_host += 1
        anchor = path[on_host - 1] if on_host else index.root
        start = sum(len(n.tokens) for n in path[:on_host]) // page
        prefetch = Prefetch(whole, start, page, self.settings)
        if start * page >= len(whole):
            prefetch.finish("cached")
            return prefetch
        with self._cond:
            if self._prefetch_stopped:
                prefetch.finish("closed")
                return prefetch
            self._active.add(prefetch)
        keys = index.keys(anchor)
        prefetch.parent_key = keys[-1] if keys else index.root_key
        index.lock(anchor)
        prefetch.anchor = anchor
        self.metrics.queue.set(len(self._active), "prefetches")
        try:
            self._workers.submit(self._run, prefetch)
        except RuntimeError:                     # the pool shut down between the check and here
            index.unlock(anchor)
            with self._cond:
                self._active.discard(prefetch)
            prefetch.finish("closed")
        return prefetch

    def _run(self, prefetch: Prefetch) -> None:
        outcome = "error"
        try:
            outcome = self._fetch(prefetch)
        except Exception:  # noqa: BLE001 - never into the serving loop: counted as an error outcome
            outcome = "error"
        finally:
            with self.lock:
                anchor = prefetch.anchor
                if anchor is not None and anchor.alive and anchor.lock > 0:
                    self.tiers.index.unlock(anchor)
                prefetch.anchor = None
            with self._cond:
                self._active.discard(prefetch)
                self._cond.notify_all()
            self.metrics.queue.set(len(self._active), "prefetches")
            self.metrics.prefetches.inc(1, outcome)
            unread = prefetch.stored_pages - prefetch.committed_pages
            if unread > 0:
                self.metrics.prefetch_skipped.inc(unread, outcome)
            prefetch.finish(outcome)

    def _fetch(self, prefetch: Prefetch) -> str:
        page = self.page_size
        keys = chain_keys(prefetch.parent_key, prefetch.tokens[prefetch.start_page * page:], page)
        stored = self.backend.exists(keys) if not self._stop_requested(prefetch) else 0
        ends: list[int] = []
        if stored and self.stored_states is not None:
            ends = self.stored_states.stored_ends(keys[:stored])
            servable = ends[-1] if ends else 0
            if stored > servable:
                self.metrics.prefetch_skipped.inc(stored - servable, "no_state")
            if not servable:
                return "no_state"
            stored = servable
        prefetch.stored_pages = stored
        if stored == 0:
            return "cancelled" if self._stop_requested(prefetch) else "miss"
        decision = self.decide(stored * page, self.stored_states.slot_bytes if self.stored_states else 0)
        if decision != "load":
            return decision
        outcome, read = self._read_pages(prefetch, keys, stored)
        if self.stored_states is None or outcome in ("evicted", "cancelled", "closed"):
            return outcome
        return self._read_state(prefetch, keys, [end for end in ends if end <= read], outcome)

    def _read_pages(self, prefetch: Prefetch, keys: list[bytes], stored: int) -> tuple[str, int]:
        """Read and commit the first ``stored`` pages of ``keys`` batch by batch; how it ended and how many pages
        were committed. (A hybrid cache's pages count as committed for the caller only with their snapshot.)"""
        position = 0
        while position < stored:
            if self._stop_requested(prefetch):
                return ("closed" if self._prefetch_stopped else "cancelled"), position
            with self.lock:
                host = self.tiers.allocate_host(min(self.settings.storage_batch_pages, stored - position),
                                                partial=True)
                if host is None:
                    return "host_full", position
                count = len(host)
                self.tiers.held_host += count
            read = 0
            try:
                with self.host.batch(host) as io:
                    read = self.backend.get(keys[position:position + count], io.pages)
            finally:
                with self.lock:
                    self.tiers.held_host -= count
                    kept = self._commit(prefetch, position, host[:read], keys[position:position + read])
                    unused = host[read:] if kept else host
                    if unused.size:
                        self.tiers.host.free(unused)
            if read and not kept:
                return "evicted", position
            position += read
            if self.stored_states is None:
                prefetch.committed_pages = position
            self.metrics.storage_pages.inc(read, "read")
            self.metrics.storage_bytes.inc(read * self.backend.page_bytes, "read")
            if read < count:
                return "truncated", position
        return "complete", position

    def _read_state(self, prefetch: Prefetch, keys: list[bytes], ends: list[int], outcome: str) -> str:
        """Hybrid caches: give the deepest committed prefix with a stored snapshot (``ends``: page counts, ascending)
        its snapshot, read into a host state slot; a snapshot that fails verification or vanished falls back to the
        next shallower one. The prefetch commits the pages up to the snapshot it placed (none without one)."""
        assert self.stored_states is not None and self.states is not None
        for end in reversed(ends):
            if self._stop_requested(prefetch):
                return "closed" if self._prefetch_stopped else "cancelled"
            with self.lock:
                slot = self.tiers.hold_host_state()
            if slot is None:
                return "host_full"
            verified = placed = False
            try:
                verified = self.stored_states.read(keys[end - 1], slot)
            finally:
                with self.lock:
                    placed = verified and self._commit_state(prefetch, end, slot)
                    if not placed:
                        self.states.release_outside([slot])
            if verified and not placed:
                return "evicted"
            if placed:
                prefetch.committed_pages = end
                self.metrics.states.inc(1, "prefetched")
                self.metrics.storage_bytes.inc(self.stored_states.slot_bytes, "read")
                return outcome if end == prefetch.stored_pages else "truncated"
        return "truncated" if outcome == "complete" else outcome

    def _commit_state(self, prefetch: Prefetch, end: int, slot: int) -> bool:
        """Under the lock: the node ending ``end`` pages past the prefetch's start takes the snapshot read into host
        ``slot`` (one that has a host snapshot already keeps it; ours goes back). False when that prefix is no longer
        whole on the host."""
        assert self.states is not None
        tokens = prefetch.tokens[:(prefetch.start_page + end) * self.page_size]
        path = self.tiers.index.split_path(tokens)
        if sum(len(n.tokens) for n in path) != len(tokens) or path[-1].host is None:
            return False
        node = path[-1]
        node.state_stored = True
        if node.host_state is None:
            self.states.adopt_outside(node, slot)
        else:
            self.states.release_outside([slot])
        return True

    def _stop_requested(self, prefetch: Prefetch) -> bool:
        return prefetch.cancelled or self._prefetch_stopped

    def _commit(self, prefetch: Prefetch, first: int, host: np.ndarray, keys: list[bytes]) -> bool:
        """Put verified pages ``first``.. (counted from the prefetch's start) into the host tier, under the lock.
        Positions the host tier already holds keep the tree's pages (ours are freed by marking them unused).
        Returns False, committing nothing, when the prefix before them is no longer on the host."""
        if not host.size:
            return True
        index, page = self.tiers.index, self.page_size
        start = prefetch.start_page + first
        end = start + len(host)
        path = index.split_path(prefetch.tokens[:end * page])
        used = np.zeros(len(host), dtype=bool)
        position = 0
        plan: list[tuple[Node, slice]] = []
        for node in path:
            a, b = position, position + len(node.tokens) // page
            position = b
            if node.host is not None:
                continue
            if a < start:
                return False                     # a gap before our pages: nothing after it may be committed
            plan.append((node, slice(a - start, b - start)))
        if position < start:
            return False
        for node, span in plan:
            index.set_host(node, host[span].copy())
            node.stored = True
            used[span] = True
        deepest = path[-1] if path else index.root
        if position < end:
            node = index.add_host_node(deepest, prefetch.tokens[position * page:end * page],
                                       host[position - start:].copy(), keys=keys[position - start:])
            node.stored = True
            used[position - start:] = True
            deepest = node
        if not used.all():
            self.tiers.host.free(host[~used])
        index.lock(deepest)
        if prefetch.anchor is not None and prefetch.anchor.alive and prefetch.anchor.lock > 0:
            index.unlock(prefetch.anchor)
        prefetch.anchor = deepest
        self.metrics.hit_tokens.inc(int(used.sum()) * page, "storage")
        return True

    # -- write-through -------------------------------------------------------------------------------------------------
    def write_through(self, nodes: list[Node]) -> None:
        """Queue the host pages of freshly backed-up nodes, and their host state snapshots, for storage (under the
        cache's lock; never blocks)."""
        idle = [n for n in nodes if n.alive and n.storing is None]
        todo = [n for n in idle if n.host is not None and not n.stored]
        stated = [n for n in idle if n.host_state is not None and not n.state_stored] if self.states else []
        if not todo and not stated:
            return
        size = sum(len(n.host) for n in todo if n.host is not None) + len(stated)
        with self._cond:
            if self._writes_closed:
                self.metrics.storage_skipped.inc(size, "cancelled_at_close")
                return
            if self._queued_pages + size > self.settings.storage_queue_pages:
                self.metrics.storage_skipped.inc(size, "queue_full")
                return
            index = self.tiers.index
            job = StoreJob(list({id(n): n for n in todo + stated}.values()),
                           np.concatenate([n.host for n in todo if n.host is not None]) if todo else
                           np.zeros(0, dtype=np.int64),
                           [key for n in todo for key in index.keys(n)], stated, [index.keys(n)[-1] for n in stated])
            for node in job.nodes:
                node.storing = job
            self._jobs.append(job)
            self._queued_pages += size
            self.metrics.queue.set(self._queued_pages, "storage_write_pages")
            self._cond.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._writes_closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._writing = True
            stored = stored_states = 0
            try:
                if job.keys:
                    with self.host.batch(job.host) as io:
                        stored = self.backend.set(job.keys, io.pages)
                if job.state_keys and self.stored_states is not None:
                    stored_states = self.stored_states.write(job.state_keys, job.state_slots)
            except Exception:  # noqa: BLE001, S110 - counted once, as store_failed; they simply are not in storage
                pass
            self._finish_job(job, stored, stored_states)

    def _finish_job(self, job: StoreJob, stored: int, stored_states: int = 0,
                    reason: str | None = "store_failed") -> None:
        with self.lock:
            written = set(job.keys[:stored])
            for node in job.nodes:
                if node.storing is job:
                    node.storing = None
                if node.alive and job.keys and written.issuperset(self.tiers.index.keys(node)):
                    node.stored = True
            for node in job.state_nodes[:stored_states]:
                node.state_stored = True
            if job.orphans:
                orphans = np.concatenate(job.orphans)
                self.tiers.host.free(orphans)
                self.tiers.held_host -= len(orphans)
            if job.state_orphans and self.states is not None:
                self.states.release_outside(job.state_orphans)
            arrived = [n for n in job.nodes if n.alive and n.storing is None and n.host_state is not None
                       and not n.state_stored and n not in job.state_nodes] if reason == "store_failed" else []
        if stored:
            self.metrics.storage_pages.inc(stored, "written")
            self.metrics.storage_bytes.inc(stored * self.backend.page_bytes, "written")
        if stored_states and self.stored_states is not None:
            self.metrics.states.inc(stored_states, "stored")
            self.metrics.storage_bytes.inc(stored_states * self.stored_states.slot_bytes, "written")
        missed = len(job.keys) - stored + len(job.state_keys) - stored_states
        if missed and reason:
            self.metrics.storage_skipped.inc(missed, reason)
        with self._cond:
            self._queued_pages -= job.size
            self._writing = False
            self.metrics.queue.set(self._queued_pages, "storage_write_pages")
            self._cond.notify_all()
        if arrived:                     # snapshots its nodes got while it wrote: their backups found them busy
            with self.lock:
                self.write_through(arrived)

    # -- lifetime ------------------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait until every prefetch has ended and every queued write is done."""
        with self._cond:
            self._cond.wait_for(lambda: not (self._active or self._jobs or self._writing))

    def stop_prefetches(self) -> None:
        """Cancel running prefetches and wait for them (close, first step). Writes go on: backups still completing
        while the cache closes queue theirs, and ``close`` decides what happens to them."""
        with self._cond:
            self._prefetch_stopped = True
            for prefetch in self._active:
                prefetch.cancel()
        self._workers.shutdown(wait=True)

    def close(self, *, cancel: bool = True) -> None:
        """Stop the writer: with ``cancel`` the queued writes are dropped (counted as ``cancelled_at_close``; the one
        being written finishes), else every queued write is made before this returns. Call after the controller has
        stopped (no backup completes later), under no lock."""
        self.stop_prefetches()
        with self._cond:
            self._writes_closed = True
            dropped = list(self._jobs) if cancel else []
            if cancel:
                self._jobs.clear()
            self._cond.notify_all()
        self._writer.join()
        for job in dropped:
            self._finish_job(job, 0, reason="cancelled_at_close")
        self.host.close()
        if self.stored_states is not None:
            self.stored_states.close()

