"""HiSparse hot buffers: the swap-in kernel against an independent pure-Python model of its LRU, byte-exact rows.

The model (:class:`Lru`) follows the documented semantics, not the kernel's code: hits keep their slot and move to the
most-recent end in their old relative order; misses (in top-k order, the first occurrence of a token owns its
duplicates) take the least-recent slots no top-k token holds, which move between the untouched evictable slots and the
hits; the newest token (seq_len - 1) maps to the request's row ``slots``; a sequence of at most ``slots`` tokens is
wholly resident (token t in row t) and leaves the state alone; entries outside [0, seq_len) get -1.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from helpers.device_kernels import random_bytes
from helpers.hisparse import LAYOUTS, Lru, Setup, host_offset, setup

from kvtier.errors import AddressDomainError, BufferClosed, IllegalAddress, InvalidArgument, KvtierError
from kvtier.memory import CpuAddress, DeviceBuffer, HostKind, get_device_accessible_ptr
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.transfer.hisparse import HotBuffer


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_swap_in_matches_the_lru_model(runtime, kind, layout):
    with setup(runtime, kind, layout, shuffle_rows=kind == "mha") as s:
        seqs = {0: 3, 1: s.N + 1, 2: s.N + 5}      # request 0 starts on the fast path
        for _ in range(14):
            batch = [int(r) for r in s.rng.permutation(s.R)[:int(s.rng.integers(1, s.R + 1))]]
            for r in batch:
                seqs[r] = min(s.T, seqs[r] + int(s.rng.integers(0, 3)))
            layer = int(s.rng.integers(0, s.L))
            topk = [s.random_topk(r, layer, seqs[r]) for r in batch]
            lens = [seqs[r] for r in batch]
            out = s.hb.swap_in(layer, batch, np.array(topk, np.int32), lens)
            s.check(out, s.expect(layer, batch, topk, lens))


def test_swap_in_fast_path_leaves_state_and_rows_alone(runtime):
    with setup(runtime, "mha", "layer_first", shuffle_rows=True) as s:
        for seq in (1, 2, s.N):
            topk = [[seq - 1, 0, -1, seq], [0, seq + 3, -7, seq - 1], [seq - 1] * s.K]
            out = s.hb.swap_in(1, [2, 0, 1], np.array(topk, np.int32), [seq] * 3)
            expected = np.array([[s.dev_locs[r][t] if 0 <= t < seq else -1 for t in top]
                                 for r, top in zip([2, 0, 1], topk, strict=True)])
            s.check(out, expected)


def test_swap_in_hits_misses_and_duplicates_by_hand(runtime):
    """A worked example: N=4 slots, K=4, seq 10."""
    with setup(runtime, "mla", "page_first_direct", requests=1, slots=4, top_k=4, max_tokens=12) as s:
        rows = s.dev_locs[0]
        # token 2 hits (slot 2); 7 and 8 miss -> least recent slots not hit: 0, 1; 7 appears twice; 9 is newest
        out = s.hb.swap_in(0, [0], np.array([[7, 2, 7, 9]], np.int32), [10])
        expected = s.expect(0, [0], [[7, 2, 7, 9]], [10])
        np.testing.assert_array_equal(expected, [[rows[0], rows[2], rows[0], rows[4]]])
        s.check(out, expected)
        assert s.hb.read_state(0, 0)["lru"].tolist() == [1, 3, 0, 2]
        # 8 misses and takes slot 1 (least recent, not hit); 2 and 7 hit and move to the end in their old order
        out = s.hb.swap_in(0, [0], np.array([[2, 8, 7, -1]], np.int32), [10])
        expected = s.expect(0, [0], [[2, 8, 7, -1]], [10])
        np.testing.assert_array_equal(expected, [[rows[2], rows[1], rows[0], -1]])
        s.check(out, expected)
        assert s.hb.read_state(0, 0)["lru"].tolist() == [3, 1, 0, 2]
        # layer 1 is its own LRU, untouched so far
        assert s.hb.read_state(0, 1)["lru"].tolist() == [0, 1, 2, 3]


def test_backup_newest_lands_on_the_host_and_swaps_back_in(runtime):
    with setup(runtime, "mha", "page_first", shuffle_rows=True) as s:
        seqs = [s.N + 1, s.N + 4, s.T]
        # the model writes each request's newest token into its row `slots`, every layer and tensor
        for r in range(s.R):
            for tensor in range(s.g.tensors):
                for layer in range(s.L):
                    row = random_bytes(s.g.row_bytes)
                    s.device[(tensor, layer)][s.dev_locs[r][s.N]] = row
                    address = s.dev.layer_device_addresses(tensor)[layer] + int(s.dev_locs[r][s.N]) * s.g.row_bytes
                    s.runtime.memcpy(address, CpuAddress(row.ctypes.data), row.nbytes)
        s.runtime.legacy_stream(0).synchronize()
        s.hb.backup_newest([2, 0, 1], [seqs[2], seqs[0], seqs[1]]).wait()
        for r in range(s.R):
            unit = s.host_locs[r][seqs[r] - 1]
            for tensor in range(s.g.tensors):
                for layer in range(s.L):
                    offset = host_offset(s.host, tensor, layer, int(unit))
                    s.host_data[offset:offset + s.g.row_bytes] = s.device[(tensor, layer)][s.dev_locs[r][s.N]]
        s.check_memory()
        # next step (one token longer): the old newest token is a miss, read back from the host
        for r in range(s.R - 1):
            top = [seqs[r] - 1, seqs[r], -1, 0]
            out = s.hb.swap_in(1, [r], np.array([top], np.int32), [seqs[r] + 1])
            s.check(out, s.expect(1, [r], [top], [seqs[r] + 1]))


def test_captured_swap_in_replays_new_topk(runtime):
    with setup(runtime, "mla", "layer_first") as s:
        batch = [1, 2]
        requests = DeviceBuffer(8 * len(batch), 0, runtime=runtime)
        topk = DeviceBuffer(4 * len(batch) * s.K, 0, runtime=runtime)
        seq_lens = DeviceBuffer(8 * len(batch), 0, runtime=runtime)
        out = DeviceBuffer(8 * len(batch) * s.K, 0, runtime=runtime)
        requests.upload(np.array(batch, np.int64))
        seqs = [s.N + 2, s.N + 7]
        seq_lens.upload(np.array(seqs, np.int64))
        topk.upload(np.zeros(len(batch) * s.K, np.int32))
        stream = runtime.create_stream(0)
        stream.begin_capture()
        try:
            returned = s.hb.swap_in(1, requests, topk, seq_lens, out=out, stream=stream)
        finally:
            graph = stream.end_capture()
        assert returned is out
        s.check_memory()  # capture ran nothing
        try:
            for step in range(6):
                seqs = [min(s.T, q + step % 2) for q in seqs]
                top = [s.random_topk(r, 1, q) for r, q in zip(batch, seqs, strict=True)]
                topk.upload(np.array(top, np.int32).reshape(-1))
                seq_lens.upload(np.array(seqs, np.int64))
                graph.launch(stream)
                stream.synchronize()
                s.check(out, s.expect(1, batch, top, seqs))
        finally:
            graph.close()
            stream.close()
            for buffer in (requests, topk, seq_lens, out):
                buffer.close()


def test_swap_in_on_a_device_operand_stream_without_capture(runtime):
    with setup(runtime, "mha", "page_first_direct", requests=2) as s:
        requests = DeviceBuffer(16, 0, runtime=runtime)
        topk = DeviceBuffer(8 * s.K, 0, runtime=runtime)
        seq_lens = DeviceBuffer(16, 0, runtime=runtime)
        try:
            requests.upload(np.array([1, 0], np.int64))
            seq_lens.upload(np.array([s.N + 3, 2], np.int64))
            top = [s.random_topk(1, 0, s.N + 3), s.random_topk(0, 0, 2)]
            topk.upload(np.array(top, np.int32).reshape(-1))
            out = s.hb.swap_in(0, requests, topk, seq_lens)
            s.check(out, s.expect(0, [1, 0], top, [s.N + 3, 2]))
        finally:
            for buffer in (requests, topk, seq_lens):
                buffer.close()


def test_assign_resets_a_request(runtime):
    with setup(runtime, "mla", "page_first", requests=2) as s:
        for _ in range(3):
            top = s.random_topk(0, 0, s.N + 6)
            out = s.hb.swap_in(0, [0], np.array([top], np.int32), [s.N + 6])
            s.check(out, s.expect(0, [0], [top], [s.N + 6]))
        s.hb.assign(0, s.host_locs[0])
        s.lru[(0, 0)] = Lru(s.N)
        s.check_memory()


def test_bad_input_is_refused_and_nothing_is_written(runtime):
    with setup(runtime, "mha", "page_first", requests=2, slots=4, top_k=3, max_tokens=12, spare_rows=2) as s:
        hb, K = s.hb, s.K
        before_out = hb.out.download()
        good_top = np.zeros((2, K), np.int32)
        cases = [
            (lambda: hb.swap_in(2, [0, 1], good_top, [5, 5]), "layer"),
            (lambda: hb.swap_in(0, [0, 1], np.zeros((2, K + 1), np.int32), [5, 5]), "shape"),
            (lambda: hb.swap_in(0, [0, 1], np.zeros(2 * K, np.int32), [5, 5]), "shape"),
            (lambda: hb.swap_in(0, [0, 1], np.zeros((2, K), np.float32), [5, 5]), "integers"),
            (lambda: hb.swap_in(0, [0], good_top, [5]), "shape"),
            (lambda: hb.swap_in(0, [0, 1], good_top, [5]), "sequence lengths"),
            (lambda: hb.swap_in(0, [0, 2], good_top, [5, 5]), "out of range"),
            (lambda: hb.swap_in(0, [-1, 0], good_top, [5, 5]), "out of range"),
            (lambda: hb.swap_in(0, [1, 1], good_top, [5, 5]), "twice"),
            (lambda: hb.swap_in(0, [0, 1], good_top, [5, 13]), r"\[1, 12\]"),
            (lambda: hb.swap_in(0, [0, 1], good_top, [0, 5]), r"\[1, 12\]"),
            (lambda: hb.swap_in(0, [0, 1, 1], np.zeros((3, K), np.int32), [5, 5, 5]), "twice|exceeds"),
            (lambda: hb.backup_newest([0, 1], [5]), "match"),
            (lambda: hb.backup_newest([3], [5]), "match"),
            (lambda: hb.backup_newest([0], [4]), "longer"),
            (lambda: hb.backup_newest([0], [13]), "longer"),
            (lambda: hb.assign(2, [0]), "request"),
            (lambda: hb.assign(0, np.arange(13)), "max_tokens"),
            (lambda: hb.assign(0, [0, s.host.pages * 4]), "host page"),
            (lambda: hb.assign(0, [0], [0, 1, 2, 3]), "distinct device rows"),
            (lambda: hb.assign(0, [0], [0, 1, 2, 3, 3]), "distinct device rows"),
            (lambda: hb.assign(0, [0], [0, 1, 2, 3, s.rows]), "device row"),
            (lambda: hb.read_state(2, 0), "request"),
            (lambda: hb.read_state(0, 2), "layer"),
        ]
        for call, match in cases:
            with pytest.raises(InvalidArgument, match=match):
                call()
        # host and device operands mixed; a device batch larger than the buffer
        requests = DeviceBuffer(8 * 3, 0, runtime=runtime)
        try:
            with pytest.raises(InvalidArgument, match="all as host arrays or all on the device"):
                hb.swap_in(0, requests, good_top, [5, 5])
            with pytest.raises(InvalidArgument, match="exceeds"):
                hb.swap_in(0, requests, requests, requests)
        finally:
            requests.close()
        hb.synchronize()
        assert hb.out.download() == before_out
        s.check_memory()


def test_swap_in_needs_host_units_for_long_sequences(runtime):
    with setup(runtime, "mla", "page_first", requests=2, slots=4, top_k=2, max_tokens=12) as s:
        s.hb.assign(1, s.host_locs[1][:6])
        s.lru[(1, 0)], s.lru[(1, 1)] = Lru(4), Lru(4)
        with pytest.raises(InvalidArgument, match="host units for fewer"):
            s.hb.swap_in(0, [1], np.array([[0, 1]], np.int32), [8])
        with pytest.raises(InvalidArgument, match="no host unit"):
            s.hb.backup_newest([1], [8])
        out = s.hb.swap_in(0, [1], np.array([[5, 6]], np.int32), [7])  # tokens 0..5 have units; 6 is newest
        s.check(out, s.expect(0, [1], [[5, 6]], [7]))


def test_hot_buffer_construction_is_checked(runtime):
    g1, g4 = KVGeometry.mha(2, 2, 16, 2, 1), KVGeometry.mha(2, 2, 16, 2, 4)
    dev = DevicePool.allocate(g1, 8, 0, runtime=runtime)
    dev4 = DevicePool.allocate(g4, 8, 0, runtime=runtime)
    host = HostPool.allocate(g4, "page_first", pages=8, runtime=runtime)
    other = HostPool.allocate(KVGeometry.mha(3, 2, 16, 2, 4), "page_first", pages=8, runtime=runtime)
    head = HostPool.allocate(g4, "page_head", pages=8, runtime=runtime)
    pageable = HostPool.allocate(g4, "page_first", pages=8, kind=HostKind.PAGEABLE, runtime=runtime)
    try:
        for kwargs, match in [({"top_k": 4}, "top_k"), ({"top_k": 0}, "top_k"), ({"max_tokens": 3}, "max_tokens"),
                              ({"slots": 0}, "slots"), ({"requests": 0}, "requests")]:
            args = {"requests": 2, "slots": 3, "top_k": 2, "max_tokens": 16, **kwargs}
            with pytest.raises(InvalidArgument, match=match):
                HotBuffer(dev, host, **args)
        args = {"requests": 2, "slots": 3, "top_k": 2, "max_tokens": 16}
        for device_pool, host_pool, match in [(dev4, host, "page size 1"), (dev, other, "differ"),
                                              (dev, head, "by head"), (dev, pageable, "registered")]:
            with pytest.raises(InvalidArgument, match=match):
                HotBuffer(device_pool, host_pool, **args)
    finally:
        for pool in (pageable, head, other, host, dev4, dev):
            pool.close()


def test_closed_buffer_and_pools_refuse_work(runtime):
    s = Setup(runtime, "mla", "page_first", requests=1, slots=2, top_k=1, max_tokens=6)
    s.hb.close()
    s.hb.close()
    for call in (lambda: s.hb.swap_in(0, [0], np.array([[1]], np.int32), [4]), lambda: s.hb.assign(0, [0]),
                 lambda: s.hb.backup_newest([0], [4])):
        with pytest.raises(BufferClosed):
            call()
    s.host.close(), s.dev.close()
    s = Setup(runtime, "mla", "page_first", requests=1, slots=2, top_k=1, max_tokens=6)
    s.host.close()  # waits for the buffer's work, then frees the host pool
    with pytest.raises(BufferClosed):
        s.hb.swap_in(0, [0], np.array([[1]], np.int32), [4])
    s.close()
    s = Setup(runtime, "mla", "page_first", requests=1, slots=2, top_k=1, max_tokens=6)
    s.dev.close()
    with pytest.raises(BufferClosed):
        s.hb.swap_in(0, [0], np.array([[1]], np.int32), [4])
    s.close()


# -- split emulator ---------------------------------------------------------------------------------------------------
def test_split_swap_in_tables_hold_aliases(split):
    with setup(split, "mha", "layer_first") as s:
        cpu, size = s.host.buffer.cpu_address.value, s.host.buffer.nbytes
        entries = s.hb.host_side.table.entries
        expected = tuple(get_device_accessible_ptr(region, 0, runtime=split)
                         for tensor in range(s.g.tensors) for region in s.host.layer_regions(tensor))
        assert entries == expected
        assert not any(cpu <= e.value < cpu + size for e in entries)
        top = s.random_topk(0, 0, s.N + 4)
        s.check(s.hb.swap_in(0, [0], np.array([top], np.int32), [s.N + 4]), s.expect(0, [0], [top], [s.N + 4]))


def test_split_swap_in_with_cpu_addresses_faults(split):
    from dataclasses import replace

    from kvtier.kernels import ChunkSide, KernelLauncher, SwapIn
    from kvtier.memory import DeviceAddress
    from kvtier.pools import build_pointer_table
    from kvtier.transfer.hisparse import STATE

    s = Setup(split, "mla", "page_first", requests=1, slots=2, top_k=1, max_tokens=8)
    hb = s.hb
    inputs = [DeviceBuffer(n, 0, runtime=split) for n in (8, 4, 8)]
    inputs[0].upload(np.array([0], np.int64)), inputs[1].upload(np.array([5], np.int32))
    inputs[2].upload(np.array([7], np.int64))
    call = SwapIn(tuple(hb.state[name] for name in STATE), hb.host_side, hb.device_side, inputs[1], inputs[0],
                  inputs[2], hb.out, 1, 2, 1, 8, 0, s.L, s.g.tensors, s.L, s.g.row_bytes)
    launcher, stream = KernelLauncher(split), split.create_stream(0)
    with pytest.raises(AddressDomainError):
        launcher.swap_in(replace(call, topk=get_device_accessible_ptr(inputs[1], 0).value), device=0, stream=stream)
    with pytest.raises(AddressDomainError):
        launcher.swap_in(replace(call, host=ChunkSide(s.host.buffer.cpu_address.value, 0, 0)), device=0,
                         stream=stream)
    with pytest.raises(KvtierError, match="top-k"):
        launcher.swap_in(replace(call, k=3), device=0, stream=stream)
    stream.synchronize()
    cpu = s.host.buffer.cpu_address
    bad = build_pointer_table(split, 0, [DeviceAddress(cpu.value + r.offset, 0) for r in s.host.layer_regions(0)])
    launcher.swap_in(replace(call, host=replace(hb.host_side, table=bad)), device=0, stream=stream)
    with pytest.raises(IllegalAddress, match="not mapped"):
        stream.synchronize()
    for thing in (bad, stream, *inputs, hb, s.host, s.dev):
        with contextlib.suppress(IllegalAddress):
            thing.close()


# -- regressions ------------------------------------------------------------------------------------------------------
def test_unassigned_requests_use_their_default_rows(runtime):
    """Regression: the constructor documents rows r * (slots + 1) .. + slots until assign() names others, but left
    them at -1, so a fast-path swap-in of a request never assigned returned -1 for every token."""
    g1, g4 = KVGeometry.mla(2, 64, 1), KVGeometry.mla(2, 64, 4)
    dev = DevicePool.allocate(g1, 10, 0, runtime=runtime)
    host = HostPool.allocate(g4, "page_first", pages=10, runtime=runtime)
    hb = HotBuffer(dev, host, requests=2, slots=4, top_k=2, max_tokens=16)
    try:
        out = hb.swap_in(0, [1, 0], np.array([[0, 3], [2, -1]], np.int32), [4, 3])
        hb.synchronize()
        np.testing.assert_array_equal(np.frombuffer(out.download(0, 32), np.int64), [5, 8, 2, -1])
        np.testing.assert_array_equal(hb.read_state(1, 0)["device_rows"], np.arange(5, 10))
    finally:
        hb.close(), host.close(), dev.close()
    # a pool too small for the default rows: requests need assign() first, and say so
    dev = DevicePool.allocate(g1, 6, 0, runtime=runtime)
    host = HostPool.allocate(g4, "page_first", pages=10, runtime=runtime)
    hb = HotBuffer(dev, host, requests=2, slots=4, top_k=2, max_tokens=16)
    try:
        with pytest.raises(InvalidArgument, match="no device rows"):
            hb.swap_in(0, [0], np.array([[0, 1]], np.int32), [3])
        hb.assign(0, np.arange(8), [5, 0, 1, 2, 3])
        out = hb.swap_in(0, [0], np.array([[0, 1]], np.int32), [3])
        hb.synchronize()
        np.testing.assert_array_equal(np.frombuffer(out.download(0, 16), np.int64), [5, 0])
    finally:
        hb.close(), host.close(), dev.close()


def test_operands_too_small_for_the_batch_are_refused(runtime):
    """Regression: ``out`` (and device topk / seq_lens) were never measured, so a small buffer made the kernel write
    or read past its end (an illegal address that poisons the device, or silent corruption of a neighbour)."""
    with setup(runtime, "mla", "page_first", requests=2, slots=4, top_k=2, max_tokens=12) as s:
        small = DeviceBuffer(8, 0, runtime=runtime)
        requests = DeviceBuffer(16, 0, runtime=runtime)
        topk = DeviceBuffer(8, 0, runtime=runtime)
        seq_lens = DeviceBuffer(8, 0, runtime=runtime)
        try:
            requests.upload(np.array([0, 1], np.int64))
            with pytest.raises(InvalidArgument, match="out holds 8 bytes"):
                s.hb.swap_in(0, [0, 1], np.array([[0, 1], [1, 2]], np.int32), [3, 3], out=small)
            with pytest.raises(InvalidArgument, match="topk holds 8 bytes"):
                s.hb.swap_in(0, requests, topk, seq_lens)
            big_topk = DeviceBuffer(16, 0, runtime=runtime)
            try:
                with pytest.raises(InvalidArgument, match="seq_lens holds 8 bytes"):
                    s.hb.swap_in(0, requests, big_topk, seq_lens)
            finally:
                big_topk.close()
            s.check_memory()
            # the device is still usable
            out = s.hb.swap_in(0, [1], np.array([[0, 3]], np.int32), [4])
            s.check(out, s.expect(0, [1], [[0, 3]], [4]))
        finally:
            for buffer in (small, requests, topk, seq_lens):
                buffer.close()


def test_one_input_ring_per_native_stream(runtime):
    """Regression: input rings were keyed by ``handle or id(stream)``; the legacy / torch default stream has handle 0
    and its wrapper is a new object at every call on CUDA, so every swap-in allocated (and kept) a new pinned ring."""
    with setup(runtime, "mla", "page_first", requests=1, slots=4, top_k=2, max_tokens=12) as s:
        for seq in (2, 3, 4):
            out = s.hb.swap_in(0, [0], np.array([[0, 1]], np.int32), [seq])
            s.check(out, s.expect(0, [0], [[0, 1]], [seq]))
        assert len(s.hb._inputs) == 1
        stream = runtime.create_stream(0)
        try:
            for seq in (5, 6):
                top = s.random_topk(0, 1, seq)
                out = s.hb.swap_in(1, [0], np.array([top], np.int32), [seq], stream=stream)
                stream.synchronize()
                s.check(out, s.expect(1, [0], [top], [seq]))
            assert len(s.hb._inputs) == 2
        finally:
            s.hb.synchronize()
            stream.close()


@pytest.mark.gpu
def test_swap_in_with_torch_operands_in_a_cuda_graph(cuda):
    import torch

    with setup(cuda, "mha", "page_first_direct", requests=2) as s:
        requests = torch.tensor([1, 0], dtype=torch.int64, device="cuda")
        seq_lens = torch.tensor([s.N + 2, s.N + 5], dtype=torch.int64, device="cuda")
        topk = torch.zeros(2, s.K, dtype=torch.int32, device="cuda")
        out = torch.full((2, s.K), -9, dtype=torch.int64, device="cuda")
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            s.hb.swap_in(0, requests, topk, seq_lens, out=out)
        seqs = [s.N + 2, s.N + 5]
        for _ in range(4):
            top = [s.random_topk(r, 0, q) for r, q in zip([1, 0], seqs, strict=True)]
            topk.copy_(torch.tensor(top, dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            expected = s.expect(0, [1, 0], top, seqs)
            np.testing.assert_array_equal(out.cpu().numpy(), expected)
            s.check_memory()


def test_assign_queues_the_reset_without_synchronizing_the_device(runtime, monkeypatch):
    """A new request joining must not stall the others' decode steps: assign() allocates nothing and never waits for
    the device; its reset is ordered on the stream before the request's next swap-in."""
    with setup(runtime, "mla", "page_first", requests=2) as s:
        s.hb.assign(1, s.host_locs[1])
        for _ in range(2):
            top = s.random_topk(0, 0, s.N + 6)
            out = s.hb.swap_in(0, [0], np.array([top], np.int32), [s.N + 6])
            s.check(out, s.expect(0, [0], [top], [s.N + 6]))
        calls = []
        for name in ("synchronize", "device_alloc", "host_alloc", "host_register"):
            original = getattr(runtime, name)
            monkeypatch.setattr(runtime, name, lambda *a, _n=name, _o=original, **k: (calls.append(_n), _o(*a, **k))[1])
        s.hb.assign(0, s.host_locs[0])
        assert calls == []
        monkeypatch.undo()
        s.lru[(0, 0)] = Lru(s.N)
        s.check_memory()


