"""The pages of both tiers and every move between them: allocation that evicts, backups, completions.

This is the policy half of the cache: which pages to evict (LRU leaves of each tier, never a busy node), what a write
policy backs up and when, how a finished or failed transfer changes the tree. ``KVCache`` is the other half: it checks
arguments, holds the lock (every method here runs under it) and runs the controller. Pages are numbers; the transfer
engines turn them into addresses. On a hybrid cache (``states``, :mod:`kvtier.cache.state_tier`) every move here takes
the nodes' state snapshots along: the same operation, all or nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np

from kvtier.cache.allocator import PageAllocator
from kvtier.cache.controller import Controller
from kvtier.cache.index import IndexCorrupted, Node, RadixIndex
from kvtier.cache.metrics import CacheMetrics
from kvtier.cache.operation import BACKUP, LOAD, Operation
from kvtier.cache.settings import WritePolicy
from kvtier.checks import integer
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.pools.geometry import KVGeometry
from kvtier.transfer.engine import CURRENT, TransferEngine

if TYPE_CHECKING:
    from kvtier.cache.state_tier import StateTier

FREE, CALLER, TREE, HELD = 0, 1, 2, 3
"""What a device page is: free, held by a caller (from ``allocate``, not inserted yet), the tree's, or held for a
load that failed to queue whole until its queued part has finished."""


class MustWait(Exception):
    """Raised under the cache's lock when a request can be met only once these transfers have finished (backups of
    write_back victims, or whatever is in flight when nothing is evictable). Nobody waits under the lock: the cache
    waits with it released, completes them, and asks again (``KVCache._locked``)."""

    def __init__(self, ops: list[Operation], freed: int = 0) -> None:
        super().__init__(f"waiting for {len(ops)} transfers")
        self.ops = ops
        self.freed = freed
        """Pages an eviction freed before it had to wait (they stay freed: the retry asks only for the rest)."""


@dataclass(frozen=True)
class TierSettings:
    """The two tiers: the KV ``geometry``, how many pages each holds, the ``write_policy``, and whether device pages
    go out in runs of consecutive pages (``contiguous_device``: copy-engine loads move a layer of a run of pages with
    one strided copy)."""

    geometry: KVGeometry
    device_pages: int
    host_pages: int
    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    contiguous_device: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, KVGeometry):
            raise InvalidArgument(f"geometry must be a KVGeometry, got {self.geometry!r}")
        object.__setattr__(self, "device_pages", integer(self.device_pages, "device_pages", low=1))
        object.__setattr__(self, "host_pages", integer(self.host_pages, "host_pages", low=1))
        object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
        if not isinstance(self.contiguous_device, bool):
            raise InvalidArgument(f"contiguous_device must be True or False, got {self.contiguous_device!r}")


class Completed(NamedTuple):
    """What a completed transfer hands on, for the cache to pass along (under its lock): ``backed_up``, the nodes of
    a backup that succeeded (write-through to storage); ``state_left``, nodes it left with a device-only snapshot,
    adopted while the backup of their KV ran, so no backup took them (write-through asks for another)."""

    backed_up: list[Node]
    state_left: list[Node]


NOTHING = Completed([], [])


class Tiers:
    def __init__(self, settings: TierSettings, *, index: RadixIndex, metrics: CacheMetrics,
                 backup_engine: TransferEngine, controller: Controller, markers: Callable[[Any], list[Any] | None],
                 states: StateTier | None = None) -> None:
        """Every collaborator exists before the tiers do. ``backup_engine`` queues backups; ``controller`` has the
        transfers in flight (an allocation that finds nothing to evict waits for them) and completes those handed to
        it; ``markers(after)`` turns an ordering request into events recorded now; ``states``: a hybrid cache's state
        snapshots."""
        self.settings = settings
        self.index, self.geometry, self.page_size = index, settings.geometry, settings.geometry.page_size
        self.metrics, self.backup_engine, self.controller, self.markers = metrics, backup_engine, controller, markers
        self.unsaved_ok: set[int] = set()
        """Nodes whose write_back backup failed during the current request: evicted without one on the retry."""
        self.device = PageAllocator(settings.device_pages, name="device", contiguous=settings.contiguous_device)
        self.host = PageAllocator(settings.host_pages, name="host", contiguous=True)
        self.page_state = np.zeros(settings.device_pages, dtype=np.uint8)
        self.fences: list[Any] = []
        """Events of writes that may still be queued to freed device pages: whoever gets pages next waits."""
        self.held_host = 0
        """Host pages in use outside the tree: read into by a prefetch, or dropped from it while storage reads them."""
        self.states = states


    def fence(self, events: list[Any] | None) -> None:
        if events:
            self.fences.extend(events)

    def pending_fences(self) -> list[Any]:
        """The fences not yet passed (those passed are dropped)."""
        self.fences = [event for event in self.fences if not event.query()]
        return list(self.fences)

    def allocate_device(self, count: int) -> np.ndarray | None:
        if count > self.device.free_pages + self.index.device_tokens // self.page_size:
            return None                      # more than free + everything cached: evicting could not help
        pages = self.device.allocate(count)
        if pages is None:
            self.evict_device(count - self.device.free_pages)
            pages = self.device.allocate(count)
        if pages is None:
            self._wait_for_inflight()
        return pages

    def _wait_for_inflight(self) -> None:
        """Nothing more is evictable now: what is in flight may free some (a node is busy while its transfer runs)."""
        pending = [op for op in self.controller.inflight(BACKUP) + self.controller.inflight(LOAD) if not op.finished]
        if pending:
            raise MustWait(pending)

    def allocate_host(self, count: int, *, partial: bool = False) -> np.ndarray | None:
        """``count`` host pages, evicting LRU host leaves as needed; None when short. ``partial``: as many as can be
        had, up to ``count`` (None when not one): a prefetch commits the leading pages that fit."""
        pages = self.host.allocate(count)
        if pages is None:
            self.evict_host(count - self.host.free_pages)
            pages = self.host.allocate(count)
        if pages is None and partial and self.host.free_pages:
            pages = self.host.allocate(self.host.free_pages)
        return pages

    def evict_device(self, need: int) -> int:
        return self._evict("device", need)

    def evict_host(self, need: int) -> int:
        return self._evict("host", need)

    def _evict(self, tier: str, need: int) -> int:
        """Free at least ``need`` pages of ``tier`` (fewer when not enough are evictable), LRU leaves first. A node
        keeping its other tier stays in the tree; one left with none is removed (device: under write_back it is
        backed up first; without a backup its pending writes become fences)."""
        other = "host" if tier == "device" else "device"
        freed = 0
        while freed < need:
            victims = self.index.lru_leaves(tier, need - freed)
            if not victims:
                break
            backing_up = None
            if tier == "device" and self.settings.write_policy is WritePolicy.WRITE_BACK:
                backing_up = self.backup_first(victims)
                if backing_up is not None:
                    victims = [v for v in victims if v.writing is None]
                    if not victims:
                        raise MustWait([backing_up], freed)
            released: list[np.ndarray] = []
            dropped = 0
            for victim in victims:
                pages = getattr(victim, tier)
                assert pages is not None
                released.append(pages)
                (self.index.set_device if tier == "device" else self.index.set_host)(victim, None)
                if self.states is not None:
                    self.states.drop(victim, tier, self.fence)
                if getattr(victim, other) is None:
                    if tier == "device":
                        self.fence(victim.written)   # dropped before any backup waited for its KV
                        dropped += 1
                    self.index.remove(victim)
            pages = np.concatenate(released)
            if tier == "device":
                self.page_state[pages] = FREE
            (self.device if tier == "device" else self.host).release(pages)
            freed += len(pages)
            self.metrics.evicted.inc(len(pages) * self.page_size, tier)
            if dropped:
                self.metrics.skipped.inc(dropped, "evicted_without_backup")
            if backing_up is not None and freed < need:
                raise MustWait([backing_up], freed)
        return freed

    # -- state snapshots (hybrid caches) ----------------------------------------------------------------------------
    def allocate_device_states(self, count: int) -> np.ndarray | None:
        """``count`` device state slots; evicts least recently used snapshots (write_back: backed up first), then
        waits for backups in flight and evicts again. None when still short."""
        assert self.states is not None
        slots = self.states.device.allocate(count)
        if slots is None:
            self.evict_device_states(count - self.states.device.free_pages)
            slots = self.states.device.allocate(count)
        if slots is None:
            self._wait_for_inflight()
        return slots

    def allocate_host_states(self, count: int) -> np.ndarray | None:
        assert self.states is not None
        slots = self.states.host.allocate(count)
        if slots is None:
            self.evict_states("host", count - self.states.host.free_pages)
            slots = self.states.host.allocate(count)
        return slots

    def hold_host_state(self) -> int | None:
        """A host state slot for storage to read a snapshot into, outside the tree until it is adopted or released
        (``StateTier.adopt_outside`` / ``release_outside``); evicts least recently used snapshots as needed."""
        assert self.states is not None
        slots = self.allocate_host_states(1)
        if slots is None:
            return None
        self.states.outside += 1
        return int(slots[0])

    def evict_device_states(self, need: int) -> int:
        if self.settings.write_policy is WritePolicy.WRITE_BACK and self.states is not None and need > 0:
            backing_up = self.backup_first(self.states.lru("device", need))
            if backing_up is not None:
                raise MustWait([backing_up])
        return self.evict_states("device", need)

    def evict_states(self, tier: str, need: int) -> int:
        """Free ``need`` snapshots of ``tier`` (fewer when not enough are evictable), least recently used first; the
        nodes keep their KV (and serve deeper prefixes), but no match ends on them from that tier any more."""
        assert self.states is not None
        victims = self.states.lru(tier, need) if need > 0 else []
        for victim in victims:
            self.states.drop(victim, tier, self.fence)
        if victims:
            self.metrics.states.inc(len(victims), f"evicted_{tier}")
        return len(victims)

    def evictable_tokens(self, tier: str) -> int:
        leaves = self.index.device_leaves if tier == "device" else self.index.host_leaves
        return sum(len(n.tokens) for n in leaves if not (n.host_busy if tier == "host" else n.busy))

    @staticmethod
    def written(chain: list[Node], after: list[Any] | None) -> list[Any] | None:
        """Events a backup of ``chain`` waits for: ``after`` and where each node's KV was written."""
        events = list(after or []) + [e for n in chain for e in (n.written or [])]
        return events or None

    def start_backup(self, targets: list[Node], after: Any) -> Operation | None:
        """Assign host pages to ``targets`` and every ancestor not yet on the host (and host slots to their state
        snapshots not yet there), and queue the copies: all of them, or none when host room runs out."""
        chain, stated = self._backup_chain(targets)
        if not chain and not stated:
            return None
        count = sum(len(n.tokens) for n in chain) // self.page_size
        for target in targets:
            if target.alive:
                self.index.lock(target)
        try:
            host, slots = self._host_room(count, len(stated), len(chain))
        finally:
            for target in targets:
                if target.alive:
                    self.index.unlock(target)
        if host is None:
            return None
        device = np.concatenate([n.device for n in chain]) if chain else host[:0]
        nbytes = count * self.geometry.bytes_per_page + len(stated) * (self.states.slot_bytes if self.states else 0)
        op = Operation(BACKUP, list(chain) + [n for n in stated if n.host is not None], device, host, nbytes)
        events = self.written(chain, after)
        events = (events or []) + [e for n in stated for e in (n.state_written or [])] or None
        try:
            if chain:
                op.transfer = self.backup_engine.backup(device, host, after=events)
            if stated:
                assert self.states is not None and slots is not None
                op.state_device, op.state_host = np.array([n.device_state for n in stated], np.int64), slots
                op.state_transfer = self.states.engine.backup(op.state_device, slots, after=events)
        except BaseException as exc:
            self._abandon(op, host, slots, exc)
            raise
        self.assign(chain, "host", host, op)
        for node, slot in zip(stated, slots if slots is not None else [], strict=True):
            assert self.states is not None
            self.states.put(node, "host", int(slot))
            node.writing = op
        return op

    def _backup_chain(self, targets: list[Node]) -> tuple[list[Node], list[Node]]:
        """The nodes whose KV a backup of ``targets`` copies (not on the host yet, top-down) and those whose state
        snapshot it copies (on the device only, and not being written)."""
        chain: list[Node] = []
        stated: list[Node] = []
        seen: set[int] = set()
        for target in targets:
            if not target.alive or target.device is None:
                continue
            for node in reversed(list(target.path())):
                if node.id in seen:
                    continue
                seen.add(node.id)
                if node.host is None:
                    chain.append(node)
                if self.state_unsaved(node) and node.writing is None:
                    stated.append(node)
        return chain, stated

    @staticmethod
    def state_unsaved(node: Node) -> bool:
        return node.device_state is not None and node.host_state is None

    def _host_room(self, pages: int, slots: int, nodes: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Host pages and host state slots for one backup, both or neither (counted as skipped when neither)."""
        host = self.allocate_host(pages)
        if host is None:
            self.metrics.skipped.inc(nodes, "host_full")
            return None, None
        if not slots:
            return host, None
        taken = self.allocate_host_states(slots)
        if taken is None:
            self.host.free(host)
            self.metrics.skipped.inc(max(nodes, 1), "host_state_full")
            return None, None
        return host, taken

    def _abandon(self, op: Operation, host: np.ndarray, slots: np.ndarray | None, error: BaseException) -> None:
        """A backup failed to queue part of its copies: its room goes back once the queued part has finished (the
        controller completes it as failed; nobody waits here, under the lock)."""
        def give_back() -> None:
            self.host.free(host)
            if slots is not None and self.states is not None:
                self.states.host.free(slots)
        self.abandon(op, give_back, error)

    def abandon(self, op: Operation, give_back: Callable[[], None], error: BaseException) -> None:
        """``op`` will never be assigned to its nodes; ``give_back`` returns its room when nothing queued reads or
        writes it any more: now when nothing was queued, else when the controller completes ``op`` (as failed)."""
        if not op.transfers():
            give_back()
            return
        op.error, op.give_back = error, give_back
        self.controller.track(op)

    def assign(self, chain: list[Node], tier: str, pages: np.ndarray, op: Operation) -> None:
        """Give each node of ``chain`` its run of ``pages`` on ``tier``, marked as in flight with ``op``."""
        start = 0
        for node in chain:
            span = len(node.tokens) // self.page_size
            if tier == "device":
                self.index.set_device(node, pages[start:start + span])
                node.loading = op
            else:
                self.index.set_host(node, pages[start:start + span])
                node.writing = op
            start += span

    def backup_first(self, victims: list[Node]) -> Operation | None:
        """write_back: start the backup of the victims not saved on the host yet (KV or state snapshot; with their
        ancestors), ordered after the caller's stream; the caller evicts them once it completed. None when none
        needs one, or no host room was had (then they go unsaved, counted)."""
        unsaved = [v for v in victims if (v.host is None or self.state_unsaved(v)) and v.id not in self.unsaved_ok]
        if not unsaved:
            return None
        op = self.start_backup(unsaved, self.markers(CURRENT))
        if op is not None:
            self.controller.track(op)
        return op

    def waited(self, op: Operation) -> Completed:
        """``op`` finished while the cache waited for it (lock released): complete it; a write_back backup that
        failed leaves its nodes to be evicted without one on the retry."""
        if op.kind == BACKUP and op.error is not None:
            self.unsaved_ok.update(n.id for n in op.nodes)
        return self.complete(op)

    def complete(self, op: Operation) -> Completed:
        """Finish ``op`` once (the controller's waiter, or a thread that had to wait for it itself); returns what
        the cache hands on."""
        if op.finished:
            return NOTHING
        op.finished = True
        if op.give_back is not None:            # never assigned; its failure was raised (and counted) when queued
            op.give_back()
            return NOTHING
        completed = NOTHING
        field = "writing" if op.kind == BACKUP else "loading"
        nodes = [n for n in op.nodes if n.alive and getattr(n, field) is op]
        for node in nodes:
            setattr(node, field, None)
        if op.error is not None:
            self.metrics.errors.inc(1, op.kind)
            for node in nodes:
                if node.alive:
                    self.drop_subtree(node, "host" if op.kind == BACKUP else "device")
        else:
            if op.kind == BACKUP:
                for node in nodes:
                    node.written = None          # on the host now; later backups need no wait
                    if node.host_state is not None:
                        node.state_written = None
                left = [n for n in nodes if n.alive and n.writing is None and self.state_unsaved(n)]
                completed = Completed(nodes, left)
            self.metrics.bytes.inc(op.nbytes, op.kind)
            self.metrics.pages.inc(len(op.device_pages), op.kind)
            if len(op.state_device):
                self.metrics.states.inc(len(op.state_device), op.kind)
            self.metrics.seconds.inc(time.perf_counter() - op.submitted, op.kind)
        return completed

    def drop_subtree(self, top: Node, tier: str) -> None:
        """A failed transfer left ``tier`` of ``top`` holding garbage: take that tier from it and everything below."""
        order, stack = [], [top]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order):
            if self.states is not None:
                if tier == "host" and node.storing is not None and node.host_state is not None:
                    node.storing.state_orphans.append(self.states.detach(node))   # storage still reads it
                else:
                    self.states.drop(node, tier)
            pages = getattr(node, tier)
            if pages is None:
                continue
            if tier == "device":
                self.page_state[pages] = FREE
                self.device.release(pages)
                self.index.set_device(node, None)
            else:
                if node.storing is not None:     # storage is still reading them: it frees them when done
                    node.storing.orphans.append(pages)
                    node.storing = None
                    self.held_host += len(pages)
                else:
                    self.host.free(pages)
                self.index.set_host(node, None)
            if node.device is None and node.host is None and not node.children:
                self.index.discard(node)

    def release_everything(self) -> int:
        """Every page back to its allocator (the caller's too); raises if any page leaked. Returns how many device
        pages callers still held."""
        for node in list(self.index.all_nodes()):
            node.lock, node.writing, node.loading, node.storing = 0, None, None, None
        self.held_states = self.states.release_everything() if self.states is not None else 0
        for tier, allocator in (("device", self.device), ("host", self.host)):
            owned = self.index.page_owners(tier)
            if owned.size:
                allocator.free(owned)
        self.index = RadixIndex(self.page_size, self.index.root_key)
        self.page_state[:] = FREE
        held = self.device.used_pages
        if held:
            self.device.free(np.flatnonzero(self.device.used_mask()))
        if self.device.free_pages != self.device.pages or self.host.free_pages != self.host.pages:
            raise KvtierError(f"pages leaked at close: {self.device.pages - self.device.free_pages} device, "
                              f"{self.host.pages - self.host.free_pages} host")
        return held

    def check(self) -> None:
        """The page (and state slot) accounting of both tiers against the tree (raises IndexCorrupted)."""
        if self.states is not None:
            self.states.check(self.index)
        for tier, allocator in (("device", self.device), ("host", self.host)):
            owned = self.index.page_owners(tier)
            if np.unique(owned).size != owned.size:
                raise IndexCorrupted(f"a {tier} page belongs to two nodes")
            if owned.size and not allocator.is_used(owned).all():
                raise IndexCorrupted(f"the tree holds a {tier} page the allocator calls free")
            if tier == "host" and owned.size + self.held_host != allocator.used_pages:
                raise IndexCorrupted(f"{allocator.used_pages} host pages allocated, the tree holds {owned.size} "
                                     f"and storage I/O {self.held_host}")
            if tier == "device":
                mask = np.zeros(self.device.pages, dtype=bool)
                mask[owned] = True
                if not np.array_equal(mask, self.page_state == TREE):
                    raise IndexCorrupted("the device pages marked as the tree's differ from the tree")
                if not np.array_equal(self.device.used_mask(), self.page_state != FREE):
                    raise IndexCorrupted("device pages in use differ from those the tree and callers hold")
