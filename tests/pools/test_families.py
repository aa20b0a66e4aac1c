"""Model-family pools (Mamba / compress state, DSA indexer, DeepSeek-V4 page rows) through ``FamilyEngine``.

Every check is byte-exact against an independent model of where each layout keeps each byte: destinations are
poisoned first, sources are fresh random bytes (never zeros), index lists are random and non-contiguous, and every byte
of both pools is compared (untouched units, pads and other layers included).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers.families import (
    STATES,
    DeviceImage,
    assert_image,
    closing,
    state_backup_expected,
    state_load_expected,
    state_pools,
)
from helpers.pools import fill_host, host_bytes
from helpers.runtimes import is_split

from kvtier.errors import AddressDomainError, BufferClosed, IllegalAddress, InvalidArgument, KvtierError
from kvtier.memory import DeviceAddress, HostKind, get_device_accessible_ptr
from kvtier.pools.paged_rows import PagedRowDevicePool, PagedRowGeometry, PagedRowHostPool
from kvtier.pools.state import StateDevicePool, StateGeometry, StateHostPool
from kvtier.transfer.family import FamilyEngine

# -- device memory, through the runtime's copy API only ---------------------------------------------------------------


# -- Mamba / compress state -------------------------------------------------------------------------------------------


def state_round_trip(runtime: Any, g: StateGeometry, request_major: bool, pad: int, layout: str,
                     counts: tuple[int, ...] = (0, 1, 3, 5)) -> None:
    rng = np.random.default_rng()
    slots, host_slots = 5, 7
    with state_pools(runtime, g, slots=slots, host_slots=host_slots, request_major=request_major, pad=pad,
                     layout=layout) as (dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        for count in counts:
            device = image.fill()
            before = fill_host(host)
            src = rng.choice(slots, count, replace=False)
            dst = rng.choice(host_slots, count, replace=False)
            engine.backup(src, dst).wait()
            after = host_bytes(host)
            np.testing.assert_array_equal(after, state_backup_expected(model, device, before, src, dst))
            assert_image(image.read(), device)  # a backup leaves the device alone
            poisoned = image.poison()
            host_src = rng.choice(host_slots, count, replace=False)
            dev_dst = rng.choice(slots, count, replace=False)
            transfer = engine.load(host_src, dev_dst)
            transfer.wait()
            assert sorted(transfer.layer_events) == list(range(g.layers))
            assert transfer.done()
            assert_image(image.read(), state_load_expected(model, poisoned, after, host_src, dev_dst))
            np.testing.assert_array_equal(host_bytes(host), after)  # a load leaves the host alone


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("request_major,pad", [(False, 0), (True, 0), (False, 6), (True, 16), (True, 3)])
@pytest.mark.parametrize("kind", list(STATES))
def test_state_round_trip(runtime, kind, request_major, pad, layout):
    state_round_trip(runtime, STATES[kind](3), request_major, pad, layout)


def test_state_load_sources_may_repeat(runtime):
    g = STATES["fp16-bf16"](2)
    with state_pools(runtime, g, pad=2) as (dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        poisoned = image.poison()
        data = fill_host(host)
        engine.load([6, 6, 2], [4, 0, 1]).wait()
        assert_image(image.read(), state_load_expected(model, poisoned, data, [6, 6, 2], [4, 0, 1]))


@pytest.mark.parametrize("request_major", [False, True])
def test_state_per_layer_events_and_layer_subsets(runtime, request_major):
    g = STATES["odd"](4)
    with state_pools(runtime, g, request_major=request_major, pad=5, layout="page_first_direct") as (
            dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        poisoned = image.poison()
        data = fill_host(host)
        transfer = engine.load([5, 1, 3], [2, 0, 4], layers=[3, 1])
        for layer in (3, 1):
            transfer.wait_layer(layer)
        transfer.wait()
        assert sorted(transfer.layer_events) == [1, 3]
        with pytest.raises(KvtierError, match="layer 0 is not part"):
            transfer.wait_layer(0)
        assert_image(image.read(), state_load_expected(model, poisoned, data, [5, 1, 3], [2, 0, 4], layers=[3, 1]))
        # not per layer: one launch per run of layers, no layer events, same bytes
        poisoned = image.poison()
        transfer = engine.load([0], [3], per_layer=False)
        transfer.wait()
        assert transfer.layer_events == {}
        assert_image(image.read(), state_load_expected(model, poisoned, data, [0], [3]))
        # an empty per-layer load still marks every layer
        transfer = engine.load([], [])
        for layer in range(g.layers):
            transfer.wait_layer(layer)
        assert sorted(transfer.layer_events) == list(range(g.layers))


@pytest.mark.parametrize("index_bytes", [4, 8])
def test_state_int32_indices_and_one_block(runtime, index_bytes):
    g = STATES["fp32"](2)
    with state_pools(runtime, g, index_bytes=index_bytes, max_blocks=1, threads=32) as (dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        device = image.fill()
        before = fill_host(host)
        engine.backup([4, 0, 2], [6, 1, 3]).wait()
        np.testing.assert_array_equal(host_bytes(host), state_backup_expected(model, device, before, [4, 0, 2],
                                                                              [6, 1, 3]))


def test_state_graph_replay_reads_host_bytes_written_after_capture(runtime):
    g = STATES["fp16-bf16"](3)
    with state_pools(runtime, g, request_major=True, pad=6, layout="page_first_direct") as (
            dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        poisoned = image.poison()
        captured = engine.capture_load([3, 0, 6], [1, 4, 0], layer=1)
        assert_image(image.read(), poisoned)  # capturing copies nothing
        for _ in range(2):
            data = fill_host(host)
            captured.replay()
            captured.stream.synchronize()
            assert_image(image.read(), state_load_expected(model, poisoned, data, [3, 0, 6], [1, 4, 0], layers=[1]))
        captured.close()
        with pytest.raises(BufferClosed):
            captured.replay()


def test_state_graph_replay_after_engine_close_is_refused(runtime):
    g = STATES["fp32"](2)
    with state_pools(runtime, g) as (_, _, engine, _):
        captured = engine.capture_load([0], [1], layer=0)
        engine.close()
        with pytest.raises(BufferClosed):
            captured.replay()


def test_state_bad_input_is_refused_before_anything_is_written(runtime):
    g = STATES["fp16-bf16"](2)
    with state_pools(runtime, g, pad=2) as (dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        device = image.fill()
        before = fill_host(host)
        cases = [([0, 5], [0, 1], "device slot index 5"),
                 ([0, -1], [0, 1], "device slot index -1"),
                 ([0, 1], [0, 7], "host slot index 7"),
                 ([0, 1], [0], "must match"),
                 ([0, 1], [3, 3], "appears twice"),
                 (np.array([0.0, 1.0]), [0, 1], "integers"),
                 ([[0, 1]], [[0, 1]], "flat")]
        for dev_units, host_units, match in cases:
            with pytest.raises(InvalidArgument, match=match):
                engine.backup(dev_units, host_units)
        for host_units, dev_units, match in [([0, 1], [2, 2], "appears twice"), ([7], [0], "host slot index 7"),
                                             ([0], [5], "device slot index 5")]:
            with pytest.raises(InvalidArgument, match=match):
                engine.load(host_units, dev_units)
            with pytest.raises(InvalidArgument, match=match):
                engine.capture_load(host_units, dev_units, layer=0)
        for layers, match in [([0, 2], "layer 2 is out of range"), ([1, 1], "repeat"), ([-1], "out of range"),
                              (1, "sequence")]:
            with pytest.raises(InvalidArgument, match=match):
                engine.load([0], [0], layers=layers)
        with pytest.raises(InvalidArgument, match="layer 2 is out of range"):
            engine.capture_load([0], [0], layer=2)
        for unit in ("page", "token"):
            with pytest.raises(InvalidArgument, match="not"):
                engine.backup([0], [0], unit=unit)
        engine.synchronize()
        np.testing.assert_array_equal(host_bytes(host), before)
        assert_image(image.read(), device)


def test_closed_engine_and_pools_refuse_work(runtime):
    g = STATES["fp32"](2)
    dev = StateDevicePool.allocate(g, 3, 0, runtime=runtime)
    host = StateHostPool.allocate(g, slots=3, runtime=runtime)
    engine = FamilyEngine(dev, host)
    engine.close()
    engine.close()  # idempotent
    for call in (lambda: engine.backup([0], [0]), lambda: engine.load([0], [0]),
                 lambda: engine.capture_load([0], [0], layer=0)):
        with pytest.raises(BufferClosed):
            call()
    engine = FamilyEngine(dev, host)
    host.close()
    with pytest.raises(BufferClosed):
        engine.load([0], [0])
    engine.close()
    engine = None
    dev2 = StateDevicePool.allocate(g, 3, 0, runtime=runtime)
    host2 = StateHostPool.allocate(g, slots=3, runtime=runtime)
    engine = FamilyEngine(dev2, host2)
    dev2.close()  # waits for the engine's queued work, then frees the state
    with pytest.raises(BufferClosed):
        engine.backup([0], [0])
    with pytest.raises(BufferClosed):
        FamilyEngine(dev2, host2)
    engine.close(), host2.close(), dev.close()


def test_engine_refuses_mismatched_or_pageable_pools(runtime):
    g, other = STATES["fp32"](2), STATES["fp32"](3)
    dev = StateDevicePool.allocate(g, 3, 0, runtime=runtime)
    with closing(dev):
        host = StateHostPool.allocate(other, slots=3, runtime=runtime)
        with closing(host), pytest.raises(InvalidArgument, match="geometries differ"):
            FamilyEngine(dev, host)
        pageable = StateHostPool.allocate(g, slots=3, kind=HostKind.PAGEABLE, runtime=runtime)
        with closing(pageable), pytest.raises(InvalidArgument, match="pageable"):
            FamilyEngine(dev, pageable)
        host = StateHostPool.allocate(g, slots=3, runtime=runtime)
        with closing(host):
            for kwargs in ({"threads": 48}, {"index_bytes": 2}, {"max_blocks": 0}):
                with pytest.raises(InvalidArgument):
                    FamilyEngine(dev, host, **kwargs)


def test_state_geometry_and_pool_arguments_are_checked(runtime):
    for make in (lambda: StateGeometry.mamba(2, (3, 0), (2,)),
                 lambda: StateGeometry.mamba(2, (3,), (2,), conv_dtype="float64"),
                 lambda: StateGeometry.mamba(0, (3,), (2,)),
                 lambda: StateGeometry("x", 2, ()),
                 lambda: StateDevicePool.allocate(STATES["fp32"](2), 0, 0, runtime=runtime),
                 lambda: StateDevicePool.allocate(STATES["fp32"](2), 2, 0, runtime=runtime, pad=-1),
                 lambda: StateHostPool.allocate(STATES["fp32"](2), "layer_first", slots=2, runtime=runtime),
                 lambda: StateHostPool.allocate(STATES["fp32"](2), slots=2, nbytes=4096, runtime=runtime),
                 lambda: StateHostPool.allocate(STATES["fp32"](2), nbytes=8, runtime=runtime)):
        with pytest.raises(InvalidArgument):
            make()
    assert StateGeometry.mamba(2, (3,), (2,), conv_dtype="torch.float16").tensor("conv").dtype == "float16"


# -- page rows --------------------------------------------------------------------------------------------------------
def rows(kind: str, layers: int = 4, page_size: int = 4, stored: tuple[int, ...] = ()) -> PagedRowGeometry:
    if kind == "dsa_indexer":
        return PagedRowGeometry.dsa_indexer(layers, index_head_dim=32, quant_block_size=16, page_size=page_size,
                                            stored_layers=stored)
    if kind == "dsv4_c4_kv":
        return PagedRowGeometry.dsv4_c4_kv(layers, page_size=page_size, stored_layers=stored)
    if kind == "dsv4_c4_indexer":
        return PagedRowGeometry.dsv4_c4_indexer(layers, page_size=page_size, index_head_dim=32, block=16,
                                                stored_layers=stored)
    return PagedRowGeometry.dsv4_c128(layers, page_size=page_size, value_bytes=80, scale_bytes=8,
                                      stored_layers=stored)


ROW_KINDS = ["dsa_indexer", "dsv4_c4_kv", "dsv4_c4_indexer", "dsv4_c128"]
GRANULAR = {"dsv4_c4_kv", "dsv4_c128"}


class RowModel:
    """Where a page-row pool keeps (stored layer position, page) rows and each token's region bytes."""

    def __init__(self, g: PagedRowGeometry, pages: int, pad: int, layout: str, host_pages: int) -> None:
        self.g, self.pages, self.stride, self.layout, self.host_pages = g, pages, g.page_bytes + pad, layout, host_pages

    def device_spans(self, pool: PagedRowDevicePool) -> dict[Any, tuple[DeviceAddress, int]]:
        _, placement = pool.part("row")
        return {i: (base, self.pages * self.stride) for i, base in enumerate(placement.bases)}

    def host_row(self, i: int, page: int) -> int:
        g = self.g
        if self.layout == "layer_first":
            return i * self.host_pages * g.page_bytes + page * g.page_bytes
        return page * len(g.stored_layers) * g.page_bytes + i * g.page_bytes

    def token_pieces(self, token: int) -> list[tuple[int, int]]:
        """(offset in the row, size) of each region of ``token`` (its page's row)."""
        page_size, out, offset = self.g.page_size, [], 0
        slot = token % page_size
        for _, size in self.g.regions:
            out.append((offset + slot * size, size))
            offset += page_size * size
        return out

    def backup(self, device: dict[int, np.ndarray], host: np.ndarray, src: Any, dst: Any, unit: str) -> np.ndarray:
        out = host.copy()
        for i in range(len(self.g.stored_layers)):
            for s, d in zip(src, dst, strict=True):
                s, d = int(s), int(d)
                if unit == "page":
                    h = self.host_row(i, d)
                    out[h:h + self.g.page_bytes] = device[i][s * self.stride:s * self.stride + self.g.page_bytes]
                    continue
                ps = self.g.page_size
                for (so, size), (do, _) in zip(self.token_pieces(s), self.token_pieces(d), strict=True):
                    h = self.host_row(i, d // ps) + do
                    a = (s // ps) * self.stride + so
                    out[h:h + size] = device[i][a:a + size]
        return out

    def load(self, device: dict[int, np.ndarray], host: np.ndarray, src: Any, dst: Any, unit: str,
             layers: Any = None) -> dict[int, np.ndarray]:
        out = {k: v.copy() for k, v in device.items()}
        positions = [i for i, layer in enumerate(self.g.stored_layers) if layers is None or layer in layers]
        for i in positions:
            for s, d in zip(src, dst, strict=True):
                s, d = int(s), int(d)
                if unit == "page":
                    h = self.host_row(i, s)
                    out[i][d * self.stride:d * self.stride + self.g.page_bytes] = host[h:h + self.g.page_bytes]
                    continue
                ps = self.g.page_size
                for (so, size), (do, _) in zip(self.token_pieces(s), self.token_pieces(d), strict=True):
                    h = self.host_row(i, s // ps) + so
                    a = (d // ps) * self.stride + do
                    out[i][a:a + size] = host[h:h + size]
        return out


@contextlib.contextmanager
def row_pools(runtime: Any, g: PagedRowGeometry, *, pages: int = 6, host_pages: int = 5, pad: int = 0,
              layout: str = "page_first", **engine_kwargs: Any
              ) -> Iterator[tuple[PagedRowDevicePool, PagedRowHostPool, FamilyEngine, RowModel]]:
    dev = PagedRowDevicePool.allocate(g, pages, 0, runtime=runtime, pad=pad)
    host = PagedRowHostPool.allocate(g, layout, pages=host_pages, runtime=runtime)
    engine = FamilyEngine(dev, host, **engine_kwargs)
    with closing(dev, host, engine):
        yield dev, host, engine, RowModel(g, pages, pad, layout, host_pages)


def scattered_tokens(rng: np.random.Generator, pages: int, page_size: int, count: int) -> np.ndarray:
    """``count`` distinct random tokens, guaranteed not to be whole aligned pages."""
    while True:
        chosen = rng.choice(pages * page_size, count, replace=False)
        if count % page_size or (chosen[::page_size] % page_size).any():
            return chosen


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("stored,pad", [((), 0), ((0, 2, 3), 16), ((1,), 8)])
@pytest.mark.parametrize("kind", ROW_KINDS)
def test_page_rows_round_trip_pages(runtime, kind, stored, pad, layout):
    rng = np.random.default_rng()
    g = rows(kind, stored=stored)
    pages, host_pages = 6, 5
    with row_pools(runtime, g, pages=pages, host_pages=host_pages, pad=pad, layout=layout) as (
            dev, host, engine, model):
        assert engine.default_unit == "page"
        image = DeviceImage(runtime, model.device_spans(dev))
        for count in (0, 1, 3, 5):
            device = image.fill()
            before = fill_host(host)
            src, dst = rng.choice(pages, count, replace=False), rng.choice(host_pages, count, replace=False)
            engine.backup(src, dst).wait()
            after = host_bytes(host)
            np.testing.assert_array_equal(after, model.backup(device, before, src, dst, "page"))
            poisoned = image.poison()
            hsrc, ddst = rng.choice(host_pages, count, replace=False), rng.choice(pages, count, replace=False)
            transfer = engine.load(hsrc, ddst)
            transfer.wait()
            # every model layer has its event, stored or not
            assert sorted(transfer.layer_events) == list(range(g.layers))
            assert_image(image.read(), model.load(poisoned, after, hsrc, ddst, "page"))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("stored,pad", [((), 0), ((0, 3), 8), ((2,), 16)])
@pytest.mark.parametrize("kind", sorted(GRANULAR))
def test_page_rows_round_trip_tokens(runtime, kind, stored, pad, layout):
    """Tokens not page-aligned: values and 8-byte scales land in their own regions."""
    rng = np.random.default_rng()
    g = rows(kind, stored=stored)
    pages, host_pages = 6, 5
    with row_pools(runtime, g, pages=pages, host_pages=host_pages, pad=pad, layout=layout) as (
            dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        for count in (1, 3, 7):
            device = image.fill()
            before = fill_host(host)
            src, dst = scattered_tokens(rng, pages, 4, count), scattered_tokens(rng, host_pages, 4, count)
            engine.backup(src, dst, unit="token").wait()
            after = host_bytes(host)
            np.testing.assert_array_equal(after, model.backup(device, before, src, dst, "token"))
            poisoned = image.poison()
            hsrc, ddst = scattered_tokens(rng, host_pages, 4, count), scattered_tokens(rng, pages, 4, count)
            transfer = engine.load(hsrc, ddst, unit="token")
            transfer.wait()
            assert sorted(transfer.layer_events) == list(range(g.layers))
            assert_image(image.read(), model.load(poisoned, after, hsrc, ddst, "token"))
        # every token of the device pool, permuted, to the host pool's tokens
        device = image.fill()
        before = fill_host(host)
        src = rng.permutation(pages * 4)[:host_pages * 4]
        dst = rng.permutation(host_pages * 4)
        engine.backup(src, dst, unit="token").wait()
        np.testing.assert_array_equal(host_bytes(host), model.backup(device, before, src, dst, "token"))


@pytest.mark.parametrize("kind", ["dsa_indexer", "dsv4_c4_indexer"])
def test_packed_rows_refuse_partial_token_transfers(runtime, kind):
    g = rows(kind, stored=(1, 3))
    with row_pools(runtime, g, pad=16, layout="layer_first") as (dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        device = image.fill()
        before = fill_host(host)
        bad = [([1, 2, 3], [4, 5, 6]),                      # part of a page
               ([4, 5, 6, 7], [1, 2, 3, 4]),                # whole page on one side, unaligned on the other
               ([5, 6, 7, 8], [4, 5, 6, 7]),                # unaligned source
               ([4, 5, 7, 6], [8, 9, 10, 11]),              # a page out of order
               ([0, 1, 2, 3, 8, 9, 10], [0, 1, 2, 3, 4, 5, 6])]  # one page and a part
        for src, dst in bad:
            with pytest.raises(InvalidArgument, match="whole pages"):
                engine.backup(src, dst, unit="token")
            with pytest.raises(InvalidArgument, match="whole pages"):
                engine.load(dst, src, unit="token")
            with pytest.raises(InvalidArgument, match="whole pages"):
                engine.capture_load(dst, src, unit="token", layer=1)
        engine.synchronize()
        np.testing.assert_array_equal(host_bytes(host), before)
        assert_image(image.read(), device)
        # whole aligned pages by token are pages
        src = [20, 21, 22, 23, 4, 5, 6, 7]
        dst = [12, 13, 14, 15, 0, 1, 2, 3]
        engine.backup(src, dst, unit="token").wait()
        after = host_bytes(host)
        np.testing.assert_array_equal(after, model.backup(device, before, [5, 1], [3, 0], "page"))
        poisoned = image.poison()
        engine.load(dst, src, unit="token").wait()
        assert_image(image.read(), model.load(poisoned, after, [3, 0], [5, 1], "page"))
        # duplicate whole pages by token: a destination written twice
        with pytest.raises(InvalidArgument, match="twice"):
            engine.load([0, 1, 2, 3, 0, 1, 2, 3], [4, 5, 6, 7, 4, 5, 6, 7], unit="token")


@pytest.mark.parametrize("kind", ROW_KINDS)
def test_page_rows_per_layer_events_with_stored_subsets(runtime, kind):
    g = rows(kind, layers=5, stored=(0, 2, 3))
    with row_pools(runtime, g, pad=8) as (dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        poisoned = image.poison()
        data = fill_host(host)
        # layers without rows: no bytes move, the events still come
        transfer = engine.load([3, 0], [5, 1], layers=[4, 1])
        transfer.wait_layer(4), transfer.wait_layer(1)
        transfer.wait()
        assert sorted(transfer.layer_events) == [1, 4]
        assert_image(image.read(), poisoned)
        transfer = engine.load([3, 0], [5, 1], layers=[3, 1, 0])
        for layer in (3, 1, 0):
            transfer.wait_layer(layer)
        assert_image(image.read(), model.load(poisoned, data, [3, 0], [5, 1], "page", layers=[3, 0]))
        # graph of a layer without rows replays as a no-op; of a stored layer, copies that layer only
        poisoned = image.poison()
        empty = engine.capture_load([1], [2], layer=1)
        empty.replay(), empty.stream.synchronize()
        assert_image(image.read(), poisoned)
        one = engine.capture_load([1, 4], [2, 0], layer=2)
        data = fill_host(host)
        one.replay(), one.stream.synchronize()
        assert_image(image.read(), model.load(poisoned, data, [1, 4], [2, 0], "page", layers=[2]))
        empty.close(), one.close()


def test_page_rows_bad_input(runtime):
    g = rows("dsv4_c4_kv", stored=(0, 2))
    with row_pools(runtime, g, pages=3, host_pages=2, pad=16) as (dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        device = image.fill()
        before = fill_host(host)
        for dev_units, host_units, unit, match in [([3], [0], "page", "device page index 3"),
                                                   ([0], [2], "page", "host page index 2"),
                                                   ([12], [0], "token", "device token index 3"),
                                                   ([0], [8], "token", "host token index 2"),
                                                   ([-1], [0], "token", "index -1"),
                                                   ([0, 1], [5, 5], "token", "appears twice"),
                                                   ([0, 1], [1, 1], "page", "appears twice"),
                                                   ([0, 1, 2], [0, 1], "token", "must match"),
                                                   ([0], [0], "slot", "not slots")]:
            with pytest.raises(InvalidArgument, match=match):
                engine.backup(dev_units, host_units, unit=unit)
        engine.synchronize()
        np.testing.assert_array_equal(host_bytes(host), before)
        assert_image(image.read(), device)


def test_page_row_geometry_checks(runtime):
    for make in (lambda: PagedRowGeometry.dsa_indexer(4, index_head_dim=40, quant_block_size=16),
                 lambda: PagedRowGeometry.dsv4_c4_kv(4, stored_layers=(0, 4)),
                 lambda: PagedRowGeometry.dsv4_c4_kv(4, stored_layers=(2, 1)),
                 lambda: PagedRowGeometry.dsv4_c4_kv(4, stored_layers=(1, 1)),
                 lambda: PagedRowGeometry.dsv4_c4_kv(4, stored_layers=(-1,)),
                 lambda: PagedRowGeometry("x", 2, 4, ()),
                 lambda: PagedRowGeometry("x", 2, 0, (("a", 4),)),
                 lambda: PagedRowDevicePool.allocate(rows("dsv4_c4_kv"), 0, 0, runtime=runtime),
                 lambda: PagedRowDevicePool.allocate(rows("dsv4_c4_kv"), 2, 0, runtime=runtime, pad=-4),
                 lambda: PagedRowHostPool.allocate(rows("dsv4_c4_kv"), "page_first_direct", pages=2,
                                                   runtime=runtime)):
        with pytest.raises(InvalidArgument):
            make()
    g = rows("dsv4_c4_kv", stored=(1, 3))
    assert g.page_bytes == 4 * (576 + 8) and g.bytes_per_page == 2 * g.page_bytes
    assert g.region_offsets() == [("values", 0, 576), ("scales", 4 * 576, 8)]


# -- split emulator: aliases everywhere, CPU addresses fault -----------------------------------------------------------
def test_split_family_tables_hold_aliases(split):
    for make in (lambda: state_pools(split, STATES["odd"](2), pad=3, layout="page_first_direct"),
                 lambda: row_pools(split, rows("dsv4_c4_kv", stored=(1, 3)), layout="layer_first")):
        with make() as (dev, host, engine, _):
            cpu, size = host.buffer.cpu_address.value, host.buffer.nbytes
            for part, device_side, host_side in engine._sides.values():
                host_entries = host_side.table.entries
                expected = tuple(get_device_accessible_ptr(region, 0, runtime=split)
                                 for region in host.placement(part).bases)
                assert host_entries == expected
                assert not any(cpu <= e.value < cpu + size for e in host_entries)
                assert all(e.device == 0 for e in host_entries + device_side.table.entries)
            # and the transfers through them are right
            engine.backup([0], [1], unit=engine.default_unit).wait()


def test_split_kernel_handed_cpu_addresses_faults(split):
    from kvtier.kernels import ChunkCopy, ChunkSide, KernelLauncher
    from kvtier.pools import build_pointer_table

    g = STATES["fp32"](2)
    dev = StateDevicePool.allocate(g, 5, 0, runtime=split)
    host = StateHostPool.allocate(g, slots=7, runtime=split)
    engine = FamilyEngine(dev, host)
    part, device_side, host_side = engine._sides["conv"]
    launcher = KernelLauncher(split)
    stream = split.create_stream(0)
    (src_index, dst_index), lease = engine.rings["h2d"].upload([np.array([1], np.int64), np.array([2], np.int64)])
    engine.rings["h2d"].fence(lease)
    # a raw integer never reaches a kernel
    raw = ChunkSide(host.buffer.cpu_address.value, host_side.page_stride, 0, host_side.piece_stride)
    shape = {"index_bytes": 8, "n_units": 1, "layer_begin": 0, "n_layers": 2, "n_pieces": 1,
             "chunk_bytes": part.chunk_bytes, "n_tensors": 1, "table_layers": 2}
    with pytest.raises(AddressDomainError):
        launcher.copy_chunks(ChunkCopy(src=raw, dst=device_side, src_index=src_index, dst_index=dst_index, **shape),
                             device=0, stream=stream)
    with pytest.raises(AddressDomainError):
        launcher.copy_chunks(ChunkCopy(src=host_side, dst=device_side, src_index=src_index.value, dst_index=dst_index,
                                       **shape), device=0, stream=stream)
    engine.synchronize()
    stream.synchronize()
    # a table of CPU addresses passed off as device addresses: the device faults
    cpu = host.buffer.cpu_address.value
    bad = build_pointer_table(split, 0, [DeviceAddress(cpu + o, 0) for o in host.cpu_offsets(part)[0]])
    bad_side = ChunkSide(bad, host_side.page_stride, host_side.unit_stride, host_side.piece_stride)
    launcher.copy_chunks(ChunkCopy(src=bad_side, dst=device_side, src_index=src_index, dst_index=dst_index,
                                   index_bytes=8, n_units=1, layer_begin=0, n_layers=2, n_pieces=1,
                                   chunk_bytes=part.chunk_bytes, n_tensors=1, table_layers=2), device=0, stream=stream)
    with pytest.raises(IllegalAddress, match="not mapped"):
        stream.synchronize()
    with pytest.raises(IllegalAddress, match="poisoned"):
        engine.close()
    for thing in (bad, stream, host, dev):
        with contextlib.suppress(IllegalAddress):
            thing.close()


def test_unified_cpu_offsets_agree_with_placements(runtime):
    """The CPU-side view (buffer offsets) names the same bytes the kernel side does."""
    if is_split(runtime):
        pytest.skip("checked on unified/CUDA, where the alias of a host byte is its CPU address")
    g = rows("dsv4_c4_kv", stored=(0, 2))
    with row_pools(runtime, g, layout="layer_first") as (dev, host, engine, _):
        cpu = host.buffer.cpu_address.value
        for part, _, _ in engine._sides.values():
            offsets, _, _ = host.cpu_offsets(part)
            bases = host.placement(part).bases
            assert [get_device_accessible_ptr(b, 0, runtime=runtime).value - cpu for b in bases] == offsets


# -- CUDA only: engine tensors of any dtype and strides ----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_state_from_strided_torch_tensors(cuda, dtype):
    import torch

    torch_dtype = getattr(torch, dtype)
    layers, slots = 3, 5
    g = StateGeometry.mamba(layers, (6, 3), (2, 4, 5), conv_dtype=dtype, temporal_dtype=dtype)
    # SGLang-style [layers, slots + 1, ...] views of bigger tensors: padded inner rows, padded slots
    conv_big = torch.randn(layers, slots + 1, 6, 8, device="cuda").to(torch_dtype)
    temporal_big = torch.randn(slots + 1, layers, 2, 4, 7, device="cuda").to(torch_dtype)
    conv = conv_big[:, :, :, :3]
    temporal = temporal_big[:, :, :, :, :5].transpose(0, 1)
    dev = StateDevicePool.from_tensors(g, {"conv": conv, "temporal": temporal}, runtime=cuda)
    host = StateHostPool.allocate(g, "page_first_direct", slots=4, runtime=cuda)
    engine = FamilyEngine(dev, host)
    with closing(dev, host, engine):
        conv_before, temporal_before = conv.clone(), temporal.clone()
        conv_big_before, temporal_big_before = conv_big.clone(), temporal_big.clone()
        engine.backup([4, 0, 2], [1, 3, 0]).wait()
        conv.fill_(7), temporal.fill_(7)
        torch.cuda.synchronize()
        transfer = engine.load([1, 3, 0], [1, 5, 3])
        transfer.wait()
        assert sorted(transfer.layer_events) == list(range(layers))
        for src, dst in ((4, 1), (0, 5), (2, 3)):
            assert torch.equal(conv[:, dst], conv_before[:, src])
            assert torch.equal(temporal[:, dst], temporal_before[:, src])
        for untouched in (0, 2, 4):
            assert (conv[:, untouched] == 7).all() and (temporal[:, untouched] == 7).all()
        # the padding of the bigger tensors is never written
        assert torch.equal(conv_big[:, :, :, 3:], conv_big_before[:, :, :, 3:])
        assert torch.equal(temporal_big[..., 5:], temporal_big_before[..., 5:])
        # host bytes are the items, contiguous per (slot, tensor) across layers
        view = host.buffer.as_tensor().numpy()
        conv_bytes = conv_before[:, 4].contiguous().cpu().view(torch.uint8).numpy().reshape(-1)
        start = 1 * g.slot_bytes
        np.testing.assert_array_equal(view[start:start + conv_bytes.size], conv_bytes)
        del view


@pytest.mark.gpu
def test_state_from_tensors_refuses_irregular_items(cuda):
    import torch

    g = StateGeometry.mamba(2, (4, 3), (2, 2), conv_dtype="float16", temporal_dtype="float16")
    conv = torch.zeros(2, 3, 4, 3, device="cuda", dtype=torch.float16)
    temporal = torch.zeros(2, 3, 4, 4, device="cuda", dtype=torch.float16)[:, :, ::2, ::2]
    with pytest.raises(InvalidArgument):
        StateDevicePool.from_tensors(g, {"conv": conv, "temporal": temporal}, runtime=cuda)
    with pytest.raises(InvalidArgument, match="expected tensors"):
        StateDevicePool.from_tensors(g, {"conv": conv}, runtime=cuda)
    with pytest.raises(InvalidArgument):
        StateDevicePool.from_tensors(g, {"conv": conv.float(), "temporal": conv}, runtime=cuda)


@pytest.mark.gpu
def test_from_tensors_refuses_layers_that_differ(cuda):
    """Regression: ``PagedRowDevicePool.from_tensors`` measured only the first layer tensor (a shorter or differently
    strided later layer was walked with the first one's pages and stride: writes past its end), and
    ``StateDevicePool.from_tensors`` never compared the dtype of later layers (same element strides, other bytes)."""
    import torch

    g = rows("dsv4_c4_kv", stored=(0, 2))
    good = torch.zeros(6, g.page_bytes, dtype=torch.uint8, device="cuda")
    for other in (torch.zeros(3, g.page_bytes, dtype=torch.uint8, device="cuda"),
                  torch.zeros(6, 2 * g.page_bytes, dtype=torch.uint8, device="cuda")[:, :g.page_bytes],
                  torch.zeros(6, g.page_bytes // 2, dtype=torch.int16, device="cuda")):
        with pytest.raises(InvalidArgument):
            PagedRowDevicePool.from_tensors(g, [good, other], runtime=cuda)
    with pytest.raises(InvalidArgument, match="stored layers"):
        PagedRowDevicePool.from_tensors(g, [good], runtime=cuda)
    pool = PagedRowDevicePool.from_tensors(g, [good, good.clone()], runtime=cuda)
    pool.close()
    s = StateGeometry.mamba(2, (4,), (2,), conv_dtype="float16", temporal_dtype="float16")
    conv = [torch.zeros(3, 4, dtype=torch.float16, device="cuda"), torch.zeros(3, 4, dtype=torch.bfloat16,
                                                                              device="cuda")]
    temporal = [torch.zeros(3, 2, dtype=torch.float16, device="cuda")] * 2
    with pytest.raises(InvalidArgument, match="dtype"):
        StateDevicePool.from_tensors(s, {"conv": conv, "temporal": temporal}, runtime=cuda)


def test_device_copy_moves_every_layer_of_each_slot_and_refuses_overlap(runtime):
    """FamilyEngine.copy: device slots → other device slots of the same pool (a snapshot forked for a request)."""
    from kvtier.pools.state import StateDevicePool, StateGeometry, StateHostPool
    from kvtier.transfer.family import FamilyEngine

    g = StateGeometry.mamba(3, (5, 3), (2, 3, 4), conv_dtype="float16")
    rng = np.random.default_rng()
    with StateDevicePool.allocate(g, 6, 0, runtime=runtime, pad=6) as dev, \
            StateHostPool.allocate(g, "page_first", slots=6, runtime=runtime) as host, FamilyEngine(dev, host) as eng:
        view = host.buffer.as_tensor().numpy()
        data = rng.integers(1, 256, view.size, dtype=np.uint8)
        view[:] = data
        eng.load(np.arange(6), np.arange(6)).wait()
        eng.copy([4, 0], [1, 5]).wait()
        runtime.synchronize(0)
        view[:] = 0xEE
        eng.backup(np.arange(6), np.arange(6)).wait()
        out = view.copy()
        slot = g.slot_bytes
        expect = data.reshape(6, slot)[[0, 4, 2, 3, 4, 0]]
        np.testing.assert_array_equal(out.reshape(6, slot), expect)
        with pytest.raises(InvalidArgument, match="both copied from and written"):
            eng.copy([1, 2], [2, 3])
        with pytest.raises(InvalidArgument, match="out of range"):
            eng.copy([0], [6])
        del view


@pytest.mark.parametrize("seed", range(3))
def test_device_copy_after_a_load_copies_the_loaded_bytes(seed):
    """copy(after=load) waits for a load another engine queued (lazy emulator: streams run only when forced)."""
    from kvtier.pools.state import StateDevicePool, StateGeometry, StateHostPool
    from kvtier.runtime.emulated import EmulatedRuntime
    from kvtier.transfer.family import FamilyEngine

    runtime = EmulatedRuntime("split", schedule="lazy", seed=seed)
    g = StateGeometry.compress_state(2, (4, 8))
    with StateDevicePool.allocate(g, 3, 0, runtime=runtime) as dev, \
            StateHostPool.allocate(g, "page_first", slots=3, runtime=runtime) as host, FamilyEngine(dev, host) as eng, \
            FamilyEngine(dev, host) as loader:
        view = host.buffer.as_tensor().numpy()
        data = np.random.default_rng().integers(1, 256, view.size, dtype=np.uint8)
        view[:] = data
        stream = runtime.create_stream(0)
        loaded = loader.load([1], [0], after=None)
        eng.copy([0], [2], stream=stream, after=[loaded.finished])
        stream.synchronize()
        view[:] = 0xEE
        eng.backup([2], [0], after=[stream]).wait()
        np.testing.assert_array_equal(view[:g.slot_bytes], data[g.slot_bytes:2 * g.slot_bytes])
        del view


def _stale_family_layer_reads(seed: int, layer_signals: Any) -> int:
    """Two state loads into the same slots, the second behind a busy model stream; a consumer stream waits for each
    layer event of the second and reads that layer's items (every tensor) at once. Returns the stale item count."""
    from kvtier.memory import HostBuffer
    from kvtier.runtime.emulated import EmulatedRuntime

    runtime = EmulatedRuntime("split", seed=seed)
    g = STATES["fp16-bf16"](4)
    with state_pools(runtime, g, pad=3, layout="page_first", layer_signals=layer_signals) as (
            dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        poisoned = image.poison()
        data = fill_host(host)
        slots, first, second = [4, 1], [0, 6], [5, 2]
        engine.load(first, slots)
        busy = runtime.create_stream(0)
        runtime.busy(busy, 40)
        launch = runtime.launch

        def slow_launch(program: Any, name: str, **kwargs: Any) -> None:  # each part's copy takes a while
            runtime.busy(kwargs["stream"], 30)
            launch(program, name, **kwargs)

        runtime.launch = slow_launch  # type: ignore[method-assign]
        transfer = engine.load(second, slots, after=busy)
        runtime.launch = launch  # type: ignore[method-assign]
        expected = state_load_expected(model, poisoned, data, second, slots)
        consumer = runtime.create_stream(0)
        total = sum(nbytes for _, nbytes in image.spans.values())
        with HostBuffer.allocate(total, HostKind.PINNED, runtime=runtime) as out:
            offsets, at = {}, 0
            for layer in range(g.layers):
                transfer.stream_wait(consumer, layer=layer)
                for key, (address, nbytes) in image.spans.items():
                    if key[1] == layer:
                        runtime.memcpy_async(out.cpu_address + at, address, nbytes, stream=consumer)
                        offsets[key], at = at, at + nbytes
            consumer.synchronize()
            view = out.as_tensor().numpy()
            stale = sum(not np.array_equal(view[offsets[key]:offsets[key] + expected[key].size], expected[key])
                        for key in offsets)
            del view
        transfer.wait()
        return stale


def test_family_layer_events_fire_after_every_part_of_the_layer_landed():
    """One launch per part, counters per part: a layer's event must wait for every tensor of that layer."""
    stale = {seed: _stale_family_layer_reads(seed, None) for seed in range(8)}
    assert not any(stale.values()), f"stale items per seed: {stale}"


def test_family_layer_ordering_check_can_fail(monkeypatch):
    """Negative control: a layer event that waits on the first part only lets stale items of the other through."""
    from kvtier.transfer.signals import LayerSignals

    original = LayerSignals.arm

    def first_part_only(self, layers, transfer):
        original(self, [(layer, adds[:1]) for layer, adds in layers], transfer)

    monkeypatch.setattr(LayerSignals, "arm", first_part_only)
    assert any(_stale_family_layer_reads(seed, None) for seed in range(8))


@pytest.mark.parametrize("layer_signals", [None, False])
def test_family_per_layer_loads_with_and_without_layer_signals_move_the_same_bytes(runtime, layer_signals):
    g = rows("dsv4_c4_kv", layers=5, stored=(0, 2, 3))
    with row_pools(runtime, g, pad=8, layer_signals=layer_signals) as (dev, host, engine, model):
        assert (engine.signals is None) == (layer_signals is False)
        image = DeviceImage(runtime, model.device_spans(dev))
        poisoned = image.poison()
        data = fill_host(host)
        transfer = engine.load([3, 0, 4], [5, 1, 2], layers=[3, 1, 0, 2])
        for layer in (3, 1, 0, 2):
            transfer.wait_layer(layer)
        assert sorted(transfer.layer_events) == [0, 1, 2, 3]
        assert_image(image.read(), model.load(poisoned, data, [3, 0, 4], [5, 1, 2], "page", layers=[3, 0, 2]))


def test_family_backup_with_more_entries_than_the_device_pool_and_odd_calls(runtime):
    """Sources may repeat on a backup, so a backup may name far more units than the index ring was sized for
    (two transfers of the whole device pool): the bytes still land. Empty and layer-subset calls behave."""
    from helpers.families import STATES, DeviceImage, state_backup_expected, state_pools

    g = STATES["fp32"](2)
    with state_pools(runtime, g, slots=2, host_slots=300) as (dev, host, engine, model):
        image = DeviceImage(runtime, model.device_spans(dev))
        device = image.fill()
        before = fill_host(host)
        src, dst = np.array([0, 1] * 150), np.arange(300)
        engine.backup(src, dst).wait()
        np.testing.assert_array_equal(host_bytes(host), state_backup_expected(model, device, before, src, dst))
        assert engine.load([0], [0], layers=[]).layer_events == {}
        assert sorted(engine.load([0], [0], layers=np.array([1])).layer_events) == [1]
        engine.load([], [], per_layer=False).wait()
        engine.capture_load([], [], layer=0).close()
        for call in (lambda: engine.load([True], [False]), lambda: engine.load(np.array([2**63], np.uint64), [0]),
                     lambda: engine.load([0], [0], unit="bogus"), lambda: engine.capture_load([0], [0], layer=-1)):
            with pytest.raises(InvalidArgument):
                call()


@pytest.mark.parametrize("pool, layout, supported", [
    (lambda g, layout, rt: StateHostPool.allocate(g["state"], layout, slots=2, runtime=rt), "layer_first",
     "'page_first', 'page_first_direct'"),
    (lambda g, layout, rt: PagedRowHostPool.allocate(g["rows"], layout, pages=2, runtime=rt), "page_first_direct",
     "'layer_first', 'page_first'"),
])
def test_family_host_pools_name_the_host_layouts_they_keep(split, pool, layout, supported):
    """One layout vocabulary (HostLayout) for every pool: a family pool given a layout it does not keep says which
    it keeps; an unknown name lists every layout."""
    geometries = {"state": StateGeometry.mamba(2, (3,), (2,)), "rows": rows("dsa_indexer")}
    with pytest.raises(InvalidArgument, match=f"cannot be '{layout}': choose one of {supported}"):
        pool(geometries, layout, split)
    with pytest.raises(InvalidArgument, match="unknown host layout 'rows'"):
        pool(geometries, "rows", split)


def test_host_layout_of_takes_a_tuple_of_supported_layouts():
    """``supported`` given as one string would be searched as a substring ('page_first' in 'page_first_direct'):
    refused, and names or members in a tuple both work. (found adversarially)"""
    from kvtier.pools import HostLayout

    with pytest.raises(InvalidArgument, match="supported must be a tuple"):
        HostLayout.of("page_first", "page_first_direct", "a pool's layout")
    assert HostLayout.of("page_first", ("page_first",), "a pool's layout") is HostLayout.PAGE_FIRST
    with pytest.raises(InvalidArgument, match="cannot be 'page_head': choose one of 'page_first'"):
        HostLayout.of("page_head", ("page_first",), "a pool's layout")