def test_closing_after_the_callers_stream_is_gone(runtime):
    """The buffer keeps an input ring per caller stream; closing it must not touch a stream the caller destroyed
    (the H200 segfaulted in cudaStreamSynchronize on the destroyed handle)."""
    with setup(runtime, "mla", "page_first", requests=1) as s:
        stream = runtime.create_stream(0)
        top = s.random_topk(0, 0, s.N + 3)
        out = s.hb.swap_in(0, [0], np.array([top], np.int32), [s.N + 3], stream=stream)
        stream.synchronize()
        s.check(out, s.expect(0, [0], [top], [s.N + 3]))
        stream.close()
        s.hb.close()


def test_hotbuffer_int64_topk_entries_outside_int32_get_row_minus_one(runtime):
    """Found: docs/families.md: "Entries outside [0, seq_len) (padding -1) get row -1". An int64 top-k array is
    accepted (``np.issubdtype(top.dtype, np.integer)``) and then truncated with ``top.astype(np.int32)``
    (hisparse.py, HotBuffer._upload), so 2**32 + 1 becomes token 1 and 2**33 token 0: both get the rows of real
    tokens instead of -1 (or a refusal)."""
    with setup(runtime, "mla", "page_first", requests=1, slots=4, top_k=4, max_tokens=12) as s:
        top = np.array([[2**32 + 1, 2**33, -1, 3]], np.int64)
        try:
            out = s.hb.swap_in(0, [0], top, [10])
        except KvtierError:
            return                                          # a refusal is fine too
        s.hb.synchronize()
        got = np.frombuffer(out.download(0, 4 * 8), np.int64)
        assert got.tolist()[:3] == [-1, -1, -1], f"out-of-range top-k entries got rows {got.tolist()[:2]}"


