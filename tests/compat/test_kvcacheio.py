"""kvtier.compat.sglang.kvcacheio against torch references, on the emulators (split, unified) and CUDA.

Device tensors are DeviceArrays on the emulators (torch has no emulated device) and CUDA tensors on the GPU; host
tensors are views of kvtier pinned buffers (and, on CUDA, torch-pinned tensors too). Every destination is poisoned
first and checked whole: copied items must hold the source, every other byte its poison. Pointer tables are built
from raw ``data_ptr()`` values, which in split mode are CPU addresses for host memory: the call must still be right.
"""

from __future__ import annotations

import pytest
import torch
from helpers.compat import Operands

from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio
from kvtier.errors import InvalidArgument, KvtierError, NotDeviceAccessible, WrongDeviceError
from kvtier.memory import HostBuffer, HostKind, register_chunks, unregister_chunks

LAYERS, HEADS, DIM, PAGE = 3, 2, 8, 4
ITEM = HEADS * DIM * 2  # bytes of one token of one layer (int16 elements)
DEVICE_TOKENS, HOST_TOKENS = 48, 64
POISON = 0x5A5A


def Memory(runtime, torch_pinned: bool = False) -> Operands:  # noqa: N802 (a class in spirit)
    return Operands(runtime, dtype=torch.int16, poison=POISON, torch_pinned=torch_pinned)


@pytest.fixture(params=[False, pytest.param(True, id="torch-pinned")])
def memory(runtime, request):
    if request.param and runtime.name != "cuda":
        pytest.skip("torch pins host memory only with CUDA")
    mem = Memory(runtime, torch_pinned=request.param)
    yield mem
    mem.close()


def pairs(n_src: int, n_dst: int, count: int = 20, absent: bool = True):
    """Random distinct source and destination items; with ``absent``, one pair has src -1 and another dst -1."""
    src = torch.randperm(n_src)[:count].tolist()
    dst = torch.randperm(n_dst)[:count].tolist()
    if absent:
        src[3], dst[7] = -1, -1
    return src, dst


def copied(src, dst):
    return [(s, d) for s, d in zip(src, dst, strict=True) if s >= 0 and d >= 0]


def assert_poison_except(got, expected):
    assert torch.equal(got, expected), f"{(got != expected).sum().item()} elements differ"


# -- per layer -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("to_host", [False, True])
def test_per_layer_between_layer_first_tensors(memory, to_host):
    make_src, make_dst = (memory.device, memory.host) if to_host else (memory.host, memory.device)
    n_src, n_dst = (DEVICE_TOKENS, HOST_TOKENS) if to_host else (HOST_TOKENS, DEVICE_TOKENS)
    src_k, src_v = make_src((n_src, HEADS, DIM)), make_src((n_src, HEADS, DIM))
    dst_k, dst_v = make_dst((n_dst, HEADS, DIM), data=False), make_dst((n_dst, HEADS, DIM), data=False)
    src, dst = pairs(n_src, n_dst)
    kvcacheio.transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, memory.indices(src), memory.indices(dst), ITEM)
    for s_tensor, d_tensor in ((src_k, dst_k), (src_v, dst_v)):
        expected = torch.full((n_dst, HEADS, DIM), POISON, dtype=torch.int16)
        source = memory.cpu(s_tensor)
        for s, d in copied(src, dst):
            expected[d] = source[s]
        assert_poison_except(memory.cpu(d_tensor), expected)


def test_per_layer_pf_lf_loads_one_layer_of_a_page_first_host(memory):
    host_k, host_v = memory.host((HOST_TOKENS, LAYERS, HEADS, DIM)), memory.host((HOST_TOKENS, LAYERS, HEADS, DIM))
    dev_k = memory.device((DEVICE_TOKENS, HEADS, DIM), data=False)
    dev_v = memory.device((DEVICE_TOKENS, HEADS, DIM), data=False)
    src, dst = pairs(HOST_TOKENS, DEVICE_TOKENS)
    layer = 2
    kvcacheio.transfer_kv_per_layer_pf_lf(host_k, dev_k, host_v, dev_v, memory.indices(src), memory.indices(dst),
                                          layer, ITEM, LAYERS * ITEM)
    for host, dev in ((host_k, dev_k), (host_v, dev_v)):
        expected = torch.full((DEVICE_TOKENS, HEADS, DIM), POISON, dtype=torch.int16)
        for s, d in copied(src, dst):
            expected[d] = host[s, layer]
        assert_poison_except(memory.cpu(dev), expected)


