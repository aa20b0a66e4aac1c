"""The state tier of a hybrid model: snapshot slots of the recurrent (linear-attention / Mamba) state, on the device
and in host memory, and the engine that moves them.

Hybrid models (Qwen3.5, Qwen3-Next: three gated-delta-net layers for every full-attention GQA layer) keep the KV of
their attention layers in pages and the state of their linear layers per request. A prefix is worth something only
where both are known: its KV pages *and* the state after its last token. So a radix node may carry a snapshot of that
state (``device_state`` / ``host_state``: slot numbers of this tier), and the cache keeps these rules:

- a tier's snapshot goes with the node's KV on that tier: ``device_state`` only on a node with device pages,
  ``host_state`` only on one with host pages; evicting a node's KV from a tier frees its snapshot there too. A
  snapshot may go alone (its slots are scarcer than pages): the node then still serves deeper prefixes;
- a match ends at the deepest node of the prompt's path that has a snapshot on some tier (never a KV prefix without
  its state);
- a backup or a load-back moves a chain's pages and its snapshots in one operation, all or nothing.

This module owns the slots and their bookkeeping; :class:`~kvtier.cache.tiers.Tiers` decides when they move.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.cache.allocator import PageAllocator
from kvtier.cache.index import IndexCorrupted, Node, RadixIndex
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.pools.state import StateDevicePool, StateHostPool
from kvtier.transfer.family import FamilyEngine

KV, STATE = "kv", "state"
FREE, CALLER, TREE = 0, 1, 2
"""What a device state slot is: free, held by a caller (``allocate_state``, not inserted yet), or the tree's."""

LayerMap = tuple[tuple[str, int], ...]


