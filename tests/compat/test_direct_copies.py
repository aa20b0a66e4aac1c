"""The ``*_direct`` functions land every byte where SGLang's loop of ``copy_`` calls puts it: runs of mixed lengths
(copies of different sizes in one plan) between device, pinned and chunk-registered operands; page-first hosts both
ways with pages at the tensor ends, host indices not starting a page, page sizes below the host page; a page-size-1
host whose size-1 dimension carries any stride; hosts registered in small chunks on split aliases. Sources are fresh
random bytes, destinations poisoned, every byte checked against a torch reference (the random draws print their
seed)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from helpers.compat import byte_operands
from helpers.operands import (
    MODES,
    POISON,
    cpu,
    device,
    fresh_rng,
    host,
    host_buffer,
    no_automatic_collection,
    poison,
    rnd,
)

from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.memory import HostBuffer, HostKind
from kvtier.runtime import create


def _runs(rng: np.random.Generator, n_tokens: int, count: int) -> np.ndarray:
    """``count`` token indices made of runs of consecutive tokens of mixed lengths (1-5), at random starts."""
    out: list[int] = []
    while len(out) < count:
        length = int(rng.integers(1, 6))
        start = int(rng.integers(0, n_tokens - length + 1))
        out += range(start, start + length)
    return np.array(out[:count], np.int64)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["split", "unified"])
def test_ok_direct_mixed_length_runs_per_layer_land_exactly(mode):
    """Random calls of transfer_kv_direct: runs of mixed lengths on both sides (so copies of different sizes in one
    plan), layers of different row sizes, device / pinned / chunk-registered (offset views) operands on either side,
    int32 and int64 indices, CPU or device-resident: every destination byte is its source token's or its poison; a
    split-mode refusal (a tensor across chunks whose aliases do not continue) leaves every byte as it was."""
    rng, seed = fresh_rng()
    runtime = create(f"emulated:{mode}")
    m = byte_operands(runtime)

    def make(kind, n_tokens, row, data):
        if kind == "dev":
            return m.device((n_tokens, row), data=data)
        if kind == "host":
            return m.host((n_tokens, row), data=data)
        offset = int(rng.choice([0, 8, 100]))
        buffer = m._own(HostBuffer.allocate(-(-(n_tokens * row + offset) // 4096) * 4096, runtime=runtime,
                                            register_chunk_bytes=4096))
        t = buffer.as_tensor(torch.uint8)[offset:offset + n_tokens * row]
        t.copy_(m.values(t.shape, data))
        return t.view(n_tokens, row)

    for _ in range(40):
        n_tokens, layers = int(rng.integers(8, 64)), int(rng.integers(1, 4))
        count = int(rng.integers(1, n_tokens))
        rows = [int(rng.choice([8, 24, 64, 100, 256])) for _ in range(layers)]
        kinds = [str(rng.choice(["dev", "host", "chunk"])) for _ in range(2 * layers)]
        kinds[int(rng.integers(0, 2 * layers))] = "dev"      # the call's runtime is that of its DeviceArrays
        srcs = [make(kinds[i], n_tokens, rows[i], True) for i in range(layers)]
        dsts = [make(kinds[layers + i], n_tokens, rows[i], False) for i in range(layers)]
        src_idx = _runs(rng, n_tokens, count)
        dst_idx = _runs(rng, n_tokens, count) if rng.random() < 0.7 else rng.permutation(n_tokens)[:count]
        _, first = np.unique(dst_idx, return_index=True)      # one source per destination token
        keep = np.sort(first)
        src_idx, dst_idx = src_idx[keep], dst_idx[keep]
        dtype = torch.int32 if rng.random() < 0.3 else torch.int64
        s, d = torch.tensor(src_idx, dtype=dtype), torch.tensor(dst_idx, dtype=dtype)
        if rng.random() < 0.3:
            s = m._own(DeviceArray.from_tensor(s, runtime=runtime))
            d = m._own(DeviceArray.from_tensor(d, runtime=runtime))
        before_src, before_dst = [cpu(x) for x in srcs], [cpu(x) for x in dsts]
        try:
            io.transfer_kv_direct(srcs, dsts, s, d, 1)
        except KvtierError as error:
            runtime.synchronize(0)
            assert mode == "split" and "chunk" in kinds, f"seed {seed}: {error}"
            assert all(torch.equal(cpu(x), b) for x, b in zip(dsts, before_dst, strict=True)), f"seed {seed}"
            continue
        runtime.synchronize(0)
        for layer in range(layers):
            want = before_dst[layer].clone()
            want[dst_idx] = before_src[layer][src_idx]
            assert torch.equal(cpu(dsts[layer]), want), (f"seed {seed}: layer {layer} rows {rows} kinds {kinds} "
                                                          f"src {src_idx.tolist()} dst {dst_idx.tolist()}")
        srcs = dsts = None
        gc.collect()


@pytest.mark.parametrize("mode", ["split", "unified"])
def test_ok_direct_page_first_both_ways_with_repeats_unaligned_and_edge_pages(mode):
    """Random pf_lf / lf_pf calls, K/V and MLA, page_size below the host page, pages touching the tensor ends,
    repeated pages (refused where they are destinations), host indices not starting a page (SGLang takes the page of
    the first token), a page or token one past the end: every byte as the SGLang loop's reference, or refused with
    every byte as it was."""
    rng, seed = fresh_rng()
    runtime = create(f"emulated:{mode}")
    m = byte_operands(runtime)
    for _ in range(120):
        pages, layers, page_size = int(rng.integers(1, 8)), int(rng.integers(1, 4)), int(rng.choice([1, 2, 4]))
        host_page, item = page_size + int(rng.integers(0, 2)), int(rng.choice([8, 16, 48]))
        n_tokens, tensors = int(rng.integers(page_size, 40)), int(rng.choice([1, 2]))
        count = int(rng.integers(1, pages + 2))
        host_pages = rng.integers(0, pages + (rng.random() < 0.15), count)
        starts = rng.integers(0, n_tokens - page_size + 1 + (rng.random() < 0.15), count)
        h_idx = np.array([p * page_size + i for p in host_pages for i in range(page_size)], np.int64)
        if rng.random() < 0.2:
            h_idx += int(rng.integers(0, page_size))
        d_idx = np.array([s + i for s in starts for i in range(page_size)], np.int64)
        to_lf = rng.random() < 0.5
        first = int(rng.integers(0, layers)) if to_lf else 0
        n_lf = layers - first
        hosts = [m.host((pages, layers, host_page, item), data=to_lf) for _ in range(tensors)]
        lf = [m.device((n_tokens, item), data=not to_lf) for _ in range(tensors * n_lf)]
        hosts_before, lf_before = [h.clone() for h in hosts], [x.cpu() for x in lf]
        want_hosts, want_lf, valid = [h.clone() for h in hosts_before], [x.clone() for x in lf_before], True
        written = set()
        for k in range(count):
            page, token = int(h_idx[k * page_size]) // page_size, int(d_idx[k * page_size])
            if page >= pages or token + page_size > n_tokens:
                valid = False
                break
            rows = set(range(token, token + page_size)) if to_lf else {page}
            if rows & written:          # two copies writing the same bytes are refused
                valid = False
                break
            written |= rows
            for t in range(tensors):
                for j in range(n_lf):
                    if to_lf:
                        want_lf[t * n_lf + j][token:token + page_size] = hosts_before[t][page, first + j, :page_size]
                    else:
                        want_hosts[t][page, j, :page_size] = lf_before[t * n_lf + j][token:token + page_size]
        try:
            if to_lf:
                io.transfer_kv_per_layer_direct_pf_lf(hosts, lf, torch.tensor(h_idx), torch.tensor(d_idx),
                                                      first, page_size)
            else:
                io.transfer_kv_all_layer_direct_lf_pf(lf, hosts, torch.tensor(d_idx), torch.tensor(h_idx),
                                                      page_size)
            refused = False
        except InvalidArgument:
            refused = True
        runtime.synchronize(0)
        assert refused == (not valid), f"seed {seed}"
        if refused:
            want_hosts, want_lf = hosts_before, lf_before
        assert all(torch.equal(a, b) for a, b in zip(hosts, want_hosts, strict=True)), f"seed {seed}"
        assert all(torch.equal(a.cpu(), b) for a, b in zip(lf, want_lf, strict=True)), f"seed {seed}"


@pytest.mark.parametrize("mode", MODES)
@no_automatic_collection()
def test_direct_takes_a_page_size_1_page_first_host_whose_size_1_dim_has_any_stride(mode):
    """A ``page_first_direct`` host tensor ``[pages, layers, 1, D]`` (page_size 1, SGLang's default) made by a
    transpose is contiguous for torch (a size-1 dimension's stride is ignored), but its ``stride(2)`` is 1, not D.
    kvtier reads the token bytes of the page from that stride (kvtier/compat/sglang/direct.py:139 ``_bytes``, used at
    :415 ``size = page_size * _bytes(host, 2)``) and refuses the legitimate call: "1 bytes on the source side but 16
    on the destination side". SGLang's ``select``/``slice``/``copy_`` take it. Fix: for a size-1 dimension use the
    contiguous stride (``prod(shape[dim + 1:]) * element_size``), e.g. ``torch.empty(0).new_empty(x.shape).stride()``,
    everywhere ``_bytes`` is read. (found adversarially, issue #15)"""
    rt = create(mode)
    pages, layers, d = 4, 2, 16
    made = host(rt, (pages, layers, d, 1))
    hk = made.transpose(2, 3)                                 # (pages, layers, 1, d), strides (32, 16, 1, 1)
    assert hk.is_contiguous() and hk.stride(2) == 1
    dk = device(rt, (8, d), data=False)
    io.transfer_kv_per_layer_direct_pf_lf([hk], [dk], torch.tensor([2, 0]), torch.tensor([5, 1]), 1, 1)
    want = torch.full((8, d), POISON, dtype=torch.uint8)
    want[5], want[1] = hk[2, 1, 0], hk[0, 1, 0]
    assert torch.equal(dk.cpu(), want)


@pytest.mark.parametrize("mode", MODES)
@no_automatic_collection()
def test_ok_direct_over_small_chunks_with_a_page_granularity_both_ways_land_exactly(mode):
    """K and V ``page_first_direct`` hosts as adjacent, non-overlapping halves of one HostBuffer registered in chunks
    of 3 pages (``granularity`` one page, so boundaries fall between pages; split aliases are not contiguous across
    chunks), layer-first device tensors K's layers then V's; int32 CPU indices, non-contiguous (every other entry of a
    longer tensor); random pages in random order, both directions, every layer. Every destination byte is its source
    byte or the poison, no copy crosses a chunk (the emulator refuses one at queue time); and the adjacent K and V
    halves are not taken for overlapping destinations."""
    rt = create(mode)
    pages, layers, page, d = 12, 2, 4, 512      # a host page (all its layers) is 4096 bytes: a whole OS page
    page_bytes = layers * page * d
    buffer, whole = host_buffer(rt, (2, pages, layers, page, d), kind=HostKind.REGISTERED,
                                register_chunk_bytes=3 * page_bytes, granularity=page_bytes)
    hk, hv = whole[0], whole[1]
    tokens = 32
    lf = [device(rt, (tokens, d)) for _ in range(2 * layers)]
    rng = np.random.default_rng()
    host_pages = rng.permutation(pages)[:5]
    dev_pages = rng.permutation(tokens // page)[:5]

    def indices(first_pages):
        values = np.concatenate([np.arange(p * page, (p + 1) * page) for p in first_pages])
        spread = torch.zeros(2 * values.size, dtype=torch.int32)
        spread[::2] = torch.from_numpy(values.astype(np.int32))
        return spread[::2]
    h_idx, d_idx = indices(host_pages), indices(dev_pages)
    assert not h_idx.is_contiguous()
    # backup: device pages -> host pages
    hk_before, hv_before = hk.clone(), hv.clone()
    io.transfer_kv_all_layer_direct_lf_pf(lf, [hk, hv], d_idx, h_idx, page)
    rt.synchronize(0)
    want_k, want_v = hk_before.clone(), hv_before.clone()
    for hp, dp in zip(host_pages, dev_pages, strict=True):
        for j in range(layers):
            want_k[hp, j] = lf[j].cpu()[dp * page:(dp + 1) * page]
            want_v[hp, j] = lf[layers + j].cpu()[dp * page:(dp + 1) * page]
    assert torch.equal(hk, want_k) and torch.equal(hv, want_v)
    # load: host pages -> device pages, one layer per call
    hk.copy_(rnd(hk.shape))
    hv.copy_(rnd(hv.shape))
    for x in lf:
        poison(x)
    for layer in range(layers):
        io.transfer_kv_per_layer_direct_pf_lf([hk, hv], [lf[layer], lf[layers + layer]], h_idx, d_idx, layer, page)
    rt.synchronize(0)
    for j in range(layers):
        for t, h in ((0, hk), (1, hv)):
            want = torch.full((tokens, d), POISON, dtype=torch.uint8)
            for hp, dp in zip(host_pages, dev_pages, strict=True):
                want[dp * page:(dp + 1) * page] = h[hp, j]
            assert torch.equal(lf[t * layers + j].cpu(), want)
