"""Adversary round 6 (issue #15): the caching in kvtier.compat.sglang.kvcacheio (kept plans, kept table values and
entry resolutions, kept index values of the *_direct functions). The first two were defects (fixed: CPU tables are
read on every call); tests named test_ok_* document cases that held up."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import KvtierError, NotDeviceAccessible
from kvtier.memory import HostBuffer, HostKind
from kvtier.runtime import create

POISON = 0x5A


def rnd(shape):
    return torch.randint(1, 255, shape, dtype=torch.uint8)


def host(rt, shape, kind=HostKind.PINNED, dtype=torch.uint8, data=True):
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    buffer = HostBuffer.allocate(nbytes, kind, runtime=rt)
    tensor = buffer.as_tensor(dtype).view(shape)
    tensor.copy_(rnd(shape) if data else torch.full(shape, POISON, dtype=dtype))
    return buffer, tensor


def device(rt, shape, data=True, dev=0):
    return DeviceArray.from_tensor(rnd(shape) if data else torch.full(shape, POISON, dtype=torch.uint8), device=dev,
                                   runtime=rt)


def pinned_indices(rt, values):
    buffer = HostBuffer.allocate(8 * len(values), HostKind.PINNED, runtime=rt)
    tensor = buffer.as_tensor(torch.int64)
    tensor.copy_(torch.tensor(values, dtype=torch.int64))
    return buffer, tensor


MODES = ["emulated:split", "emulated:unified"]


@pytest.mark.parametrize("spec", MODES)
def test_a_cpu_table_rewritten_through_data_is_read_again(spec):
    """A CPU uint64 pointer table changed in place with a torch op (``table.data[1] = ...``) keeps the same tensor
    object and torch version (``.data`` has its own version counter), so ``table_entries`` returns the values read on
    the first call: layer 1 was copied from the OLD source tensor (stale KV; pre-existing, it failed the same way at
    1abeb26). A CPU table is now read on every call, so the copy comes from the new source."""
    rt = create(spec)
    N, D, L = 16, 16, 2
    srcs = [device(rt, (N, D)) for _ in range(L)]
    other = device(rt, (N, D))
    dsts = [device(rt, (N, D), data=False) for _ in range(L)]
    src_table = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.uint64)
    dst_table = torch.tensor([t.data_ptr() for t in dsts], dtype=torch.uint64)
    si, di = torch.tensor([1, 4, 9]), torch.tensor([0, 5, 15])
    sit, dit = DeviceArray.from_tensor(si, runtime=rt), DeviceArray.from_tensor(di, runtime=rt)
    io.transfer_kv_all_layer_mla(src_table, dst_table, sit, dit, D, L)
    rt.synchronize(0)
    src_table.data[1] = other.data_ptr()          # a torch in-place op on the table
    for t in dsts:
        t.copy_(torch.full((N, D), POISON, dtype=torch.uint8))
    io.transfer_kv_all_layer_mla(src_table, dst_table, sit, dit, D, L)
    rt.synchronize(0)
    for layer, source in enumerate([srcs[0], other]):
        expected = torch.full((N, D), POISON, dtype=torch.uint8)
        expected[di] = source.cpu()[si]
        assert torch.equal(dsts[layer].cpu(), expected), f"layer {layer} copied from a stale table entry"


@pytest.mark.parametrize("spec", MODES)
def test_a_cpu_table_rewritten_through_data_to_pageable_memory_is_refused(spec):
    """Same kept table values: after ``table.data[0] = <pageable CPU address>`` the stale entry (the old, valid
    device array) was used and the copy went into memory the caller no longer names. Now refused with
    NotDeviceAccessible naming ``dst_layers[0]``."""
    rt = create(spec)
    N, D = 16, 16
    src = device(rt, (N, D))
    dst = device(rt, (N, D), data=False)
    pageable = torch.full((N, D), POISON, dtype=torch.uint8)
    src_table = torch.tensor([src.data_ptr()], dtype=torch.uint64)
    dst_table = torch.tensor([dst.data_ptr()], dtype=torch.uint64)
    sit = DeviceArray.from_tensor(torch.tensor([1, 2]), runtime=rt)
    dit = DeviceArray.from_tensor(torch.tensor([3, 4]), runtime=rt)
    io.transfer_kv_all_layer_mla(src_table, dst_table, sit, dit, D, 1)
    rt.synchronize(0)
    dst_table.data[0] = pageable.data_ptr()
    with pytest.raises(NotDeviceAccessible, match=r"dst_layers\[0\]"):
        io.transfer_kv_all_layer_mla(src_table, dst_table, sit, dit, D, 1)


@pytest.mark.parametrize("spec", MODES)
def test_ok_host_buffer_closed_and_replaced_under_a_kept_plan(spec):
    """A kept _copy plan over a host view: closing its buffer and allocating another (pinned/registered/shm) makes
    the next call plan again (host generation), so the new buffer gets the right bytes."""
    rt = create(spec)
    N, D = 32, 16
    dev = device(rt, (N, D))
    sib, si = pinned_indices(rt, [1, 3, 5, 7])
    dib, di = pinned_indices(rt, [2, 4, 6, 8])
    for kind in (HostKind.PINNED, HostKind.REGISTERED, HostKind.SHM):
        buffer, dst = host(rt, (N, D), kind, data=False)
        io.transfer_kv_per_layer_mla(dev, dst, si, di, D)
        rt.synchronize(0)
        expected = torch.full((N, D), POISON, dtype=torch.uint8)
        expected[[2, 4, 6, 8]] = dev.cpu()[[1, 3, 5, 7]]
        assert torch.equal(dst, expected)
        del dst
        gc.collect()
        buffer.close()


@pytest.mark.parametrize("spec", MODES)
def test_ok_device_array_closed_under_a_kept_plan_is_refused(spec):
    rt = create(spec)
    N, D = 16, 16
    src, dst = device(rt, (N, D)), device(rt, (N, D), data=False)
    si, di = DeviceArray.from_tensor(torch.tensor([1, 2]), runtime=rt), DeviceArray.from_tensor(torch.tensor([3, 4]),
                                                                                                 runtime=rt)
    io.transfer_kv_per_layer_mla(src, dst, si, di, D)
    dst.close()
    with pytest.raises(KvtierError, match="dst"):
        io.transfer_kv_per_layer_mla(src, dst, si, di, D)


@pytest.mark.parametrize("spec", MODES)
def test_ok_direct_indices_rewritten_through_numpy(spec):
    """*_direct: CPU index tensors rewritten through .numpy() between calls are compared by value, not trusted."""
    rt = create(spec)
    N, D = 32, 16
    buffer, src = host(rt, (N, D))
    dst = device(rt, (N, D), data=False)
    si, di = torch.tensor([1, 2, 3, 9]), torch.tensor([4, 5, 6, 20])
    io.transfer_kv_direct([src], [dst], si, di, 1)
    si.numpy()[:] = [10, 11, 12, 30]
    di.numpy()[:] = [0, 7, 8, 21]
    io.transfer_kv_direct([src], [dst], si, di, 1)
    expected = torch.full((N, D), POISON, dtype=torch.uint8)
    for s, d in [(1, 4), (2, 5), (3, 6), (9, 20), (10, 0), (11, 7), (12, 8), (30, 21)]:
        expected[d] = src[s]
    assert torch.equal(dst.cpu(), expected)


@pytest.mark.parametrize("spec", MODES)
def test_ok_direct_same_index_objects_other_function_and_page_size(spec):
    """The same index tensors through transfer_kv_direct (page_size 1) then the pf_lf direct load (page_size 4)."""
    rt = create(spec)
    P, L, PS, D = 8, 2, 4, 8
    buffer, pf = host(rt, (P, L, PS, D))
    lf = [device(rt, (P * PS, D), data=False) for _ in range(L)]
    si, di = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23]), torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    flat_buffer, flat = host(rt, (P * PS, D))
    io.transfer_kv_direct([flat], [lf[0]], si, di, 1)
    for layer in range(L):
        io.transfer_kv_per_layer_direct_pf_lf([pf], [lf[layer]], si, di, layer, PS)
    for layer in range(L):
        expected = torch.full((P * PS, D), POISON, dtype=torch.uint8)
        for s, d in zip(si.tolist(), di.tolist(), strict=True):
            expected[d] = pf[s // PS, layer, s % PS]
        assert torch.equal(lf[layer].cpu(), expected)


@pytest.mark.parametrize("spec", MODES)
def test_ok_threads_with_different_operands(spec):
    """Two threads repeating kept plans over different operands at once: each gets its own bytes."""
    rt = create(spec)
    N, D = 64, 16
    errors = []

    def worker(seed):
        try:
            src, dst = device(rt, (N, D)), device(rt, (N, D), data=False)
            perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
            si = DeviceArray.from_tensor(perm[:16].clone(), runtime=rt)
            di = DeviceArray.from_tensor(perm[16:32].clone(), runtime=rt)
            for _ in range(30):
                io.transfer_kv_per_layer_mla(src, dst, si, di, D)
            expected = torch.full((N, D), POISON, dtype=torch.uint8)
            expected[perm[16:32]] = src.cpu()[perm[:16]]
            assert torch.equal(dst.cpu(), expected)
        except BaseException as error:   # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_ok_direct_index_tensors_shared_by_two_runtimes():
    """The same CPU index tensors drive per-layer direct loads on a split and a unified runtime in turn: the copies
    kept with the index values belong to the runtime they were planned on, and each runtime's load lands right."""
    P, PS, L, D = 6, 4, 2, 16
    si = torch.tensor([p * PS + i for p in (4, 1, 5) for i in range(PS)])
    di = torch.tensor([p * PS + i for p in (0, 3, 2) for i in range(PS)])
    sides = []
    for spec in MODES:
        rt = create(spec)
        buffer, pf = host(rt, (P, L, PS, D))
        lf = [device(rt, (P * PS, D), data=False) for _ in range(L)]
        sides.append((rt, buffer, pf, lf))
    for _ in range(2):
        for rt, _, pf, lf in sides:
            for layer in range(L):
                io.transfer_kv_per_layer_direct_pf_lf([pf], [lf[layer]], si, di, layer, PS)
            rt.synchronize(0)
            for layer in range(L):
                expected = torch.full((P * PS, D), POISON, dtype=torch.uint8)
                for s, d in zip(si.tolist(), di.tolist(), strict=True):
                    expected[d] = pf[s // PS, layer, s % PS]
                assert torch.equal(lf[layer].cpu(), expected)
