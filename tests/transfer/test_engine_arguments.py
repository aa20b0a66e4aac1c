"""A TransferEngine's arguments are checked when it is built, not at its first transfer (after part of it was
queued): numpy integers taken as ints, bad launch settings and impossible index rings refused with kvtier errors, layer
lists given as tensors as page lists are. (found adversarially)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.pools import SMALL_MHA, fill_device, poison_device, read_device

from kvtier.errors import InvalidArgument, KvtierError
from kvtier.pools import DevicePool, HostPool
from kvtier.runtime import create
from kvtier.transfer import TransferEngine


def _round_trip(engine: TransferEngine, dev: DevicePool) -> None:
    data = fill_device(dev)
    engine.backup([0, 1], [2, 3]).wait()
    poison_device(dev)
    engine.load([2, 3], [1, 0]).wait()
    for tensor in range(SMALL_MHA.tensors):
        for layer in range(SMALL_MHA.layers):
            np.testing.assert_array_equal(read_device(dev, tensor, layer)[[1, 0]], data[(tensor, layer)][[0, 1]])


def test_staged_engine_accepts_numpy_staging_bytes():
    rt = create("emulated:unified")
    with DevicePool.allocate(SMALL_MHA, 4, 0, runtime=rt) as dev, \
            HostPool.allocate(SMALL_MHA, "page_first", pages=4, runtime=rt) as host:
        with TransferEngine(dev, host, backend="staged", staging_bytes=np.int64(1 << 20)) as engine:
            _round_trip(engine, dev)


@pytest.mark.parametrize("options", [
    pytest.param(dict(backend="staged", relayout_blocks=-1), id="relayout_blocks=-1"),
    pytest.param(dict(backend="staged", relayout_blocks=0.5), id="relayout_blocks=0.5"),
    pytest.param(dict(backend="kernel", threads=33), id="threads=33"),
    pytest.param(dict(backend="kernel", index_bytes=4.0), id="index_bytes=4.0"),
])
def test_bad_engine_settings_are_refused_at_construction(options):
    """These build an engine; the first backup() then dies in the launch boundary with a bare KvtierError ('launch of
    -1 blocks x 1024 threads'), after part of the transfer was queued. Construction should raise InvalidArgument."""
    rt = create("emulated:unified")
    with DevicePool.allocate(SMALL_MHA, 4, 0, runtime=rt) as dev, \
            HostPool.allocate(SMALL_MHA, "page_first", pages=4, runtime=rt) as host:
        with pytest.raises(InvalidArgument):
            TransferEngine(dev, host, **options).close()


def test_an_impossible_index_ring_raises_a_kvtier_error():
    rt = create("emulated:unified")
    with DevicePool.allocate(SMALL_MHA, 4, 0, runtime=rt) as dev, \
            HostPool.allocate(SMALL_MHA, "page_first", pages=4, runtime=rt) as host:
        with pytest.raises(KvtierError):
            TransferEngine(dev, host, index_ring_bytes=1 << 60)


def test_layers_accept_a_tensor_like_pages_do():
    """Page lists take torch tensors; layers=torch.tensor([1]) is refused ('layers[0] must be an integer, got
    Tensor')."""
    rt = create("emulated:unified")
    with DevicePool.allocate(SMALL_MHA, 4, 0, runtime=rt) as dev, \
            HostPool.allocate(SMALL_MHA, "page_first", pages=4, runtime=rt) as host, \
            TransferEngine(dev, host) as engine:
        engine.load(torch.tensor([0]), torch.tensor([1]), layers=torch.tensor([1])).wait()
