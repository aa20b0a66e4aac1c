"""Reason counters take documented labels only: a count under an undocumented reason is a count nobody reads."""

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
        metrics.add("storage_skipped", 4, "error")
    assert "storage_skipped.error" not in metrics.snapshot()
    metrics.add("storage_skipped", 4, "store_failed")
    assert metrics.snapshot()["storage_skipped.store_failed"] == 4