def page_head(memory, data=True):
    """A page_head host tensor: [pages, heads, page_size, layers, dim]."""
    return memory.host((HOST_TOKENS // PAGE, HEADS, PAGE, LAYERS, DIM), data=data)


def ph_token(host, token, layer):
    """Token ``token``'s heads of ``layer`` in a page_head tensor, as [heads, dim]."""
    return host[token // PAGE, :, token % PAGE, layer]


def test_per_layer_ph_lf_loads_one_layer_of_a_page_head_host(memory):
    host_k, host_v = page_head(memory), page_head(memory)
    dev_k = memory.device((DEVICE_TOKENS, HEADS, DIM), data=False)
    dev_v = memory.device((DEVICE_TOKENS, HEADS, DIM), data=False)
    src, dst = pairs(HOST_TOKENS, DEVICE_TOKENS)
    layer = 1
    kvcacheio.transfer_kv_per_layer_ph_lf(host_k, dev_k, host_v, dev_v, memory.indices(src), memory.indices(dst),
                                          layer, ITEM, LAYERS * ITEM, PAGE, HEADS)
    for host, dev in ((host_k, dev_k), (host_v, dev_v)):
        expected = torch.full((DEVICE_TOKENS, HEADS, DIM), POISON, dtype=torch.int16)
        for s, d in copied(src, dst):
            expected[d] = ph_token(host, s, layer)
        assert_poison_except(memory.cpu(dev), expected)


# -- all layers ----------------------------------------------------------------------------------------------------
def device_layers(memory, data=True):
    return [memory.device((DEVICE_TOKENS, HEADS, DIM), data=data) for _ in range(LAYERS)]


@pytest.mark.parametrize("to_host", [True, False])
def test_all_layer_through_tables_of_raw_pointers(memory, to_host):
    """Both sides layer-first and found through uint64 tables; the host side's table holds CPU addresses (split
    mode: not what a kernel may dereference)."""
    dev_k, dev_v = device_layers(memory, data=to_host), device_layers(memory, data=to_host)
    host = memory.host((2, LAYERS, HOST_TOKENS, HEADS, DIM), data=not to_host)
    host_k, host_v = [host[0, layer] for layer in range(LAYERS)], [host[1, layer] for layer in range(LAYERS)]
    sides = [(dev_k, dev_v, DEVICE_TOKENS), (host_k, host_v, HOST_TOKENS)]
    (src_k, src_v, n_src), (dst_k, dst_v, n_dst) = sides[::-1] if not to_host else sides
    src, dst = pairs(n_src, n_dst)
    kvcacheio.transfer_kv_all_layer(memory.table(src_k), memory.table(dst_k), memory.table(src_v),
                                    memory.table(dst_v), memory.indices(src), memory.indices(dst), ITEM, LAYERS)
    for s_layers, d_layers in ((src_k, dst_k), (src_v, dst_v)):
        for layer in range(LAYERS):
            expected = torch.full((n_dst, HEADS, DIM), POISON, dtype=torch.int16)
            source = memory.cpu(s_layers[layer])
            for s, d in copied(src, dst):
                expected[d] = source[s]
            assert_poison_except(memory.cpu(d_layers[layer]), expected)


def test_all_layer_lf_pf_backs_up_into_a_page_first_host(memory):
    dev_k, dev_v = device_layers(memory), device_layers(memory)
    host_k = memory.host((HOST_TOKENS, LAYERS, HEADS, DIM), data=False)
    host_v = memory.host((HOST_TOKENS, LAYERS, HEADS, DIM), data=False)
    src, dst = pairs(DEVICE_TOKENS, HOST_TOKENS)
    kvcacheio.transfer_kv_all_layer_lf_pf(memory.table(dev_k), host_k, memory.table(dev_v), host_v,
                                          memory.indices(src), memory.indices(dst), ITEM, LAYERS * ITEM, LAYERS)
    for layers, host in ((dev_k, host_k), (dev_v, host_v)):
        expected = torch.full((HOST_TOKENS, LAYERS, HEADS, DIM), POISON, dtype=torch.int16)
        for layer in range(LAYERS):
            source = memory.cpu(layers[layer])
            for s, d in copied(src, dst):
                expected[d, layer] = source[s]
        assert_poison_except(memory.cpu(host), expected)


def test_all_layer_lf_ph_backs_up_into_a_page_head_host(memory):
    dev_k, dev_v = device_layers(memory), device_layers(memory)
    host_k, host_v = page_head(memory, data=False), page_head(memory, data=False)
    src, dst = pairs(DEVICE_TOKENS, HOST_TOKENS)
    kvcacheio.transfer_kv_all_layer_lf_ph(memory.table(dev_k), host_k, memory.table(dev_v), host_v,
                                          memory.indices(src), memory.indices(dst), ITEM, LAYERS * ITEM, LAYERS,
                                          PAGE, HEADS)
    for layers, host in ((dev_k, host_k), (dev_v, host_v)):
        expected = torch.full(tuple(host.shape), POISON, dtype=torch.int16)
        for layer in range(LAYERS):
            source = memory.cpu(layers[layer])
            for s, d in copied(src, dst):
                ph_token(expected, d, layer)[:] = source[s]
        assert_poison_except(memory.cpu(host), expected)


# -- MLA -----------------------------------------------------------------------------------------------------------
MLA_DIM = 36  # 72-byte rows: 8-byte accesses, not 16


def test_mla_per_layer_and_pf_lf(memory):
    item = MLA_DIM * 2
    src_t, dst_t = memory.host((HOST_TOKENS, MLA_DIM)), memory.device((DEVICE_TOKENS, MLA_DIM), data=False)
    src, dst = pairs(HOST_TOKENS, DEVICE_TOKENS)
    kvcacheio.transfer_kv_per_layer_mla(src_t, dst_t, memory.indices(src), memory.indices(dst), item)
    expected = torch.full((DEVICE_TOKENS, MLA_DIM), POISON, dtype=torch.int16)
    for s, d in copied(src, dst):
        expected[d] = src_t[s]
    assert_poison_except(memory.cpu(dst_t), expected)

    host = memory.host((HOST_TOKENS, LAYERS, MLA_DIM))
    dev = memory.device((DEVICE_TOKENS, MLA_DIM), data=False)
    kvcacheio.transfer_kv_per_layer_mla_pf_lf(host, dev, memory.indices(src), memory.indices(dst), 1, item,
                                              LAYERS * item)
    expected = torch.full((DEVICE_TOKENS, MLA_DIM), POISON, dtype=torch.int16)
    for s, d in copied(src, dst):
        expected[d] = host[s, 1]
    assert_poison_except(memory.cpu(dev), expected)


def test_mla_all_layer_and_lf_pf(memory):
    item = MLA_DIM * 2
    dev = [memory.device((DEVICE_TOKENS, MLA_DIM)) for _ in range(LAYERS)]
    host = memory.host((LAYERS, HOST_TOKENS, MLA_DIM), data=False)
    host_layers = [host[layer] for layer in range(LAYERS)]
    src, dst = pairs(DEVICE_TOKENS, HOST_TOKENS)
    kvcacheio.transfer_kv_all_layer_mla(memory.table(dev), memory.table(host_layers), memory.indices(src),
                                        memory.indices(dst), item, LAYERS)
    expected = torch.full((LAYERS, HOST_TOKENS, MLA_DIM), POISON, dtype=torch.int16)
    for layer in range(LAYERS):
        source = memory.cpu(dev[layer])
        for s, d in copied(src, dst):
            expected[layer, d] = source[s]
    assert_poison_except(memory.cpu(host), expected)

    pf = memory.host((HOST_TOKENS, LAYERS, MLA_DIM), data=False)
    kvcacheio.transfer_kv_all_layer_mla_lf_pf(memory.table(dev), pf, memory.indices(src), memory.indices(dst), item,
                                              LAYERS * item, LAYERS)
    expected = torch.full((HOST_TOKENS, LAYERS, MLA_DIM), POISON, dtype=torch.int16)
    for layer in range(LAYERS):
        source = memory.cpu(dev[layer])
        for s, d in copied(src, dst):
            expected[d, layer] = source[s]
    assert_poison_except(memory.cpu(pf), expected)


# -- direct --------------------------------------------------------------------------------------------------------
def page_aligned(n_src: int, n_dst: int, pages: int = 5, runs: bool = True):
    """Whole pages of tokens: random source and destination pages, two adjacent on both sides (one longer run)."""
    src_pages = torch.randperm(n_src // PAGE)[:pages].tolist()
    dst_pages = torch.randperm(n_dst // PAGE)[:pages].tolist()
    if runs and src_pages[0] + 1 < n_src // PAGE and dst_pages[0] + 1 < n_dst // PAGE:
        src_pages[1:] = [p for p in src_pages[1:] if p != src_pages[0] + 1][:pages - 2]
        dst_pages[1:] = [p for p in dst_pages[1:] if p != dst_pages[0] + 1][:pages - 2]
        src_pages.insert(1, src_pages[0] + 1)
        dst_pages.insert(1, dst_pages[0] + 1)
    src = [p * PAGE + i for p in src_pages for i in range(PAGE)]
    dst = [p * PAGE + i for p in dst_pages for i in range(PAGE)]
    return src, dst


def test_direct_copies_token_runs_of_every_layer(memory):
    dev = [memory.device((DEVICE_TOKENS, HEADS, DIM), data=False) for _ in range(2 * LAYERS)]
    host = memory.host((2 * LAYERS, HOST_TOKENS, HEADS, DIM))
    host_layers = [host[i] for i in range(2 * LAYERS)]
    src, dst = page_aligned(HOST_TOKENS, DEVICE_TOKENS)
    kvcacheio.transfer_kv_direct(host_layers, dev, memory.indices(src), memory.indices(dst), PAGE)
    for i in range(2 * LAYERS):
        expected = torch.full((DEVICE_TOKENS, HEADS, DIM), POISON, dtype=torch.int16)
        for s, d in zip(src, dst, strict=True):
            expected[d] = host[i, s]
        assert_poison_except(memory.cpu(dev[i]), expected)


@pytest.mark.parametrize("mla", [False, True])
def test_direct_page_first_both_ways(memory, mla):
    tensors = 1 if mla else 2
    pf = [memory.host((HOST_TOKENS // PAGE, LAYERS, PAGE, HEADS, DIM)) for _ in range(tensors)]
    dev = [memory.device((DEVICE_TOKENS, HEADS, DIM), data=False) for _ in range(tensors)]  # one layer: K (and V)
    src, dst = page_aligned(HOST_TOKENS, DEVICE_TOKENS, runs=False)
    layer = 2
    kvcacheio.transfer_kv_per_layer_direct_pf_lf(pf, dev, memory.indices(src), memory.indices(dst), layer, PAGE)
    for t in range(tensors):
        expected = torch.full((DEVICE_TOKENS, HEADS, DIM), POISON, dtype=torch.int16)
        for s, d in zip(src, dst, strict=True):
            expected[d] = pf[t][s // PAGE, layer, s % PAGE]
        assert_poison_except(memory.cpu(dev[t]), expected)

    layers = [memory.device((DEVICE_TOKENS, HEADS, DIM)) for _ in range(tensors * LAYERS)]  # K's layers, then V's
    out = [memory.host((HOST_TOKENS // PAGE, LAYERS, PAGE, HEADS, DIM), data=False) for _ in range(tensors)]
    back_src, back_dst = page_aligned(DEVICE_TOKENS, HOST_TOKENS, runs=False)
    kvcacheio.transfer_kv_all_layer_direct_lf_pf(layers, out, memory.indices(back_src), memory.indices(back_dst),
                                                 PAGE)
    for t in range(tensors):
        expected = torch.full(tuple(out[t].shape), POISON, dtype=torch.int16)
        for layer in range(LAYERS):
            source = memory.cpu(layers[t * LAYERS + layer])
            for s, d in zip(back_src, back_dst, strict=True):
                expected[d // PAGE, layer, d % PAGE] = source[s]
        assert_poison_except(memory.cpu(out[t]), expected)


def test_direct_per_layer_calls_reuse_what_they_derived_only_while_the_index_values_hold(memory):
    """A per-layer direct load derives its copies once and reuses them for the next layers' calls with the same
    index tensors. Index values rewritten in place (a numpy write: torch's version counter does not move) are seen
    by the next call; a bad rewrite is refused on every call, nothing copied."""
    import numpy as np

    pf = [memory.host((HOST_TOKENS // PAGE, LAYERS, PAGE, HEADS, DIM)) for _ in range(2)]
    src_i, dst_i = torch.zeros(5 * PAGE, dtype=torch.int64), torch.zeros(5 * PAGE, dtype=torch.int64)
    for turn in range(3):
        src, dst = page_aligned(HOST_TOKENS, DEVICE_TOKENS, runs=False)
        src_i.numpy()[:], dst_i.numpy()[:] = src, dst
        dev = [memory.device((DEVICE_TOKENS, HEADS, DIM), data=False) for _ in range(2 * LAYERS)]
        for layer in range(LAYERS):
            kvcacheio.transfer_kv_per_layer_direct_pf_lf(pf, [dev[layer], dev[LAYERS + layer]], src_i, dst_i, layer,
                                                         PAGE)
        for t in range(2):
            for layer in range(LAYERS):
                expected = torch.full((DEVICE_TOKENS, HEADS, DIM), POISON, dtype=torch.int16)
                for s, d in zip(src, dst, strict=True):
                    expected[d] = pf[t][s // PAGE, layer, s % PAGE]
                assert_poison_except(memory.cpu(dev[t * LAYERS + layer]), expected), f"turn {turn}"
    np.copyto(dst_i.numpy()[PAGE:2 * PAGE], dst_i.numpy()[:PAGE])      # two pages to one destination page
    dev = [memory.device((DEVICE_TOKENS, HEADS, DIM), data=False) for _ in range(2)]
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="same bytes"):
            kvcacheio.transfer_kv_per_layer_direct_pf_lf(pf, dev, src_i, dst_i, 0, PAGE)
    assert all(memory.poisoned(x) for x in dev)


# -- refusals: clear errors, nothing copied ------------------------------------------------------------------------
def test_a_pageable_table_entry_is_refused_by_name_and_nothing_is_copied(memory):
    dev_k, dev_v = device_layers(memory), device_layers(memory)
    host = memory.host((2, LAYERS, HOST_TOKENS, HEADS, DIM), data=False)
    host_k, host_v = [host[0, layer] for layer in range(LAYERS)], [host[1, layer] for layer in range(LAYERS)]
    pageable = torch.zeros((HOST_TOKENS, HEADS, DIM), dtype=torch.int16)
    src, dst = pairs(DEVICE_TOKENS, HOST_TOKENS)
    with pytest.raises(NotDeviceAccessible, match=r"dst_v_layers\[1\]"):
        kvcacheio.transfer_kv_all_layer(memory.table(dev_k), memory.table(host_k), memory.table(dev_v),
                                        memory.table([host_v[0], pageable, host_v[2]]), memory.indices(src),
                                        memory.indices(dst), ITEM, LAYERS)
    assert torch.equal(memory.cpu(host), torch.full(tuple(host.shape), POISON, dtype=torch.int16))


def test_tables_must_hold_num_layers(memory):
    dev_k, dev_v = device_layers(memory), device_layers(memory)
    src, dst = pairs(DEVICE_TOKENS, DEVICE_TOKENS)
    with pytest.raises(InvalidArgument, match="num_layers"):
        kvcacheio.transfer_kv_all_layer(memory.table(dev_k), memory.table(dev_k[:2]), memory.table(dev_v),
                                        memory.table(dev_v[:2]), memory.indices(src), memory.indices(dst), ITEM,
                                        LAYERS)


@pytest.mark.parametrize("bad", [{"item_size": 12}, {"item_size": 0}, {"block_quota": 0},
                                 {"num_warps_per_block": 33}])
def test_bad_sizes_are_refused(memory, bad):
    src_t, dst_t = memory.device((DEVICE_TOKENS, HEADS, DIM)), memory.device((DEVICE_TOKENS, HEADS, DIM), data=False)
    src, dst = pairs(DEVICE_TOKENS, DEVICE_TOKENS, absent=False)
    args = {"item_size": ITEM, **bad}
    with pytest.raises(KvtierError):
        kvcacheio.transfer_kv_per_layer_mla(src_t, dst_t, memory.indices(src), memory.indices(dst), **args)
    assert torch.equal(memory.cpu(dst_t), torch.full((DEVICE_TOKENS, HEADS, DIM), POISON, dtype=torch.int16))


def test_mismatched_indices_are_refused(memory):
    src_t, dst_t = memory.device((DEVICE_TOKENS, HEADS, DIM)), memory.device((DEVICE_TOKENS, HEADS, DIM))
    with pytest.raises(InvalidArgument, match="same length"):
        kvcacheio.transfer_kv_per_layer_mla(src_t, dst_t, memory.indices([1, 2, 3]), memory.indices([1, 2]), ITEM)


def test_host_indices_out_of_range_are_refused_before_the_copy(memory):
    """Indices the host can read (a pinned CPU tensor) are checked against the tensors they index."""
    src_t, dst_t = memory.host((HOST_TOKENS, HEADS, DIM)), memory.device((DEVICE_TOKENS, HEADS, DIM), data=False)
    buffer = HostBuffer.allocate(2 * 8 * 3, HostKind.PINNED, runtime=memory.runtime)
    memory.keep.append(buffer)
    indices = buffer.as_tensor(torch.int64)
    indices[:3] = torch.tensor([0, 1, HOST_TOKENS])  # source 64 of 64 tokens
    indices[3:] = torch.tensor([0, 1, 2])
    with pytest.raises(InvalidArgument, match="out of range"):
        kvcacheio.transfer_kv_per_layer_mla(src_t, dst_t, indices[:3], indices[3:], ITEM)
    assert torch.equal(memory.cpu(dst_t), torch.full((DEVICE_TOKENS, HEADS, DIM), POISON, dtype=torch.int16))
    indices[2] = HOST_TOKENS - 1
    kvcacheio.transfer_kv_per_layer_mla(src_t, dst_t, indices[:3], indices[3:], ITEM)
    assert torch.equal(memory.cpu(dst_t)[:3], src_t[[0, 1, HOST_TOKENS - 1]])


@pytest.fixture
def side_by_side(memory):
    """One pageable mapping registered as two separate registrations that touch: (the mapping, the bytes of the
    first registration). Separate registrations are separate memory even where they touch."""
    if memory.torch_pinned:
        pytest.skip("kvtier registrations only")
    half = 8192
    region = memory.buffer(2 * half, HostKind.PAGEABLE)
    base = region.cpu_address.value
    first = register_chunks(memory.runtime, base, half)
    second = register_chunks(memory.runtime, base + half, half)
    yield region, half
    if memory.cuda:
        torch.cuda.synchronize()
    unregister_chunks(memory.runtime, second)
    unregister_chunks(memory.runtime, first)


def test_a_registration_touching_the_next_one_is_its_own_span(memory, side_by_side):
    """Regression: the bounds walk took a neighbouring registration for a chunk of the same buffer. In split mode
    their aliases do not continue, so a call with device-resident indices was refused; in unified mode an index
    running into the neighbour was let through."""
    region, half = side_by_side
    whole = region.as_tensor(torch.int16)
    whole.copy_(memory.values(whole.shape))
    per_layer = HOST_TOKENS * HEADS * DIM
    host = [whole[layer * per_layer:(layer + 1) * per_layer].view(HOST_TOKENS, HEADS, DIM) for layer in range(LAYERS)]
    dev = device_layers(memory, data=False)
    src, dst = pairs(HOST_TOKENS, DEVICE_TOKENS)
    kvcacheio.transfer_kv_all_layer_mla(memory.table(host), memory.table(dev), memory.indices(src),
                                        memory.indices(dst), ITEM, LAYERS)
    for layer in range(LAYERS):
        expected = torch.full((DEVICE_TOKENS, HEADS, DIM), POISON, dtype=torch.int16)
        for s, d in copied(src, dst):
            expected[d] = host[layer][s]
        assert_poison_except(memory.cpu(dev[layer]), expected)

    fresh = device_layers(memory, data=False)
    last = (LAYERS - 1) * per_layer * 2           # byte offset of the last layer in the first registration
    beyond = (half - last) // ITEM                # the first item that starts in the second registration
    with pytest.raises(InvalidArgument, match="out of range"):
        kvcacheio.transfer_kv_all_layer_mla(memory.table(host), memory.table(fresh),
                                            memory.pinned_indices([0, beyond]), memory.pinned_indices([0, 1]),
                                            ITEM, LAYERS)
    assert all(memory.poisoned(layer) for layer in fresh)


def test_a_pageable_tensor_operand_is_refused(memory):
    if memory.runtime.device_attributes(0).pageable_memory_access:
        pytest.skip("this device reads pageable host memory")
    pageable = torch.zeros((HOST_TOKENS, HEADS, DIM), dtype=torch.int16)
    dst_t = memory.device((DEVICE_TOKENS, HEADS, DIM), data=False)
    src, dst = pairs(HOST_TOKENS, DEVICE_TOKENS, absent=False)
    with pytest.raises(NotDeviceAccessible, match="src"):
        kvcacheio.transfer_kv_per_layer_mla(pageable, dst_t, memory.indices(src), memory.indices(dst), ITEM)


def test_memory_of_another_device_in_a_table_is_refused(runtime):
    if runtime.device_count() < 2:
        pytest.skip("needs two devices")
    mem = Memory(runtime)
    try:
        dev = device_layers(mem)
        if mem.cuda:
            other = torch.zeros((DEVICE_TOKENS, HEADS, DIM), dtype=torch.int16, device="cuda:1")
        else:
            other = DeviceArray.empty((DEVICE_TOKENS, HEADS, DIM), torch.int16, device=1, runtime=runtime)
            mem.keep.append(other)
        src, dst = pairs(DEVICE_TOKENS, DEVICE_TOKENS)
        with pytest.raises(WrongDeviceError, match=r"dst_layers\[2\]"):
            kvcacheio.transfer_kv_all_layer_mla(mem.table(dev), mem.table([dev[0], dev[1], other]),
                                                mem.indices(src), mem.indices(dst), ITEM, LAYERS)
    finally:
        mem.close()


# -- CUDA only -----------------------------------------------------------------------------------------------------
@pytest.fixture
def cuda_memory(cuda):
    mem = Memory(cuda)
    yield mem
    mem.close()   # after the test's frame is gone: no host view is left to hold the buffers


@pytest.mark.gpu
def test_a_per_layer_call_replays_from_a_cuda_graph(cuda_memory):
    mem = cuda_memory
    host_k, host_v = mem.host((HOST_TOKENS, LAYERS, HEADS, DIM)), mem.host((HOST_TOKENS, LAYERS, HEADS, DIM))
    dev_k = torch.full((DEVICE_TOKENS, HEADS, DIM), POISON, dtype=torch.int16, device="cuda")
    dev_v = torch.full((DEVICE_TOKENS, HEADS, DIM), POISON, dtype=torch.int16, device="cuda")
    src_i = torch.zeros(16, dtype=torch.int64, device="cuda")
    dst_i = torch.zeros(16, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up: builds and keeps the kernel's tables
        kvcacheio.transfer_kv_per_layer_pf_lf(host_k, dev_k, host_v, dev_v, src_i, dst_i, 1, ITEM, LAYERS * ITEM)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kvcacheio.transfer_kv_per_layer_pf_lf(host_k, dev_k, host_v, dev_v, src_i, dst_i, 1, ITEM, LAYERS * ITEM)
    src, dst = pairs(HOST_TOKENS, DEVICE_TOKENS, count=16)
    dev_k.fill_(POISON), dev_v.fill_(POISON)
    src_i.copy_(torch.tensor(src)), dst_i.copy_(torch.tensor(dst))
    graph.replay()
    torch.cuda.synchronize()
    for host, dev in ((host_k, dev_k), (host_v, dev_v)):
        expected = torch.full((DEVICE_TOKENS, HEADS, DIM), POISON, dtype=torch.int16)
        for s, d in copied(src, dst):
            expected[d] = host[s, 1]
        assert_poison_except(dev.cpu(), expected)


# -- DeviceArray -----------------------------------------------------------------------------------------------------
def test_device_array_answers_the_tensor_api_the_compat_layer_reads(split):
    data = torch.randint(-30000, 30000, (4, 3, 5), dtype=torch.int16)
    array = DeviceArray.from_tensor(data, runtime=split)
    try:
        assert array.shape == (4, 3, 5) and array.stride() == (15, 5, 1) and array.element_size() == 2
        assert array.numel() == 60 and array.nbytes == 120 and array.dim() == 3 and len(array) == 4
        assert torch.equal(array.cpu(), data) and torch.equal(array[2].cpu(), data[2])
        assert torch.equal(array[-1].cpu(), data[-1])
        assert array[1].data_ptr() == array.data_ptr() + 30
        with pytest.raises(InvalidArgument, match="out of range"):
            array[4]
        with pytest.raises(InvalidArgument, match="dimension 0"):
            array.select(1, 0)
        with pytest.raises(InvalidArgument, match="bytes"):
            array.copy_(torch.zeros(7, dtype=torch.int16))
        array[3].copy_(torch.ones((3, 5), dtype=torch.int16))
        assert torch.equal(array.cpu()[3], torch.ones((3, 5), dtype=torch.int16))
        assert torch.equal(array.cpu()[:3], data[:3])
    finally:
        array.close()


def test_device_array_from_a_zero_dim_tensor(rt):
    """DeviceArray.from_tensor(torch.tensor(5)) crashes inside copy_ with torch's RuntimeError ("self.dim() cannot
    be 0 to view Long as Byte"). Expected: a 0-d DeviceArray holding 5 (or a kvtier InvalidArgument).
    (found adversarially, issue #15)"""
    try:
        array = DeviceArray.from_tensor(torch.tensor(5), runtime=rt)
    except KvtierError:
        return
    assert array.cpu().item() == 5


def test_a_new_table_tensor_at_a_freed_ones_address_is_read_again(split):
    """Raw tables are read once per tensor and version. A new tensor over the same bytes (a freed table's address
    reused, version 0 again) with other entries must be read again: keyed on the address and version alone, the
    second call copied from the first table's layers (wrong KV)."""
    import numpy as np

    mem = Memory(split)
    try:
        first, second = device_layers(mem), device_layers(mem)
        dst = device_layers(mem, data=False)
        src, dst_i = pairs(DEVICE_TOKENS, DEVICE_TOKENS, absent=False)
        raw = np.array([t.data_ptr() for t in first], dtype=np.uint64)
        table = torch.from_numpy(raw)
        dst_table = mem.table(dst)
        kvcacheio.transfer_kv_all_layer_mla(table, dst_table, mem.indices(src), mem.indices(dst_i), ITEM, LAYERS)
        del table
        raw[:] = [t.data_ptr() for t in second]           # numpy writes: torch sees no new version
        table = torch.from_numpy(raw)
        kvcacheio.transfer_kv_all_layer_mla(table, dst_table, mem.indices(src), mem.indices(dst_i), ITEM, LAYERS)
        for layer in range(LAYERS):
            source, got = second[layer].cpu(), dst[layer].cpu()
            for s, d in zip(src, dst_i, strict=True):
                assert torch.equal(got[d], source[s]), f"layer {layer} token {d} came from a stale table"
    finally:
        mem.close()


def test_a_warm_table_call_resolves_only_what_kvtier_cannot_see_change(memory, monkeypatch):
    """Table entries inside kvtier's host ranges keep their resolution while those ranges are unchanged, so a warm
    all-layer call asks the driver nothing for them (~10 µs each on the H200, 64-128 per call); device entries and
    torch-pinned host entries, which kvtier cannot see freed, are resolved on every call; a host buffer allocated or
    closed anywhere makes the next call resolve everything again; and every call copies right."""
    import kvtier.compat.operands as operands

    resolved: list[int] = []
    real = operands.resolve_foreign_address

    def counting(value, device, *, runtime=None):
        resolved.append(value)
        return real(value, device, runtime=runtime)

    monkeypatch.setattr(operands, "resolve_foreign_address", counting)
    dev = device_layers(memory)
    host = memory.host((LAYERS, HOST_TOKENS, HEADS, DIM), data=False)
    host_layers = [host[layer] for layer in range(LAYERS)]
    dev_table, host_table = memory.table(dev), memory.table(host_layers)
    host_addresses = {t.data_ptr() for t in host_layers}

    def backup():
        src, dst = pairs(DEVICE_TOKENS, HOST_TOKENS, absent=False)
        resolved.clear()
        kvcacheio.transfer_kv_all_layer_mla(dev_table, host_table, memory.indices(src), memory.indices(dst), ITEM,
                                            LAYERS)
        memory.runtime.synchronize(0)
        got = memory.cpu(host)
        for layer in range(LAYERS):
            source = memory.cpu(dev[layer])
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(got[layer, d], source[s]), f"layer {layer} token {d}"
        return set(resolved) & host_addresses, len(resolved)

    cold = (host_addresses, 2 * LAYERS)
    warm = cold if memory.torch_pinned else (set(), LAYERS)
    assert backup() == cold
    assert backup() == warm
    memory.buffer(4096)                                       # kvtier's host ranges changed
    assert backup() == cold
    assert backup() == warm


def _counting_prepares(monkeypatch, runtime) -> list:
    import kvtier.compat.operands as operands

    launcher = operands._per_runtime(runtime).launcher
    real, prepared = launcher.prepare, []

    def prepare(*args, **kwargs):
        prepared.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(launcher, "prepare", prepare)
    return prepared


def test_a_repeated_per_layer_call_reuses_its_plan_and_copies_what_the_indices_say_now(memory, monkeypatch):
    """A per-layer load is ~60 calls a request over the same tensors: each layer is planned once (resolution,
    checks, kernel arguments) and later calls only bind their indices and launch, ~4x less host time. Index values
    are read by the kernel, so a kept plan with rewritten device indices copies the new items, and a request's new
    index tensors (another count too) bind to the same plans; a torch-pinned host operand (whose alias kvtier cannot
    see change) is planned on every call."""
    prepared = _counting_prepares(monkeypatch, memory.runtime)
    item = MLA_DIM * 2
    host = memory.host((HOST_TOKENS, LAYERS, MLA_DIM))
    dev = [memory.device((DEVICE_TOKENS, MLA_DIM), data=False) for _ in range(LAYERS)]
    src_i, dst_i = memory.indices([0] * 20), memory.indices([0] * 20)

    def load(src, dst, src_i, dst_i, what):
        for layer in range(LAYERS):
            kvcacheio.transfer_kv_per_layer_mla_pf_lf(host, dev[layer], src_i, dst_i, layer, item, LAYERS * item)
        for layer in range(LAYERS):
            got = memory.cpu(dev[layer])
            for s, d in copied(src, dst):
                assert torch.equal(got[d], host[s, layer]), f"{what} layer {layer} token {d}"

    for turn in range(3):
        src, dst = pairs(HOST_TOKENS, DEVICE_TOKENS)
        for index, values in ((src_i, src), (dst_i, dst)):
            index.copy_(torch.tensor(values))
        load(src, dst, src_i, dst_i, f"turn {turn}")
    assert len(prepared) == (3 * LAYERS if memory.torch_pinned else LAYERS)
    for turn in range(2):       # each request brings index tensors of its own: bound to the kept plans
        src, dst = pairs(HOST_TOKENS, DEVICE_TOKENS, count=12 + turn)
        load(src, dst, memory.indices(src), memory.indices(dst), f"request {turn}")
    assert len(prepared) == (5 * LAYERS if memory.torch_pinned else LAYERS)


def test_a_kept_plan_over_a_closed_device_array_is_refused_by_name(split, monkeypatch):
    """Emulator DeviceArrays can be closed under a kept plan: the next call must refuse the operand by name, not
    launch at its freed address."""
    mem = Memory(split)
    src = DeviceArray.from_tensor(torch.randint(-300, 300, (DEVICE_TOKENS, HEADS, DIM), dtype=torch.int16),
                                  runtime=split)
    dst = mem.device((DEVICE_TOKENS, HEADS, DIM), data=False)
    try:
        si, di = mem.indices([1, 2]), mem.indices([3, 4])
        kvcacheio.transfer_kv_per_layer_mla(src, dst, si, di, ITEM)
        kvcacheio.transfer_kv_per_layer_mla(src, dst, si, di, ITEM)
        src.close()
        with pytest.raises(KvtierError, match="src"):
            kvcacheio.transfer_kv_per_layer_mla(src, dst, si, di, ITEM)
    finally:
        mem.close()


def test_a_host_buffer_closed_and_reallocated_under_a_kept_plan_is_planned_again(runtime, monkeypatch):
    """A per-layer load planned over a kvtier host buffer; the buffer is closed and a new one allocated (often at
    the same CPU address, on split-alias platforms with another device alias). The new buffer's call is planned
    again and copies from the new bytes."""
    prepared = _counting_prepares(monkeypatch, runtime)
    mem = Memory(runtime)
    try:
        dst = mem.device((DEVICE_TOKENS, HEADS, DIM), data=False)
        si, di = mem.indices([5, 6]), mem.indices([7, 8])

        def load():
            buffer = HostBuffer.allocate(HOST_TOKENS * ITEM, HostKind.PINNED, runtime=runtime)
            host = buffer.as_tensor(torch.int16).view(HOST_TOKENS, HEADS, DIM)
            host.copy_(torch.randint(-300, 300, host.shape, dtype=torch.int16))
            for _ in range(2):
                kvcacheio.transfer_kv_per_layer_mla(host, dst, si, di, ITEM)
            got = mem.cpu(dst)
            assert torch.equal(got[7], host[5]) and torch.equal(got[8], host[6])
            del host
            buffer.close()

        load()
        assert len(prepared) == 1
        load()
        assert len(prepared) == 2
    finally:
        mem.close()


def test_pageable_indices_are_refused_by_name(split):
    mem = Memory(split)
    try:
        src_t, dst_t = mem.device((DEVICE_TOKENS, HEADS, DIM)), mem.device((DEVICE_TOKENS, HEADS, DIM), data=False)
        with pytest.raises(NotDeviceAccessible, match="src_indices"):
            kvcacheio.transfer_kv_per_layer_mla(src_t, dst_t, torch.tensor([1, 2]), mem.indices([3, 4]), ITEM)
        assert torch.equal(dst_t.cpu(), torch.full((DEVICE_TOKENS, HEADS, DIM), POISON, dtype=torch.int16))
    finally:
        mem.close()


# SGLang's public signatures (sgl_kernel/kvcacheio.py): names, order, and which parameters have defaults.
SGLANG_SIGNATURES = {
    "transfer_kv_per_layer": "src_k dst_k src_v dst_v src_indices dst_indices item_size block_quota= "
                             "num_warps_per_block=",
    "transfer_kv_per_layer_pf_lf": "src_k dst_k src_v dst_v src_indices dst_indices layer_id item_size "
                                   "src_layout_dim block_quota= num_warps_per_block=",
    "transfer_kv_per_layer_ph_lf": "src_k dst_k src_v dst_v src_indices dst_indices layer_id item_size "
                                   "src_layout_dim page_size head_num block_quota= num_warps_per_block=",
    "transfer_kv_all_layer": "src_k_layers dst_k_layers src_v_layers dst_v_layers src_indices dst_indices item_size "
                             "num_layers block_quota= num_warps_per_block=",
    "transfer_kv_all_layer_lf_pf": "src_k_layers dst_k src_v_layers dst_v src_indices dst_indices item_size "
                                   "dst_layout_dim num_layers block_quota= num_warps_per_block=",
    "transfer_kv_all_layer_lf_ph": "src_k_layers dst_k src_v_layers dst_v src_indices dst_indices item_size "
                                   "dst_layout_dim num_layers page_size head_num block_quota= num_warps_per_block=",
    "transfer_kv_direct": "src_layers dst_layers src_indices dst_indices page_size",
    "transfer_kv_per_layer_direct_pf_lf": "src_ptrs dst_ptrs src_indices dst_indices layer_id page_size",
    "transfer_kv_all_layer_direct_lf_pf": "src_ptrs dst_ptrs src_indices dst_indices page_size",
    "transfer_kv_per_layer_mla": "src dst src_indices dst_indices item_size block_quota= num_warps_per_block=",
    "transfer_kv_per_layer_mla_pf_lf": "src dst src_indices dst_indices layer_id item_size src_layout_dim "
                                       "block_quota= num_warps_per_block=",
    "transfer_kv_all_layer_mla": "src_layers dst_layers src_indices dst_indices item_size num_layers block_quota= "
                                 "num_warps_per_block=",
    "transfer_kv_all_layer_mla_lf_pf": "src_layers dst src_indices dst_indices item_size dst_layout_dim num_layers "
                                       "block_quota= num_warps_per_block=",
}


@pytest.mark.parametrize("name", sorted(SGLANG_SIGNATURES))
def test_signatures_are_sglangs(name):
    """A drop-in keeps SGLang's names, argument order and defaults (2 blocks; 32 warps, 16 on ROCm), so positional
    calls written for sgl_kernel land on the same parameters."""
    import inspect

    assert name in kvcacheio.__all__
    parameters = inspect.signature(getattr(kvcacheio, name)).parameters.values()
    got = " ".join(p.name + ("=" if p.default is not inspect.Parameter.empty else "") for p in parameters)
    assert got == SGLANG_SIGNATURES[name]
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    if defaults:
        warps = 16 if getattr(torch.version, "hip", None) else 32
        assert defaults == {"block_quota": 2, "num_warps_per_block": warps}
    assert len(kvcacheio.__all__) == 13
