"""One ``*_direct`` call's copies go in batches, in no defined order, so a call whose copies would touch the same bytes
is refused by name with nothing copied: a destination token written twice (repeated indices, or a run and a single
token over it), a destination tensor that another layer's copy reads (an in-place move SGLang's run-by-run loop
defines and a batch would reorder)."""

from __future__ import annotations

import pytest
import torch
from helpers.compat import byte_operands
from helpers.operands import MODES, all_poison, cpu, device, no_automatic_collection

from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import InvalidArgument
from kvtier.runtime import create


def test_direct_repeated_destination_tokens_are_refused_untouched(rt):
    """transfer_kv_direct with a repeated destination token (dst_indices [100, 100, 102, ..., 114]) once handed
    memcpy_runs_async two copies writing the same row: CUDA queues strided groups, lone copies and a batch (which
    orders nothing) in its own order, so which source landed depended on the runtime (on CUDA source token 5, on the
    emulators 0). Repeated or overlapping destinations are refused now, by name, with nothing copied.
    (found adversarially, issue #15)"""
    m = byte_operands(rt)
    src, dst = m.device((128, 64)), m.host((128, 64), data=False)
    s = torch.tensor([5] + [10 * i for i in range(8)])
    d = torch.tensor([100] + [100 + 2 * i for i in range(8)])
    with pytest.raises(InvalidArgument, match=r"dst_layers\[0\].*same bytes"):
        io.transfer_kv_direct([src], [dst], s, d, 1)
    other = m.host((128, 64), data=False)
    with pytest.raises(InvalidArgument, match=r"dst_layers\[0\].*same bytes"):   # a run [3, 6) and token 4 again
        io.transfer_kv_direct([src, m.device((128, 64))], [other, m.host((128, 64), data=False)],
                              torch.tensor([7, 8, 9, 20]), torch.tensor([3, 4, 5, 4]), 1)
    rt.synchronize(0)
    assert all_poison(dst) and all_poison(other)


@pytest.mark.parametrize("mode", MODES)
@no_automatic_collection()
def test_direct_refuses_a_destination_that_another_layers_copy_reads(mode):
    """``transfer_kv_direct([a0, a1], [a1, b1], ...)``: layer 0 writes ``a1``, which layer 1 reads. SGLang's loop runs
    run by run, each run's layers in order (run 0 layer 0, run 0 layer 1, run 1 layer 0, ...); kvtier queues every
    layer's runs as one batch, layer by layer, so here layer 1 of run 0 reads the token run 1 of layer 0 has already
    overwritten: the call is accepted and ``b1`` ends up with other bytes than SGLang gives (on a GPU the batch orders
    nothing at all, so it is undefined). The overlap checks look only at destinations against destinations
    (kvtier/compat/sglang/direct.py:246 ``_refuse_shared`` and :257 ``_refuse_overlap``, called from :318 and
    :337); a destination that is another copy's source passes both, although the reason they give (one call's copies
    land in no defined order) applies to it in full. It matters for in-place moves (compaction, a pool shifted by a
    layer), which SGLang's loop defines and kvtier silently reorders. Fix: in ``_refuse_shared`` also refuse a
    destination tensor whose span overlaps any source tensor of another layer (and, within a layer, a destination
    run overlapping a source run of another copy), or order the copies as SGLang's loop does when they do.
    (found adversarially, issue #15)"""
    rt = create(mode)
    n, row = 8, 32
    a0, a1, b1 = device(rt, (n, row)), device(rt, (n, row)), device(rt, (n, row))
    before = [cpu(x) for x in (a0, a1, b1)]
    src, dst = torch.tensor([0, 5]), torch.tensor([3, 0])     # two runs: 0 -> 3, then 5 -> 0
    want = [x.clone() for x in before]                        # SGLang: for each run, for each layer, copy_
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        want[1][d] = want[0][s]
        want[2][d] = want[1][s]
    try:
        io.transfer_kv_direct([a0, a1], [a1, b1], src, dst, 1)
    except InvalidArgument:
        for x, was in zip((a0, a1, b1), before, strict=True):
            assert torch.equal(cpu(x), was), "a refused call changed a tensor"
        return
    for name, x, expected in zip(("a0", "a1", "b1"), (a0, a1, b1), want, strict=True):
        assert torch.equal(cpu(x), expected), f"{name} differs from SGLang's run-by-run loop"
