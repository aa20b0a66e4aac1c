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
from kvtier.errors import InvalidArgument
from kvtier.keys import chain_keys
from kvtier.locks import named_condition
from kvtier.storage.views import HostPages

if TYPE_CHECKING:
    from kvtier.cache.tiers import Tiers
    from kvtier.pools import HostPool
    from kvtier.storage import StorageBackend


class Prefetch:
    """A storage read of a prompt's pages past its host-resident prefix. ``outcome`` says how it ended:
    ``complete``, ``cached`` (nothing to read), ``miss`` (storage has none), ``truncated`` (stopped at a page that
    failed verification or vanished), ``cancelled``, ``host_full``, ``slower_than_recompute``, ``evicted`` (its
    prefix left the host), ``closed`` or ``error``."""

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
        """Tokens read from storage and in the cache's host tier now."""
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
    """Host pages of some nodes being written to storage; ``nodes`` grows when one of them is split, ``orphans``
    holds host pages the tree dropped while the write still reads them (freed when it is done)."""

    def __init__(self, nodes: list[Node], host: np.ndarray, keys: list[bytes]) -> None:
        self.nodes, self.host, self.keys = nodes, host, keys
        self.orphans: list[np.ndarray] = []


class StorageTier:
    def __init__(self, backend: StorageBackend, host_pool: HostPool, tiers: Tiers, metrics: CacheMetrics,
                 lock: Any, settings: CacheSettings, decide: Callable[[int], str]) -> None:
        """``lock`` is the cache's lock (index and allocators); ``decide(tokens)`` says whether reading that many
        tokens from storage beats recomputing them."""
        if backend.namespace.digest != tiers.index.root_key:
            raise InvalidArgument(f"{backend!r} stores another namespace than the cache's")
        if backend.page_bytes != host_pool.geometry.bytes_per_page:
            raise InvalidArgument(f"{backend!r} stores pages of {backend.page_bytes} bytes; the host pool's are "
                                  f"{host_pool.geometry.bytes_per_page}")
        self.backend, self.tiers, self.metrics, self.lock, self.settings = backend, tiers, metrics, lock, settings
        self.decide = decide
        self.page_size = tiers.page_size
        self.host = HostPages(host_pool, backend)
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
        prefetch.stored_pages = stored
        if stored == 0:
            return "cancelled" if self._stop_requested(prefetch) else "miss"
        decision = self.decide(stored * page)
        if decision != "load":
            return decision
        position = 0
        while position < stored:
            if self._stop_requested(prefetch):
                return "closed" if self._prefetch_stopped else "cancelled"
            with self.lock:
                host = self.tiers.allocate_host(min(self.settings.storage_batch_pages, stored - position),
                                                partial=True)
                if host is None:
                    return "host_full"
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
                return "evicted"
            position += read
            prefetch.committed_pages = position
            self.metrics.storage_pages.inc(read, "read")
            self.metrics.storage_bytes.inc(read * self.backend.page_bytes, "read")
            if read < count:
                return "truncated"
        return "complete"

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
        """Queue the host pages of freshly backed-up nodes for storage (under the cache's lock; never blocks)."""
        todo = [n for n in nodes if n.alive and n.host is not None and not n.stored and n.storing is None]
        if not todo:
            return
        pages = sum(len(n.host) for n in todo if n.host is not None)
        with self._cond:
            if self._writes_closed:
                self.metrics.storage_skipped.inc(pages, "cancelled_at_close")
                return
            if self._queued_pages + pages > self.settings.storage_queue_pages:
                self.metrics.storage_skipped.inc(pages, "queue_full")
                return
            index = self.tiers.index
            job = StoreJob(todo, np.concatenate([n.host for n in todo if n.host is not None]),
                           [key for n in todo for key in index.keys(n)])
            for node in todo:
                node.storing = job
            self._jobs.append(job)
            self._queued_pages += pages
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
            stored = 0
            try:
                with self.host.batch(job.host) as io:
                    stored = self.backend.set(job.keys, io.pages)
            except Exception:  # noqa: BLE001 - counted once, as store_failed; the pages simply are not in storage
                stored = 0
            self._finish_job(job, stored)

    def _finish_job(self, job: StoreJob, stored: int, reason: str | None = "store_failed") -> None:
        with self.lock:
            written = set(job.keys[:stored])
            for node in job.nodes:
                if node.storing is job:
                    node.storing = None
                if node.alive and written.issuperset(self.tiers.index.keys(node)):
                    node.stored = True
            if job.orphans:
                orphans = np.concatenate(job.orphans)
                self.tiers.host.free(orphans)
                self.tiers.held_host -= len(orphans)
        if stored:
            self.metrics.storage_pages.inc(stored, "written")
            self.metrics.storage_bytes.inc(stored * self.backend.page_bytes, "written")
        if stored < len(job.keys) and reason:
            self.metrics.storage_skipped.inc(len(job.keys) - stored, reason)
        with self._cond:
            self._queued_pages -= len(job.keys)
            self._writing = False
            self.metrics.queue.set(self._queued_pages, "storage_write_pages")
            self._cond.notify_all()

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

