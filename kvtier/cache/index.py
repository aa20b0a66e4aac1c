"""The radix index: which token prefixes the cache holds, and in which tier each page of them lives.

A node owns a run of whole pages (``tokens`` is a multiple of the page size) and, per tier, the page numbers of that
run (``device``, ``host``; None when absent). Children are found by the token ids of their first page, and matching
compares whole edges with numpy, so a 128k-token prompt is a few dictionary lookups and array compares, never a loop
per token or per page in Python.

Invariants (``check()`` verifies all of them; the tests run it after every step):

- every node but the root holds its pages in at least one tier;
- the device tier and the host tier are each closed under ancestors: a node on a tier has its parent on it too, so
  a match is a device prefix followed by a host-only chain, and eviction works on leaves of each tier;
- ``lock`` counts requests using a node or a descendant (a lock pins the whole path); a locked node is evicted from
  no tier; a node with a transfer in flight (``writing``: its backup; ``loading``: its load-back) neither;
- each node's counts of children on the device / host tier, the leaf sets and the per-tier token totals agree with
  the tree.

The index does no I/O and allocates no pages: the cache decides policy and moves bytes; the index keeps the truth.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.errors import InvalidArgument, KvtierError
from kvtier.keys import chain_keys

EMPTY = np.zeros(0, dtype=np.int64)
_CHILDREN = {"device": "device_children", "host": "host_children"}
_LEAVES = {"device": "device_leaves", "host": "host_leaves"}
NO_TOKENS = np.zeros(0, dtype=np.uint32)


class IndexCorrupted(KvtierError):
    """An invariant of the radix index does not hold (a bug in kvtier: please report it with the message)."""


class Node:
    __slots__ = ("id", "parent", "children", "tokens", "device", "host", "lock", "hits", "last_access",
                 "writing", "loading", "written", "storing", "stored", "device_children", "host_children", "alive",
                 "device_state", "host_state", "state_written", "state_stored", "_keys")

    def __init__(self, node_id: int, parent: Node | None, tokens: np.ndarray) -> None:
        self.id, self.parent, self.tokens = node_id, parent, tokens
        self.children: dict[bytes, Node] = {}
        self.device: np.ndarray | None = None
        self.host: np.ndarray | None = None
        self.lock = self.hits = self.last_access = 0
        self.writing: Any = None
        self.loading: Any = None
        self.written: Any = None
        """What a backup of this node's device pages must wait for: where its KV was written (events)."""
        self.storing: Any = None
        """The storage write reading this node's host pages (they stay put until it is done)."""
        self.stored = False
        """Known to be in storage (written there, or read from there): not written again."""
        self.device_children = self.host_children = 0
        self.alive = True
        self.device_state: int | None = None
        self.host_state: int | None = None
        """Hybrid models: slots of a snapshot of the recurrent state after this node's last token (see
        :mod:`kvtier.cache.state_tier`); a split leaves it with the tail, where it belongs."""
        self.state_written: Any = None
        """What a backup of ``device_state`` must wait for: where the snapshot was written (events)."""
        self.state_stored = False
        """Its state snapshot is known to be in storage (written there, or read from there): not written again."""
        self._keys: list[bytes] | None = None

    @property
    def busy(self) -> bool:
        """Pinned: locked, or a transfer touching it is in flight."""
        return self.lock > 0 or self.writing is not None or self.loading is not None

    @property
    def host_busy(self) -> bool:
        """Pinned on the host tier: busy, or storage is reading its host pages (device pages may still go)."""
        return self.busy or self.storing is not None

    def path(self) -> Iterator[Node]:
        """This node and its ancestors up to (not including) the root."""
        node: Node | None = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent

    def __lt__(self, other: Node) -> bool:
        return self.id < other.id

    def __repr__(self) -> str:
        tiers = "".join(t for t, v in (("D", self.device), ("H", self.host)) if v is not None)
        tiers += "".join(t for t, v in (("d", self.device_state), ("h", self.host_state)) if v is not None)
        return f"Node({self.id}, {len(self.tokens)} tokens, {tiers or '-'}, lock={self.lock})"


