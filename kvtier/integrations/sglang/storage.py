"""kvtier's stores as SGLang's HiCache L3 storage: a ``HiCacheStorage`` SGLang loads itself, with no fork.

SGLang builds it from its ``dynamic`` backend (``--hicache-storage-backend dynamic`` and an extra config naming
``kvtier.integrations.sglang`` / ``KVTierStorage`` and a kvtier store spec), then registers its host pool. From then on
its controller threads call the batch methods: the zero-copy ``batch_get_v1`` / ``batch_set_v1`` when the extra config
sets ``interface_v1``, the flat-page ``batch_get`` / ``batch_set`` otherwise, ``batch_exists`` for the stored prefix,
and the ``*_v2`` calls for hybrid models whose Mamba state is stored beside the KV.

What SGLang gets from kvtier here: every page verified when read (header fields and an xxh3 checksum: a damaged,
truncated or foreign page is a miss, never KV); keys that cannot collide across models, geometries, dtypes, TP ranks,
pipeline stages, adapters or tenants (SGLang's own key stays the page's identity inside that namespace); Redis and
Redis Cluster; and outages that become misses: no call raises into SGLang's controller threads. A call SGLang gives
bad arguments (lengths that disagree, indices outside the pool) fails as a whole, is logged once in a while, and
counted (``refused``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from kvtier.address import CpuAddress
from kvtier.cache.rates import read_beats_recompute, storage_read_gbps
from kvtier.errors import InvalidArgument
from kvtier.integrations.sglang.host_pools import SGLangPool, flat_page
from kvtier.integrations.sglang.metrics import HiCacheMetrics
from kvtier.integrations.sglang.settings import Deployment, Settings
from kvtier.locks import named_lock
from kvtier.pools.geometry import payload_order
from kvtier.pools.state import StateGeometry
from kvtier.storage import StorageBackend, open_store, state_snapshots
from kvtier.storage.state_format import StateFormat, geometry_fingerprint

logger = logging.getLogger("kvtier.sglang")
KV = "kv"
MAMBA = "mamba"
_HEX = frozenset("0123456789abcdef")
_KEY_TAG = b"kvtier-sglang-key-v1\0"
_STATE_TAG = b"kvtier-sglang-state-v1\0"


def page_key(key: str) -> bytes:
    """The kvtier key of SGLang's page key: its 32 bytes when it is SGLang's usual SHA-256 hex (lowercase, as
    ``hexdigest`` writes it), else SHA-256 of it (tagged, so no hex key's bytes can equal it; an uppercase key is
    another key, as SGLang compares them)."""
    if not isinstance(key, str) or not key:
        raise InvalidArgument(f"page key {key!r:.60}: SGLang's keys are non-empty strings")
    if len(key) == 64 and _HEX.issuperset(key):
        return bytes.fromhex(key)
    return hashlib.sha256(_KEY_TAG + key.encode()).digest()


def state_keys(geometry: StateGeometry) -> Callable[[str], bytes]:
    """The key of the state snapshot taken at SGLang's page ``key``, for state of ``geometry``: SHA-256 of a tag,
    the geometry's fingerprint and the page's key. Two deployments of one model whose state differs (another SSM
    dtype) keep their snapshots apart instead of reading each other's as damaged."""
    prefix = _STATE_TAG + geometry_fingerprint(geometry).to_bytes(8, "little")
    return lambda key: hashlib.sha256(prefix + page_key(key)).digest()


def _pool_name(name: Any) -> str:
    return str(name)                       # PoolName is a str enum whose str() is its value


@dataclass
class Bound:
    """A registered SGLang pool and the view of the store its pages go to."""

    pool: SGLangPool
    store: StorageBackend
    key: Callable[[str], bytes]


