"""The io backend interface is one abstract method: a backend without it cannot be built, every shipped backend
writes it, the module docstring lists exactly it, and a backend written from that docstring alone moves pages
through a real engine."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from helpers.interfaces import documented_primitives, implemented_except
from helpers.pools import engine_on, fill_device, poison_device, read_device

import kvtier.transfer.backend as backend
from kvtier.errors import InvalidArgument
from kvtier.pools import KVGeometry, device_strides
from kvtier.transfer import engine
from kvtier.transfer.backend import Backend, BackendOptions
from kvtier.transfer.job import D2H


def test_the_docstring_lists_exactly_the_primitives():
    assert Backend.__abstractmethods__
    assert documented_primitives(backend) == {"Backend": set(Backend.__abstractmethods__)}


@pytest.mark.parametrize("primitive", sorted(Backend.__abstractmethods__))
def test_a_backend_missing_a_primitive_cannot_be_built_and_is_told_which(primitive):
    with pytest.raises(TypeError, match=rf"abstract method.*\b{primitive}\b"):
        implemented_except(Backend, primitive)(None, None)


@pytest.mark.parametrize("shipped", sorted(engine.BACKENDS))
def test_every_shipped_backend_writes_every_primitive(shipped):
    assert issubclass(engine.BACKENDS[shipped], Backend)
    assert not inspect.isabstract(engine.BACKENDS[shipped])


@pytest.mark.parametrize(("field", "value"), [("ring_bytes", 0), ("staging_bytes", -1), ("relayout_blocks", 0),
                                              ("layer_signals", "yes")])
def test_backend_options_refuse_bad_values(field, value):
    given = {"ring_bytes": 1 << 20, "staging_bytes": 1 << 20, field: value}
    with pytest.raises(InvalidArgument, match=field):
        BackendOptions(**given)


class PageByPage(Backend):
    """What a newcomer writes from the docstring: ``run`` only, one copy per page, layer and tensor."""

    name = "page_by_page"

    def run(self, job):
        context = self.context
        g, host, runtime = context.geometry, context.host_pool, context.runtime
        device_page = device_strides(g).page
        for layer in job.layers:
            for tensor in range(g.tensors):
                device_base = context.device_pool.layer_device_addresses(tensor)[layer]
                host_base = host.buffer.cpu_address + host.tensor_offset(tensor) + layer * host.strides.layer
                for d, h in zip(job.device_pages.tolist(), job.host_pages.tolist(), strict=True):
                    on_device, on_host = device_base + d * device_page, host_base + h * host.strides.page
                    dst, src = (on_host, on_device) if job.direction == D2H else (on_device, on_host)
                    runtime.memcpy_async(dst, src, g.page_bytes, stream=job.stream)
            job.mark(runtime, context.device, layer, job.stream)


def test_a_backend_written_from_the_docstring_moves_pages_through_the_engine(runtime, monkeypatch):
    monkeypatch.setitem(engine.BACKENDS, PageByPage.name, PageByPage)
    g = KVGeometry.mha(3, kv_heads=2, head_dim=16, itemsize=2, page_size=4)
    with engine_on(runtime, g, "layer_first", device_pages=6, host_pages=6, backend=PageByPage.name) as (dev, _, eng):
        data = fill_device(dev)
        eng.backup([1, 4], [5, 0]).wait()
        poison_device(dev)
        load = eng.load([5, 0], [2, 3])
        load.wait()
        assert sorted(load.layer_events) == list(range(g.layers))
        for tensor in range(g.tensors):
            for layer in range(g.layers):
                got = read_device(dev, tensor, layer)
                np.testing.assert_array_equal(got[[2, 3]], data[(tensor, layer)][[1, 4]])
                assert (got[[0, 1, 4, 5]] == 0xEE).all()
