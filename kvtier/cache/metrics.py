"""What the cache did, as a Prometheus registry and as a plain dict.

Each cache has its own ``CollectorRegistry`` (two caches in one process never collide); expose it with
``prometheus_client.start_http_server(port, registry=cache.metrics.registry)`` or read ``snapshot()``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvtier.locks import named_lock

TIERS = ("device", "host", "storage")
DIRECTIONS = ("load", "backup")
REASONS: dict[str, dict[str, str]] = {
    "skipped": {
        "host_full": "a backup found no host room, even after evicting what the policy allows",
        "host_state_full": "a hybrid backup found no host state slot",
        "evicted_without_backup": "a device page went before any backup took it (not write_back)",
        "cancelled_at_close": "a backup asked for but not started when close(cancel=True) ran",
    },
    "storage_skipped": {
        "queue_full": "more pages waited for storage than storage_queue_pages allows",
        "store_failed": "the store refused or failed the write (its own counters say why)",
        "cancelled_at_close": "queued, or backed up while closing, when close(cancel=True) ran",
    },
    "decisions": {
        "load": "the load-back was queued",
        "too_short": "shorter than load_back_min_tokens",
        "slower_than_recompute": "bytes / load rate not below tokens / recompute rate",
        "no_device_pages": "no device pages could be had",
        "no_device_state": "no device state slot could be had (hybrid)",
        "no_state": "the match's state snapshot was evicted since the match (hybrid)",
        "stale_match": "the match's last node left the cache since the match",
    },
    "prefetches": {
        "complete": "every stored page was read",
        "cached": "nothing past the host-resident prefix to read",
        "miss": "storage holds none of the pages",
        "truncated": "stopped at a page that failed verification or vanished",
        "cancelled": "settled or cancelled before the end",
        "host_full": "the host tier ran out of room: the leading pages that fit were committed",
        "slower_than_recompute": "reading would take longer than recomputing",
        "evicted": "its prefix left the host tier while it read",
        "closed": "the cache closed",
        "error": "an unexpected error in the worker",
        "no_storage": "the cache has no storage tier",
    },
}
"""The only labels these counters take, and what each means (docs/cache.md and docs/storage.md list them): a count
under a reason nobody documented is a count nobody reads."""
REASONS["prefetch_skipped"] = REASONS["prefetches"]


class CacheMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._lock = named_lock("cache.metrics")
        self._values: dict[str, float] = defaultdict(float)
        r = self.registry
        self._counters = {
            "lookups": Counter("kvtier_cache_lookups", "match_prefix calls", registry=r),
            "lookup_tokens": Counter("kvtier_cache_lookup_tokens", "tokens looked up (whole pages)", registry=r),
            "hits": Counter("kvtier_cache_hits", "lookups with a hit on a tier", ["tier"], registry=r),
            "hit_tokens": Counter("kvtier_cache_hit_tokens", "tokens found per tier", ["tier"], registry=r),
            "bytes": Counter("kvtier_cache_transfer_bytes", "bytes moved per direction", ["direction"], registry=r),
            "pages": Counter("kvtier_cache_transfer_pages", "pages moved per direction", ["direction"], registry=r),
            "seconds": Counter("kvtier_cache_transfer_seconds", "submit-to-completion time of transfers",
                               ["direction"], registry=r),
            "states": Counter("kvtier_cache_states", "state snapshots moved (load, backup) or evicted alone "
                              "(evicted_device, evicted_host) on hybrid caches", ["what"], registry=r),
            "evicted": Counter("kvtier_cache_evicted_tokens", "tokens evicted per tier", ["tier"], registry=r),
            "decisions": Counter("kvtier_cache_load_back_decisions", "load-back decisions", ["decision"],
                                 registry=r),
            "skipped": Counter("kvtier_cache_backups_skipped", "backups not made", ["reason"], registry=r),
            "errors": Counter("kvtier_cache_transfer_errors", "transfers that failed", ["direction"], registry=r),
            "prefetches": Counter("kvtier_cache_prefetches", "storage prefetches by outcome", ["outcome"],
                                  registry=r),
            "storage_pages": Counter("kvtier_cache_storage_pages", "pages read from / written to storage",
                                     ["direction"], registry=r),
            "storage_bytes": Counter("kvtier_cache_storage_bytes", "bytes read from / written to storage",
                                     ["direction"], registry=r),
            "prefetch_skipped": Counter("kvtier_cache_prefetch_pages_skipped", "stored pages a prefetch did not "
                                        "read, by the outcome that ended it", ["reason"], registry=r),
            "storage_skipped": Counter("kvtier_cache_storage_writes_skipped", "pages not written to storage",
                                       ["reason"], registry=r),
        }
        self._gauges = {
            "queue": Gauge("kvtier_cache_queue_depth", "work waiting or in flight", ["queue"], registry=r),
            "tokens": Gauge("kvtier_cache_tokens", "tokens held per tier", ["tier"], registry=r),
            "free_pages": Gauge("kvtier_cache_free_pages", "free pages per tier", ["tier"], registry=r),
        }

    def add(self, name: str, amount: float = 1.0, label: str | None = None) -> None:
        known = REASONS.get(name)
        if known is not None and label not in known:
            raise KeyError(f"{label!r} is not a documented label of {name}: {', '.join(known)}")
        counter = self._counters[name]
        (counter.labels(label) if label is not None else counter).inc(amount)
        with self._lock:
            self._values[f"{name}.{label}" if label is not None else name] += amount

    def set(self, name: str, value: float, label: str) -> None:
        self._gauges[name].labels(label).set(value)
        with self._lock:
            self._values[f"{name}.{label}"] = value

    def get(self, key: str) -> float:
        with self._lock:
            return self._values.get(key, 0.0)

    def snapshot(self) -> dict[str, Any]:
        """Every value by ``name.label``, plus hit rates and GB/s per direction."""
        with self._lock:
            values = dict(self._values)
        looked = values.get("lookup_tokens", 0.0)
        for tier in TIERS:
            values[f"hit_rate.{tier}"] = values.get(f"hit_tokens.{tier}", 0.0) / looked if looked else 0.0
        for direction in DIRECTIONS:
            seconds = values.get(f"seconds.{direction}", 0.0)
            values[f"gbps.{direction}"] = values.get(f"bytes.{direction}", 0.0) / seconds / 1e9 if seconds else 0.0
        return values