def interleaved_layers(kv_layers: int, state_layers: int) -> LayerMap:
    """Model layer i → (``"kv"``, KV layer) or (``"state"``, state layer), attention layers spread evenly, each closing
    its group — Qwen3.5's ``full_attention_interval=4`` is ``interleaved_layers(n // 4, n - n // 4)``."""
    total = kv_layers + state_layers
    layers: list[tuple[str, int]] = []
    for i in range(total):
        kv = sum(1 for kind, _ in layers if kind == KV)
        layers.append((KV, kv) if (i + 1) * kv_layers // total > kv else (STATE, i - kv))
    return tuple(layers)


def check_layer_map(layer_map: Sequence[tuple[str, int]], kv_layers: int, state_layers: int) -> LayerMap:
    """A layer map must name every KV layer and every state layer exactly once."""
    if isinstance(layer_map, (str, bytes, dict)) or not isinstance(layer_map, Sequence):
        raise InvalidArgument(f"layer_map must be a sequence of ({KV!r} | {STATE!r}, index) pairs, got {layer_map!r}")
    layers = []
    for i, entry in enumerate(layer_map):
        if not isinstance(entry, (tuple, list)) or len(entry) != 2 or entry[0] not in (KV, STATE) or \
                isinstance(entry[1], (bool, np.bool_)) or not isinstance(entry[1], (int, np.integer)):
            raise InvalidArgument(f"layer_map[{i}] = {entry!r}: each model layer is ({KV!r} | {STATE!r}, an integer "
                                  f"layer index)")
        layers.append((str(entry[0]), int(entry[1])))
    for kind, count in ((KV, kv_layers), (STATE, state_layers)):
        got = sorted(index for k, index in layers if k == kind)
        if got != list(range(count)):
            raise InvalidArgument(f"layer_map must name each of the {count} {kind} layers once, got {got}")
    return tuple(layers)


class StateTier:
    def __init__(self, device_pool: StateDevicePool, host_pool: StateHostPool, *, kv_layers: int,
                 layer_map: Sequence[tuple[str, int]] | None = None, max_blocks: int = 2) -> None:
        """``layer_map``: which model layer is which (default :func:`interleaved_layers`); load-backs wait per
        model layer through it."""
        if not isinstance(device_pool, StateDevicePool) or not isinstance(host_pool, StateHostPool):
            raise InvalidArgument(f"state=(StateDevicePool, StateHostPool), got ({type(device_pool).__name__}, "
                                  f"{type(host_pool).__name__})")
        state_layers = device_pool.geometry.layers
        self.layer_map = check_layer_map(layer_map, kv_layers, state_layers) if layer_map is not None else \
            interleaved_layers(kv_layers, state_layers)
        self.device_pool, self.host_pool = device_pool, host_pool
        self.slot_bytes = device_pool.geometry.slot_bytes
        self.device = PageAllocator(device_pool.units, name="device state")
        self.host = PageAllocator(host_pool.units, name="host state", contiguous=True)
        self.slots = np.zeros(device_pool.units, dtype=np.uint8)
        self.held: dict[str, set[Node]] = {"device": set(), "host": set()}
        self.outside = 0
        """Host slots in use outside the tree: read into by a prefetch, or dropped from it while storage writes them."""
        self.engine = FamilyEngine(device_pool, host_pool, max_blocks=max_blocks)

    # -- what a node holds ------------------------------------------------------------------------------------------
    @staticmethod
    def usable(node: Node) -> bool:
        """A match may end here: a snapshot on some tier."""
        return node.device_state is not None or node.host_state is not None

    @staticmethod
    def on_device(node: Node) -> bool:
        """A match may end here without a load-back."""
        return node.device_state is not None

    def put(self, node: Node, tier: str, slot: int) -> None:
        """Give ``node`` its snapshot on ``tier`` (the slot is already allocated)."""
        if getattr(node, tier) is None or getattr(node, f"{tier}_state") is not None:
            raise IndexCorrupted(f"{node} cannot take a {tier} state: no {tier} pages, or it has one")
        setattr(node, f"{tier}_state", int(slot))
        self.held[tier].add(node)
        if tier == "device":
            self.slots[slot] = TREE

    def drop(self, node: Node, tier: str, fence: Callable[[Any], None] | None = None) -> bool:
        """Free ``node``'s snapshot on ``tier`` (if any). A device slot dropped while the write of its snapshot may
        still be queued hands those events to ``fence``: whoever gets the slot next waits for them."""
        slot = getattr(node, f"{tier}_state")
        if slot is None:
            return False
        setattr(node, f"{tier}_state", None)
        self.held[tier].discard(node)
        if tier == "device":
            self.slots[slot] = FREE
            if fence is not None:
                fence(node.state_written)
            self.device.release(np.array([slot], dtype=np.int64))
        else:
            self.host.release(np.array([slot], dtype=np.int64))
        return True

    def detach(self, node: Node) -> int:
        """Take ``node``'s host snapshot from the tree without freeing its slot (storage still reads it: the slot is
        counted ``outside`` until :meth:`release_outside`)."""
        slot = node.host_state
        if slot is None:
            raise IndexCorrupted(f"{node} has no host state to detach")
        node.host_state = None
        self.held["host"].discard(node)
        self.outside += 1
        return slot

    def release_outside(self, slots: Sequence[int] | np.ndarray) -> None:
        """Host slots used outside the tree go back to the allocator."""
        if len(slots):
            self.host.release(np.asarray(slots, dtype=np.int64))
            self.outside -= len(slots)

    def adopt_outside(self, node: Node, slot: int) -> None:
        """A host slot used outside the tree (a snapshot a prefetch read) becomes ``node``'s host snapshot."""
        self.put(node, "host", slot)
        self.outside -= 1

    def lru(self, tier: str, count: int) -> list[Node]:
        """Least recently used nodes holding an evictable snapshot on ``tier`` (at most ``count``). A lock pins the
        snapshot a match ends on, not those of shorter prefixes on its path (their KV stays pinned): a request
        reads only the state at its match's end."""
        def pinned(n: Node) -> bool:
            ends_here = n.lock > sum(child.lock for child in n.children.values())
            moving = n.writing is not None or n.loading is not None or (tier == "host" and n.storing is not None)
            return ends_here or moving

        return heapq.nsmallest(count, (n for n in self.held[tier] if not pinned(n)),
                               key=lambda n: (n.last_access, n.id))

    # -- caller slots -----------------------------------------------------------------------------------------------
    def check_caller_slot(self, slot: Any, what: str) -> int:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise InvalidArgument(f"{what}: a state slot is an int from allocate_state(), got {slot!r}")
        slot = int(slot)
        if not 0 <= slot < self.device.pages:
            raise InvalidArgument(f"{what}: state slot {slot} is out of range (0..{self.device.pages - 1})")
        if self.slots[slot] != CALLER:
            whose = "the cache's own" if self.slots[slot] == TREE else "not allocated"
            raise InvalidArgument(f"{what}: state slot {slot} is {whose}, not a slot from allocate_state()")
        return slot

    def give_back(self, slot: int) -> None:
        self.slots[slot] = FREE
        self.device.release(np.array([slot], dtype=np.int64))

    # -- teardown and checks ----------------------------------------------------------------------------------------
    def release_everything(self) -> int:
        """Every slot back (callers' too); raises if one leaked. Returns how many device slots callers held."""
        for tier, allocator in (("device", self.device), ("host", self.host)):
            for node in list(self.held[tier]):
                setattr(node, f"{tier}_state", None)
            self.held[tier].clear()
            used = np.flatnonzero(allocator.used_mask())
            if used.size:
                allocator.release(used)
        held = int(np.count_nonzero(self.slots == CALLER))
        self.slots[:] = FREE
        self.outside = 0
        if self.device.free_pages != self.device.pages or self.host.free_pages != self.host.pages:
            raise KvtierError("state slots leaked at close")
        return held

    def check(self, index: RadixIndex) -> None:
        """Snapshots sit only with their tier's KV, each slot belongs to one node, and the allocators agree."""
        found: dict[str, list[int]] = {"device": [], "host": []}
        held: dict[str, set[Node]] = {"device": set(), "host": set()}
        for node in index.all_nodes():
            for tier in ("device", "host"):
                slot = getattr(node, f"{tier}_state")
                if slot is None:
                    continue
                if getattr(node, tier) is None:
                    raise IndexCorrupted(f"{node} has a {tier} state without {tier} pages")
                found[tier].append(slot)
                held[tier].add(node)
        for tier, allocator in (("device", self.device), ("host", self.host)):
            slots = np.array(found[tier], dtype=np.int64)
            if np.unique(slots).size != slots.size:
                raise IndexCorrupted(f"a {tier} state slot belongs to two nodes")
            if held[tier] != self.held[tier]:
                raise IndexCorrupted(f"the {tier} state set disagrees with the tree")
            if slots.size and not allocator.is_used(slots).all():
                raise IndexCorrupted(f"the tree holds a {tier} state slot the allocator calls free")
            if tier == "host" and allocator.used_pages != slots.size + self.outside:
                raise IndexCorrupted(f"{allocator.used_pages} host state slots in use, the tree holds {slots.size} "
                                     f"and storage I/O {self.outside}")
        mask = np.zeros(self.device.pages, dtype=bool)
        mask[np.array(found["device"], dtype=np.int64)] = True
        if not np.array_equal(mask, self.slots == TREE):
            raise IndexCorrupted("the device state slots marked as the tree's differ from the tree")
        if not np.array_equal(self.device.used_mask(), self.slots != FREE):
            raise IndexCorrupted("device state slots in use differ from those the tree and callers hold")

    def close(self) -> None:
        self.engine.close()