def test_hotbuffer_refuses_device_rows_another_request_holds(runtime):
    """Found: ``assign`` checks that a request's rows are distinct and in range, but not that they are free of
    other requests' rows: two requests sharing rows overwrite each other's hot tokens (request 0's swap-in copies
    token 7 into the row that request 1 serves as its token 0). Shown here with the bytes request 1 is served."""
    with setup(runtime, "mla", "page_first", requests=2, slots=4, top_k=4, max_tokens=12) as s:
        shared = s.dev_locs[0]
        try:
            s.hb.assign(1, s.host_locs[1], shared)
        except KvtierError:
            return                                          # refused: fine
        # request 1 holds tokens 0..3 in rows shared[0..3] (its prefill wrote them there)
        before = {t: s.device[(0, 0)][shared[t]].copy() for t in range(4)}
        s.hb.swap_in(0, [0], np.array([[7, 8, -1, -1]], np.int32), [10])   # request 0: two misses
        out = s.hb.swap_in(0, [1], np.array([[0, 1, 2, 3]], np.int32), [4])  # request 1: all resident
        s.hb.synchronize()
        rows = np.frombuffer(out.download(0, 4 * 8), np.int64)
        from helpers.pools import read_device
        now = read_device(s.dev, 0, 0)
        served = [t for t in range(4) if not np.array_equal(now[rows[t]], before[t])]
        assert not served, f"request 1 was served other bytes for tokens {served}: its rows were request 0's"


