"""Fixtures of the SGLang HiCache backend's tests: a store spec of each kind SGLang users would pick, and a
``backends`` list that closes every backend a test made."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import sglang as sg

SGLANG_STORES = ["file", "redis", "mooncake"]


@pytest.fixture(autouse=True)
def _sglang() -> None:
    sg.need_sglang()


@pytest.fixture(params=SGLANG_STORES)
def spec(request: pytest.FixtureRequest, tmp_path) -> str:
    """A kvtier store spec on a real store: a directory, a Redis server, a Mooncake Store."""
    if request.param == "file":
        return f"file:{tmp_path / 'store'}"
    if request.param == "redis":
        return request.getfixturevalue("redis_url")
    return request.getfixturevalue("mooncake_spec")


@pytest.fixture
def file_spec(tmp_path) -> str:
    return f"file:{tmp_path / 'store'}"


@pytest.fixture
def backends() -> Iterator[list]:
    """Backends a test makes (append them): closed at the end, whatever happened."""
    made: list = []
    yield made
    for backend in made:
        backend.close()
