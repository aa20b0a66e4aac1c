"""The hypothesis state machine that runs the cache against a reference model (subclassed by the storage tier's)."""

from __future__ import annotations

import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers.cache import P, build
from kvtier.cache import OutOfPages, page_keys
from kvtier.runtime import create

TOKENS = st.lists(st.integers(0, 2), min_size=P, max_size=8 * P)



class CacheMachine(RuleBasedStateMachine):
    runtime_name = "emulated:split"
    policy = "write_through"

    @initialize()
    def start(self):
        runtime = create(self.runtime_name)
        self.cache, self.model, self.dev, self.host = build(runtime, device_pages=12, host_pages=20,
                                                            write_policy=self.policy, write_through_threshold=2)
        self.inserted: set[bytes] = set()
        self.held: list = []
        self.prompts: list[np.ndarray] = []

    def _served_bytes_are_right(self, tokens, pages):
        assert not self.model.mismatches(tokens, pages), "the cache served wrong KV"
        keys = page_keys(self.model.namespace, tokens)[: len(pages)]
        assert set(keys) <= self.inserted, "the cache matched a prefix nobody inserted"

    @rule(tokens=TOKENS, load=st.booleans())
    def request(self, tokens, load):
        self._serve(np.array(tokens), load)
        self.prompts.append(np.array(tokens))

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), cut=st.integers(0, 3 * P))
    def repeat(self, data, cut):
        tokens = data.draw(st.sampled_from(self.prompts))
        self._serve(tokens[: max(P, len(tokens) - cut)], True)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def evict_then_reload(self, data):
        self.cache.drain()
        self.cache.evict(device_pages=12)
        self._serve(data.draw(st.sampled_from(self.prompts)), True)

    @rule()
    def drain_and_evict_the_device(self):
        self.cache.drain()
        self.cache.evict(device_pages=12)

    def _serve(self, tokens, load):
        with self.cache.request(tokens, load_back=load, force=True, prefetch=False) as request:
            request.wait()
            self._served_bytes_are_right(tokens, request.match.device_pages)
            if load:
                loaded = request.load
                event("load-back" if loaded is not None else "no load-back")
                if loaded is not None:
                    event(f"load-back of {'one page' if len(loaded.device_pages) == 1 else 'several pages'}")
                    self._served_bytes_are_right(tokens, request.prefix_pages)
            try:
                new = request.allocate()
            except OutOfPages:
                return
            self.model.write(tokens, new, first_page=len(request.prefix_pages))
            request.insert()
            self.inserted.update(page_keys(self.model.namespace, tokens))

    @precondition(lambda self: len(self.held) < 3)
    @rule(tokens=TOKENS)
    def hold(self, tokens):
        self.held.append(self.cache.match_prefix(np.array(tokens), lock=True))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        match = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.cache.unlock(match)

    @rule(device=st.integers(0, 12), host=st.integers(0, 20))
    def evict(self, device, host):
        self.cache.evict(device_pages=device, host_pages=host)

    @rule(tokens=TOKENS)
    def backup(self, tokens):
        self.cache.backup(self.cache.match_prefix(np.array(tokens)))

    @rule()
    def drain(self):
        self.cache.drain()

    @invariant()
    def consistent(self):
        if hasattr(self, "cache"):
            self.cache.check()

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for match in self.held:
            self.cache.unlock(match)
        self.cache.drain()
        self.cache.check()
        assert all(n.lock == 0 for n in self.cache.index.all_nodes()), "locks do not balance"
        self.cache.close()
        assert self.cache.device.free_pages == self.cache.device.pages
        assert self.cache.host.free_pages == self.cache.host.pages
        self.host.close()
        self.dev.close()