def _guarded(op: str, failure: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Never raise into SGLang's controller threads: an exception becomes ``failure``'s answer (from the call's
    arguments), a log line and a count."""
    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: KVTierStorage, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as error:              # noqa: BLE001 (the controller thread must live on)
                self._refused(op, method.__name__, error)
                return failure(*args, **kwargs)
        return call
    return wrap


def _count(items: Any) -> int:
    try:
        return len(items)
    except TypeError:
        return 0


def _keys_failed(keys: Any = (), *rest: Any, **kwargs: Any) -> list[bool]:
    return [False] * _count(keys)


def _transfers_failed(transfers: Any = (), *rest: Any, **kwargs: Any) -> dict[Any, list[bool]]:
    try:
        return {t.name: [False] * _count(t.keys) for t in transfers}
    except Exception:                                   # noqa: BLE001 (not transfers at all: nothing to answer for)
        return {}


class KVTierStorage(HiCacheStorage):
    """SGLang's HiCache storage over a kvtier store (``file:``, ``redis://``, ``redis+cluster://``,
    ``mooncake://``). See the module docstring and docs/sglang.md."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        """As SGLang's factory builds a dynamic backend: ``cls(storage_config, kwargs)``. The options come from
        ``storage_config.extra_config`` (``store`` required; see ``settings.OPTIONS``); a missing or malformed one
        raises here, so SGLang's attach fails with its name instead of running without storage."""
        self.settings = Settings.from_extra_config(getattr(storage_config, "extra_config", None))
        self.deployment = Deployment.of(storage_config, self.settings)
        self.storage_config = storage_config
        self.store: StorageBackend | None = None
        self._bound: dict[str, Bound] = {}
        self._registered: list[tuple[StorageBackend, CpuAddress]] = []
        self._lock = named_lock("sglang.backend")
        self._closed = False
        self._refusals = 0
        self.metrics = HiCacheMetrics(self._store_counters)

    # -- registration --------------------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host KV pool: opens the store in this deployment's namespace for the pool's geometry, dtype and
        layout, and registers the pool's memory with it (by CPU address) for zero-copy stores. An unsupported pool
        raises, naming what kvtier cannot store."""
        super().register_mem_pool_host(mem_pool_host)
        with self._lock:
            if self._closed:
                raise InvalidArgument(f"{self!r} is closed")
            if KV in self._bound:
                if self._bound[KV].pool.pool is mem_pool_host:
                    return
                raise InvalidArgument(f"{self!r}: a host KV pool is registered already")
            pool = SGLangPool(mem_pool_host, KV)
            assert pool.geometry is not None                 # a KV pool (SGLangPool says which)
            namespace = self.deployment.namespace(pool.geometry, pool.dtype, self.settings, row_split=pool.row_split,
                                                  order=payload_order(pool.geometry, pool.layout))
            store = open_store(self.settings.store, namespace, layout=pool.layout, **self.settings.store_options)
            try:
                self._register(store, pool)
            except BaseException:
                store.close()
                raise
            self.store = store
            self._bound[KV] = Bound(pool, store, page_key)
        logger.info("kvtier HiCache storage: %r, %s pages of %d bytes (%s), namespace %s", store, pool.kind,
                    pool.page_bytes, pool.layout.value, store.namespace_id)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of a hybrid model's host pool group. The KV pool is the one ``register_mem_pool_host`` bound; a
        Mamba state pool is stored beside it, each slot a verified state snapshot under a key derived from its KV
        page's. Any other pool is logged and left out: its transfers fail, so SGLang recomputes instead."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_name(host_pool_name)
        with self._lock:
            kv = self._bound.get(KV)
            if name == KV or kv is None:
                if kv is None:
                    logger.warning("kvtier HiCache storage: pool %r registered before the host KV pool; ignored", name)
                return
            if name in self._bound:                      # registered again: the new pool replaces the old
                if self._bound[name].pool.pool is host_pool:
                    return
                self._unregister(self._bound.pop(name))
            try:
                if name != MAMBA:
                    raise InvalidArgument(f"pool {name!r} ({type(host_pool).__name__}) is not one kvtier stores "
                                          f"(it stores kv and mamba)")
                if self.deployment.is_mla:
                    raise InvalidArgument("Mamba state beside MLA KV: the state is TP-sharded, the KV is not")
                pool = SGLangPool(host_pool, name)
                if pool.state is None:
                    raise InvalidArgument(f"pool {name!r} ({pool.kind}) is not a Mamba state pool")
                view = state_snapshots(kv.store, StateFormat.of(kv.store.namespace, pool.state, pool.layout))
                self._register(kv.store, pool)
            except Exception as error:                   # noqa: BLE001 (logged; SGLang recomputes these)
                logger.warning("kvtier HiCache storage: pool %r left out: %s", name, error)
                return
            assert pool.state is not None
            self._bound[name] = Bound(pool, view, state_keys(pool.state))

    def _register(self, store: StorageBackend, pool: SGLangPool) -> None:
        for span in pool.spans:
            address = CpuAddress(span.start)
            store.register_memory(address, span.nbytes)
            self._registered.append((store, address))

    def _unregister(self, bound: Bound) -> None:
        """Take a replaced pool's memory out of the store's registry (under ``_lock``)."""
        mine = {CpuAddress(span.start) for span in bound.pool.spans}
        for store, address in [entry for entry in self._registered if entry[1] in mine]:
            self._registered.remove((store, address))
            store.unregister_memory(address)

    # -- the stored prefix ---------------------------------------------------------------------------------------------
    @_guarded("exists", lambda *a, **k: False)
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    @_guarded("exists", lambda *a, **k: 0)
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading ``keys`` storage holds (one round trip per batch on stores that answer many keys).
        SGLang's keys already chain their prefix, so ``extra_info.prefix_keys`` adds nothing."""
        bound = self._kv()
        hits = bound.store.exists([bound.key(k) for k in keys])
        if hits and not self._worth_reading(bound, hits):
            self.metrics.count("exists", "declined", hits)
            hits = 0
        self.metrics.count("exists", "hit", hits)
        self.metrics.count("exists", "miss", len(keys) - hits)
        return hits

    def _worth_reading(self, bound: Bound, pages: int) -> bool:
        """kvtier's rule: a stored prefix is a hit only if reading it beats prefilling it again (with
        ``prefill_tokens_per_s`` set; the store's measured read rate, or ``storage_gbps`` until it has one)."""
        gbps = storage_read_gbps(bound.store.stats(), self.settings.storage_gbps)
        return read_beats_recompute(pages * bound.pool.page_size, pages * bound.pool.page_bytes,
                                    self.settings.prefill_tokens_per_s, gbps)

    @_guarded("exists", lambda *a, **k: PoolTransferResult.empty())
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The longest KV prefix whose other pools' pages are there too, by each pool's hit policy: ``all_pages``
        needs the pool's page at every page of the prefix, ``trailing_pages`` at the last ``len(transfer.keys)``
        (a Mamba state at the prefix's end). A pool kvtier does not store has none."""
        kv_hits = self.batch_exists(keys)
        counts: dict[Any, int] = {KV: kv_hits} if kv_hits else {}
        restorable = set(range(1, kv_hits + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            bound = self._bound.get(_pool_name(transfer.name))
            present = (bound.store.present([bound.key(k) for k in keys[:kv_hits]]) if bound is not None
                       else [False] * kv_hits)
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                run = next((i for i, hit in enumerate(present) if not hit), kv_hits)
                allowed = set(range(1, run + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                allowed = {end for end in range(1, kv_hits + 1) if all(present[max(0, end - window):end])}
            else:
                logger.warning("kvtier HiCache storage: hit policy %s of pool %s is not supported; no hits",
                               transfer.hit_policy, transfer.name)
                allowed = set()
            if allowed:
                counts[transfer.name] = max(allowed)
            restorable &= allowed
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, counts, ordered)

    # -- zero-copy reads and writes (interface_v1) ---------------------------------------------------------------------
    @_guarded("get", _keys_failed)
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read the pages of ``keys`` into the host pool at ``host_indices`` (``page_size`` indices a page); per
        key, whether it was read and verified. Only a leading run succeeds: a page that is missing or fails
        verification ends it, as SGLang's prefetch stops at the first miss."""
        bound = self._kv()
        return self._read(bound, keys, bound.pool.pieces(host_indices, len(keys)))

    @_guarded("set", _keys_failed)
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``; per key, whether it is stored."""
        bound = self._kv()
        return self._write(bound, keys, lambda: bound.pool.pieces(host_indices, len(keys)))

    # -- flat pages (SGLang's generic path, without interface_v1) ------------------------------------------------------
    @_guarded("get", lambda *a, **k: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        result = self.batch_get([key], [target_location])
        return result[0] if result else None

    @_guarded("get", lambda keys=(), *a, **k: [None] * _count(keys))
    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Read each page into its flat tensor (``get_dummy_flat_data_page()``); the tensor, or None from the first
        page that was not read and verified."""
        bound = self._kv()
        if target_locations is None or len(target_locations) != len(keys):
            raise InvalidArgument(f"batch_get: {len(keys)} keys need as many target tensors")
        pages = [flat_page(t, bound.pool.page_bytes, f"target {i}") for i, t in enumerate(target_locations)]
        done = self._read(bound, keys, pages)
        return [t if ok else None for t, ok in zip(target_locations, done, strict=True)]

    @_guarded("set", lambda *a, **k: False)
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    @_guarded("set", lambda *a, **k: False)
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store each flat page tensor (``get_data_page(index)``); True when every one is stored."""
        bound = self._kv()
        if values is None or len(values) != len(keys):
            raise InvalidArgument(f"batch_set: {len(keys)} keys need as many page tensors")
        return all(self._write(bound, keys, lambda: [flat_page(v, bound.pool.page_bytes, f"value {i}")
                                                     for i, v in enumerate(values)]))

    # -- hybrid pools (v2) ---------------------------------------------------------------------------------------------
    @_guarded("get", _transfers_failed)
    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[Any, list[bool]]:
        """Per transfer (the KV pool's, a Mamba pool's), read its keys' pages into its host indices."""
        return {t.name: self._transfer(t, write=False) for t in transfers}

    @_guarded("set", _transfers_failed)
    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[Any, list[bool]]:
        return {t.name: self._transfer(t, write=True) for t in transfers}

    def _transfer(self, transfer: PoolTransfer, *, write: bool) -> list[bool]:
        keys = list(transfer.keys or [])
        bound = self._bound.get(_pool_name(transfer.name))
        try:
            if bound is None:
                raise InvalidArgument(f"pool {transfer.name!r} is not stored by kvtier (registered: "
                                      f"{', '.join(self._bound) or 'none'})")
            if write:
                return self._write(bound, keys, lambda: bound.pool.pieces(transfer.host_indices, len(keys)))
            return self._read(bound, keys, bound.pool.pieces(transfer.host_indices, len(keys)))
        except Exception as error:                      # noqa: BLE001 (one pool failing leaves the others)
            self._refused("set" if write else "get", f"batch_{'set' if write else 'get'}_v2 {transfer.name}", error)
            return [False] * len(keys)

    # -- the moves -----------------------------------------------------------------------------------------------------
    def _read(self, bound: Bound, keys: list[str], pages: list[Any]) -> list[bool]:
        kkeys = [bound.key(k) for k in keys]
        start = time.perf_counter()
        done = bound.store.get(kkeys, pages)
        self.metrics.call("get", done, done * bound.pool.page_bytes, time.perf_counter() - start)
        self.metrics.count("get", "hit", done)
        self.metrics.count("get", "miss", len(keys) - done)
        return [i < done for i in range(len(keys))]

    def _write(self, bound: Bound, keys: list[str], pages: Callable[[], list[Any]]) -> list[bool]:
        """Store pages not stored yet (with ``skip_existing``, the default: one lookup first, as SGLang's own
        backends do). An MLA rank that is not the storage writer writes nothing and reports success, as
        ``HiCacheStorageConfig.is_storage_writer`` says: the writer rank stores the same bytes."""
        kkeys = [bound.key(k) for k in keys]
        views = pages()                                  # checks the arguments, on every rank
        if not self.deployment.writer:
            self.metrics.count("set", "skipped", len(keys))
            return [True] * len(keys)
        todo = list(range(len(keys)))
        if self.settings.skip_existing and keys:
            todo = [i for i, hit in enumerate(bound.store.present(kkeys)) if not hit]
            self.metrics.count("set", "skipped", len(keys) - len(todo))
        start = time.perf_counter()
        stored = bound.store.set([kkeys[i] for i in todo], [views[i] for i in todo]) if todo else 0
        self.metrics.call("set", stored, stored * bound.pool.page_bytes, time.perf_counter() - start)
        self.metrics.count("set", "stored", stored)
        self.metrics.count("set", "error", len(todo) - stored)
        failed = set(todo[stored:])
        return [i not in failed for i in range(len(keys))]

    def _kv(self) -> Bound:
        bound = self._bound.get(KV)
        if bound is None:
            raise InvalidArgument("no host KV pool registered yet (SGLang calls register_mem_pool_host first)"
                                  if not self._closed else f"{self!r} is closed")
        return bound

    def _refused(self, op: str, call: str, error: BaseException) -> None:
        self.metrics.count(op, "refused", 1)
        self._refusals += 1
        if self._refusals <= 10 or self._refusals % 1000 == 0:
            logger.warning("kvtier HiCache storage: %s failed (%d so far): %s: %s", call, self._refusals,
                           type(error).__name__, error)

    # -- the rest of SGLang's interface --------------------------------------------------------------------------------
    @_guarded("set", lambda *a, **k: False)
    def clear(self) -> bool:
        """Remove this deployment's pages (its namespace: KV and state snapshots), nobody else's."""
        store = self._kv().store
        removed = store.clear()
        logger.info("kvtier HiCache storage: cleared %d stored values of namespace %s", removed, store.namespace_id)
        return True

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s of each get and set since the last call), with kvtier's
        totals and the store's counters as its ``kvtier`` attribute."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:                              # an SGLang without it has no storage metrics to fill
            return None
        metrics = StorageMetrics(**self.metrics.drain())
        metrics.kvtier = self.stats()
        return metrics

    def _store_counters(self) -> dict[str, float]:
        store = self.store
        if store is None or store.closed:
            return {}
        return {name: value for name, value in store.stats().items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)}

    def stats(self) -> dict[str, Any]:
        """kvtier's totals per call and outcome, and the store's own (misses by reason, errors, reconnects)."""
        store = self.store.stats() if self.store is not None and not self.store.closed else {}
        return {"calls": self.metrics.snapshot(), "store": store}

    def close(self) -> None:
        """Unregister the pools' memory and close the store; idempotent, and calls after it fail as misses."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            bound, self._bound = self._bound, {}
            registered, self._registered = self._registered, []
        for store, address in registered:
            try:
                store.unregister_memory(address)
            except Exception as error:                   # noqa: BLE001 (closing goes on)
                logger.warning("kvtier HiCache storage: unregistering %s failed: %s", address, error)
        if KV in bound:
            bound[KV].store.close()

    def __repr__(self) -> str:
        return f"<KVTierStorage {self.settings.store!r} model={self.deployment.model!r}>"
