"""One suite for every runtime: each test that takes ``runtime`` runs on emulated:split, emulated:unified and, on a
machine with a usable GPU, the GPU runtime (marked ``gpu``; its id stays ``cuda``): ``cuda``, or the one
``KVTIER_GPU_RUNTIME`` names (``hip`` in scripts/amd_check.sh).

A run that leaves kvtier's files behind (temporary directories, shm files) fails and names them; the GPU runs a
machine without a GPU skips are summed up in one line of ``-ra``.

The suite runs in the lock-order mode (``KVTIER_LOCK_ORDER=1``, set here before kvtier is imported; ``=0`` turns
it off for a run): every kvtier lock records which locks its thread holds while it is taken, and a run in which
any acquisition inverted an order seen before fails and names both locks with their stacks (docs/lifetime.md)."""

from __future__ import annotations

import os

os.environ.setdefault("KVTIER_LOCK_ORDER", "1")   # read once, when kvtier is imported: so before any kvtier import

import gc
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.runtimes import cuda_runtime
from helpers.sglang import place_torchvision

from kvtier import lock_order, locks
from kvtier.memory.shm import DEFAULT_DIR as DEFAULT_SHM_DIR
from kvtier.memory.shm import DIR_ENV_VAR as SHM_DIR_ENV_VAR
from kvtier.runtime import Runtime, create

place_torchvision()                                # before anything imports transformers (helpers/sglang.py)

RUNTIMES = ["emulated:split", "emulated:unified", pytest.param("cuda", marks=pytest.mark.gpu)]
NO_GPU = "no usable CUDA GPU"


# -- leftovers: a test run must leave nothing of kvtier's behind ------------------------------------------------------
# The session gets a temporary directory (and an shm directory) of its own, inherited by every subprocess, so what a
# run leaves is told apart from what other runs on the same machine make at the same time. In the shared default shm
# directory, files named after this process (the creator's pid) count too. Under pytest-xdist (``-n 2``) each worker
# has directories of its own and reports what it found to the controller, which fails the run.
_private: dict[str, str] = {}
_reported: dict[str, list[str]] = {"kvtier_left": [], "lock_inversions": [], "lock_collector_cycles": []}
PRIVATE_SHM = "KVTIER_TEST_PRIVATE_SHM"


def pytest_configure(config: pytest.Config) -> None:
    if (os.environ[locks.ENV_VAR] == "1") != locks.RECORDING:
        raise pytest.UsageError(f"kvtier was imported before tests/conftest.py set {locks.ENV_VAR}: its locks do "
                                f"not follow the setting (a plugin importing kvtier?)")
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())   # tmp_path stays where pytest keeps it
    _private["tmp"] = tempfile.mkdtemp(prefix="kvtier-test-session-")
    os.environ["TMPDIR"] = tempfile.tempdir = _private["tmp"]
    if not os.environ.get(SHM_DIR_ENV_VAR) or os.environ.get(PRIVATE_SHM):
        _private["shm"] = os.environ[SHM_DIR_ENV_VAR] = f"/dev/shm/kvtier-test-session-{uuid.uuid4().hex[:12]}"
        os.environ[PRIVATE_SHM] = "1"


def leftovers() -> list[str]:
    """kvtier's files and directories the tests left in the session's temporary and shm directories."""
    found = list(Path(_private["tmp"]).glob("kvtier-*"))
    shm = Path(_private.get("shm", "/nonexistent"))
    found += list(shm.iterdir()) if shm.is_dir() else []
    found += Path(DEFAULT_SHM_DIR).glob(f"kvtier-{os.getpid()}-*")
    return sorted(str(entry) for entry in found)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """An xdist worker finished: keep what it left behind and the lock inversions it saw (it cannot fail the run
    itself)."""
    for key, found in _reported.items():
        found.extend(getattr(node, "workeroutput", {}).get(key, []))


