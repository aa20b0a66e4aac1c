"""Fixtures of the disaggregation tests."""

from __future__ import annotations

import pytest
from helpers.mooncake import need_mooncake


@pytest.fixture
def mooncake_wheel() -> None:
    """Skip (or fail, with KVTIER_REQUIRE_MOONCAKE=1) where Mooncake's wheel is missing."""
    need_mooncake()
