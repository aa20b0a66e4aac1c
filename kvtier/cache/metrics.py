"""What the cache did, as a Prometheus registry and as a plain dict.

Each cache has its own ``CollectorRegistry`` (two caches in one process never collide); expose it with
``prometheus_client.start_http_server(port, registry=cache.metrics.registry)`` or read ``snapshot()``. Counts are
plain numbers under one lock, turned into Prometheus families only when scraped: the cache counts on every match and
insert, and a prometheus-client series costs microseconds a call there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

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
        "no_state": "storage holds KV pages but no state snapshot at any of them, or past the deepest one (hybrid)",
    },
}
"""The only labels these counters take, and what each means (docs/cache.md and docs/storage.md list them): a count
under a reason nobody documented is a count nobody reads."""
REASONS["prefetch_skipped"] = REASONS["prefetches"]


LABELS: dict[str, tuple[str, ...]] = {
    **{name: tuple(reasons) for name, reasons in REASONS.items()},
    "hits": TIERS, "hit_tokens": TIERS, "evicted": TIERS,
    "bytes": DIRECTIONS, "pages": DIRECTIONS, "seconds": DIRECTIONS, "errors": DIRECTIONS,
    "states": ("load", "backup", "evicted_device", "evicted_host", "forked", "stored", "prefetched"),
    "storage_pages": ("read", "written"), "storage_bytes": ("read", "written"),
    "queue": ("backup_requests", "loads_in_flight", "backups_in_flight", "prefetches", "storage_write_pages"),
    "tokens": ("device", "host"), "free_pages": ("device", "host"),
}
"""Every label each labelled metric takes: the snapshot lists each one (0 until counted), so a reader that names a
label nobody counts under fails (a KeyError) instead of reading 0 for ever."""


class Metric:
    """One counter or gauge, read and written by attribute (``metrics.hits.inc(1, "device")``,
    ``metrics.hits.value("device")``): a misspelt metric is an AttributeError and an undocumented label a KeyError,
    where reading a dict by a string key with a default would have said 0."""

    def __init__(self, name: str, metric: str, doc: str, kind: str, label: str | None,
                 labels: tuple[str, ...] | None, lock: Any) -> None:
        self.name, self.metric, self.doc, self.kind, self.label = name, metric, doc, kind, label
        self.labels, self._lock = labels, lock
        self._values: dict[str | None, float] = dict.fromkeys(labels if labels is not None else (None,), 0.0)
        self._live: dict[str | None, Callable[[], float]] = {}

    def _check(self, label: str | None) -> None:
        if self.labels is None and label is not None:
            raise KeyError(f"{self.name} takes no label, got {label!r}")
        if self.labels is not None and label not in self.labels:
            raise KeyError(f"{label!r} is not a documented label of {self.name}: {', '.join(self.labels)}")

    def inc(self, amount: float = 1.0, label: str | None = None) -> None:
        if label not in self._values:
            self._check(label)
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up, got {amount}")
        with self._lock:
            self._values[label] += amount

    def set(self, value: float, label: str) -> None:
        if label not in self._values:
            self._check(label)
        with self._lock:
            self._values[label] = value

    def live(self, label: str, read: Callable[[], float]) -> None:
        """The gauge's ``label`` is ``read()`` whenever it is read (a scrape, ``value``, ``snapshot``), so nothing
        on a hot path keeps it up to date. ``read`` runs without the cache's lock: it must only read."""
        self._check(label)
        with self._lock:
            self._live[label] = read

    def value(self, label: str | None = None) -> float:
        self._check(label)
        with self._lock:
            read = self._live.get(label)
            if read is None:
                return self._values[label]
        return read()

    def family(self) -> CounterMetricFamily | GaugeMetricFamily:
        """This metric as a Prometheus family, every documented label present."""
        kind = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        family = kind(self.metric, self.doc, labels=[self.label] if self.label else [])
        for label, value in self._current().items():
            family.add_metric([label] if label is not None else [], value)
        return family

    def _current(self) -> dict[str | None, float]:
        with self._lock:
            values, live = dict(self._values), dict(self._live)
        values.update((label, read()) for label, read in live.items())
        return values

    def items(self) -> list[tuple[str, float]]:
        """(``name.label`` or ``name``, value) for every label, counted or not."""
        return [(self.name if label is None else f"{self.name}.{label}", value)
                for label, value in self._current().items()]


