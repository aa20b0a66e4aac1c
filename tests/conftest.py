"""One suite for every runtime: each test that takes ``runtime`` runs on emulated:split, emulated:unified and, on a
machine with a usable GPU, the GPU runtime (marked ``gpu``; its id stays ``cuda``): ``cuda``, or the one
``KVTIER_GPU_RUNTIME`` names (``hip`` in scripts/amd_check.sh)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvtier.errors import RuntimeUnavailable
from kvtier.runtime import Runtime, create, get

RUNTIMES = ["emulated:split", "emulated:unified", pytest.param("cuda", marks=pytest.mark.gpu)]


def cuda_runtime() -> Runtime | None:
    try:
        return get(os.environ.get("KVTIER_GPU_RUNTIME") or "cuda")
    except RuntimeUnavailable:
        return None


@pytest.fixture(params=RUNTIMES)
def runtime(request: pytest.FixtureRequest) -> Runtime:
    if request.param == "cuda":
        rt = cuda_runtime()
        if rt is None:
            pytest.skip("no usable CUDA GPU")
        return rt
    return create(request.param)


@pytest.fixture
def cuda() -> Runtime:
    """The real CUDA runtime, for tests that only mean something there (mark them ``gpu``)."""
    rt = cuda_runtime()
    if rt is None:
        pytest.skip("no usable CUDA GPU")
    return rt


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> tuple:
    """(a CudaRuntime whose driver is a ``cuda_fakes.FakeCudart``, a non-default stream of it, the fake): CUDA's copy
    paths on a machine without a GPU."""
    import cuda_fakes

    import kvtier.runtime.cuda as cuda_module

    fake = cuda_fakes.FakeCudart()
    return cuda_fakes.fake_runtime(monkeypatch, fake), cuda_module.CudaStream(fake, 0, 0x1234, owned=False), fake


@pytest.fixture
def split() -> Runtime:
    return create("emulated:split")


@pytest.fixture(params=["emulated:split", "emulated:unified"])
def rt(request: pytest.FixtureRequest) -> Runtime:
    """A fresh emulated runtime, split then unified: tests that poison a device (a fault) get their own."""
    return create(request.param)


@pytest.fixture
def two_devices(runtime: Runtime) -> Runtime:
    if runtime.device_count() < 2:
        pytest.skip("needs two devices")
    return runtime


def is_split(runtime: Runtime) -> bool:
    return not runtime.device_attributes(0).can_use_host_pointer_for_registered_mem


def _redis(variable: str, start: str) -> Iterator[str]:
    """CI's server (``variable`` names its URL) or one started from ``storage_helpers.<start>`` for the session."""
    import storage_helpers

    storage_helpers.need_server()
    if os.environ.get(variable):
        yield os.environ[variable]
        return
    servers = getattr(storage_helpers, start)()
    yield servers.url
    servers.close()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A standalone Redis."""
    yield from _redis("KVTIER_TEST_REDIS_URL", "RedisServer")


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A 3-node Redis Cluster."""
    yield from _redis("KVTIER_TEST_REDIS_CLUSTER_URL", "RedisClusterServers")


STORE_KINDS = ["memory", "file", "redis", "redis-cluster"]


@pytest.fixture(params=STORE_KINDS)
def store_spec(request: pytest.FixtureRequest, tmp_path) -> str:
    """A storage spec of each kind (Redis ones on real servers)."""
    kind = request.param
    if kind == "memory":
        return "memory:"
    if kind == "file":
        return f"file:{tmp_path / 'store'}"
    if kind == "redis":
        return request.getfixturevalue("redis_url")
    return request.getfixturevalue("redis_cluster_url")
