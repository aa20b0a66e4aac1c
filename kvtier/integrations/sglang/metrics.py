"""What the HiCache backend did, three ways: SGLang's ``StorageMetrics`` (pages and GB/s per call since the last
``get_stats``, which SGLang turns into its own histograms), a Prometheus registry of kvtier's own (per-call outcomes,
plus every counter of the store: misses by reason, errors, reconnects), and a plain dict (``snapshot``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvtier.locks import named_lock

OPS = ("get", "set", "exists")
OUTCOMES = ("hit", "miss", "declined", "stored", "skipped", "refused", "error")


class _StoreCounters(Collector):
    """The store's own counters (``StorageBackend.stats()['counters']``), read when Prometheus scrapes."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("kvtier_hicache_store_events", "the kvtier store's counters (misses by reason, "
                                     "errors, reconnects, bytes and seconds per direction)", labels=["event"])
        for name, value in sorted(self.read().items()):
            family.add_metric([name], value)
        yield family


class HiCacheMetrics:
    def __init__(self, store_counters: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        self.pages = Counter("kvtier_hicache_pages", "pages SGLang asked for, by call and outcome", ["op", "outcome"],
                             registry=self.registry)
        self.bytes = Counter("kvtier_hicache_bytes", "KV bytes moved for SGLang, by call", ["op"],
                             registry=self.registry)
        self.registry.register(_StoreCounters(store_counters))
        self._lock = named_lock("sglang.metrics")
        self._calls: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                               "backup_bandwidth": []}
        self._totals: dict[str, float] = {}

    def count(self, op: str, outcome: str, pages: int) -> None:
        if pages:
            self.pages.labels(op, outcome).inc(pages)
            with self._lock:
                key = f"{op}.{outcome}"
                self._totals[key] = self._totals.get(key, 0) + pages

    def call(self, op: str, pages: int, nbytes: int, seconds: float) -> None:
        """One get or set call that moved ``pages`` pages (``nbytes``) in ``seconds``."""
        if not pages:
            return
        self.bytes.labels(op).inc(nbytes)
        kind = "prefetch" if op == "get" else "backup"
        with self._lock:
            self._calls[f"{kind}_pgs"].append(pages)
            self._calls[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def drain(self) -> dict[str, list[float]]:
        """The per-call lists since the last drain (SGLang's ``get_stats`` reports each call once)."""
        with self._lock:
            calls = {name: list(values) for name, values in self._calls.items()}
            for values in self._calls.values():
                values.clear()
        return calls

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {f"{op}.{outcome}": self._totals.get(f"{op}.{outcome}", 0) for op in OPS for outcome in OUTCOMES}
