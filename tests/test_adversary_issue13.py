"""Adversarial tests of the per-layer-signal loads, the unit-major walk, the staged backend's strided copies and the
kernel launcher's settings (issue 13).

The first group are failing tests, one per defect found. The last group pass: they are byte-exact checks of every
backend, host layout and geometry against a numpy model of the layouts (poisoned destinations, fresh random sources,
every byte compared), kept because they cover combinations the rest of the suite does not (several registration
chunks under the staged backend, odd layer orders, int32 indices, signal and non-signal loads compared to one model).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers.pools import engine_on, fill_host, launch_names

from kvtier.errors import InvalidArgument, KvtierError
from kvtier.kernels import KernelLauncher
from kvtier.memory import CpuAddress, HostBuffer, HostKind
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.runtime.emulated import EmulatedRuntime
from kvtier.transfer import TransferEngine
from kvtier.transfer.hisparse import HotBuffer

G = KVGeometry.mha(3, kv_heads=2, head_dim=16, itemsize=2, page_size=4)


# ---- defects -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_width", [8.0, True], ids=["float", "bool"])
def test_kernel_launcher_refuses_a_max_width_that_is_not_an_int(split, max_width):
    """``KernelLauncher(max_width=...)`` checks ``max_width not in WIDTHS``, which a float (8.0) or a bool (True == 1)
    passes. The launcher is built, and then every copy it launches fails: 8.0 with ``TypeError: 'float' object cannot
    be interpreted as an integer`` (chunk_group gets a float vector count), True with "program ... has no kernel
    'kvtier_copy_chunks_i64_wTrue'". Expected: the constructor refuses such a value up front, as it refuses 3 or 32
    ("bad kernel specialization") and as the engine's own settings refuse non-integers; or the launches work.
    At fault: ``KernelLauncher.__init__`` (kvtier/kernels/launch.py)."""
    try:
        launcher = KernelLauncher(split, max_width=max_width)
    except KvtierError:
        return                      # refused up front: what is expected
    with engine_on(split, G, "page_first", launcher=launcher) as (_, host, engine):
        fill_host(host)
        engine.load([0, 1], [2, 3]).wait()     # today: TypeError / InvalidArgument from deep inside the launch


def test_max_width_caps_the_hisparse_swap_in_width_too(split, monkeypatch):
    """``KernelLauncher(max_width=4)`` "caps the access width (bytes per load and store; a launch otherwise takes the
    widest its addresses allow)", and the swap-in kernel exists in 4-byte form (``kvtier_hot_swap_in_w4``). But
    ``KernelLauncher.swap_in`` computes its width from the rows and tables alone and never applies ``max_width``: a
    HotBuffer given a launcher capped at 4 bytes still launches the 16-byte ``kvtier_hot_swap_in``. Expected: every
    launch of the launcher, the swap-in included, uses at most ``max_width`` bytes per access.
    At fault: ``KernelLauncher.swap_in`` (kvtier/kernels/launch.py)."""
    host_g, dev_g = KVGeometry.mla(2, 80, 4), KVGeometry.mla(2, 80, 1)
    dev = DevicePool.allocate(dev_g, 7, 0, runtime=split)
    host = HostPool.allocate(host_g, "page_first", pages=8, runtime=split)
    hot = HotBuffer(dev, host, requests=1, slots=6, top_k=4, max_tokens=24,
                    launcher=KernelLauncher(split, max_width=4))
    try:
        hot.assign(0, np.arange(24))
        names = launch_names(split, monkeypatch)
        hot.swap_in(0, [0], np.array([[10, 11, 3, 12]], np.int32), [20])
        hot.synchronize()
        assert names == ["kvtier_hot_swap_in_w4"], f"a launcher capped at 4-byte accesses launched {names}"
    finally:
        hot.close()
        host.close()
        dev.close()


def test_an_engine_over_a_launcher_with_fewer_threads_fails_with_a_false_message(split):
    """``TransferEngine(threads=1024)`` (the default) accepts ``launcher=KernelLauncher(rt, max_threads=256)``; the
    mismatch surfaces only at the first load, as ``KvtierError('launch of 2 blocks x 1024 threads: need >=1 block and
    32..1024 threads in whole warps')`` — a message that says 1024 threads are allowed while refusing 1024. Expected:
    the engine refuses the pair when it is built (or uses at most the launcher's threads), and any message names the
    launcher's limit (256). At fault: ``TransferEngine.__init__`` (no check of ``threads`` against
    ``launcher.max_threads``) and ``KernelLauncher.prepare``'s message (hard-coded 1024)."""
    launcher = KernelLauncher(split, max_threads=256)
    try:
        with engine_on(split, G, "page_first", launcher=launcher) as (_, host, engine):
            fill_host(host)
            engine.load([0, 1], [2, 3]).wait()
    except KvtierError as error:
        assert "256" in str(error), f"the error does not name the launcher's 256-thread limit: {error}"


def test_staged_honours_layer_signals_true(split):
    with engine_on(split, G, "layer_first", backend="staged", layer_signals=True) as (_, _, engine):
        assert engine._backend.signals is not None


@pytest.mark.parametrize("backend", ["direct", "batch"])
def test_layer_signals_true_is_not_silently_ignored_by_other_backends(split, backend):
    """``layer_signals=True`` is a demand: the kernel backend raises InvalidArgument where it cannot honour it
    ("layer_signals=True: ... cannot wait on a memory value"). The other backends take the setting in ``**_`` and
    drop it, so ``TransferEngine(backend='staged', layer_signals=True)`` builds an engine whose layer events are plain
    events on the relayout stream, with no word to the caller. Expected: InvalidArgument naming the backend (only
    None/False make sense there). At fault: ``Settings`` / ``TransferEngine.__init__`` (kvtier/transfer/engine.py),
    which pass the setting to every backend without checking the backend uses it."""
    with pytest.raises(InvalidArgument, match="layer_signals"):
        with engine_on(split, G, "layer_first", backend=backend, layer_signals=True):
            pass


# ---- coverage (passes) ---------------------------------------------------------------------------------------------

GEOMETRIES = [KVGeometry.mha(4, kv_heads=2, head_dim=16, itemsize=2, page_size=4),
              KVGeometry.mha(2, kv_heads=8, head_dim=8, itemsize=2, page_size=3),
              KVGeometry.mla(5, latent_bytes=96, page_size=4),
              KVGeometry.k_only(3, heads=3, head_dim=16, itemsize=2, page_size=5)]
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def _host_index(host: HostPool, tensor: int, layer: int, page: int) -> np.ndarray:
    """Buffer offsets of host page ``page`` of (tensor, layer), in the device page's byte order, from the strides."""
    g, s = host.geometry, host.strides
    slot = np.arange(g.page_size)[:, None, None]
    head = np.arange(g.heads)[None, :, None]
    byte = np.arange(g.head_bytes)[None, None, :]
    return (host.tensor_offset(tensor) + layer * s.layer + page * s.page + slot * s.slot + head * s.head
            + byte).reshape(-1)


def _device_layer(dev: DevicePool, tensor: int, layer: int) -> np.ndarray:
    out = np.empty(dev.layer_bytes, np.uint8)
    dev.runtime.memcpy(CpuAddress(out.ctypes.data), dev.layer_device_addresses(tensor)[layer], out.nbytes)
    dev.runtime.legacy_stream(dev.device).synchronize()
    return out


def _set_device_layer(dev: DevicePool, tensor: int, layer: int, data: np.ndarray) -> None:
    dev.runtime.memcpy(dev.layer_device_addresses(tensor)[layer], CpuAddress(data.ctypes.data), data.nbytes)
    dev.runtime.legacy_stream(dev.device).synchronize()


def _check_ops(seed: int, g: KVGeometry, layout: str, backend: str, ops, *, dev_pages: int, host_pages: int,
               register_chunk_bytes: int | None = None, **engine_kwargs) -> None:
    mode = "unified" if register_chunk_bytes and backend == "kernel" else "split"   # split aliases of separate
    runtime = EmulatedRuntime(mode, seed=seed)                                        # chunks are not contiguous
    rng = np.random.default_rng(seed)
    dev = DevicePool.allocate(g, dev_pages, 0, runtime=runtime)
    extra = {} if register_chunk_bytes is None else {"register_chunk_bytes": register_chunk_bytes}
    host = HostPool.allocate(g, layout, pages=host_pages, runtime=runtime, **extra)
    engine = TransferEngine(dev, host, backend=backend, **engine_kwargs)
    view = host.buffer.as_tensor().numpy()
    try:
        for op in ops:
            view[:] = rng.integers(0, 256, view.size, dtype=np.uint8)
            before_host = view.copy()
            before_dev = {}
            for t in range(g.tensors):
                for layer in range(g.layers):
                    before_dev[(t, layer)] = rng.integers(0, 256, dev.layer_bytes, dtype=np.uint8)
                    _set_device_layer(dev, t, layer, before_dev[(t, layer)])
            if op[0] == "backup":
                _, device_pages, slots = op
                engine.backup(device_pages, slots).wait()
                want = before_host.copy()
                for (t, layer), data in before_dev.items():
                    for d, h in zip(device_pages, slots, strict=True):
                        want[_host_index(host, t, layer, h)] = data[d * g.page_bytes:(d + 1) * g.page_bytes]
                bad = np.flatnonzero(view != want)
                assert not bad.size, f"{op}: {bad.size} host bytes wrong, first at {bad[:4]}"
            else:
                _, slots, device_pages, layers, per_layer = op
                engine.load(slots, device_pages, layers=layers, per_layer=per_layer).wait()
                chosen = range(g.layers) if layers is None else layers
                for (t, layer), data in before_dev.items():
                    want = data.copy()
                    if layer in chosen:
                        for d, h in zip(device_pages, slots, strict=True):
                            want[d * g.page_bytes:(d + 1) * g.page_bytes] = before_host[_host_index(host, t, layer, h)]
                    bad = np.flatnonzero(_device_layer(dev, t, layer) != want)
                    assert not bad.size, f"{op}: tensor {t} layer {layer}: {bad.size} device bytes wrong"
    finally:
        del view
        engine.close()
        host.close()
        dev.close()


def _random_ops(rng, g: KVGeometry, dev_pages: int, host_pages: int, count: int = 4):
    ops = []
    for _ in range(count):
        k = int(rng.integers(1, min(dev_pages, host_pages) + 1))
        if rng.random() < 0.5:
            if rng.random() < 0.5:                          # a run of consecutive host slots, maybe shuffled
                first = int(rng.integers(0, host_pages - k + 1))
                slots = rng.permutation(np.arange(first, first + k)).tolist()
            else:
                slots = rng.choice(host_pages, k, replace=False).tolist()
            ops.append(("backup", rng.integers(0, dev_pages, k).tolist(), slots))   # sources may repeat
        else:
            layers = None if rng.random() < 0.3 else rng.permutation(g.layers)[:rng.integers(1, g.layers + 1)].tolist()
            slots, pages = rng.integers(0, host_pages, k).tolist(), rng.choice(dev_pages, k, replace=False).tolist()
            ops.append(("load", slots, pages, layers, bool(rng.random() < 0.7)))
    return ops


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend, options", [("kernel", {}), ("kernel", {"layer_signals": False}),
                                              ("kernel", {"index_bytes": 4}), ("staged", {"small": True}),
                                              ("direct", {}), ("batch", {})],
                         ids=["kernel-signals", "kernel-events", "kernel-int32", "staged-small", "direct", "batch"])
