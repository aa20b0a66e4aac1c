"""Metrics are read and written by attribute and take documented labels only: a count under an undocumented reason
is a count nobody reads, and a reader that names a counter or label nobody counts under fails instead of reading 0."""

from __future__ import annotations

import pytest
from helpers.paths import ROOT

from kvtier.cache.metrics import REASONS, CacheMetrics

DOCS = ROOT / "docs" / "cache.md"


def test_every_reason_label_is_documented():
    text = DOCS.read_text()
    missing = [f"{name}.{label}" for name, labels in REASONS.items() for label in labels if f"`{label}`" not in text]
    assert not missing, f"docs/cache.md does not name these labels: {missing}"


def test_a_count_under_an_undocumented_reason_raises_and_counts_nothing():
    metrics = CacheMetrics()
    with pytest.raises(KeyError, match="not a documented label of storage_skipped"):
        metrics.storage_skipped.inc(4, "error")
    assert "storage_skipped.error" not in metrics.snapshot()
    metrics.storage_skipped.inc(4, "store_failed")
    assert metrics.snapshot()["storage_skipped.store_failed"] == 4 == metrics.storage_skipped.value("store_failed")


def test_a_misnamed_counter_or_label_fails_where_it_is_read():
    """The old dict read ``get("prefetch_skiped.host_full", 0)`` said 0 for ever; attributes and a snapshot that lists
    every documented label turn the same slip into an error."""
    metrics = CacheMetrics()
    with pytest.raises(AttributeError):
        metrics.prefetch_skiped                                  # noqa: B018
    with pytest.raises(KeyError, match="not a documented label of hits"):
        metrics.hits.value("disk")
    with pytest.raises(KeyError, match="lookups takes no label"):
        metrics.lookups.inc(1, "device")
    snapshot = metrics.snapshot()
    assert snapshot["prefetch_skipped.host_full"] == 0 and snapshot["queue.storage_write_pages"] == 0
    with pytest.raises(KeyError):
        snapshot["prefetch_skiped.host_full"]                    # noqa: B018
    assert all(f"{m.name}.{label}" in snapshot for m in metrics.all() for label in m.labels or ())


def test_the_prometheus_registry_counts_what_the_attributes_count():
    metrics = CacheMetrics()
    metrics.hit_tokens.inc(48, "host")
    metrics.queue.set(3, "prefetches")
    assert metrics.registry.get_sample_value("kvtier_cache_hit_tokens_total", {"tier": "host"}) == 48
    assert metrics.registry.get_sample_value("kvtier_cache_queue_depth", {"queue": "prefetches"}) == 3


def test_a_live_gauge_reads_its_source_at_every_read_and_nothing_keeps_it_up_to_date():
    """The cache's token and free-page gauges are read from the tree and the allocators when read (a scrape, a
    snapshot), not set on every call that changes them: a value set once and never again would go stale."""
    metrics = CacheMetrics()
    source = {"free": 7}
    metrics.free_pages.live("device", lambda: source["free"])
    source["free"] = 3
    assert metrics.free_pages.value("device") == 3 == metrics.snapshot()["free_pages.device"]
    assert metrics.registry.get_sample_value("kvtier_cache_free_pages", {"tier": "device"}) == 3
    with pytest.raises(KeyError, match="not a documented label of free_pages"):
        metrics.free_pages.live("disk", lambda: 0)


def test_a_scrape_beside_serving_and_close_reads_every_family_and_ends_at_empty_tiers(rt):
    """Prometheus scrapes from its own thread whenever it likes: while requests are served, and while the cache closes
    (which gives the tiers a fresh index). Every scrape must see every family, and the last one the empty tiers."""
    import threading

    from helpers.cache import P, build, joined, prompt, serve, spawn
    from prometheus_client import generate_latest

    cache, model, dev, host = build(rt, device_pages=16, host_pages=32)
    stop = threading.Event()
    scrapes: list[bytes] = []

    def scraping():
        while not stop.is_set():
            scrapes.append(generate_latest(cache.metrics.registry))

    scraper, outcome = spawn("scraper", scraping)
    try:
        for _ in range(20):
            serve(cache, model, prompt(2 * P))
        cache.close()
    finally:
        stop.set()
        joined(scraper)
        host.close()
        dev.close()
    assert outcome == [("ok", None)] and scrapes
    assert all(b"kvtier_cache_lookups_total" in s and b'kvtier_cache_free_pages{tier="host"}' in s for s in scrapes)
    final = generate_latest(cache.metrics.registry).decode()
    assert 'kvtier_cache_tokens{tier="device"} 0.0' in final and "kvtier_cache_lookups_total 20.0" in final
