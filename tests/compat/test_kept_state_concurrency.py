"""kvtier.compat.sglang.kvcacheio's kept state (plans keyed on operand identity, kept pointer tables, per-call index
binding, the ``*_direct`` memos, the host-range generation) under threads, forks and in-place rewrites: a live table
entry is resolved while another thread frees unrelated memory, a fork child never inherits a compat lock held for
good, and every call copies what its operands and indices say now, while plans are dropped and made again. Races are
forced at pause points that only order threads, never with sleeps. (Found adversarially, issue #15.)
"""

from __future__ import annotations

import random
import sys
import threading

import pytest
import torch
from helpers.operands import (
    MODES,
    POISON,
    cpu,
    dev_idx,
    device,
    fork_operands,
    fresh,
    host,
    pin_idx,
    poison,
    rnd,
    run_in_fork,
    start_and_join,
)

from kvtier.compat import DeviceArray, operands
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import KvtierError
from kvtier.memory import HostBuffer, HostKind
from kvtier.pause_points import armed
from kvtier.runtime import create


@pytest.mark.parametrize("spec", MODES)
def test_a_live_table_entry_is_not_refused_while_another_thread_frees_unrelated_device_memory(spec):
    """A raw pointer-table entry is resolved by ``resolve._host_alias``: ``host_range`` (under the runtime lock),
    then ``pointer_attributes`` -> ``EmulatedRuntime._find_mapped`` -> ``RangeIndex.find``, which reads the device's
    address map WITHOUT the lock. ``RangeIndex.pop`` (a ``device_free`` of any other allocation, under the lock)
    deletes from ``_starts`` and from ``_ranges`` in two steps; a ``find`` between them pairs a start with the range
    before it and answers None. So a live, valid device entry is refused as "pageable (or unmapped) host memory"
    because another thread freed an unrelated, lower-addressed DeviceArray at that moment (``add`` in the middle of
    a map, e.g. a unified host alias, does the same). Every SGLang ``transfer_kv_all_layer*`` call resolves its table
    entries this way, so multi-threaded CI flakes with a NotDeviceAccessible naming a tensor that is alive. Forced at
    pause points: the caller stops after ``host_range``, the freeing thread stops where it updates the map."""
    rt = create(spec)
    n, row, layers = 8, 32, 2
    early = DeviceArray.from_tensor(torch.ones(64, dtype=torch.uint8), runtime=rt)     # below every layer
    src = [device(rt, (n, row)) for _ in range(layers)]
    dst = [device(rt, (n, row), data=False) for _ in range(layers)]
    src_table = torch.tensor([x.data_ptr() for x in src], dtype=torch.uint64)
    dst_table = torch.tensor([x.data_ptr() for x in dst], dtype=torch.uint64)
    si, di = dev_idx(rt, [1, 3]), dev_idx(rt, [0, 5])
    caller_ready, freer_paused, go = threading.Event(), threading.Event(), threading.Event()

    def map_read():
        if threading.current_thread().name == "caller":
            go.set()        # the map was read: let the freer finish (the caller needs its lock next)

    def mid_pop():
        if threading.current_thread().name == "freer":
            freer_paused.set()
            go.wait(60)

    def before_attributes():
        if threading.current_thread().name == "caller" and not caller_ready.is_set():
            caller_ready.set()
            freer_paused.wait(60)

    errors: list[BaseException] = []

    def caller():
        try:
            io.transfer_kv_all_layer_mla(src_table, dst_table, si, di, row, layers)
        except Exception as error:  # noqa: BLE001
            errors.append(error)
        finally:
            go.set()

    def freer():
        caller_ready.wait(60)
        early.close()

    threads = [threading.Thread(target=caller, name="caller"), threading.Thread(target=freer, name="freer")]
    with (armed("resolve.host_alias_attributes", before_attributes), armed("ranges.pop", mid_pop),
          armed("emulated.pointer_attributes_mapped", map_read)):
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    rt.synchronize(0)
    assert not errors, f"a live entry was refused: {errors[0]!r}"
    for s, d in zip(src, dst, strict=True):
        want = fresh((n, row))
        want[[0, 5]] = s.cpu()[[1, 3]]
        assert torch.equal(d.cpu(), want)