def test_every_byte_against_a_numpy_model_of_the_layouts(layout, backend, options):
    """All-layer backups (unit-major on page_first / page_first_direct / one-head page_head hosts), per-layer and
    per_layer=False loads with layer subsets in odd orders, random and consecutive slots, repeated sources, on hosts
    registered in several chunks: every byte of the destination pool is compared with a numpy model."""
    options = dict(options)
    for seed in range(8):
        rng = np.random.default_rng(seed)
        g = GEOMETRIES[seed % len(GEOMETRIES)]
        dev_pages, host_pages = int(rng.integers(2, 9)), int(rng.integers(3, 14))
        kwargs = {k: v for k, v in options.items() if k != "small"}
        if options.get("small"):
            kwargs["staging_bytes"] = int(g.bytes_per_page * rng.integers(1, 4))
        if seed % 2:
            granularity = g.page_bytes if layout == "layer_first" else g.layers * g.page_bytes
            kwargs["register_chunk_bytes"] = math.lcm(granularity, 4096)
        _check_ops(seed, g, layout, backend, _random_ops(rng, g, dev_pages, host_pages), dev_pages=dev_pages,
                   host_pages=host_pages, **kwargs)


@pytest.mark.parametrize("schedule", ["eager", "lazy"])
@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_layer_events_of_back_to_back_loads_behind_busy_streams(schedule, layout):
    """Eight loads into disjoint device pages, most behind a busy model stream, with layer subsets in odd orders and
    a tiny index ring; a consumer waits for each (load, layer) event in a shuffled order and reads that layer's pages
    at once. No read may be stale. (Checked: with ``LayerSignals.arm`` patched to restart its targets from zero, the
    lazy runs report stale reads at seed 0; the eager runs, whose consumer rarely gets a step between a premature
    event and the kernel, do not.)"""
    g = KVGeometry.mla(5, latent_bytes=96, page_size=4)
    for seed in range(6):
        runtime = EmulatedRuntime("split", seed=seed, schedule=schedule)
        rng = np.random.default_rng(seed)
        with engine_on(runtime, g, layout, device_pages=16, host_pages=8, index_ring_bytes=256,
                       index_bytes=4 if seed % 2 else 8) as (dev, host, engine), \
                HostBuffer.allocate(g.page_bytes * 2 * g.layers * 8, HostKind.PINNED, runtime=runtime) as out:
            snapshot = fill_host(host)
            model = runtime.create_stream(0)
            loads = []
            for i in range(8):
                pages, slots = [2 * i + 1, 2 * i], rng.integers(0, 8, 2).tolist()
                layers = rng.permutation(g.layers)[:rng.integers(1, g.layers + 1)].tolist()
                runtime.busy(model, int(rng.integers(1, 200)))
                loads.append((engine.load(slots, pages, layers=layers, after=model), pages, slots, layers))
            consumer = runtime.create_stream(0)
            reads, offset = [], 0
            order = [(i, layer) for i in range(8) for layer in loads[i][3]]
            rng.shuffle(order)
            for i, layer in order:
                transfer, pages, slots, _ = loads[i]
                transfer.stream_wait(consumer, layer=layer)
                base = dev.layer_device_addresses(0)[layer]
                for page, slot in zip(pages, slots, strict=True):
                    runtime.memcpy_async(out.cpu_address + offset, base + page * g.page_bytes, g.page_bytes,
                                         stream=consumer)
                    reads.append((offset, _host_index(host, 0, layer, slot), (i, layer, page)))
                    offset += g.page_bytes
            consumer.synchronize()
            view = out.as_tensor().numpy()
            stale = [info for at, index, info in reads
                     if not np.array_equal(view[at:at + g.page_bytes], snapshot[index])]
            del view
            for transfer, *_ in loads:
                transfer.wait()
            assert not stale, f"seed {seed}: stale reads {stale[:4]}"