def inversions() -> tuple[list[str], list[str]]:
    """The lock-order inversions and the cycles through finalizers this process and its xdist workers saw."""
    return ([str(i) for i in lock_order.ORDER.inversions] + _reported["lock_inversions"],
            [str(c) for c in lock_order.ORDER.collector_cycles] + _reported["lock_collector_cycles"])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or "tmp" not in _private:
        return
    gc.collect()                                       # buffers only garbage holds give their files back first
    left = leftovers() + _reported["kvtier_left"]
    inverted, cycles = inversions()
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput.update(kvtier_left=left, lock_inversions=inverted, lock_collector_cycles=cycles)
    if left:
        _private["left"] = "\n".join(left[:20] + ([f"… and {len(left) - 20} more"] if len(left) > 20 else []))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if inverted:                                       # raised where they happened, but a thread may have swallowed it
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _private.get("left"):
        terminalreporter.section("kvtier files left behind", red=True)
        terminalreporter.line("the tests left these (a test that makes one must remove it); the run fails:\n"
                              + _private["left"])
    inverted, cycles = inversions()
    if inverted:
        terminalreporter.section("kvtier lock order inversions", red=True)
        terminalreporter.line(f"{len(inverted)} acquisition(s) took two locks in both orders (docs/lifetime.md "
                              f"gives the order); the run fails:")
        for inversion in inverted:
            terminalreporter.line(inversion)
    if cycles:
        terminalreporter.section("kvtier lock order cycles through finalizers", yellow=True)
        terminalreporter.line(f"{len(cycles)} lock order cycle(s) need a lock a finalizer took inside a garbage "
                              f"collection; whether a run sees one depends on where collections start, so they "
                              f"are reported, not failed:")
        for cycle in cycles:
            terminalreporter.line(cycle)


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in (_private.pop("tmp", None), _private.pop("shm", None)):
        if path:
            shutil.rmtree(path, ignore_errors=True)


# -- one summary line for the GPU runs a machine without a GPU skips --------------------------------------------------
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    """Every test that takes ``runtime`` has a ``cuda`` run; without a GPU, ``-ra`` would list each skip on a line of
    its own. Reported from here instead, they fold into one line; other skips keep their own."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple) and report.longrepr[2].endswith(NO_GPU):
        report.longrepr = (__file__, None, f"{NO_GPU} (the gpu-marked runs)")
    return report


@pytest.fixture(params=RUNTIMES)
def runtime(request: pytest.FixtureRequest) -> Runtime:
    if request.param == "cuda":
        rt = cuda_runtime()
        if rt is None:
            pytest.skip(NO_GPU)
        return rt
    return create(request.param)


@pytest.fixture
def cuda() -> Runtime:
    """The real CUDA runtime, for tests that only mean something there (mark them ``gpu``)."""
    rt = cuda_runtime()
    if rt is None:
        pytest.skip(NO_GPU)
    return rt


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> tuple:
    """(a CudaRuntime whose driver is a ``cuda_fakes.FakeCudart``, a non-default stream of it, the fake): CUDA's copy
    paths on a machine without a GPU."""
    import helpers.cuda_fakes as cuda_fakes

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


def _redis(variable: str, start: str) -> Iterator[str]:
    """CI's server (``variable`` names its URL) or one started from ``storage_helpers.<start>`` for the session."""
    import helpers.storage as storage_helpers

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


@pytest.fixture
def own_server() -> Iterator[object]:
    """A private standalone Redis, for tests that stop it, kill its clients or change its settings."""
    import helpers.storage as storage_helpers

    server = storage_helpers.RedisServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def mooncake_spec() -> Iterator[str]:
    """A Mooncake Store (master, metadata server, segment holder): CI's, or one started for the session."""
    import helpers.mooncake as mooncake_helpers

    mooncake_helpers.need_mooncake()
    if os.environ.get("KVTIER_MOONCAKE_SPEC"):
        yield os.environ["KVTIER_MOONCAKE_SPEC"]
        return
    servers = mooncake_helpers.MooncakeServers()
    yield servers.spec
    servers.close()


@pytest.fixture
def mooncake_servers() -> Iterator[object]:
    """A private Mooncake Store, for tests that kill its master."""
    import helpers.mooncake as mooncake_helpers

    servers = mooncake_helpers.MooncakeServers()
    yield servers
    servers.close()


STORE_KINDS = ["memory", "file", "redis", "redis-cluster", "mooncake"]


@pytest.fixture(params=STORE_KINDS)
def store_spec(request: pytest.FixtureRequest, tmp_path) -> str:
    """A storage spec of each kind (Redis and Mooncake ones on real servers)."""
    kind = request.param
    if kind == "memory":
        return "memory:"
    if kind == "file":
        return f"file:{tmp_path / 'store'}"
    if kind == "redis":
        return request.getfixturevalue("redis_url")
    if kind == "mooncake":
        return request.getfixturevalue("mooncake_spec")
    return request.getfixturevalue("redis_cluster_url")
