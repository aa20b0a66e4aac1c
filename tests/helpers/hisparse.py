"""HiSparse hot buffers set up on a runtime, and an independent pure-Python model of the swap-in's LRU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from helpers.device_kernels import random_bytes
from helpers.pools import fill_device, host_bytes, read_device
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.transfer.hisparse import HotBuffer

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]



class Lru:
    """One (request, layer)'s hot slots."""

    def __init__(self, slots: int) -> None:
        self.n = slots
        self.order = list(range(slots))       # least recent first
        self.tokens = list(range(slots))      # slot -> token

    def step(self, top: list[int], seq: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Slot of each entry (``n`` for the newest token, -1 outside the sequence) and the (token, slot) misses."""
        if seq <= self.n:
            return [t if 0 <= t < seq else -1 for t in top], []
        hits: set[int] = set()
        misses: list[int] = []
        for t in top:
            if not 0 <= t < seq - 1:
                continue
            if t in self.tokens:
                hits.add(self.tokens.index(t))
            elif t not in misses:
                misses.append(t)
        evictable = [s for s in self.order if s not in hits]
        victims = evictable[:len(misses)]
        self.order = evictable[len(misses):] + victims + [s for s in self.order if s in hits]
        for t, s in zip(misses, victims, strict=True):
            self.tokens[s] = t
        slots = [-1 if not 0 <= t < seq else self.n if t == seq - 1 else self.tokens.index(t) for t in top]
        return slots, list(zip(misses, victims, strict=True))



def host_offset(host: HostPool, tensor: int, layer: int, unit: int) -> int:
    """Byte offset of token ``unit``'s row, by the documented layouts."""
    g, pages = host.geometry, host.pages
    page, slot = divmod(unit, g.page_size)
    base = tensor * pages * g.layers * g.page_bytes
    if host.layout.value == "layer_first":
        return base + layer * pages * g.page_bytes + page * g.page_bytes + slot * g.row_bytes
    if host.layout.value == "page_first":
        return base + page * g.layers * g.page_bytes + slot * g.layers * g.row_bytes + layer * g.row_bytes
    return base + page * g.layers * g.page_bytes + layer * g.page_bytes + slot * g.row_bytes



class Setup:
    def __init__(self, runtime: Any, kind: str, layout: str, *, requests: int = 3, slots: int = 6, top_k: int = 4,
                 max_tokens: int = 24, layers: int = 2, page_size: int = 4, shuffle_rows: bool = False,
                 spare_rows: int = 0) -> None:
        self.rng = np.random.default_rng()
        self.runtime, self.R, self.N, self.K, self.T, self.L = runtime, requests, slots, top_k, max_tokens, layers
        if kind == "mha":
            hg, dg = (KVGeometry.mha(layers, 2, 16, 2, ps) for ps in (page_size, 1))
        else:
            hg, dg = (KVGeometry.mla(layers, 80, ps) for ps in (page_size, 1))
        self.g = dg
        self.rows = requests * (slots + 1) + spare_rows
        self.dev = DevicePool.allocate(dg, self.rows, 0, runtime=runtime)
        units = requests * max_tokens + 2 * page_size
        self.host = HostPool.allocate(hg, layout, pages=-(-units // page_size), runtime=runtime)
        self.hb = HotBuffer(self.dev, self.host, requests=requests, slots=slots, top_k=top_k, max_tokens=max_tokens)
        # every request's tokens at random, disjoint host units; its rows at random device rows when asked
        perm = self.rng.permutation(self.host.pages * page_size)
        row_perm = self.rng.permutation(self.rows) if shuffle_rows else np.arange(self.rows)
        self.host_locs = [perm[r * max_tokens:(r + 1) * max_tokens] for r in range(requests)]
        self.dev_locs = [row_perm[r * (slots + 1):(r + 1) * (slots + 1)] for r in range(requests)]
        for r in range(requests):
            self.hb.assign(r, self.host_locs[r], self.dev_locs[r] if shuffle_rows else None)
        view = self.host.buffer.as_tensor().numpy()
        view[:] = random_bytes(view.size)
        del view
        self.host_data = host_bytes(self.host)
        self.device = fill_device(self.dev)   # {(tensor, layer): [rows, row_bytes]}
        self.lru = {(r, layer): Lru(slots) for r in range(requests) for layer in range(layers)}

    def close(self) -> None:
        self.hb.close(), self.host.close(), self.dev.close()

    def host_row(self, tensor: int, layer: int, unit: int) -> np.ndarray:
        offset = host_offset(self.host, tensor, layer, int(unit))
        return self.host_data[offset:offset + self.g.row_bytes]

    def random_topk(self, request: int, layer: int, seq: int) -> list[int]:
        """Hits, misses, duplicates, padding, out-of-range entries and the newest token, mixed."""
        lru, out = self.lru[(request, layer)], []
        for _ in range(self.K):
            roll = self.rng.random()
            if roll < 0.3 and seq > 1:
                resident = [t for t in lru.tokens if t < seq - 1] if seq > self.N else list(range(seq))
                out.append(int(self.rng.choice(resident)) if resident else int(self.rng.integers(0, seq)))
            elif roll < 0.65:
                out.append(int(self.rng.integers(0, seq)))
            elif roll < 0.75 and out:
                out.append(int(self.rng.choice(out)))
            elif roll < 0.82:
                out.append(-1)
            elif roll < 0.87:
                out.append(int(self.rng.integers(seq, seq + 5)))
            elif roll < 0.92:
                out.append(int(self.rng.integers(-5, -1)))
            else:
                out.append(seq - 1)
        return out

    def expect(self, layer: int, requests: list[int], topk: list[list[int]], seqs: list[int]) -> np.ndarray:
        """Advance the model; returns the expected out rows and updates the expected device rows."""
        expected = np.full((len(requests), self.K), -1, np.int64)
        for b, (r, top, seq) in enumerate(zip(requests, topk, seqs, strict=True)):
            slots, misses = self.lru[(r, layer)].step(top, seq)
            expected[b] = [self.dev_locs[r][s] if s >= 0 else -1 for s in slots]
            for token, slot in misses:
                for tensor in range(self.g.tensors):
                    self.device[(tensor, layer)][self.dev_locs[r][slot]] = self.host_row(
                        tensor, layer, self.host_locs[r][token])
        return expected

    def check(self, out: Any, expected: np.ndarray) -> None:
        self.hb.synchronize()
        got = np.frombuffer(out.download(0, expected.size * 8), np.int64).reshape(expected.shape)
        np.testing.assert_array_equal(got, expected)
        self.check_memory()

    def check_memory(self) -> None:
        for tensor in range(self.g.tensors):
            for layer in range(self.L):
                np.testing.assert_array_equal(read_device(self.dev, tensor, layer), self.device[(tensor, layer)],
                                              err_msg=f"tensor {tensor} layer {layer}")
        np.testing.assert_array_equal(host_bytes(self.host), self.host_data)
        for (r, layer), lru in self.lru.items():
            state = self.hb.read_state(r, layer)
            assert state["lru"].tolist() == lru.order, (r, layer)
            assert state["slot_tokens"][:self.N].tolist() == lru.tokens, (r, layer)
            np.testing.assert_array_equal(state["device_rows"], self.dev_locs[r])



@contextlib.contextmanager
def setup(runtime: Any, kind: str = "mla", layout: str = "page_first", **kwargs: Any) -> Iterator[Setup]:
    s = Setup(runtime, kind, layout, **kwargs)
    try:
        yield s
    finally:
        s.close()
