"""Compat calls inside a stream capture, as on a GPU: a captured per-layer call replays with the index values of
replay time; a call that must wait on the host while capturing (compat checks, device-resident indices or tables
read back) is refused, as CUDA refuses the wait, and writes nothing; a captured call over raw pointer tables follows
entries rewritten before replay or is refused. The emulator refuses host synchronisation during a capture as CUDA
does, so CI sees what a GPU would."""

from __future__ import annotations

import pytest
import torch
from helpers.operands import MODES, POISON, dev_idx, device, host, no_automatic_collection, pin_idx, poison

from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import KvtierError
from kvtier.runtime import create


@pytest.mark.parametrize("what", ["stream", "device", "compat-checks", "direct-device-indices"])
@no_automatic_collection()
def test_the_emulator_refuses_a_host_synchronise_inside_a_stream_capture_as_cuda_does(what, monkeypatch):
    """CUDA refuses to synchronise a stream that is capturing, and a device synchronise while any stream captures
    (cudaErrorStreamCaptureUnsupported, and the capture is invalidated); torch's ``.to("cpu")`` of a CUDA index tensor
    inside a capture raises the same way. The emulator returns at once: ``EmulatedStream.synchronize``
    (kvtier/runtime/emulated_device.py:240) and ``EmulatedRuntime.synchronize`` (kvtier/runtime/emulated.py:122)
    never look at ``capturing``. So on CI a compat call that cannot be captured on a GPU is captured without a word:
    one with ``KVTIER_COMPAT_CHECKS=1`` (kvcacheio.py:215 synchronises the stream; docs/sglang.md says such a call
    cannot be captured), a ``*_direct`` call over device-resident indices (direct.py:45 reads them back with
    ``DeviceArray.cpu()``; the graph then replays the capture-time indices forever). The emulator claims to be at
    least as hostile as a GPU (docs/design.md "The emulated runtime"). Fix: raise ``RuntimeCallError(...,
    "cudaErrorStreamCaptureUnsupported")`` from both synchronise paths (and ``Event.synchronize``/``query`` on a
    captured event) while the stream, or for a device synchronise any stream of the device, is capturing.
    (found adversarially, issue #15)"""
    rt = create("emulated:split")
    n, row = 8, 32
    hk, hv = host(rt, (n, row)), host(rt, (n, row))
    dk, dv = device(rt, (n, row), data=False), device(rt, (n, row), data=False)
    si, di = dev_idx(rt, [1, 2]), dev_idx(rt, [3, 4])
    io.transfer_kv_per_layer(hk, dk, hv, dv, si, di, row)   # warmed up: the capture itself allocates nothing
    rt.synchronize(0)
    if what == "compat-checks":
        monkeypatch.setenv("KVTIER_COMPAT_CHECKS", "1")
    stream = rt.create_stream(0)
    actions = {
        "stream": stream.synchronize,
        "device": lambda: rt.synchronize(0),
        "compat-checks": lambda: io.transfer_kv_per_layer(hk, dk, hv, dv, si, di, row),
        "direct-device-indices": lambda: io.transfer_kv_direct([hk, hv], [dk, dv], si, di, 1),
    }
    with rt.use_stream(stream):
        stream.begin_capture()
        try:
            with pytest.raises(KvtierError):
                actions[what]()
        finally:
            stream.end_capture()


@pytest.mark.parametrize("spec", ["emulated:split", "emulated:unified:lazy"])
@no_automatic_collection()
def test_ok_a_captured_per_layer_call_replays_with_the_index_values_of_replay_time(spec):
    """A warmed per-layer call captured on a side stream (K and V, pinned host → device, device-resident int64 and
    pinned int32 indices) and replayed after the index tensors were rewritten in place: every replay copies the
    pairs the indices hold at replay time, nothing else; the capture itself ran nothing."""
    rt = create(spec)
    n, row = 16, 64
    hk, hv = host(rt, (n, row)), host(rt, (n, row))
    dk, dv = device(rt, (n, row), data=False), device(rt, (n, row), data=False)
    cases = [(dev_idx(rt, [1, 2, 3]), dev_idx(rt, [4, 5, 6])),
             (pin_idx(rt, [1, 2, 3], torch.int32), pin_idx(rt, [4, 5, 6], torch.int32))]
    stream = rt.create_stream(0)
    for si, di in cases:
        io.transfer_kv_per_layer(hk, dk, hv, dv, si, di, row)
        rt.synchronize(0)
        poison(dk)
        poison(dv)
        with rt.use_stream(stream):
            stream.begin_capture()
            io.transfer_kv_per_layer(hk, dk, hv, dv, si, di, row)
            graph = stream.end_capture()
        rt.synchronize(0)
        assert (dk.cpu() == POISON).all() and (dv.cpu() == POISON).all(), "the capture ran the copy"
        for src_values, dst_values in (([7, 8, 9], [10, 0, 15]), ([15, -1, 0], [1, 2, 14])):
            for x, values in ((si, src_values), (di, dst_values)):
                x.copy_(torch.tensor(values, dtype=x.dtype))
            poison(dk)
            poison(dv)
            graph.launch(stream)
            stream.synchronize()
            for h, d in ((hk, dk), (hv, dv)):
                want = torch.full((n, row), POISON, dtype=torch.uint8)
                for s, t in zip(src_values, dst_values, strict=True):
                    if s >= 0 and t >= 0:
                        want[t] = h[s]
                assert torch.equal(d.cpu(), want)
        graph.close()


