"""The compat ``*_direct`` functions submit every layer's copies in one batch: over many layers whose operands mix
device arrays, pinned and registered host memory (in every pairing), with host pools registered in chunks whose
copies are cut at each registration edge (on split aliases too), the same index tensors called again on kept plans.
A refusal anywhere (a destination two layers share, a bad last layer) leaves every layer untouched. Destinations
poisoned, checked byte for byte. (Found adversarially, issue #15.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.operands import MODES, POISON, cpu, device, host, poison

from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.memory import HostKind
from kvtier.runtime import create

CHUNK = 16 << 10


@pytest.mark.parametrize("which", ["transfer_kv_direct", "transfer_kv_all_layer_direct_lf_pf"])
@pytest.mark.parametrize("spec", MODES)
def test_direct_calls_refuse_a_destination_two_layers_share(spec, which):
    """docs/sglang.md: 'Repeated or overlapping destinations are refused: one call's copies land in no defined order
    (a batched copy orders nothing)'. The check runs on the destination *indices* of one layer only
    (``_token_runs`` / ``_page_overlap`` name ``dst_layers[0]`` / ``dst_ptrs[0]``, direct.py:298-303, 325-330), never
    on the destination *tensors*: the same tensor given for two layers (or K and V as one ``page_first_direct``
    tensor) is accepted, and since the one-batch submission (``_submit``, direct.py:256-261) all layers' copies go in
    one ``cudaMemcpyBatchAsync``, so which layer's bytes end up there is undefined on CUDA (SGLang's loop of
    ``copy_`` keeps the last layer; before this change each layer was its own batch, ordered on the stream). Fix:
    refuse destination tensors whose byte spans overlap (compare each plan's destination base + [lo, hi) span across
    layers, once per plan)."""
    rt = create(spec)
    n, row, layers = 16, 64, 2
    si, di = torch.tensor([3, 4, 5, 9]), torch.tensor([0, 1, 2, 7])
    if which == "transfer_kv_direct":
        shared = host(rt, (n, row), data=False)
        srcs = [device(rt, (n, row)) for _ in range(2)]
        call = lambda: io.transfer_kv_direct(srcs, [shared, shared], si, di, 1)  # noqa: E731
    else:
        shared = host(rt, (4, layers, 2, row), data=False)
        srcs = [device(rt, (n, row)) for _ in range(2 * layers)]
        call = lambda: io.transfer_kv_all_layer_direct_lf_pf(srcs, [shared, shared], torch.tensor([2, 3, 8, 9]),  # noqa: E731
                                                             torch.tensor([0, 1, 4, 5]), 2)
    with pytest.raises(InvalidArgument):
        call()
    rt.synchronize(0)
    assert (shared == POISON).all()


def _page_first_round_trip(rt):
    """Every layer of K and V backed up into a ``page_first_direct`` host pool registered in 4 KiB chunks whose
    boundaries fall inside pages (granularity 1), then loaded back layer by layer; every byte checked."""
    page, pl, pages, row = 4, 8, 12, 64
    k = [device(rt, (pages * page, row)) for _ in range(pl)]
    v = [device(rt, (pages * page, row)) for _ in range(pl)]
    hk = host(rt, (pages, pl, page, row), HostKind.REGISTERED, False, chunk=4096)
    hv = host(rt, (pages, pl, page, row), HostKind.REGISTERED, False, chunk=4096)
    assert (pl * page * row) % 4096 and hk.untyped_storage().nbytes() > 4096
    token_src = torch.tensor(np.concatenate([np.arange(p * page, (p + 1) * page) for p in (5, 0, 9)]))
    token_dst = torch.tensor(np.concatenate([np.arange(p * page, (p + 1) * page) for p in (2, 11, 7)]))
    io.transfer_kv_all_layer_direct_lf_pf([*k, *v], [hk, hv], token_src, token_dst, page)
    rt.synchronize(0)
    for layer in range(pl):
        for lf, pf in ((k, hk), (v, hv)):
            for sp, dp in ((5, 2), (0, 11), (9, 7)):
                assert torch.equal(pf[dp, layer], cpu(lf[layer])[sp * page:(sp + 1) * page]), (layer, dp)
    back_k = [device(rt, (pages * page, row), False) for _ in range(pl)]
    back_v = [device(rt, (pages * page, row), False) for _ in range(pl)]
    for layer in range(pl):
        io.transfer_kv_per_layer_direct_pf_lf([hk, hv], [back_k[layer], back_v[layer]], token_dst, token_src,
                                              layer, page)
    rt.synchronize(0)
    for layer in range(pl):
        for orig, back in ((k, back_k), (v, back_v)):
            want = torch.full((pages * page, row), POISON, dtype=torch.uint8)
            want[token_src] = cpu(orig[layer])[token_src]
            assert torch.equal(cpu(back[layer]), want), layer


def test_direct_calls_take_a_host_pool_registered_in_chunks_on_split_aliases():
    """docs/sglang.md promises for the ``*_direct`` functions: 'Host-side copies are cut where two kvtier
    registrations meet (a buffer registered in chunks), since no single DMA may cross one', and direct.py's
    ``_plan`` does cut them (direct.py:212-221, with CPU addresses: DMA needs no alias). But before that, ``_base``
    (direct.py:232) resolves the whole host tensor as a *kernel* operand (``operands.address`` ->
    ``get_device_accessible_ptr``, operands.py:122), which refuses a span over two chunks whose device aliases do not
    continue each other (memory/alias.py:29, RegistrationError '... spans two registration chunks whose aliases on
    device 0 are not contiguous'). On split aliases (MI355X, WSL2) every ``page_first_direct`` host pool larger
    than one registration chunk (default 64 GiB: a normal HiCache host pool) is refused by
    ``transfer_kv_all_layer_direct_lf_pf`` / ``transfer_kv_per_layer_direct_pf_lf``, the very case the cutting code
    exists for; it works only on unified aliases (``test_ok_direct_many_layers...``). Fix: for a host side of a DMA,
    check each registration the copies touch resolves for the device (``host_range`` per chunk, as
    ``split_at_boundaries`` already walks them) instead of resolving the whole tensor as one kernel operand."""
    _page_first_round_trip(create("emulated:split"))


@pytest.mark.parametrize("spec", MODES)
def test_ok_direct_many_layers_mixed_kinds_and_buffers_registered_in_chunks(spec):
    """``transfer_kv_direct`` over 40 layers whose operands cycle through device arrays, pinned host tensors and
    views of registered buffers (on unified aliases straddling 16 KiB chunk boundaries; split ones refuse those,
    see the test above), in every pairing (D2D, H2D, D2H), random indices with runs, called twice (kept plans).
    On unified aliases also the ``page_first_direct`` round trip through a pool in chunks split inside pages."""
    rt = create(spec)
    n, row, layers = 96, 256, 40
    chunk = CHUNK if spec == "emulated:unified" else None
    pairs = [("device", "pinned"), ("chunked", "device"), ("device", "device"), ("pinned", "device"),
             ("device", "chunked")]

    def make(kind, data):
        if kind == "device":
            return device(rt, (n, row), data)
        if kind == "pinned":
            return host(rt, (n, row), data=data)
        return host(rt, (n, row), HostKind.REGISTERED, data, chunk=chunk, offset=CHUNK // 2)

    srcs = [make(pairs[i % len(pairs)][0], True) for i in range(layers)]
    dsts = [make(pairs[i % len(pairs)][1], False) for i in range(layers)]
    rng = np.random.default_rng()
    picks = np.sort(rng.permutation(n)[:48])
    si = torch.tensor(np.concatenate([np.arange(10, 26), picks[:32]]))
    di = torch.tensor(rng.permutation(n)[:48])
    for _ in range(2):
        for d in dsts:
            poison(d)
        io.transfer_kv_direct(srcs, dsts, si, di, 1)
        rt.synchronize(0)
        for layer, (s, d) in enumerate(zip(srcs, dsts, strict=True)):
            want = torch.full((n, row), POISON, dtype=torch.uint8)
            want[di] = cpu(s)[si]
            assert torch.equal(cpu(d), want), layer
    if chunk:
        _page_first_round_trip(rt)


@pytest.mark.parametrize("spec", MODES)
def test_ok_a_refusal_in_the_last_of_many_layers_leaves_every_layer_untouched(spec):
    """A ``transfer_kv_direct`` of 24 layers whose last destination is short (index out of range there only), whose
    last layer's rows differ, or whose last layer is pageable memory: refused before anything is queued (no layer
    written), and the valid call right after (same index tensors, kept values) lands exactly."""
    rt = create(spec)
    n, row, layers = 32, 128, 24
    srcs = [device(rt, (n, row)) for _ in range(layers)]
    dsts = [host(rt, (n, row), data=False) for _ in range(layers)]
    si, di = torch.tensor([0, 1, 2, 3, 17, 30]), torch.tensor([5, 6, 7, 8, 31, 0])
    wrong = {"short": host(rt, (n - 1, row), data=False), "rows": host(rt, (n, row // 2), data=False),
             "pageable": torch.full((n, row), POISON, dtype=torch.uint8)}
    for name, last in wrong.items():
        for d in dsts:
            poison(d)
        with pytest.raises(KvtierError):
            io.transfer_kv_direct(srcs, [*dsts[:-1], last], si, di, 1)
        rt.synchronize(0)
        assert all(bool((d == POISON).all()) for d in dsts), name
        assert bool((last == POISON).all()), name
        io.transfer_kv_direct(srcs, dsts, si, di, 1)
        rt.synchronize(0)
        for s, d in zip(srcs, dsts, strict=True):
            want = torch.full((n, row), POISON, dtype=torch.uint8)
            want[di] = cpu(s)[si]
            assert torch.equal(d, want), name