def test_hotbuffer_backup_newest_refuses_a_request_named_twice(runtime):
    """Found: ``swap_in`` refuses a request twice in one batch; ``backup_newest`` does not, so
    ``backup_newest([0, 0], [9, 10])`` copies the one newest-token row over the host KV of token 8 as well as token 9
    (hisparse.py, backup_newest: no duplicate check), destroying token 8's only full copy; a later miss of token 8
    swaps the wrong bytes in."""
    with setup(runtime, "mla", "page_first", requests=1, slots=4, top_k=4, max_tokens=12) as s:
        unit = int(s.host_locs[0][8])                       # token 8: not the newest at seq_len 10
        offsets = [host_offset(s.host, t, layer, unit) for t in range(s.g.tensors) for layer in range(s.L)]
        try:
            s.hb.backup_newest([0, 0], [9, 10]).wait()
        except KvtierError:
            return                                          # refused: fine
        from helpers.pools import host_bytes
        after = host_bytes(s.host)
        clobbered = [o for o in offsets if not np.array_equal(after[o:o + s.g.row_bytes],
                                                              s.host_data[o:o + s.g.row_bytes])]
        assert not clobbered, "backup_newest overwrote token 8's host KV with the newest-token row"


def test_hotbuffer_fast_path_after_swaps_serves_rows_that_hold_other_tokens(runtime):
    """Found (a contract gap): docs/families.md: "A sequence no longer than slots is wholly resident (token t in row
    t)". After the request's sequence grew past ``slots`` and swap-ins replaced tokens 0 and 1 with 7 and 8, a step
    with seq_len <= slots (a rollback, or a reused request without ``assign``) takes the fast path and returns row t
    for token t, although the buffer's own state says those rows hold tokens 7 and 8: wrong KV rows, silently. The
    kernel's fast path (reference.hot_swap_in: ``if seq <= n_slots: result = dloc[top]``) ignores slot_tokens; the
    host-side check in _upload could refuse it or the buffer could reset."""
    with setup(runtime, "mla", "page_first", requests=1, slots=4, top_k=4, max_tokens=12) as s:
        s.hb.swap_in(0, [0], np.array([[7, 8, -1, -1]], np.int32), [10])
        try:
            out = s.hb.swap_in(0, [0], np.array([[0, 1, 2, 3]], np.int32), [4])
        except KvtierError:
            return                                          # refused: fine
        s.hb.synchronize()
        rows = np.frombuffer(out.download(0, 4 * 8), np.int64).tolist()
        state = s.hb.read_state(0, 0)
        held = {int(row): int(token) for row, token in zip(state["device_rows"][:s.N], state["slot_tokens"][:s.N],
                                                            strict=True)}
        wrong = {t: held.get(rows[t]) for t in range(4) if held.get(rows[t]) != t}
        assert not wrong, f"token -> token the returned row holds: {wrong}"