@dataclass
class Match:
    """What ``match`` found: ``device_tokens`` on the device (``device_pages``), then ``host_tokens`` more in host
    memory only (``host_nodes``, top-down). ``last_node`` is the deepest matched node (lock it to pin the match).
    Hybrid caches: ``device_state`` / ``host_state`` are the slots of the state snapshot at the match's end (the cache's
    own: read, never write them; ``load_back`` brings a host-only one to the device). ``lock_token`` is the cache's
    record of this match's lock (set and cleared by ``KVCache.lock``/``unlock`` only), so a copy cannot unlock it."""

    tokens: int
    device_tokens: int
    host_tokens: int
    device_pages: np.ndarray
    last_device_node: Node
    last_node: Node
    host_nodes: list[Node] = field(default_factory=list)
    pending: list[Any] = field(default_factory=list)
    locked: bool = False
    device_state: int | None = None
    host_state: int | None = None
    lock_token: object | None = field(default=None, repr=False, compare=False)

    @property
    def cached_tokens(self) -> int:
        return self.device_tokens + self.host_tokens


@dataclass
class Placement:
    """How ``place`` put a prompt into the tree: ``new_node`` holds pages the tree did not have, ``revived`` nodes got
    device pages back from the caller, ``duplicates`` are caller pages for positions the device tier already had."""

    new_node: Node | None
    revived: list[Node]
    duplicates: np.ndarray
    existing_tokens: int
    last_node: Node


