"""SGLang's own classes for the HiCache backend's tests: its storage config, its backend factory and its real host
pools, built on the CPU (``helpers.sglang_pools``, which the bench imports too: the stand-ins it uses are described
there).

Here a missing SGLang is a skip, unless ``KVTIER_REQUIRE_SGLANG=1`` (CI) makes it a failure: each builder of
``helpers.sglang_pools`` that needs SGLang is wrapped so.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import pytest

import helpers.sglang_pools as pools
from helpers.sglang_pools import (  # noqa: F401 (the tests' names for them)
    FACTORY,
    PLACEHOLDERS,
    POOL_BUDGET,
    STORAGE,
    SGLangMissing,
    _pointer_table,
    extra_config,
    fill_pages,
    page_bytes,
    page_keys,
    page_slots,
    pages_at,
    place_torchvision,
    poison_pages,
    reads_back,
    restore_pages,
    store_pages,
)


def _skip_without_sglang(build: Callable[..., Any]) -> Callable[..., Any]:
    """``build``, where SGLangMissing skips the test (fails it with ``KVTIER_REQUIRE_SGLANG=1``)."""
    @functools.wraps(build)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return build(*args, **kwargs)
        except SGLangMissing as missing:
            if os.environ.get("KVTIER_REQUIRE_SGLANG") == "1":
                pytest.fail(f"{missing} (KVTIER_REQUIRE_SGLANG=1)")
            pytest.skip(str(missing))
    return call


need_sglang = _skip_without_sglang(pools.import_storage)
"""Skip (or fail, with ``KVTIER_REQUIRE_SGLANG=1``) where SGLang's HiCache storage interface does not import."""
import_host_pools = _skip_without_sglang(pools.import_host_pools)
mha_host_pool = _skip_without_sglang(pools.mha_host_pool)
mla_host_pool = _skip_without_sglang(pools.mla_host_pool)
mamba_host_pool = _skip_without_sglang(pools.mamba_host_pool)
storage_config = _skip_without_sglang(pools.storage_config)
create_backend = _skip_without_sglang(pools.create_backend)
create_sglang_backend = _skip_without_sglang(pools.create_sglang_backend)