def test_hotbuffer_bad_inputs_are_refused(runtime):
    with setup(runtime, "mla", "page_first", requests=1, slots=4, top_k=4, max_tokens=12) as s:
        good = np.array([[7, 8, -1, -1]], np.int32)
        cases = [
            (lambda: s.hb.swap_in(0, [0], good.astype(np.float64), [10]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [0], good.astype(bool), [10]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [0], good[:, :3], [10]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [0], good, [0]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [0], good, [13]), InvalidArgument),
            (lambda: s.hb.swap_in(2, [0], good, [10]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [0, 0], np.repeat(good, 2, 0), [10, 10]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [1], good, [10]), InvalidArgument),
            (lambda: s.hb.swap_in(0, [0], good, [10], out=np.zeros(4, np.int64)), KvtierError),
            (lambda: s.hb.backup_newest([0], [4]), InvalidArgument),
            (lambda: s.hb.assign(0, np.arange(13)), InvalidArgument),
            (lambda: s.hb.assign(0, [-1, 2]), InvalidArgument),
            (lambda: s.hb.assign(0, [10**6]), InvalidArgument),
            (lambda: s.hb.assign(0, [0, 1], [0, 1, 2, 3, 99]), InvalidArgument),
            (lambda: s.hb.assign(0, [0, 1], [0, 1, 2, 3, 3]), InvalidArgument),
            (lambda: s.hb.assign(1, [0, 1]), InvalidArgument),
        ]
        for call, error in cases:
            with pytest.raises(error):
                call()
        s.check_memory()
        s.hb.close()
        with pytest.raises(BufferClosed):
            s.hb.swap_in(0, [0], good, [10])
