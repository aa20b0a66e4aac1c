"""The prefix caches bench/cache.py's control-plane rows time, behind one small interface, so every row runs each of
them on the same inputs in the same process, interleaved: kvtier's ``KVCache``, kvtier's ``RadixIndex`` alone (what
``KVCache`` adds around it is the difference), and SGLang's own ``RadixCache`` (Python) and ``UnifiedRadixCache``
(its default, a Rust tree core) where SGLang imports.

Each subject does what an engine's scheduler needs done for the same answer: ``match`` returns the device pages (for
SGLang: ``match_prefix`` and the device indices of the matched path, what its scheduler reads next); ``insert`` hands
over a prompt's KV and frees what duplicates the tree's own (kvtier's ``insert`` does that inside, timed; SGLang's
scheduler frees them after its ``insert`` returns: ``settle`` does it here, untimed, in SGLang's favour); ``evict``
frees tokens (SGLang's in one free group, its cheapest way).
Values are KV slot indices from each cache's own allocator (kvtier: pages; SGLang: token slots).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.cache import CacheSettings, KVCache, Namespace
from kvtier.cache.index import RadixIndex
from kvtier.pools import DevicePool, HostPool, KVGeometry

PLACEHOLDERS = Path(__file__).resolve().parent.parent / "tests" / "helpers" / "placeholders"


class Subject:
    """One prefix cache under test. ``tokens(ids)`` puts a prompt in the form the cache's engine holds it in
    (kvtier: a uint32 array; SGLang: its requests' ``array("q")``) and ``pages(count)`` hands out ``count`` pages'
    worth of KV slots, both untimed; ``insert`` / ``match`` / ``evict`` are the timed calls."""

    name = ""

    def __init__(self, page: int, capacity_tokens: int) -> None:
        self.page = page

    def tokens(self, ids: np.ndarray) -> Any:
        return np.ascontiguousarray(ids, dtype=np.uint32)

    def pages(self, count: int) -> Any:
        raise NotImplementedError

    def insert(self, tokens: Any, slots: Any, owned: int = 0) -> None:
        """``slots``: the KV slots of every whole page of ``tokens``, of which the first ``owned`` tokens' are the
        tree's own (a chunked prefill's earlier chunks, matched before)."""
        raise NotImplementedError

    def match(self, tokens: Any) -> int:
        """Matched device tokens."""
        raise NotImplementedError

    def with_prefix(self, tokens: Any, pages: int) -> tuple[Any, int]:
        """Slots for ``pages`` whole pages of ``tokens``: the matched prefix's own, then fresh ones (untimed); and
        how many tokens of them the tree owns."""
        raise NotImplementedError

    def evict(self, tokens: int) -> None:
        raise NotImplementedError

    def evict_all(self) -> None:
        self.evict(1 << 62)

    def settle(self) -> None:
        """Untimed work a timed call left (after every timed call)."""

    def close(self) -> None:
        pass


class KVTierSubject(Subject):
    """kvtier's subjects: a match is a ``Match`` (device pages and tokens)."""

    def _match(self, tokens: np.ndarray) -> Any:
        raise NotImplementedError

    def match(self, tokens: np.ndarray) -> int:
        return self._match(tokens).device_tokens

    def with_prefix(self, tokens: np.ndarray, pages: int) -> tuple[np.ndarray, int]:
        have = self._match(tokens).device_pages
        return np.concatenate([have, self.pages(pages - len(have))]), len(have) * self.page