@pytest.mark.parametrize("mode", MODES)
@no_automatic_collection()
def test_a_captured_call_follows_a_pointer_table_rewritten_before_replay_or_is_refused(mode):
    """``transfer_kv_all_layer_mla`` captured on a side stream with pinned CPU ``uint64`` tables (device-resident
    indices), then the destination table's entry 0 rewritten in place to another device tensor before replay. In
    SGLang the kernel dereferences the caller's table when it runs, so a replay writes the new destination (as kvtier
    follows index tensors rewritten before replay: test_ok_a_captured_per_layer_call...). kvtier reads the
    table when the call is made (operands.py:205 ``table_entries``) into a kernel table of its own
    (operands.py:255 ``pointer_table``), which the graph captured: the replay writes the capture-time destination,
    which the caller has re-pointed away from (it may be freed or reused by then), and leaves the new one untouched.
    Nothing says so: docs/sglang.md says 'A CPU table is read on every call', and of captures only that kvtier's own
    tables keep their address. Fix: refuse a call with raw tables while its stream is capturing (InvalidArgument:
    'raw pointer tables are read when the call is made; a graph would replay the capture-time entries'), or, where
    entries need no translation (unified aliases, device memory), copy the caller's table into the kernel table on the
    stream inside the capture; at least document it. (found adversarially, issue #15)"""
    rt = create(mode)
    n, row, layers = 8, 32, 2
    src = [host(rt, (n, row)) for _ in range(layers)]
    dst = [device(rt, (n, row), data=False) for _ in range(layers)]
    other = device(rt, (n, row), data=False)
    src_table = pin_idx(rt, [x.data_ptr() for x in src])
    dst_table = pin_idx(rt, [x.data_ptr() for x in dst])
    si, di = dev_idx(rt, [1, 2]), dev_idx(rt, [3, 4])
    io.transfer_kv_all_layer_mla(src_table, dst_table, si, di, row, layers)    # warm: tables built
    rt.synchronize(0)
    for x in dst:
        poison(x)
    stream = rt.create_stream(0)
    with rt.use_stream(stream):
        stream.begin_capture()
        try:
            io.transfer_kv_all_layer_mla(src_table, dst_table, si, di, row, layers)
        except KvtierError:
            stream.end_capture().close()
            rt.synchronize(0)
            assert all((x.cpu() == POISON).all() for x in (*dst, other)), "a refused capture wrote"
            return
        graph = stream.end_capture()
    dst_table[0] = other.data_ptr()
    graph.launch(stream)
    stream.synchronize()
    want = torch.full((n, row), POISON, dtype=torch.uint8)
    want[[3, 4]] = src[0][[1, 2]]
    assert (dst[0].cpu() == POISON).all(), "the replay wrote the tensor the table no longer names"
    assert torch.equal(other.cpu(), want), "the replay did not write the tensor the table names"
    graph.close()


@pytest.mark.parametrize("mode", MODES)
@no_automatic_collection()
def test_ok_a_capture_over_a_device_table_is_refused_and_writes_nothing(mode):
    """A device-resident table (read back on every call on the emulator) captured: the read-back is a host wait
    during a capture, refused as CUDA does; the capture is ended, nothing is written, and the same call outside the
    capture still lands."""
    rt = create(mode)
    n, row = 8, 32
    src, dst = host(rt, (n, row)), device(rt, (n, row), data=False)
    ts, td = dev_idx(rt, [src.data_ptr()]), dev_idx(rt, [dst.data_ptr()])
    si, di = dev_idx(rt, [2]), dev_idx(rt, [5])
    io.transfer_kv_all_layer_mla(ts, td, si, di, row, 1)
    rt.synchronize(0)
    poison(dst)
    stream = rt.create_stream(0)
    with rt.use_stream(stream):
        stream.begin_capture()
        with pytest.raises(KvtierError, match="Capture"):
            io.transfer_kv_all_layer_mla(ts, td, si, di, row, 1)
        stream.end_capture().close()
    rt.synchronize(0)
    assert (dst.cpu() == POISON).all()
    io.transfer_kv_all_layer_mla(ts, td, si, di, row, 1)
    want = torch.full((n, row), POISON, dtype=torch.uint8)
    want[5] = src[2]
    assert torch.equal(dst.cpu(), want)