class RadixIndex:
    def __init__(self, page_size: int, root_key: bytes) -> None:
        self.page_size, self.root_key = page_size, root_key
        self._ids = itertools.count(1)
        self.root = Node(0, None, NO_TOKENS)
        self.root.device, self.root.host = EMPTY, EMPTY
        self.root.lock = 1
        self.root._keys = []
        self.device_leaves: set[Node] = set()
        self.host_leaves: set[Node] = set()
        self.device_tokens = self.host_tokens = self.nodes = 0
        self._clock = 0

    # -- lookups ----------------------------------------------------------------------------------------------------
    def whole_pages(self, tokens: np.ndarray) -> np.ndarray:
        return tokens[: len(tokens) // self.page_size * self.page_size]

    def match(self, tokens: np.ndarray, *, touch: bool = True, usable: Callable[[Node], bool] | None = None
              ) -> Match:
        """Longest cached prefix of ``tokens`` (whole pages), split so it ends at a node boundary. ``usable``: the
        match ends at the deepest node of that path it accepts (hybrid models: one with a state snapshot)."""
        path, _ = self._walk(self.whole_pages(tokens))
        if usable is not None:
            ends = [i for i, node in enumerate(path) if usable(node)]
            path = path[:ends[-1] + 1] if ends else []
        if touch:
            self._clock += 1
            clock = self._clock
            for node in path:
                node.last_access = clock
                node.hits += 1
        on_device, pending = 0, []                     # the device tier holds a prefix of the path
        for node in path:
            if node.device is None:
                break
            on_device += 1
            if node.loading is not None and node.loading not in pending:
                pending.append(node.loading)
        device_nodes, host_nodes = path[:on_device], path[on_device:]
        if on_device > 1:
            device_pages = np.concatenate([n.device for n in device_nodes])
        else:
            device_pages = np.array(device_nodes[0].device if device_nodes else EMPTY)   # a copy: the caller's
        last = path[-1] if path else None
        return Match(len(tokens), len(device_pages) * self.page_size,
                     sum(len(n.tokens) for n in host_nodes) if host_nodes else 0, device_pages,
                     device_nodes[-1] if device_nodes else self.root, last or self.root, host_nodes, pending,
                     False, last.device_state if last else None, last.host_state if last else None)

    def _walk(self, tokens: np.ndarray, split: bool = True) -> tuple[list[Node], int]:
        """The nodes ``tokens`` runs through, and how many pages of the last one it covers when that is only part of
        it (0 when whole). With ``split`` the last node is split there instead, so the path ends on a boundary."""
        page, node, pos, path = self.page_size, self.root, 0, []
        total = len(tokens)
        while pos < total:
            child = node.children.get(tokens[pos:pos + page].tobytes())
            if child is None:
                break
            length = min(len(child.tokens), total - pos)
            matched = length
            if length > page and child.tokens[page:length].tobytes() != tokens[pos + page:pos + length].tobytes():
                differ = np.flatnonzero(child.tokens[page:length] != tokens[pos + page:pos + length])
                if differ.size:                        # (equal values in another dtype differ only as bytes)
                    matched = page + int(differ[0]) // page * page
            if matched < len(child.tokens):
                if not split:
                    path.append(child)
                    return path, matched // page
                child = self._split(child, matched // page)
            path.append(child)
            pos += matched
            node = child
            if matched < length:
                break
        return path, 0

    def host_chain(self, node: Node) -> list[Node]:
        """The host-only nodes from the device boundary down to ``node`` (top-down)."""
        chain = [n for n in node.path() if n.device is None]
        return chain[::-1]

    # -- changes ----------------------------------------------------------------------------------------------------
    def walk(self, tokens: np.ndarray) -> tuple[list[Node], int]:
        """The nodes of the longest cached prefix of ``tokens`` (whole pages) and the pages of the last one it covers
        if only part (0: whole). Changes nothing: no split, no LRU or hit update."""
        return self._walk(self.whole_pages(tokens), split=False)

    def split_path(self, tokens: np.ndarray) -> list[Node]:
        """The nodes of the longest cached prefix of ``tokens`` (whole pages), the last split so the path ends on a
        node boundary. No LRU or hit update."""
        return self._walk(self.whole_pages(tokens), split=True)[0]

    def add_host_node(self, parent: Node, tokens: np.ndarray, host: np.ndarray,
                      keys: list[bytes] | None = None) -> Node:
        """A new host-only child of ``parent`` (which must be on the host tier) holding ``tokens`` in ``host``;
        ``keys``, when the caller has them already (a prefetch read the pages by key), saves hashing them again."""
        page = self.page_size
        if parent.host is None or tokens[:page].tobytes() in parent.children:
            raise IndexCorrupted(f"cannot add a host node under {parent}: it is not on the host or has that child")
        node = Node(next(self._ids), parent, tokens)
        parent.children[tokens[:page].tobytes()] = node
        self.nodes += 1
        self._clock += 1
        node.last_access = self._clock
        self.set_host(node, host)
        if keys is not None:
            node._keys = list(keys)
        return node

    def place(self, tokens: np.ndarray, pages: np.ndarray,
              walked: tuple[list[Node], int] | None = None) -> Placement:
        """Put a prompt with its device ``pages`` (one per whole page) into the tree; nothing is freed here. The tree
        keeps views of both arrays: hand it arrays nobody changes later (``KVCache`` passes its own copies).
        ``walked``: what ``walk(tokens)`` returned, if nothing changed the tree since."""
        tokens = self.whole_pages(tokens)
        path, partial = self._walk(tokens, split=False) if walked is None else walked
        if partial:
            path = path[:-1] + [self._split(path[-1], partial)]
        page, pos, revived, duplicates = self.page_size, 0, [], []
        for node in path:
            count = len(node.tokens) // page
            given = pages[pos // page: pos // page + count]
            if node.device is None:
                self.set_device(node, given.copy())
                revived.append(node)
            else:
                duplicates.append(given[given != node.device])
            pos += len(node.tokens)
        existing = pos
        new_node = None
        parent = path[-1] if path else self.root
        if pos < len(tokens):
            rest = tokens[pos:]
            new_node = Node(next(self._ids), parent, rest if pos <= len(tokens) // 4 else rest.copy())
            parent.children[new_node.tokens[:page].tobytes()] = new_node
            self.nodes += 1
            self._clock += 1
            new_node.last_access = self._clock
            self.set_device(new_node, pages[pos // page:])
        dup = np.concatenate(duplicates) if duplicates else EMPTY
        return Placement(new_node, revived, dup, existing, new_node or parent)

    def device_pages_along(self, walked: tuple[list[Node], int]) -> np.ndarray:
        """The device pages along what ``walk`` returned, -1 for the pages of a host-only node."""
        path, partial = walked
        parts = [n.device if n.device is not None else np.full(len(n.tokens) // self.page_size, -1, np.int64)
                 for n in path]
        if partial:
            parts[-1] = parts[-1][:partial]
        return np.concatenate(parts) if parts else EMPTY

    def set_device(self, node: Node, pages: np.ndarray | None) -> None:
        self._set_tier(node, "device", pages)

    def set_host(self, node: Node, pages: np.ndarray | None) -> None:
        self._set_tier(node, "host", pages)

    def _set_tier(self, node: Node, tier: str, pages: np.ndarray | None) -> None:
        before = getattr(node, tier) is not None
        after = pages is not None
        if pages is not None and len(pages) * self.page_size != len(node.tokens):
            raise IndexCorrupted(f"{tier} pages of {node} must cover {len(node.tokens)} tokens, got {len(pages)}")
        setattr(node, tier, pages)
        if before == after:
            return
        delta = len(node.tokens) if after else -len(node.tokens)
        counter, leaves = _CHILDREN[tier], getattr(self, _LEAVES[tier])
        if tier == "device":
            self.device_tokens += delta
        else:
            self.host_tokens += delta
        parent = node.parent
        assert parent is not None
        setattr(parent, counter, getattr(parent, counter) + (1 if after else -1))
        if after:
            leaves.discard(parent)
            if getattr(node, counter) == 0:
                leaves.add(node)
        else:
            leaves.discard(node)
            if parent.parent is not None and getattr(parent, counter) == 0 and getattr(parent, tier) is not None:
                leaves.add(parent)

    def remove(self, node: Node) -> None:
        """Take a node with no pages left and no children out of the tree."""
        if node.children or node.device is not None or node.host is not None or node.host_busy:
            raise IndexCorrupted(f"cannot remove {node}: it still has children, pages or users")
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[: self.page_size].tobytes()]
        node.alive = False
        self.nodes -= 1

    def discard(self, node: Node) -> None:
        """Remove a node whose pages a failed transfer left unusable, even if requests hold it: their locks are
        taken off its ancestors too (a later unlock of it is refused as not in the cache)."""
        for ancestor in node.parent.path() if node.parent is not None else ():
            ancestor.lock -= node.lock
        node.lock, node.writing, node.loading, node.written, node.storing = 0, None, None, None, None
        self.remove(node)

    def _split(self, node: Node, pages: int) -> Node:
        """Cut ``node`` after ``pages`` pages: a new node takes the head, ``node`` keeps the tail (so references to
        a deep node stay valid for locking). State is copied, so the split changes no answer."""
        page, cut = self.page_size, pages * self.page_size
        parent = node.parent
        assert parent is not None and 0 < cut < len(node.tokens)
        head = Node(next(self._ids), parent, node.tokens[:cut])
        head.device = None if node.device is None else node.device[:pages]
        head.host = None if node.host is None else node.host[:pages]
        head.lock, head.hits, head.last_access = node.lock, node.hits, node.last_access
        head.writing, head.loading, head.written = node.writing, node.loading, node.written
        head.storing, head.stored = node.storing, node.stored
        for op in {id(o): o for o in (node.writing, node.loading, node.storing) if o is not None}.values():
            op.nodes.append(head)
        head.device_children = int(node.device is not None)
        head.host_children = int(node.host is not None)
        if node._keys is not None:
            head._keys, node._keys = node._keys[:pages], node._keys[pages:]
        node.tokens = node.tokens[cut:]
        node.device = None if node.device is None else node.device[pages:]
        node.host = None if node.host is None else node.host[pages:]
        parent.children[head.tokens[:page].tobytes()] = head
        head.children[node.tokens[:page].tobytes()] = node
        node.parent = head
        self.nodes += 1
        return head

    def grew(self, node: Node) -> bool:
        """Whether ``node`` is or was a node of this tree (a removed node keeps its parent link)."""
        while node.parent is not None:
            node = node.parent
        return node is self.root

    def owns(self, node: Node) -> bool:
        """Whether ``node`` is a live node of this tree (not of another cache, not removed)."""
        if not node.alive:
            return False
        while node.parent is not None:
            node = node.parent
        return node is self.root

    # -- locks --------------------------------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        if not node.alive:
            raise InvalidArgument(f"{node} is no longer in the cache")
        for n in node.path():
            n.lock += 1

    def unlock(self, node: Node) -> None:
        if any(n.lock <= 0 for n in node.path()):
            raise InvalidArgument(f"unlock of {node} without a matching lock")
        for n in node.path():
            n.lock -= 1

    # -- eviction order ---------------------------------------------------------------------------------------------
    def lru_leaves(self, tier: str, pages: int) -> list[Node]:
        """Least recently used evictable leaves of ``tier`` holding at least ``pages`` pages in all (fewer when
        not enough are evictable). Leaves only: a parent becomes a leaf once its children are gone."""
        leaves = self.device_leaves if tier == "device" else self.host_leaves
        heap = [(n.last_access, n.id, n) for n in leaves if not (n.host_busy if tier == "host" else n.busy)]
        heapq.heapify(heap)
        chosen, total = [], 0
        while heap and total < pages:
            chosen.append(heapq.heappop(heap)[2])
            total += len(chosen[-1].tokens) // self.page_size
        return chosen

    # -- keys -------------------------------------------------------------------------------------------------------
    def keys(self, node: Node) -> list[bytes]:
        """Page keys of ``node``'s pages (computed once, from its parent's last key)."""
        if node._keys is None:
            parent = node.parent
            assert parent is not None
            parent_keys = self.keys(parent)
            node._keys = chain_keys(parent_keys[-1] if parent_keys else self.root_key, node.tokens, self.page_size)
        return node._keys

    # -- introspection ----------------------------------------------------------------------------------------------
    def all_nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check(self) -> None:
        """Raise IndexCorrupted naming the first invariant that does not hold."""
        page = self.page_size
        device_tokens = host_tokens = count = 0
        device_leaves: set[Node] = set()
        host_leaves: set[Node] = set()
        for node in self.all_nodes():
            count += 1
            parent = node.parent
            problem = None
            if parent is None or not node.alive:
                problem = "is detached"
            elif not len(node.tokens) or len(node.tokens) % page:
                problem = f"holds {len(node.tokens)} tokens, not whole pages"
            elif parent.children.get(node.tokens[:page].tobytes()) is not node:
                problem = "is not its parent's child under its first page"
            elif node.device is None and node.host is None:
                problem = "holds no pages in any tier"
            elif node.device is not None and parent.device is None:
                problem = "is on the device but its parent is not"
            elif node.host is not None and parent.host is None:
                problem = "is in host memory but its parent is not"
            elif node.lock < sum(c.lock for c in node.children.values()) or node.lock < 0:
                problem = f"has lock {node.lock}, less than its children's"
            elif node.writing is not None and (node.host is None or node.device is None):
                problem = "is being written without pages on both tiers"
            elif node.loading is not None and node.device is None:
                problem = "is being loaded without device pages"
            for tier in ("device", "host"):
                pages = getattr(node, tier)
                if pages is not None and len(pages) * page != len(node.tokens):
                    problem = f"has {len(pages)} {tier} pages for {len(node.tokens)} tokens"
                on_tier = sum(getattr(c, tier) is not None for c in node.children.values())
                if on_tier != getattr(node, f"{tier}_children"):
                    problem = f"counts {getattr(node, f'{tier}_children')} {tier} children, has {on_tier}"
                if pages is not None and not on_tier:
                    (device_leaves if tier == "device" else host_leaves).add(node)
            if problem:
                raise IndexCorrupted(f"{node} {problem}")
            device_tokens += len(node.tokens) if node.device is not None else 0
            host_tokens += len(node.tokens) if node.host is not None else 0
        if (device_tokens, host_tokens, count) != (self.device_tokens, self.host_tokens, self.nodes):
            raise IndexCorrupted(f"totals: tree has {device_tokens} device / {host_tokens} host tokens in {count} "
                                 f"nodes; index counts {self.device_tokens} / {self.host_tokens} in {self.nodes}")
        if device_leaves != self.device_leaves or host_leaves != self.host_leaves:
            raise IndexCorrupted("the leaf sets disagree with the tree")

    def page_owners(self, tier: str) -> np.ndarray:
        """Every page the tree holds on ``tier`` (with repeats, if the tree were corrupt)."""
        arrays = [getattr(n, tier) for n in self.all_nodes() if getattr(n, tier) is not None]
        return np.concatenate(arrays) if arrays else EMPTY
