"""Kernel backups run narrower blocks than loads. Measured on the H200 (bench/gemm_beside.py, 2 SMs): 1024-thread
blocks writing KV to host memory slowed a concurrent bf16 GEMM by ~90%, 512-thread ones by ~10%, both at ~50 GB/s;
loads need the wide block (reads wait on the link: 41 GB/s at 512 threads against 49 at 1024), and so does a
one-block backup (53% of the link at 512 threads, 72% at 1024). So ``backup_threads`` defaults to ``threads``, capped
at 512 when the budget is more than one block, and is the caller's to set. FamilyEngine (the state snapshots of a
hybrid cache) keeps the same policy, and both engines refuse, when they are built, a launcher whose max_threads is
below the threads they would launch."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.pools import engine_on, fill_device, fill_host, poison_device, read_device

from kvtier.errors import InvalidArgument, KvtierError
from kvtier.kernels import KernelLauncher
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.pools.state import StateDevicePool, StateGeometry, StateHostPool
from kvtier.runtime.emulated import EmulatedRuntime
from kvtier.transfer import TransferEngine
from kvtier.transfer.family import FamilyEngine

G = KVGeometry.mha(3, kv_heads=2, head_dim=256, itemsize=2, page_size=4)  # 1 KiB rows
NARROW = KVGeometry.mla(3, latent_bytes=64, page_size=4)


def _launch_blocks(runtime, monkeypatch) -> list[tuple[str, int]]:
    seen: list[tuple[str, int]] = []
    launch = runtime.launch

    def recorded(program, name, **kwargs):
        seen.append((name, kwargs["block"]))
        return launch(program, name, **kwargs)

    monkeypatch.setattr(runtime, "launch", recorded)
    return seen


@pytest.mark.parametrize("threads, backup_threads, blocks, expected", [
    (1024, None, 2, 512), (256, None, 2, 256), (1024, 1024, 2, 1024), (512, 128, 2, 128),
    (1024, None, 1, 1024),  # one block of 512 threads wrote 53% of the link on the H200, 1024 threads 72%
    (1024, 256, 1, 256)])
def test_backups_launch_backup_threads_and_loads_threads(monkeypatch, threads, backup_threads, blocks, expected):
    runtime = EmulatedRuntime("split", seed=0)
    with engine_on(runtime, G, "page_first", device_pages=4, host_pages=4, threads=threads, max_blocks=blocks,
                   backup_threads=backup_threads) as (dev, host, engine):
        assert engine.backup_threads == expected
        data = fill_device(dev)
        fill_host(host, 0xA5)
        seen = _launch_blocks(runtime, monkeypatch)
        engine.backup([2, 0], [1, 3]).wait()
        backup_blocks = {block for _, block in seen}
        seen.clear()
        poison_device(dev)
        engine.load([1, 3], [3, 1], per_layer=False).wait()
        load_blocks = {block for _, block in seen}
        assert backup_blocks == {expected} and load_blocks == {threads}
        for (tensor, layer), pages in data.items():
            got = read_device(dev, tensor, layer)
            assert np.array_equal(got[3], pages[2]) and np.array_equal(got[1], pages[0])
            assert (got[[0, 2]] == 0xEE).all()


@pytest.mark.parametrize("layout, expected", [("page_first", 1024), ("layer_first", 512)])
def test_narrow_chunks_keep_full_blocks_for_backups(layout, expected):
    """Chunks under 512 bytes keep 1024-thread backup blocks: 64-byte rows on a page_first host (64-byte chunks)
    moved 66% of the link at 512 threads against 77% at 1024 (H200, 2 SMs). A layer_first host of the same rows
    copies a page's rows as one chunk: 4 rows (256 bytes) are still narrow, 16 rows (1 KiB) are not."""
    runtime = EmulatedRuntime("split", seed=0)
    with engine_on(runtime, NARROW, layout, device_pages=4, host_pages=4) as (dev, host, engine):
        assert engine.plan.chunk_bytes == (64 if layout == "page_first" else 256)
        assert engine.backup_threads == 1024
    wide = KVGeometry.mla(3, latent_bytes=64, page_size=16)
    with engine_on(runtime, wide, layout, device_pages=4, host_pages=4) as (dev, host, engine):
        assert engine.backup_threads == expected


@pytest.mark.parametrize("bad, match", [(100, "whole warps"), (2048, "backup_threads"), (0, "backup_threads"),
                                        (64.0, "backup_threads"), (True, "backup_threads")])
def test_bad_backup_threads_are_refused_before_anything_is_allocated(bad, match):
    runtime = EmulatedRuntime("split", seed=0)
    with pytest.raises(InvalidArgument, match=match):
        with engine_on(runtime, G, "page_first", backup_threads=bad):
            pass