@pytest.mark.parametrize("which", ["kernel", "direct"])
def test_a_fork_child_does_not_hang_on_a_lock_a_parent_thread_held_at_fork(which):
    """kvtier.compat keeps module-level and per-runtime ``threading.Lock``s (``operands._state_lock``,
    ``_PerRuntime.lock``, ``direct._indexed_lock``) and registers nothing with ``os.register_at_fork``. A server that
    forks a worker (multiprocessing's default 'fork' on Linux) while another of its threads is inside a compat call
    gives the child a copy of a lock that is held forever: the child's first compat call blocks for good (here the
    child is still alive 3 s later; without the held lock the same call finishes in milliseconds, see
    ``test_ok_a_fork_child_calls_after_the_parent_used_the_module``). A hang, where working or a clear error is
    expected. Forced at a pause point: the parent thread is parked inside ``kept_plan``'s (or ``_indexed_values``')
    ``with`` block while the parent forks. A fix: re-create the locks in the child
    (``os.register_at_fork(after_in_child=...)``)."""
    rt = create("emulated:split")
    n, row = 8, 32
    src, dst, layers, outs, si, di = fork_operands(rt, n, row)

    def kernel():
        io.transfer_kv_per_layer_mla(src, dst, si, di, row)
        rt.synchronize(0)

    def direct():
        io.transfer_kv_direct(layers, outs, torch.tensor([1, 3]), torch.tensor([0, 5]), 1)
        rt.synchronize(0)

    call = kernel if which == "kernel" else direct
    call()
    inside = "operands.kept_plan_locked" if which == "kernel" else "direct.indexed_locked"
    held, go = threading.Event(), threading.Event()

    def park():
        if threading.current_thread().name == "parked" and not held.is_set():
            held.set()
            go.wait(60)

    thread = threading.Thread(target=call, name="parked")
    with armed(inside, park):
        thread.start()
        assert held.wait(60)
        hung, result = run_in_fork(call, meanwhile=lambda: (go.set(), thread.join(60)))
    assert not hung, "the fork child hangs in its first compat call: a lock held by a parent thread at fork"
    assert result == "ok"


def test_ok_a_fork_child_calls_after_the_parent_used_the_module():
    """With no parent thread inside a call at fork, a 'fork' child's kernel and *_direct calls (kept plans, tables
    and memos inherited from the parent) copy the right bytes in its own copy of the emulator's memory, and the
    parent's memory is untouched by them."""
    rt = create("emulated:split")
    n, row = 8, 32
    src, dst, layers, outs, si, di = fork_operands(rt, n, row)

    def both():
        io.transfer_kv_per_layer_mla(src, dst, si, di, row)
        io.transfer_kv_direct(layers, outs, torch.tensor([1, 3]), torch.tensor([0, 5]), 1)
        rt.synchronize(0)
        for s, d in ((src, dst), *zip(layers, outs, strict=True)):
            want = fresh((n, row))
            want[[0, 5]] = s.cpu()[[1, 3]]
            if not torch.equal(d.cpu(), want):
                raise AssertionError("wrong bytes in the child")

    both()
    poison(dst), [poison(x) for x in outs]
    hung, result = run_in_fork(both, timeout=60)
    assert not hung and result == "ok"
    assert all(bool((x.cpu() == POISON).all()) for x in (dst, *outs))


