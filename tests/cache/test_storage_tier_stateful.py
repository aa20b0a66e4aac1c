"""The stateful cache test with a storage tier: random requests, prefetches under every policy, restarts over the
same store, corrupted and vanished stored pages, a store that goes down and comes back. Whatever is matched holds
exactly the bytes inserted for it, and the index and page accounting hold after every step."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from helpers.cache import build
from helpers.cache_machine import CacheMachine
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvtier.cache import page_keys
from kvtier.runtime import create
from kvtier.storage import FileStore, MemoryStore, SharedPages

pytestmark = pytest.mark.slow   # whole-program or stateful runs: `-m 'not slow'` skips them


class Flaky:
    """Makes a store's calls fail while ``down`` (a server that went away), through the backend's own hooks."""

    def __init__(self, store) -> None:
        self.store, self.down = store, False
        for name in ("_exists", "_get", "_set"):
            real = getattr(store, name)
            setattr(store, name, self._wrap(real))

    def _wrap(self, real):
        def call(*args):
            if self.down:
                raise ConnectionError("store down")
            return real(*args)
        return call


class StorageMachine(CacheMachine):
    store_kind = "memory"

    @initialize()
    def start(self):
        self.shared = SharedPages()
        self.directory = tempfile.mkdtemp(prefix="kvtier-stateful-")
        self.stores: list = []
        self.flaky: list[Flaky] = []
        self.salt = None
        self._open()
        self.inserted: set[bytes] = set()
        self.held: list = []
        self.prompts: list[np.ndarray] = []

    def _storage(self, namespace):
        store = MemoryStore(namespace, shared=self.shared, retry_interval=0) if self.store_kind == "memory" else \
            FileStore(self.directory, namespace, retry_interval=0)
        self.stores.append(store)
        self.flaky.append(Flaky(store))
        return store

    def _open(self):
        self.cache, self.model, self.dev, self.host = build(
            create(self.runtime_name), device_pages=12, host_pages=20, write_policy=self.policy,
            write_through_threshold=2, storage=self._storage, storage_batch_pages=2)
        if self.salt is not None:
            self.model.salt = self.salt                  # the same model after a restart
        self.salt = self.model.salt

    def _serve(self, tokens, load):
        """Every request that may load asks storage first (what an engine does at arrival)."""
        if load:
            fetch = self.cache.prefetch(tokens)
            fetch.settle("wait_complete")
            event(f"prefetch {fetch.outcome}")
        super()._serve(tokens, load)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]))
    def prefetch_then_serve(self, data, policy):
        tokens = data.draw(st.sampled_from(self.prompts))
        fetch = self.cache.prefetch(tokens)
        fetch.settle(policy)
        fetch.wait()
        event(f"prefetch {fetch.outcome}")
        self._serve(tokens, True)

    @rule()
    def restart(self):
        for match in self.held:
            self.cache.unlock(match)
        self.held = []
        self.cache.drain()
        self.cache.close()
        self.host.close()
        self.dev.close()
        self._open()

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), how=st.sampled_from(["corrupt", "truncate", "delete"]))
    def damage_a_stored_page(self, data, how):
        self.cache.drain()
        tokens = data.draw(st.sampled_from(self.prompts))
        keys = page_keys(self.model.namespace, tokens)
        key = keys[data.draw(st.integers(0, len(keys) - 1))]
        store = self.stores[-1]
        if store.exists([key]) == 0:
            return
        if how == "delete":
            store.delete([key])
        elif isinstance(store, MemoryStore):
            store.corrupt(key, 200, truncate=100 if how == "truncate" else None)
        else:
            path = store.path(key)
            blob = bytearray(path.read_bytes())
            if how == "truncate":
                del blob[100:]
            else:
                blob[-3] ^= 0x10
            path.write_bytes(bytes(blob))
        event(f"damaged: {how}")

    @rule(down=st.booleans())
    def store_goes_down_or_comes_back(self, down):
        self.flaky[-1].down = down

    def teardown(self):
        try:
            if hasattr(self, "flaky") and self.flaky:
                self.flaky[-1].down = False
            super().teardown()
            for store in getattr(self, "stores", []):
                store.close()
        finally:
            if hasattr(self, "directory"):
                shutil.rmtree(self.directory, ignore_errors=True)


def storage_machine(runtime_name: str, policy: str, store_kind: str) -> type[StorageMachine]:
    return type(f"Storage_{runtime_name}_{policy}_{store_kind}", (StorageMachine,),
                {"runtime_name": runtime_name, "policy": policy, "store_kind": store_kind})


@pytest.mark.parametrize("store_kind", ["memory", "file"])
@pytest.mark.parametrize("runtime_name", ["emulated:split", "emulated:split:2:lazy"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_cache_with_storage_against_the_reference(runtime_name, policy, store_kind):
    test = storage_machine(runtime_name, policy, store_kind).TestCase
    test.settings = settings(max_examples=30, stateful_step_count=30, deadline=None,
                             suppress_health_check=list(HealthCheck))
    test().runTest()


def test_every_example_removes_its_store_directory(monkeypatch):
    """Each example makes a directory for its file store; a run of hundreds of examples must not leave them."""
    made, mkdtemp = [], tempfile.mkdtemp

    def recording(*args, **kwargs):
        made.append(mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recording)
    test = storage_machine("emulated:split", "write_back", "file").TestCase
    test.settings = settings(max_examples=3, stateful_step_count=5, deadline=None,
                             suppress_health_check=list(HealthCheck))
    test().runTest()
    assert made and [path for path in made if os.path.exists(path)] == []