class CacheMetrics:
    """Each counter and gauge of the cache as an attribute (a :class:`Metric`); ``snapshot()`` is the plain dict
    ``KVCache.stats()`` and the demo report read, with every documented label present."""

    def __init__(self) -> None:
        lock = named_lock("cache.metrics")

        def counter(name: str, metric: str, doc: str, label: str | None = None) -> Metric:
            return Metric(name, metric, doc, "counter", label, LABELS[name] if label else None, lock)

        def gauge(name: str, metric: str, doc: str, label: str) -> Metric:
            return Metric(name, metric, doc, "gauge", label, LABELS[name], lock)

        self.lookups = counter("lookups", "kvtier_cache_lookups", "match_prefix calls")
        self.lookup_tokens = counter("lookup_tokens", "kvtier_cache_lookup_tokens", "tokens looked up (whole pages)")
        self.hits = counter("hits", "kvtier_cache_hits", "lookups with a hit on a tier", "tier")
        self.hit_tokens = counter("hit_tokens", "kvtier_cache_hit_tokens", "tokens found per tier", "tier")
        self.bytes = counter("bytes", "kvtier_cache_transfer_bytes", "bytes moved per direction", "direction")
        self.pages = counter("pages", "kvtier_cache_transfer_pages", "pages moved per direction", "direction")
        self.seconds = counter("seconds", "kvtier_cache_transfer_seconds", "submit-to-completion time of transfers",
                               "direction")
        self.states = counter("states", "kvtier_cache_states", "state snapshots moved (load, backup), forked, "
                              "evicted alone (evicted_device, evicted_host), written to or read from storage (stored, "
                              "prefetched) on hybrid caches", "what")
        self.evicted = counter("evicted", "kvtier_cache_evicted_tokens", "tokens evicted per tier", "tier")
        self.decisions = counter("decisions", "kvtier_cache_load_back_decisions", "load-back decisions", "decision")
        self.skipped = counter("skipped", "kvtier_cache_backups_skipped", "backups not made", "reason")
        self.errors = counter("errors", "kvtier_cache_transfer_errors", "transfers that failed", "direction")
        self.prefetches = counter("prefetches", "kvtier_cache_prefetches", "storage prefetches by outcome", "outcome")
        self.storage_pages = counter("storage_pages", "kvtier_cache_storage_pages",
                                     "pages read from / written to storage", "direction")
        self.storage_bytes = counter("storage_bytes", "kvtier_cache_storage_bytes",
                                     "bytes read from / written to storage", "direction")
        self.prefetch_skipped = counter("prefetch_skipped", "kvtier_cache_prefetch_pages_skipped", "stored pages a "
                                        "prefetch did not read, by the outcome that ended it", "reason")
        self.storage_skipped = counter("storage_skipped", "kvtier_cache_storage_writes_skipped",
                                       "pages not written to storage", "reason")
        self.queue = gauge("queue", "kvtier_cache_queue_depth", "work waiting or in flight", "queue")
        self.tokens = gauge("tokens", "kvtier_cache_tokens", "tokens held per tier", "tier")
        self.free_pages = gauge("free_pages", "kvtier_cache_free_pages", "free pages per tier", "tier")
        self._lookup_values = (self.lookups._values, self.lookup_tokens._values, self.hits._values,
                               self.hit_tokens._values)
        self.registry = CollectorRegistry()
        self.registry.register(_Families(self.all))

    def lookup(self, tokens: int, device: int, host: int) -> None:
        """One ``match_prefix``: its tokens, and its hits per tier, counted under one lock (it runs on every match)."""
        lookups, looked, hits, hit_tokens = self._lookup_values
        with self.lookups._lock:                     # every metric of a cache shares the one lock
            lookups[None] += 1
            looked[None] += tokens
            if device:
                hits["device"] += 1
                hit_tokens["device"] += device
            if host:
                hits["host"] += 1
                hit_tokens["host"] += host

    def all(self) -> list[Metric]:
        return [value for value in vars(self).values() if isinstance(value, Metric)]

    def snapshot(self) -> dict[str, Any]:
        """Every value by ``name.label`` (every documented label, 0 until counted), plus hit rates and GB/s per
        direction."""
        values: dict[str, Any] = dict(item for metric in self.all() for item in metric.items())
        looked = values["lookup_tokens"]
        for tier in TIERS:
            values[f"hit_rate.{tier}"] = values[f"hit_tokens.{tier}"] / looked if looked else 0.0
        for direction in DIRECTIONS:
            seconds = values[f"seconds.{direction}"]
            values[f"gbps.{direction}"] = values[f"bytes.{direction}"] / seconds / 1e9 if seconds else 0.0
        return values


class _Families(Collector):
    """Every metric of a cache as Prometheus families, built when the registry is scraped."""

    def __init__(self, metrics: Callable[[], list[Metric]]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for metric in self.metrics():
            yield metric.family()
