"""Real Redis servers for the storage tests (never a fake): a standalone server and a 3-node cluster.

CI starts them (``scripts/redis_servers.sh``) and passes their URLs in ``KVTIER_TEST_REDIS_URL`` and
``KVTIER_TEST_REDIS_CLUSTER_URL``; without those the fixtures start their own on free ports. Tests that stop a
server mid-run always get a private one. Without ``redis-server`` on the machine the Redis tests skip, unless
``KVTIER_REQUIRE_REDIS=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import numpy as np
import pytest

from helpers.cache import build, close_all, serve
from kvtier.cache import Namespace
from kvtier.pools import KVGeometry
from kvtier.storage import MemoryStore, SharedPages

SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
CLI = shutil.which("redis-cli") or shutil.which("valkey-cli")
GEOMETRY = KVGeometry.mha(layers=2, kv_heads=1, head_dim=32, itemsize=2, page_size=4)
PAGE = GEOMETRY.bytes_per_page
"""Bytes of one stored page of GEOMETRY (every tensor and layer)."""


def namespace(geometry: KVGeometry = GEOMETRY, **fields) -> Namespace:
    """A namespace no other test uses (a fresh tenant), so tests sharing a server never see each other's pages."""
    fields.setdefault("tenant", uuid.uuid4().hex)
    return Namespace(fields.pop("model", "test-model"), geometry, fields.pop("dtype", "bfloat16"), **fields)


def random_pages(count: int, geometry: KVGeometry = GEOMETRY) -> list[np.ndarray]:
    """Fresh random pages (never zeros)."""
    rng = np.random.default_rng()
    return [rng.integers(1, 256, geometry.bytes_per_page, dtype=np.uint8) for _ in range(count)]


def read_pages(store, keys, geometry: KVGeometry = GEOMETRY) -> tuple[int, list[np.ndarray]]:
    """``store.get`` into poisoned buffers: (pages read, the buffers)."""
    out = [np.full(geometry.bytes_per_page, 0x5A, np.uint8) for _ in keys]
    return store.get(keys, [[o] for o in out]), out


def need_server() -> None:
    if SERVER is None or CLI is None:
        if os.environ.get("KVTIER_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server / redis-cli are required here (KVTIER_REQUIRE_REDIS=1)")
        pytest.skip("redis-server is not installed")


def free_port(*, bus: bool = False) -> int:
    """A free loopback port; ``bus``: also its cluster bus port (+10000), so below 55536."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 55000)
        try:
            for p in (port, port + 10000) if bus else (port,):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


class RedisServer:
    """A redis-server process on a loopback port; ``stop()`` kills it, ``start()`` brings it back on the same
    port (empty: nothing is saved)."""

    def __init__(self, *args: str, port: int | None = None, tls: bool = False) -> None:
        need_server()
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvtier-redis-")
        self.tls = tls
        if tls:                              # a self-signed certificate for 127.0.0.1; the server speaks only TLS
            self.cert = os.path.join(self.dir, "cert.pem")
            key = os.path.join(self.dir, "key.pem")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out",
                            self.cert, "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                            "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
            args = ("--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.cert, "--tls-key-file", key,
                    "--tls-ca-cert-file", self.cert, "--tls-auth-clients", "no", *args)
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        if self.tls:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert SERVER is not None
        self.process = subprocess.Popen([SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", self.dir, *self.args],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisClusterServers:
    """Three cluster-enabled servers joined with ``redis-cli --cluster create``."""

    def __init__(self) -> None:
        need_server()
        ports = [free_port(bus=True) for _ in range(3)]
        self.servers = [RedisServer("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{p}.conf",
                                    "--cluster-node-timeout", "2000", port=p) for p in ports]
        assert CLI is not None
        subprocess.run([CLI, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self.wait_ok()
        self.url = f"redis+cluster://127.0.0.1:{ports[0]}"

    def wait_ok(self, seconds: float = 60) -> None:
        """Until every node says ``cluster_state:ok`` (after creation, or after a node restarted)."""
        assert CLI is not None
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            states = [subprocess.run([CLI, "-p", str(s.port), "cluster", "info"], capture_output=True,
                                     text=True).stdout for s in self.servers]
            if all("cluster_state:ok" in state for state in states):
                return
            time.sleep(0.1)
        raise RuntimeError("the test cluster did not reach cluster_state:ok")

    def close(self) -> None:
        for server in self.servers:
            server.close()


# -- caches over stores -----------------------------------------------------------------------------------------
class Hooked(MemoryStore):
    """A MemoryStore whose reads can be slowed, broken, or raced by an eviction after ``exists``."""

    def __init__(self, namespace, **options):
        super().__init__(namespace, **options)
        self.delay = 0.0
        self.fail: str | None = None
        self.vanish_after_exists: int | None = None
        self.reads = 0
        self.fail_from_read: int | None = None
        """Reads from this one on (counted from 1) fail: a store that goes down in the middle of a prefetch."""

    def _exists(self, keys):
        if self.fail == "exists":
            raise ConnectionError("server went away")
        found = super()._exists(keys)
        if self.vanish_after_exists is not None and self.vanish_after_exists < len(keys):
            self._delete([keys[self.vanish_after_exists]])
        return found

    def _get(self, keys, pages):
        self.reads += 1
        time.sleep(self.delay)
        if self.fail == "get" or self.fail_from_read is not None and self.reads >= self.fail_from_read:
            raise TimeoutError("read timed out")
        yield from super()._get(keys, pages)

    def _set(self, keys, pages):
        time.sleep(self.delay)
        if self.fail == "set":
            raise ConnectionError("server went away")
        return super()._set(keys, pages)


def stores_of(kind=None, **options):
    """A factory of stores of ``kind`` (default MemoryStore) sharing one dict of pages (a restart, a second cache),
    and the list of stores it made (close them after the caches)."""
    kind = kind or MemoryStore
    shared, stores = SharedPages(), []

    def storage(ns):
        stores.append(kind(ns, shared=shared, **options))
        return stores[-1]

    return storage, stores


def hooked_stores(**options):
    """Hooked stores (reads and writes slowed or broken on demand) sharing one dict, and the list of them."""
    return stores_of(Hooked, **options)


def memory_stores():
    return stores_of()


def warm(runtime, storage, prompts, **settings):
    """A first cache that serves ``prompts`` and writes them through to storage; returns the model's salt."""
    cache, model, dev, host = build(runtime, device_pages=64, host_pages=128, storage=storage, **settings)
    try:
        for p in prompts:
            serve(cache, model, p)
        cache.drain()
        assert cache.stats()["storage_pages.written"] >= sum(len(p) // 4 for p in prompts)
    finally:
        close_all(cache, dev, host)
    return model.salt


def second(runtime, storage, salt, **settings):
    """A cache over the same store whose stand-in model writes the first one's bytes (``salt``)."""
    settings.setdefault("device_pages", 64)
    settings.setdefault("host_pages", 128)
    cache, model, dev, host = build(runtime, storage=storage, **settings)
    model.salt = salt
    return cache, model, dev, host


def slow_cache(rt, shared, delay=0.02, device_pages=64, host_pages=128, **settings):
    """(cache, model, dev, host, store): a cache over a ``Hooked`` store on ``shared`` whose writes each take
    ``delay`` seconds, so writes queue up behind the backups."""
    made = {}

    def storage(ns):
        made["store"] = Hooked(ns, shared=shared)
        made["store"].delay = delay
        return made["store"]

    cache, model, dev, host = build(rt, device_pages=device_pages, host_pages=host_pages, storage=storage, **settings)
    return cache, model, dev, host, made["store"]