class KVTierCache(KVTierSubject):
    """kvtier's ``KVCache`` on emulated pools (no bytes move in these rows): locks, page checks and metrics in."""

    name = "kvtier KVCache"

    def __init__(self, page: int, capacity_tokens: int) -> None:
        super().__init__(page, capacity_tokens)
        from kvtier.runtime import get as get_runtime

        runtime = get_runtime("emulated:split")
        g = KVGeometry.k_only(layers=1, heads=1, head_dim=32, itemsize=2, page_size=page)
        self._dev = DevicePool.allocate(g, capacity_tokens // page + 8, 0, runtime=runtime)
        self._host = HostPool.allocate(g, "page_first", pages=1, kind="pinned", runtime=runtime)
        settings = CacheSettings(write_policy="write_through_selective", write_through_threshold=1 << 30,
                                 io_backend="direct", calibrate=False)
        self.cache = KVCache(self._dev, self._host, Namespace("bench", g, "bfloat16"), settings)

    def pages(self, count: int) -> np.ndarray:
        pages = self.cache.allocate(count)
        self._dev.runtime.synchronize(self._dev.device)   # the emulator runs queued copies and frees on the CPU:
        return pages                                      # on a GPU they would not be in the next timed call

    def insert(self, tokens: np.ndarray, slots: np.ndarray, owned: int = 0) -> None:
        self.cache.insert(tokens, slots)

    def _match(self, tokens: np.ndarray) -> Any:
        return self.cache.match_prefix(tokens)

    def evict(self, tokens: int) -> None:
        self.cache.evict(device_pages=min(tokens // self.page, self._dev.pages))

    def close(self) -> None:
        self.cache.close()
        self._host.close()
        self._dev.close()


class KVTierIndex(KVTierSubject):
    """kvtier's ``RadixIndex`` alone: the tree walk, split and placement, without the cache around it. Its pages
    come from a counter (it keeps no free list); eviction is the cache's, so it has no evict rows."""

    name = "kvtier index alone"

    def __init__(self, page: int, capacity_tokens: int) -> None:
        super().__init__(page, capacity_tokens)
        self.index = RadixIndex(page, bytes(32))
        self._next = 0

    def pages(self, count: int) -> np.ndarray:
        start, self._next = self._next, self._next + count
        return np.arange(start, start + count, dtype=np.int64)

    def insert(self, tokens: np.ndarray, slots: np.ndarray, owned: int = 0) -> None:
        self.index.place(tokens, np.array(slots[: len(tokens) // self.page]))

    def _match(self, tokens: np.ndarray) -> Any:
        return self.index.match(tokens)

    def evict(self, tokens: int) -> None:
        if tokens < 1 << 62:
            raise NotImplementedError("the index alone does not evict")
        self.index = RadixIndex(self.page, bytes(32))


class SGLangCache(Subject):
    """SGLang 0.5.23's prefix cache over its own token-slot allocator (CPU tensors, a one-layer, one-head pool)."""

    kind = ""

    def __init__(self, page: int, capacity_tokens: int) -> None:
        super().__init__(page, capacity_tokens)
        import torch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page))
        size = capacity_tokens + 8 * page
        kv = MHATokenToKVPool(size=size, page_size=page, dtype=torch.bfloat16, head_num=1, head_dim=1, layer_num=1,
                              device="cpu", enable_memory_saver=False)
        self.allocator = TokenToKVPoolAllocator(size=size, dtype=torch.bfloat16, device="cpu", kvcache=kv,
                                                need_sort=False)
        params = CacheInitParams(disable=False, page_size=page, token_to_kv_pool_allocator=self.allocator,
                                 req_to_token_pool=ReqToTokenPool(size=4, max_context_len=16, device="cpu",
                                                                  enable_memory_saver=False),
                                 tree_components=(ComponentType.FULL,))
        self.cache = (UnifiedRadixCache if self.kind == "unified" else RadixCache)(params)
        self._key, self._insert, self._match, self._evict = RadixKey, InsertParams, MatchPrefixParams, EvictParams
        self._unfreed: list[Any] = []

    def pages(self, count: int) -> Any:
        slots = self.allocator.alloc(count * self.page)
        if slots is None:
            raise RuntimeError(f"{self.name}: out of KV slots (bench sizing)")
        return slots

    def tokens(self, ids: np.ndarray) -> array:
        return array("q", ids.tolist())

    def insert(self, tokens: array, slots: Any, owned: int = 0) -> None:
        key = self._key(tokens)
        done = self.cache.insert(self._insert(key=key, value=slots[: len(key)]))
        if done.prefix_len > owned:            # the scheduler frees what the tree already held: after the timing
            self._unfreed.append(slots[owned: done.prefix_len])

    def settle(self) -> None:
        """The slots an insert found duplicated go back to the allocator here, untimed: its ``free`` copies its
        whole free list (milliseconds with a million free slots), a cost of this allocator and not of the tree."""
        while self._unfreed:
            self.allocator.free(self._unfreed.pop())

    def _matched(self, tokens: array) -> Any:
        found = self.cache.match_prefix(self._match(key=self._key(tokens)))
        return self.cache.path_device_indices(found.last_device_node)[: found.device_prefix_len]

    def match(self, tokens: array) -> int:
        return len(self._matched(tokens))

    def with_prefix(self, tokens: array, pages: int) -> tuple[Any, int]:
        import torch

        have = self._matched(tokens)
        return torch.cat([have, self.pages(pages - len(have) // self.page)]), len(have)

    def evict(self, tokens: int) -> None:
        """In one free group: the allocator's ``free`` concatenates its free list per call (one per evicted node),
        which alone took 0.4-3 s of a 1M-token eviction here; the group frees once, SGLang's cheapest way."""
        self.allocator.free_group_begin()
        try:
            self.cache.evict(self._evict(num_tokens=min(tokens, 1 << 40)))
        finally:
            self.allocator.free_group_end()


class SGLangRadixCache(SGLangCache):
    name = "SGLang RadixCache (Python)"
    kind = "python"


class SGLangUnifiedRadixCache(SGLangCache):
    name = "SGLang UnifiedRadixCache (Rust)"
    kind = "unified"


def sglang_missing() -> str | None:
    """Why SGLang's caches cannot run here (None when they can). Where SGLang is installed without torchvision (its
    CUDA build does not import beside a CPU torch), the tests' placeholder package stands in for that one import."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (pip install --no-deps sglang==0.5.23 and the sglang-interface extra)"
    if importlib.util.find_spec("torchvision") is None and str(PLACEHOLDERS) not in sys.path:
        sys.path.append(str(PLACEHOLDERS))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import sglang.srt.mem_cache.radix_cache  # noqa: F401
            import sglang.srt.mem_cache.unified_radix_cache  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (any import failure means: not usable here)
        return f"SGLang's radix caches do not import: {type(exc).__name__}: {exc}"
    return None


def subjects(with_sglang: bool) -> list[type[Subject]]:
    kinds: list[type[Subject]] = [KVTierCache, KVTierIndex]
    return kinds + ([SGLangRadixCache, SGLangUnifiedRadixCache] if with_sglang else [])
