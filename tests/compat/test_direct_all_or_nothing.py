"""SGLang ``*_direct`` copies land whole or are refused with nothing copied: over host buffers registered in chunks
or in separate registrations that touch (each copy is cut at every registration edge, on both sides), with a
page_size that is not the host's, with DeviceArrays of two devices, and over host memory the call's device cannot
reach (the runtime's error is named by operand). docs/sglang.md: '*_direct functions check everything first ... a
refusal leaves every tensor as it was'. (Found adversarially, issue #15.)
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from helpers.compat import BYTE_ITEM, OS_PAGE
from helpers.compat import byte_operands as Mem
from helpers.operands import POISON, all_poison

from kvtier.compat.sglang import kvcacheio
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.memory import HostBuffer, register_chunks, unregister_chunks
from kvtier.runtime import HostRegisterFlags, create


# -- cut at registration edges -----------------------------------------------------------------------------------------
def test_direct_lf_pf_into_a_chunk_registered_host_in_unified_mode_is_all_or_nothing():
    """Unified addressing (H200), page_first_direct K and V hosts for 2 pages of one layer; V's HostBuffer is
    registered in two chunks of one page each (register_chunk_bytes, boundary between the pages, as the docs
    allow), K's in one. transfer_kv_all_layer_direct_lf_pf resolves V whole (its chunks' aliases continue each
    other, so the tensor is accepted), then groups V's two equally spaced pages into one strided copy whose extent
    crosses the registration boundary; the copy API refuses it (RuntimeCallError cudaMemcpy2DAsync
    cudaErrorInvalidValue, naming no operand) AFTER K's copy was queued: K is overwritten, V is not.
    docs/sglang.md: '*_direct functions check everything first ... a refusal leaves every tensor as it was'.
    Expected: both pages of K and V land (a strided copy must not cross a registration boundary: split it, as
    Runtime.groups does for CPU bases), or a refusal before anything is queued."""
    runtime = create("emulated:unified")
    m = Mem(runtime)
    page_size, item = 4, OS_PAGE // 4                      # one page of one layer = one OS page
    k_buf = m._own(HostBuffer.allocate(2 * OS_PAGE, runtime=runtime))
    v_buf = m._own(HostBuffer.allocate(2 * OS_PAGE, runtime=runtime, granularity=OS_PAGE, register_chunk_bytes=OS_PAGE))
    assert len(v_buf.chunks) == 2
    k_host, v_host = (b.as_tensor(torch.uint8).view(2, 1, page_size, item) for b in (k_buf, v_buf))
    k_host.fill_(POISON)
    v_host.fill_(POISON)
    k_src, v_src = m.device((8, item)), m.device((8, item))
    indices = torch.arange(8)
    try:
        kvcacheio.transfer_kv_all_layer_direct_lf_pf([k_src, v_src], [k_host, v_host], indices, indices, page_size)
    except KvtierError:
        runtime.synchronize(0)
        assert all_poison(k_host) and all_poison(v_host), "a refused direct call already copied K"
        return
    runtime.synchronize(0)
    assert torch.equal(k_host.reshape(8, item), k_src.cpu())
    assert torch.equal(v_host.reshape(8, item), v_src.cpu())


def _direct_trial(rng: random.Random, mode: str) -> None:
    """One random *_direct call over host buffers registered in chunks (boundaries inside pages and token runs,
    offset views), both directions, K/V and MLA: every byte lands, or it is refused with nothing copied."""
    runtime = create(f"emulated:{mode}")
    m = Mem(runtime)
    item, page_size, layers = rng.choice([64, 256, 1024]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3])
    pages, chunk = rng.choice([2, 4, 8]), rng.choice([OS_PAGE, 2 * OS_PAGE, 3 * OS_PAGE])
    tokens, offset = pages * page_size, rng.choice([0, 0, 64, 100, OS_PAGE - 64])

    def host(nbytes, data):
        buffer = m._own(HostBuffer.allocate(-(-(nbytes + offset) // OS_PAGE) * OS_PAGE, runtime=runtime,
                                            register_chunk_bytes=chunk))
        t = buffer.as_tensor(torch.uint8)[offset:offset + nbytes]
        t.copy_(m.values(t.shape, data))
        return t

    func = rng.choice(["direct", "pf_lf", "lf_pf"])
    try:
        if func == "direct":
            n = min(rng.choice([1, 2, 3]) * page_size, tokens)
            start = rng.randrange(0, tokens - n + 1)
            h_idx = list(range(start, start + n)) if rng.random() < 0.5 else rng.sample(range(tokens), n)
            d_idx = rng.sample(range(tokens), n) if rng.random() < 0.5 else list(range(n))
            to_host = rng.random() < 0.5
            hosts = [host(tokens * item, not to_host).view(tokens, item) for _ in range(layers)]
            devs = [m.device((tokens, item)) for _ in range(layers)]
            before = [h.clone() for h in hosts] + [d.cpu() for d in devs]
            try:
                if to_host:
                    kvcacheio.transfer_kv_direct(devs, hosts, torch.tensor(d_idx), torch.tensor(h_idx), page_size)
                else:
                    kvcacheio.transfer_kv_direct(hosts, devs, torch.tensor(h_idx), torch.tensor(d_idx), page_size)
            except KvtierError:
                runtime.synchronize(0)
                assert mode == "split"
                assert all(torch.equal(a, b) for a, b in zip([*hosts, *[d.cpu() for d in devs]], before, strict=True))
                return
            runtime.synchronize(0)
            for h, d in zip(hosts, devs, strict=True):
                if to_host:
                    assert torch.equal(h[h_idx], d.cpu()[d_idx]) and all_poison(
                        h[[i for i in range(tokens) if i not in h_idx]])
                else:
                    assert torch.equal(d.cpu()[d_idx], h[h_idx])
            return
        mla = rng.random() < 0.5
        count = rng.choice([1, 2, pages])
        hp, dp = rng.sample(range(pages), count), rng.sample(range(pages), count)
        h_idx = torch.tensor([p * page_size + i for p in hp for i in range(page_size)])
        d_idx = torch.tensor([p * page_size + i for p in dp for i in range(page_size)])
        hosts = [host(pages * layers * page_size * item, func == "pf_lf").view(pages, layers, page_size, item)
                 for _ in range(1 if mla else 2)]
        lf = [m.device((tokens, item)) for _ in range(len(hosts) * layers)]
        before = [h.clone() for h in hosts] + [x.cpu() for x in lf]
        try:
            if func == "lf_pf":
                kvcacheio.transfer_kv_all_layer_direct_lf_pf(lf, hosts, d_idx, h_idx, page_size)
            else:
                kvcacheio.transfer_kv_per_layer_direct_pf_lf(hosts, lf, h_idx, d_idx, 0, page_size)
        except KvtierError:
            runtime.synchronize(0)
            assert mode == "split"
            assert all(torch.equal(a, b) for a, b in zip([*hosts, *[x.cpu() for x in lf]], before, strict=True))
            return
        runtime.synchronize(0)
        for t, h in enumerate(hosts):
            expected = before[t].clone()
            for layer in range(layers):
                src = before[len(hosts) + t * layers + layer]
                got = lf[t * layers + layer].cpu()
                for a, b in zip(hp, dp, strict=True):
                    if func == "lf_pf":
                        expected[a, layer] = src[b * page_size:(b + 1) * page_size]
                    else:
                        assert torch.equal(got[b * page_size:(b + 1) * page_size], h[a, layer])
            if func == "lf_pf":
                assert torch.equal(h, expected)
    finally:
        hosts = devs = lf = None  # noqa: F841
        gc.collect()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["split", "unified"])
def test_ok_direct_copies_over_chunk_registered_hosts_land_exactly_or_are_refused_whole(mode):
    rng = random.Random(15_4)
    for _ in range(60):
        _direct_trial(rng, mode)


def test_ok_direct_host_to_host_with_different_chunk_boundaries_on_each_side_lands():
    """Unified: a layer whose source AND destination are host tensors (offset views) over buffers registered in
    chunks with different boundaries: every piece is cut on both sides and lands."""
    runtime = create("emulated:unified")
    m = Mem(runtime)
    a = m._own(HostBuffer.allocate(8 * OS_PAGE, runtime=runtime, register_chunk_bytes=OS_PAGE))
    b = m._own(HostBuffer.allocate(8 * OS_PAGE, runtime=runtime, register_chunk_bytes=3 * OS_PAGE))
    c = m._own(HostBuffer.allocate(8 * OS_PAGE, runtime=runtime))
    src = a.as_tensor()[512:512 + 7 * OS_PAGE].view(-1, 1024)
    dst = b.as_tensor()[1024:1024 + 7 * OS_PAGE].view(-1, 1024)
    other = c.as_tensor()[:7 * OS_PAGE].view(-1, 1024)
    src.copy_(m.values(src.shape))
    dst.fill_(POISON)
    other.fill_(POISON)
    dev = m.device(tuple(src.shape))
    n = src.shape[0]
    kvcacheio.transfer_kv_direct([dev, src], [other, dst], torch.arange(n), torch.arange(n), 1)
    runtime.synchronize(0)
    assert torch.equal(dst, src) and torch.equal(other, dev.cpu())


def test_ok_direct_into_two_touching_registrations_is_cut_between_them():
    runtime = create("emulated:unified")
    m = Mem(runtime)
    plain = m._own(HostBuffer.allocate(4 * OS_PAGE, "pageable", runtime=runtime))
    base = plain.cpu_address.value
    first, second = register_chunks(runtime, base, OS_PAGE), register_chunks(runtime, base + OS_PAGE, 3 * OS_PAGE)
    host = plain.as_tensor().view(-1, 64)
    try:
        host.fill_(POISON)
        dev = m.device((256, 64))
        kvcacheio.transfer_kv_direct([dev], [host], torch.arange(40, 100), torch.arange(30, 90), 1)
        runtime.synchronize(0)
        assert torch.equal(host[30:90], dev.cpu()[40:100])
        assert all_poison(host[:30]) and all_poison(host[90:])
    finally:
        host = None
        unregister_chunks(runtime, second)
        unregister_chunks(runtime, first)


# -- refusals ----------------------------------------------------------------------------------------------------------
def test_direct_pf_lf_refuses_a_page_size_larger_than_the_host_page():
    """page_first_direct host [pages=4, layers=2, page_size=4, item]; transfer_kv_per_layer_direct_pf_lf called
    with page_size=8. Each copy is 8 tokens of bytes from (page, layer 0): the 4 tokens of layer 0 then the 4 of
    LAYER 1 of the same page, which land as tokens 4..7 of the destination's layer 0: wrong KV, silently (only
    the whole tensor's extent is checked). SGLang's copy_ of a [4, item] page slice into [8, item] fails its shape
    check. Expected: InvalidArgument (page_size does not match the host's pages), destination untouched."""
    runtime = create("emulated:split")
    m = Mem(runtime)
    host = m.host((4, 2, 4, BYTE_ITEM))
    dst = [m.device((16, BYTE_ITEM), data=False) for _ in range(2)]
    with pytest.raises(InvalidArgument):
        kvcacheio.transfer_kv_per_layer_direct_pf_lf([host], dst, torch.arange(8), torch.arange(8), 0, 8)
    runtime.synchronize(0)
    assert all(m.poisoned(d) for d in dst), "layer 1's KV was copied as layer 0's tokens 4..7"


def test_direct_lf_pf_with_a_page_size_larger_than_the_host_page_does_not_overwrite_other_pages():
    """transfer_kv_all_layer_direct_lf_pf into a page_first_direct host [pages=4, layers=2, page_size=4, item] with
    page_size=8 and destination tokens 0..7 (page 0): each layer's 8-token copy overruns its 4-token slot, so layer
    0 writes page 0's layer-1 slot and layer 1 writes page 1's layer-0 slot, a page the call never addressed (KV of
    another request). Expected: InvalidArgument, host untouched."""
    runtime = create("emulated:split")
    m = Mem(runtime)
    host = m.host((4, 2, 4, BYTE_ITEM), data=False)
    src = [m.device((16, BYTE_ITEM)) for _ in range(2)]
    with pytest.raises(InvalidArgument):
        kvcacheio.transfer_kv_all_layer_direct_lf_pf(src, [host], torch.arange(8), torch.arange(8), 8)
    runtime.synchronize(0)
    assert all_poison(host[1:]), "a page outside the destination indices was overwritten"


def test_ok_direct_refusals_leave_destinations_untouched(rt):
    m = Mem(rt)
    src = [m.device((8, BYTE_ITEM)) for _ in range(2)]
    dst = [m.host((8, BYTE_ITEM), data=False) for _ in range(2)]
    cases = [
        (torch.arange(4, dtype=torch.int32), torch.arange(4)),                   # dtypes differ
        (torch.tensor([0, 1, 2, 2 ** 62]), torch.arange(4)),                     # huge
        (torch.tensor([0, 1, 2, 8]), torch.arange(4)),                           # one past the end
        (torch.arange(3), torch.arange(3)),                                      # not whole pages of 2
        (torch.arange(4, dtype=torch.float32), torch.arange(4, dtype=torch.float32)),
    ]
    for s, d in cases:
        with pytest.raises(InvalidArgument):
            kvcacheio.transfer_kv_direct(src, dst, s, d, 2)
    with pytest.raises(InvalidArgument):
        kvcacheio.transfer_kv_direct(src, dst, m.indices([0, 1, 2, 3]), m.indices([0, 1, 2, 9]), 2)
    rt.synchronize(0)
    assert all(all_poison(d) for d in dst)
    kvcacheio.transfer_kv_direct(src, dst, torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), 2)
    kvcacheio.transfer_kv_direct(src, dst, m.indices([6, 7, 0, 1]), m.pinned_indices([0, 1, 4, 5]), 2)
    rt.synchronize(0)
    for s, d in zip(src, dst, strict=True):
        got = s.cpu()
        assert torch.equal(d[[0, 1, 4, 5]], got[[6, 7, 0, 1]])
        assert all_poison(d[[2, 3, 6, 7]])


