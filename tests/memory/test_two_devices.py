"""Target-device aliases across two devices (issue #4): the emulator's two devices in CI, two real GPUs where present.

``get_device_accessible_ptr(obj, device)`` promises an address valid on the *target* device, the caller's current
device unchanged, and another device's memory refused. Each test runs a real kernel on the device it resolved for,
so an address valid only on the other device faults (emulator) or reads wrong bytes (CUDA) instead of passing.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.device_kernels import random_bytes, xor_copy
from helpers.pools import fill_device, poison_device, read_device
from helpers.runtimes import is_split

from kvtier.errors import WrongDeviceError
from kvtier.kernels import ChunkCopy, ChunkSide, KernelLauncher
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind, get_device_accessible_ptr
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.transfer import TransferEngine


@pytest.mark.parametrize("kind", [HostKind.REGISTERED, HostKind.PINNED])
def test_alias_for_device_1_is_read_by_a_kernel_there_while_device_0_stays_current(two_devices, kind):
    rt = two_devices
    nbytes = 1 << 16
    data = random_bytes(nbytes)
    with HostBuffer.allocate(nbytes, kind, runtime=rt) as host, DeviceBuffer(nbytes, 1, runtime=rt) as out:
        host.as_tensor().numpy()[:] = data
        out.upload(np.full(nbytes, 0xEE, np.uint8))
        rt.set_device(0)
        alias = get_device_accessible_ptr(host, 1)
        assert rt.current_device() == 0
        assert alias.device == 1
        if is_split(rt):
            assert alias.value != host.cpu_address.value
            assert alias != get_device_accessible_ptr(host, 0)
        xor_copy(rt, out.address, alias, nbytes, 0x5A, device=1)
        assert rt.current_device() == 0
        np.testing.assert_array_equal(np.frombuffer(out.download(), np.uint8), data ^ np.uint8(0x5A))


def test_device_1_memory_for_device_0_is_refused_without_a_fault(two_devices):
    rt = two_devices
    data = random_bytes(4096)
    with DeviceBuffer(4096, 1, runtime=rt) as dev1, DeviceBuffer(4096, 0, runtime=rt) as dev0:
        dev1.upload(data)
        rt.set_device(0)
        with pytest.raises(WrongDeviceError, match="device 1.*device 0"):
            get_device_accessible_ptr(dev1, 0)
        index = DeviceBuffer(8, 0, runtime=rt)
        index.upload(np.zeros(1, np.int64))
        call = ChunkCopy(src=ChunkSide(dev1, 0, 0), dst=ChunkSide(dev0, 0, 0), src_index=index, dst_index=index,
                         index_bytes=8, n_units=1, layer_begin=0, n_layers=1, n_pieces=1, chunk_bytes=4096)
        stream = rt.create_stream(0)
        with pytest.raises(WrongDeviceError):
            KernelLauncher(rt).copy_chunks(call, device=0, stream=stream)
        assert rt.current_device() == 0
        stream.synchronize()
        assert bytes(dev1.download()) == data.tobytes()
        stream.close()
        index.close()


def test_per_layer_loads_on_both_devices_at_once_share_one_host_pool(two_devices):
    """Each engine's host table holds the host pool's aliases for its own device; loads run concurrently."""
    rt = two_devices
    g = KVGeometry.mha(3, kv_heads=2, head_dim=64, itemsize=2, page_size=16)
    rng = np.random.default_rng()
    pools = [DevicePool.allocate(g, 8, device, runtime=rt) for device in (0, 1)]
    host = HostPool.allocate(g, "page_first", pages=16, runtime=rt)
    engines = [TransferEngine(pool, host, backend="kernel") for pool in pools]
    try:
        for device, engine in enumerate(engines):
            aliases = [get_device_accessible_ptr(region, device) for region in host.layer_regions(0)]
            assert [a.device for a in aliases] == [device] * g.layers
            assert engine._backend.host_table.entries[:g.layers] == tuple(aliases)
        slots = rng.permutation(16)[:8].reshape(2, 4)
        sources = [rng.choice(8, 4, replace=False) for _ in engines]
        data = [fill_device(pool) for pool in pools]
        for engine, src, slot in zip(engines, sources, slots, strict=True):
            engine.backup(src, slot).wait()
        for pool in pools:
            poison_device(pool)
        targets = [rng.choice(8, 4, replace=False) for _ in engines]
        rt.set_device(0)
        loads = [engine.load(slot, dst) for engine, slot, dst in zip(engines, slots, targets, strict=True)]
        assert rt.current_device() == 0
        for load in loads:
            load.wait()
        for pool, values, src, dst in zip(pools, data, sources, targets, strict=True):
            for tensor in range(g.tensors):
                for layer in range(g.layers):
                    got = read_device(pool, tensor, layer)
                    np.testing.assert_array_equal(got[dst], values[(tensor, layer)][src])
                    assert (got[np.setdiff1d(np.arange(8), dst)] == 0xEE).all()
    finally:
        for engine in engines:
            engine.close()
        host.close()
        for pool in pools:
            pool.close()