def test_a_launcher_too_narrow_for_the_backup_threads_is_refused():
    runtime = EmulatedRuntime("split", seed=0)
    launcher = KernelLauncher(runtime, max_threads=256)
    with pytest.raises(KvtierError, match="max_threads"):
        with engine_on(runtime, G, "page_first", threads=256, backup_threads=512, launcher=launcher):
            pass


def test_an_engine_over_a_launcher_with_fewer_threads_fails_with_a_false_message(split):
    """``TransferEngine(threads=1024)`` (the default) accepted ``launcher=KernelLauncher(rt, max_threads=256)``; the
    mismatch surfaced only at the first load, as ``KvtierError('launch of 2 blocks x 1024 threads: need >=1 block and
    32..1024 threads in whole warps')`` — a message that says 1024 threads are allowed while refusing 1024. The
    engine refuses the pair when it is built (or uses at most the launcher's threads), and any message names the
    launcher's limit (256). (Found adversarially, issue #13.)"""
    launcher = KernelLauncher(split, max_threads=256)
    try:
        with engine_on(split, G, "page_first", launcher=launcher) as (_, host, engine):
            fill_host(host)
            engine.load([0, 1], [2, 3]).wait()
    except KvtierError as error:
        assert "256" in str(error), f"the error does not name the launcher's 256-thread limit: {error}"


def test_family_engine_checks_its_threads_against_the_launcher_up_front():
    """``TransferEngine`` refuses, when it is built, a ``threads`` its launcher cannot run
    (``launcher.check_threads(threads, max_blocks)`` in ``TransferEngine.__init__``). ``FamilyEngine`` has "the same
    contract as TransferEngine" but had no such check: ``FamilyEngine(dev, host, launcher=KernelLauncher(rt,
    max_threads=256))`` (threads defaults to 1024) was built, and the mismatch surfaced only at the first backup or
    load, as a KvtierError from deep inside the launch. The constructor refuses the pair (as TransferEngine does).
    (Found adversarially, issue #13.)"""
    runtime = EmulatedRuntime("split", seed=0)
    g = StateGeometry.compress_state(2, (4, 8))
    dev = StateDevicePool.allocate(g, 3, 0, runtime=runtime)
    host = StateHostPool.allocate(g, "page_first", slots=3, runtime=runtime)
    launcher = KernelLauncher(runtime, max_threads=256)
    # the reference behaviour: the KV engine refuses the same pair when it is built
    kv = KVGeometry.mha(2, kv_heads=2, head_dim=16, itemsize=2, page_size=4)
    kv_dev = DevicePool.allocate(kv, 2, 0, runtime=runtime)
    kv_host = HostPool.allocate(kv, "page_first", pages=2, runtime=runtime)
    try:
        with pytest.raises(KvtierError, match="256"):
            TransferEngine(kv_dev, kv_host, launcher=launcher).close()
        engine = None
        try:
            with pytest.raises(KvtierError, match="256"):
                engine = FamilyEngine(dev, host, launcher=launcher)
        finally:
            if engine is not None:
                engine.close()
    finally:
        kv_host.close()
        kv_dev.close()
        host.close()
        dev.close()


def test_family_engine_backups_use_narrow_blocks_like_transfer_engine():
    """The backup_threads policy (kernel backups at most 512 threads a block when the budget is more than one block)
    applied to TransferEngine only: FamilyEngine, whose docstring promises "the same contract as TransferEngine" and
    which a hybrid KVCache builds for its state snapshots (StateTier, max_blocks=2), backed up with 2 blocks of 1024
    threads and had no ``backup_threads`` to set. It takes ``backup_threads`` with the same default.
    (Found adversarially, issue #13.)"""
    runtime = EmulatedRuntime("split", seed=0)
    g = StateGeometry.mamba(2, (4, 3), (2, 2, 4), conv_dtype="float32", temporal_dtype="float32")
    dev = StateDevicePool.allocate(g, 3, 0, runtime=runtime)
    host = StateHostPool.allocate(g, slots=3, runtime=runtime)
    engine = FamilyEngine(dev, host, max_blocks=2)
    blocks = []
    launch = runtime.launch

    def recorded(program, name, **kwargs):
        blocks.append(kwargs["block"])
        return launch(program, name, **kwargs)

    runtime.launch = recorded
    try:
        engine.backup([0, 1], [1, 2]).wait()
        assert set(blocks) == {512}, f"state backups launched {sorted(set(blocks))}-thread blocks"
    finally:
        runtime.launch = launch
        engine.close()
        host.close()
        dev.close()
