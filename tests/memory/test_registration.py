"""Chunked registration: page-aligned chunk boundaries, all-or-nothing, unregistered by CPU address."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import RegistrationError, RuntimeCallError
from kvtier.memory import HostBuffer, get_device_accessible_ptr, plan_chunks
from kvtier.runtime import MemoryType
from kvtier.runtime.emulated import EmulatedRuntime


@given(granularity=st.integers(1, 1 << 22), chunks=st.integers(1, 64), whole=st.integers(0, 300),
       rest=st.integers(0, 1 << 30))
def test_plan_covers_the_buffer_without_splitting_a_page(granularity, chunks, whole, rest):
    chunk_bytes = granularity * chunks + granularity // 2
    nbytes = whole * chunk_bytes + rest % chunk_bytes or 1
    plan = plan_chunks(nbytes, chunk_bytes, granularity)
    assert plan[0][0] == 0 and sum(size for _, size in plan) == nbytes
    for (offset, size), (following, _) in zip(plan, plan[1:], strict=False):
        assert offset + size == following and following % granularity == 0
    assert all(0 < size <= chunk_bytes for _, size in plan)


def test_plan_refuses_chunks_smaller_than_a_page():
    with pytest.raises(RegistrationError, match="smaller than the granularity"):
        plan_chunks(1 << 20, 4096, 8192)


def _nothing_registered(runtime, starts):
    for start in starts:
        assert runtime.host_range(start) is None
        assert runtime.pointer_attributes(start).type is MemoryType.UNREGISTERED


@pytest.mark.parametrize("failing_chunk", [0, 1, 3])
def test_failure_in_chunk_k_unregisters_everything(runtime, monkeypatch, failing_chunk):
    calls = []
    real = runtime._host_register

    def flaky(address, nbytes, flags):
        calls.append(address)
        if len(calls) == failing_chunk + 1:
            raise RuntimeCallError("cudaHostRegister", "cudaErrorMemoryAllocation", "injected")
        real(address, nbytes, flags)

    monkeypatch.setattr(runtime, "_host_register", flaky)
    with pytest.raises(RegistrationError, match=f"chunk {failing_chunk} of 4"):
        HostBuffer.allocate(4 << 20, runtime=runtime, register_chunk_bytes=1 << 20)
    assert len(calls) == failing_chunk + 1
    _nothing_registered(runtime, calls)


@pytest.mark.gpu
def test_real_driver_failure_midway_unregisters_everything(cuda):
    """Register part of chunk 2 behind kvtier's back so the driver itself refuses it."""
    from cuda.bindings import runtime as cudart

    from kvtier import osmem
    from kvtier.memory import host_memory
    from kvtier.memory.registration import register_chunks

    memory = host_memory.anonymous(4 << 20)
    try:
        intruder = memory.address + (2 << 20) + 4096
        assert cudart.cudaHostRegister(intruder, 4096, 0)[0] == cudart.cudaError_t.cudaSuccess
        try:
            with pytest.raises(RegistrationError, match="chunk 2 of 4.*cudaErrorHostMemoryAlreadyRegistered"):
                register_chunks(cuda, memory.address, memory.nbytes, chunk_bytes=1 << 20, granularity=osmem.PAGE_SIZE)
            _nothing_registered(cuda, [memory.address + (i << 20) for i in range(2)])
        finally:
            cudart.cudaHostUnregister(intruder)
    finally:
        memory.release()


def test_emulated_driver_limit_on_single_registrations_is_met_by_chunking():
    rt = EmulatedRuntime("split", max_registration_bytes=1 << 20)
    with pytest.raises(RegistrationError, match="per-registration limit"):
        HostBuffer.allocate(2 << 20, runtime=rt, register_chunk_bytes=2 << 20)
    with HostBuffer.allocate(2 << 20, runtime=rt, register_chunk_bytes=1 << 20) as buf:
        assert len(buf.chunks) == 2


def test_emulated_pinning_limit_rolls_back():
    rt = EmulatedRuntime("split", pinnable_bytes=3 << 20)
    with pytest.raises(RegistrationError, match="chunk 3 of 4"):
        HostBuffer.allocate(4 << 20, runtime=rt, register_chunk_bytes=1 << 20)
    with HostBuffer.allocate(3 << 20, runtime=rt, register_chunk_bytes=1 << 20):
        pass


def test_split_chunks_get_non_adjacent_aliases_and_pages_never_span(split):
    page = 9216
    with HostBuffer.allocate(page * 64, runtime=split, granularity=page, register_chunk_bytes=page * 20) as buf:
        starts = [start - buf.cpu_address for start, _ in buf.chunks]
        assert all(offset % page == 0 for offset in starts)
        first, second = (get_device_accessible_ptr(buf.region(s, 1), 0) for s in (0, starts[1]))
        assert second - first != starts[1]
        for index in range(64):
            alias = get_device_accessible_ptr(buf.region(index * page, page), 0)
            chunk = max(i for i, s in enumerate(starts) if s <= index * page)
            assert alias == get_device_accessible_ptr(buf.region(starts[chunk], 1), 0) + (index * page - starts[chunk])
        with pytest.raises(RegistrationError, match="not contiguous"):
            get_device_accessible_ptr(buf.region(starts[1] - 16, 32), 0)


def test_register_overlapping_buffer_memory_is_refused(runtime):
    with HostBuffer.allocate(1 << 20, runtime=runtime) as buf:
        from kvtier.memory import register_chunks

        with pytest.raises(RegistrationError, match="already registered"):
            register_chunks(runtime, buf.cpu_address.value + 4096, 8192)
        assert len(buf.chunks) == 1 and runtime.host_range(buf.cpu_address.value).nbytes == 1 << 20


def test_a_span_is_one_registration_call_even_beside_another(runtime):
    """Chunks of one call are one span; a separate registration that touches it is not part of it."""
    from kvtier.memory import register_chunks, unregister_chunks
    from kvtier.memory.registration import registered_span

    with HostBuffer.allocate(1 << 20, runtime=runtime, register_chunk_bytes=256 << 10) as chunked:
        base = chunked.cpu_address.value
        assert all(registered_span(runtime, start.value + 5) == (base, base + (1 << 20)) for start, _ in chunked.chunks)
    assert registered_span(runtime, base) is None
    with HostBuffer.allocate(1 << 16, "pageable", runtime=runtime) as region:
        base = region.cpu_address.value
        first, second = register_chunks(runtime, base, 1 << 15), register_chunks(runtime, base + (1 << 15), 1 << 15)
        try:
            assert registered_span(runtime, base + 100) == (base, base + (1 << 15))
            assert registered_span(runtime, base + (1 << 15)) == (base + (1 << 15), base + (1 << 16))
        finally:
            unregister_chunks(runtime, second)
            unregister_chunks(runtime, first)
