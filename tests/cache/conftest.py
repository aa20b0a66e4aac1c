"""Fixtures the cache's tests share."""

from __future__ import annotations

import pytest
from helpers.cache import build, close_all


@pytest.fixture
def small_cache(rt):
    """(cache, model, runtime): 8 device and 16 host pages on a fresh emulated runtime, closed after the test."""
    cache, model, dev, host = build(rt, device_pages=8, host_pages=16)
    yield cache, model, rt
    close_all(cache, dev, host)


@pytest.fixture
def made(runtime, request):
    """(cache, model) on every runtime, built with ``build``'s defaults or the options a test parametrizes
    indirectly; closed after the test."""
    cache, model, dev, host = build(runtime, **getattr(request, "param", {}))
    yield cache, model
    close_all(cache, dev, host)
