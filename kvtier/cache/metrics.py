"""What the cache did, as a Prometheus registry and as a plain dict.

Each cache has its own ``CollectorRegistry`` (two caches in one process never collide); expose it with
``prometheus_client.start_http_server(port, registry=cache.metrics.registry)`` or read ``snapshot()``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

TIERS = ("device", "host", "storage")
DIRECTIONS = ("load", "backup")


class CacheMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
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
            "storage_skipped": Counter("kvtier_cache_storage_writes_skipped", "pages not written to storage",
                                       ["reason"], registry=r),
        }
        self._gauges = {
            "queue": Gauge("kvtier_cache_queue_depth", "work waiting or in flight", ["queue"], registry=r),
            "tokens": Gauge("kvtier_cache_tokens", "tokens held per tier", ["tier"], registry=r),
            "free_pages": Gauge("kvtier_cache_free_pages", "free pages per tier", ["tier"], registry=r),
        }

    def add(self, name: str, amount: float = 1.0, label: str | None = None) -> None:
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
