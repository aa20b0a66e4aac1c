"""Without Mooncake's wheel, kvtier imports and ``kvtier.disagg`` imports; making an endpoint says what to
install."""

from __future__ import annotations

import sys

import pytest
from helpers.disagg import GEOMETRY, make_pool

from kvtier.errors import RuntimeUnavailable


def test_an_endpoint_without_the_wheel_names_what_to_install(rt, monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    from kvtier.disagg import KVReceiver

    pool = make_pool(GEOMETRY, "page_first", 4, rt)
    try:
        with pytest.raises(RuntimeUnavailable, match="pip install mooncake-transfer-engine"):
            KVReceiver(pool)
        assert not pool.closed
    finally:
        pool.close()
