"""Kernel backups run narrower blocks than loads. Measured on the H200 (bench/gemm_beside.py, 2 SMs): 1024-thread
blocks writing KV to host memory slowed a concurrent bf16 GEMM by ~90%, 512-thread ones by ~10%, both at ~50 GB/s;
loads need the wide block (reads wait on the link: 41 GB/s at 512 threads against 49 at 1024), and so does a
one-block backup (53% of the link at 512 threads, 72% at 1024). So ``backup_threads`` defaults to ``threads``, capped
at 512 when the budget is more than one block, and is the caller's to set."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.pools import engine_on, fill_device, fill_host, poison_device, read_device

from kvtier.errors import InvalidArgument, KvtierError
from kvtier.kernels import KernelLauncher
from kvtier.pools import KVGeometry
from kvtier.runtime.emulated import EmulatedRuntime

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