@pytest.mark.parametrize("spec", MODES)
@pytest.mark.parametrize("seed", [1, 2])
def test_ok_threads_over_shared_and_own_operands_while_buffers_come_and_go(spec, seed):
    """6 threads x 25 calls of pf_lf, all_layer_mla (CPU and DeviceArray tables into pinned host layers),
    all_layer_mla_lf_pf, transfer_kv_direct and both page-first direct functions, over shared sources and each
    thread's own poisoned destinations, fresh random indices of both kinds each call; meanwhile a thread allocates
    and closes host buffers and device arrays (every kept plan and memo's generation keeps changing). Every
    destination byte is checked after each call. Switch interval 10 µs. (Held for seeds 1-4, both modes.)"""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        rt = create(spec)
        n, layers, row, page = 32, 3, 32, 4
        hk, hv = host(rt, (n, layers, row)), host(rt, (n, layers, row))
        paged = host(rt, (n // page, layers, page, row))
        sk = [device(rt, (n, row)) for _ in range(layers)]
        hsk = [host(rt, (n, row)) for _ in range(layers)]
        errors, bad, stop = [], [], threading.Event()

        def churn():
            r = random.Random(seed)
            while not stop.is_set():
                b = HostBuffer.allocate(r.choice([4096, 8192]), HostKind.PINNED, runtime=rt)
                d = DeviceArray.empty((64,), torch.uint8, runtime=rt)
                b.close(), d.close()

        def work(k):
            r = random.Random(seed * 100 + k)
            dk = [device(rt, (n, row), False) for _ in range(layers)]
            dv = [device(rt, (n, row), False) for _ in range(layers)]
            out = host(rt, (n, layers, row), data=False)
            out_paged = host(rt, (n // page, layers, page, row), data=False)
            host_table = torch.tensor([x.data_ptr() for x in hsk], dtype=torch.uint64)
            dk_table = torch.tensor([x.data_ptr() for x in dk], dtype=torch.uint64)
            dk_table_dev = DeviceArray.from_tensor(dk_table, runtime=rt)
            for it in range(25):
                cnt = r.choice([1, 3, 8])
                si, di = r.sample(range(n), cnt), r.sample(range(n), cnt)
                make = r.choice([dev_idx, pin_idx])
                f = r.choice(["pf", "tables", "lf_pf", "direct", "dpf", "dlf"])
                try:
                    if f == "pf":
                        layer = r.randrange(layers)
                        poison(dk[layer]), poison(dv[layer])
                        io.transfer_kv_per_layer_pf_lf(hk, dk[layer], hv, dv[layer], make(rt, si), make(rt, di),
                                                       layer, row, layers * row)
                        rt.synchronize(0)
                        for s, d in ((hk, dk[layer]), (hv, dv[layer])):
                            want = fresh((n, row))
                            want[di] = s[si, layer]
                            bad.extend([] if torch.equal(cpu(d), want) else [(k, it, f)])
                    elif f == "tables":
                        for x in dk:
                            poison(x)
                        io.transfer_kv_all_layer_mla(host_table, r.choice([dk_table, dk_table_dev]), dev_idx(rt, si),
                                                     dev_idx(rt, di), row, layers)
                        rt.synchronize(0)
                        for layer in range(layers):
                            want = fresh((n, row))
                            want[di] = hsk[layer][si]
                            bad.extend([] if torch.equal(cpu(dk[layer]), want) else [(k, it, f)])
                    elif f == "lf_pf":
                        poison(out)
                        io.transfer_kv_all_layer_mla_lf_pf(host_table, out, dev_idx(rt, si), dev_idx(rt, di), row,
                                                           layers * row, layers)
                        rt.synchronize(0)
                        want = fresh((n, layers, row))
                        for layer in range(layers):
                            want[di, layer] = hsk[layer][si]
                        bad.extend([] if torch.equal(out, want) else [(k, it, f)])
                    elif f == "direct":
                        for x in dk:
                            poison(x)
                        io.transfer_kv_direct(sk, dk, torch.tensor(si), torch.tensor(di), 1)
                        rt.synchronize(0)
                        for layer in range(layers):
                            want = fresh((n, row))
                            want[di] = cpu(sk[layer])[si]
                            bad.extend([] if torch.equal(cpu(dk[layer]), want) else [(k, it, f)])
                    else:
                        pages, to = r.sample(range(n // page), 2), r.sample(range(n // page), 2)
                        s = [p * page + j for p in pages for j in range(page)]
                        d = [p * page + j for p in to for j in range(page)]
                        if f == "dpf":
                            layer = r.randrange(layers)
                            poison(dk[0])
                            io.transfer_kv_per_layer_direct_pf_lf([paged], [dk[0]], torch.tensor(s), torch.tensor(d),
                                                                  layer, page)
                            rt.synchronize(0)
                            want = fresh((n, row))
                            for x, y in zip(s, d, strict=True):
                                want[y] = paged[x // page, layer, x % page]
                            bad.extend([] if torch.equal(cpu(dk[0]), want) else [(k, it, f)])
                        else:
                            poison(out_paged)
                            io.transfer_kv_all_layer_direct_lf_pf(sk, [out_paged], torch.tensor(s), torch.tensor(d),
                                                                  page)
                            rt.synchronize(0)
                            want = fresh((n // page, layers, page, row))
                            for x, y in zip(s, d, strict=True):
                                for layer in range(layers):
                                    want[y // page, layer, y % page] = cpu(sk[layer])[x]
                            bad.extend([] if torch.equal(out_paged, want) else [(k, it, f)])
                except Exception as error:  # noqa: BLE001
                    errors.append((k, it, f, error))

        churner = threading.Thread(target=churn)
        churner.start()
        start_and_join([threading.Thread(target=work, args=(k,)) for k in range(6)], 60)
        stop.set()
        churner.join(60)
        assert not errors, errors[:3]
        assert not bad, bad[:10]
    finally:
        sys.setswitchinterval(old)


@pytest.mark.parametrize("spec", MODES)
def test_ok_plans_and_tables_past_their_lru_limits_then_reused(spec, monkeypatch):
    """TABLES_KEPT lowered to 4 (plans, tables and memos all use it): 12 operand sets of per-layer and pf_lf calls,
    4 threads walking them in different orders three times, so kept plans and tables are dropped while others use
    them and old sets come back planned again. Every destination byte is right."""
    monkeypatch.setattr(operands, "TABLES_KEPT", 4)
    rt = create(spec)
    n, row, sets = 16, 32, 12
    srcs = [device(rt, (n, row)) for _ in range(sets)]
    hosts = [host(rt, (n, 2, row)) for _ in range(sets)]
    errors, bad = [], []

    def work(k):
        r = random.Random(k)
        dst = device(rt, (n, row), data=False)
        for it in range(3 * sets):
            j = r.randrange(sets)
            si, di = r.sample(range(n), 5), r.sample(range(n), 5)
            try:
                poison(dst)
                if it % 2:
                    io.transfer_kv_per_layer_mla(srcs[j], dst, dev_idx(rt, si), dev_idx(rt, di), row)
                    source = srcs[j].cpu()
                else:
                    layer = r.randrange(2)
                    io.transfer_kv_per_layer_mla_pf_lf(hosts[j], dst, pin_idx(rt, si), pin_idx(rt, di), layer, row,
                                                       2 * row)
                    source = hosts[j][:, layer]
                rt.synchronize(0)
                want = fresh((n, row))
                want[di] = source[si]
                bad.extend([] if torch.equal(dst.cpu(), want) else [(k, it)])
            except Exception as error:  # noqa: BLE001
                errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert not bad, bad[:10]
    assert len(operands._per_runtime(rt).plans) <= 4 and len(operands._per_runtime(rt).tables) <= 4


@pytest.mark.parametrize("spec", MODES)
def test_ok_raw_tables_rewritten_in_place_and_entries_into_freed_memory(spec):
    """One CPU uint64 table and one DeviceArray table, rewritten between calls (index assignment, through
    ``.numpy()``, through ``.data``; ``copy_`` for the DeviceArray): each call copies from the layers the table names
    now. An entry pointing into a closed DeviceArray or a closed host buffer is refused by name (KvtierError), and
    nothing is copied; the call after it, with the table mended, is right."""
    rt = create(spec)
    n, row, layers = 8, 32, 2
    pool = [device(rt, (n, row)) for _ in range(4)]
    dst = [device(rt, (n, row), data=False) for _ in range(layers)]
    dst_table = DeviceArray.from_tensor(torch.tensor([x.data_ptr() for x in dst], dtype=torch.uint64), runtime=rt)
    table = torch.tensor([pool[0].data_ptr(), pool[1].data_ptr()], dtype=torch.uint64)
    si, di = [2, 7, 0], [5, 1, 3]

    def check(sources):
        for s, d in zip(sources, dst, strict=True):
            want = fresh((n, row))
            want[di] = cpu(s)[si]
            assert torch.equal(d.cpu(), want)

    def call(src_table):
        for d in dst:
            poison(d)
        io.transfer_kv_all_layer_mla(src_table, dst_table, dev_idx(rt, si), pin_idx(rt, di), row, layers)
        rt.synchronize(0)

    call(table)
    check(pool[:2])
    table[0] = pool[2].data_ptr()
    call(table)
    check([pool[2], pool[1]])
    table.numpy()[1] = pool[3].data_ptr()
    call(table)
    check([pool[2], pool[3]])
    table.data[0] = pool[1].data_ptr()
    call(table)
    check([pool[1], pool[3]])
    dev_table = DeviceArray.from_tensor(table, runtime=rt)
    call(dev_table)
    check([pool[1], pool[3]])
    dev_table.copy_(torch.tensor([pool[0].data_ptr(), pool[2].data_ptr()], dtype=torch.uint64))
    call(dev_table)
    check([pool[0], pool[2]])
    gone = device(rt, (n, row))
    gone_host = HostBuffer.allocate(n * row, HostKind.PINNED, runtime=rt)
    gone_view = gone_host.as_tensor(torch.uint8).view(n, row)
    gone_view.copy_(rnd((n, row)))
    table[:] = torch.tensor([pool[0].data_ptr(), gone_host.cpu_address.value], dtype=torch.uint64)
    call(table)
    check([pool[0], gone_view])
    table[1] = gone.data_ptr()
    call(table)
    check([pool[0], gone])
    gone_address, gone_host_address = gone.data_ptr(), gone_host.cpu_address.value
    del gone_view
    gone.close()
    gone_host.close()
    for bad_entry in (gone_address, gone_host_address + 64):
        table[1] = bad_entry
        for d in dst:
            poison(d)
        with pytest.raises(KvtierError, match=r"src_layers\[1\]"):
            io.transfer_kv_all_layer_mla(table, dst_table, dev_idx(rt, si), pin_idx(rt, di), row, layers)
        rt.synchronize(0)
        assert all(bool((d.cpu() == POISON).all()) for d in dst)
    table[1] = pool[3].data_ptr()
    call(table)
    check([pool[0], pool[3]])


@pytest.mark.parametrize("spec", MODES)
def test_ok_direct_index_tensors_rewritten_in_place_between_calls(spec):
    """The same index tensor objects (CPU int64, CPU int32, pinned views at an offset, DeviceArrays) rewritten in
    place between transfer_kv_direct / per_layer_direct_pf_lf calls (``.numpy()``, ``copy_``, ``.data``, index
    assignment), including back to values seen before (the memo of the last 4 index pairs): each call copies what
    the indices say now; a rewrite into a repeated destination is refused with nothing copied."""
    rt = create(spec)
    n, row, page, layers = 16, 32, 2, 2
    sk = [device(rt, (n, row)) for _ in range(layers)]
    dk = [device(rt, (n, row), data=False) for _ in range(layers)]
    paged = host(rt, (n // page, layers, page, row))
    pinned = pin_idx(rt, list(range(40)))
    kinds = [(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)),
             (torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)),
             (pinned[3:7], pinned[23:27]),
             (dev_idx(rt, [0, 0, 0, 0]), dev_idx(rt, [0, 0, 0, 0]))]
    r = random.Random(5)
    history = []
    for step in range(24):
        s_idx, d_idx = kinds[step % len(kinds)]
        if step >= 12 and history and step % 3 == 0:
            si, di = history[r.randrange(len(history))]
        else:
            pages, to = r.sample(range(n // page), 2), r.sample(range(n // page), 2)
            si = [p * page + j for p in pages for j in range(page)]
            di = [p * page + j for p in to for j in range(page)]
        history.append((si, di))
        for x, values in ((s_idx, si), (d_idx, di)):
            if isinstance(x, DeviceArray):
                x.copy_(torch.tensor(values, dtype=x.dtype))
            elif step % 3 == 0:
                x.numpy()[:] = values
            elif step % 3 == 1:
                x.data[:] = torch.tensor(values, dtype=x.dtype)
            else:
                for i, v in enumerate(values):
                    x[i] = v
        for d in dk:
            poison(d)
        if step % 2:
            io.transfer_kv_direct(sk, dk, s_idx, d_idx, page)
            sources = [cpu(x)[si] for x in sk]
        else:
            layer = r.randrange(layers - 1)
            io.transfer_kv_per_layer_direct_pf_lf([paged], dk[:1], s_idx, d_idx, layer, page)
            sources = [torch.stack([paged[x // page, layer, x % page] for x in si])]
        rt.synchronize(0)
        for got, source in zip(dk, sources, strict=False):
            want = fresh((n, row))
            want[di] = source
            assert torch.equal(got.cpu(), want), step
        assert all(bool((d.cpu() == POISON).all()) for d in dk[len(sources):])
    s_idx, d_idx = kinds[0]
    d_idx.numpy()[:] = [4, 5, 4, 5]
    for d in dk:
        poison(d)
    with pytest.raises(KvtierError):
        io.transfer_kv_direct(sk, dk, s_idx, d_idx, page)
    rt.synchronize(0)
    assert all(bool((d.cpu() == POISON).all()) for d in dk)