@pytest.mark.parametrize("mode", ["unified:2", "split:2"])
def test_ok_direct_with_device_arrays_of_two_devices_is_refused_with_nothing_copied(mode):
    runtime = create(f"emulated:{mode}")
    m = Mem(runtime)
    hosts = [m.host((64, 256), data=False) for _ in range(2)]
    d0, d1 = m.device((64, 256), device=0), m.device((64, 256), device=1)
    with pytest.raises(KvtierError):
        kvcacheio.transfer_kv_direct([d0, d1], hosts, torch.arange(10, 30), torch.arange(5, 25), 1)
    for device in range(2):
        runtime.synchronize(device)
    assert all(all_poison(h) for h in hosts)
    kvcacheio.transfer_kv_direct([d1, d1], hosts, torch.arange(10, 30), torch.arange(5, 25), 1)
    runtime.synchronize(1)
    assert all(torch.equal(h[5:25], d1.cpu()[10:30]) and all_poison(h[:5]) and all_poison(h[25:]) for h in hosts)


@pytest.mark.parametrize("form", ["direct", "pf_lf"])
def test_direct_on_a_host_tensor_the_calls_device_cannot_reach_raises_a_kvtier_error(form):
    """Two devices; a host tensor over memory registered without PORTABLE (runtime.host_register(..., MAPPED), as
    cudaHostRegister without cudaHostRegisterPortable) is mapped for device 0 only; the call runs on device 1
    (its DeviceArrays are there). Resolving the host operand fails inside the runtime with RuntimeCallError
    (cudaHostGetDevicePointer cudaErrorInvalidValue); compat.operands.address re-raises it as
    type(error)(f'{what}: {error}'), but RuntimeCallError takes (call, error, detail): the caller gets a bare
    TypeError 'RuntimeCallError.__init__() missing 1 required positional argument' naming neither the operand nor
    the cause (the same pattern is in table_entries and the new table_room wrap in kvcacheio). Expected: a
    KvtierError naming dst_layers[0] / src_ptrs[0], nothing copied."""
    runtime = create("emulated:split:2")
    m = Mem(runtime)
    plain = m._own(HostBuffer.allocate(4 * OS_PAGE, "pageable", runtime=runtime))
    runtime.host_register(plain.cpu_address.value, 4 * OS_PAGE, HostRegisterFlags.MAPPED)    # device 0 only
    try:
        host = plain.as_tensor(torch.uint8)
        host.fill_(POISON)
        layers = [m.device((16, 64), device=1) for _ in range(2)]
        with pytest.raises(KvtierError):
            if form == "direct":
                kvcacheio.transfer_kv_direct(layers[:1], [host.view(-1, 64)], torch.arange(4), torch.arange(4), 1)
            else:
                kvcacheio.transfer_kv_per_layer_direct_pf_lf([host.view(16, 2, 8, 64)], layers, torch.arange(8),
                                                             torch.arange(8), 0, 8)
        runtime.synchronize(1)
        assert all_poison(host)
        assert not any(m.poisoned(x) for x in layers)
    finally:
        host = None
        runtime.host_unregister(plain.cpu_address.value)
