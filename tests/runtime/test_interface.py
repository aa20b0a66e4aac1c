"""The runtime interface is its abstract methods: a platform missing one cannot be built, every shipped platform
writes all of them, and the module docstring a newcomer implements from lists exactly them."""

from __future__ import annotations

import inspect

import pytest
from helpers.interfaces import documented_primitives, implemented_except

import kvtier.runtime.base as base
from kvtier.runtime import cuda, emulated, emulated_device, hip

INTERFACES = (base.Runtime, base.Stream, base.Event, base.Graph)
SHIPPED = {
    base.Runtime: (cuda.CudaRuntime, hip.HipRuntime, emulated.EmulatedRuntime),
    base.Stream: (cuda.CudaStream, hip.HipStream, emulated_device.EmulatedStream),
    base.Event: (cuda.CudaEvent, hip.HipEvent, emulated_device.EmulatedEvent),
    base.Graph: (cuda.CudaGraph, hip.HipGraph, emulated_device.EmulatedGraph),
}


@pytest.mark.parametrize("interface", INTERFACES, ids=lambda c: c.__name__)
def test_the_docstring_lists_exactly_the_primitives(interface):
    assert interface.__abstractmethods__, f"{interface.__name__} has no abstract methods"
    assert documented_primitives(base).get(interface.__name__) == set(interface.__abstractmethods__)


def test_the_docstring_lists_primitives_of_the_interfaces_only():
    assert set(documented_primitives(base)) == {c.__name__ for c in INTERFACES}


@pytest.mark.parametrize(("interface", "primitive"),
                         [(c, name) for c in INTERFACES for name in sorted(c.__abstractmethods__)],
                         ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_a_platform_missing_a_primitive_cannot_be_built_and_is_told_which(interface, primitive):
    with pytest.raises(TypeError, match=rf"abstract method.*\b{primitive}\b"):
        implemented_except(interface, primitive)()


@pytest.mark.parametrize("interface", INTERFACES, ids=lambda c: c.__name__)
def test_a_platform_writing_every_primitive_is_built(interface):
    assert isinstance(implemented_except(interface)(), interface)


@pytest.mark.parametrize(("interface", "shipped"), [(i, s) for i, impls in SHIPPED.items() for s in impls],
                         ids=lambda c: c.__name__)
def test_every_shipped_platform_writes_every_primitive(interface, shipped):
    assert issubclass(shipped, interface)
    assert not inspect.isabstract(shipped), sorted(shipped.__abstractmethods__)


def test_synchronize_makes_the_releases_a_capture_kept_back(split):
    """The shared part of ``synchronize`` lives in the base: a platform's ``_synchronize`` only waits."""
    released = []
    stream = split.create_stream(0)
    stream.begin_capture()
    try:
        split.after_device_work(lambda: released.append(True))
        assert not released
    finally:
        stream.end_capture().close()
    split.synchronize(0)
    assert released == [True]
    stream.close()


def test_a_closed_event_with_a_keeper_stays_open(split):
    """``close`` on an event its keeper owns does nothing on every platform: the rule lives in the base."""
    event = split.create_event(0)
    event.keeper = "Transfer"
    event.close()
    event.record(split.create_stream(0))
    event.keeper = None
    event.close()
    with pytest.raises(Exception, match="closed"):
        event.query()
