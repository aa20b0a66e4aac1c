"""Two real processes for the ``kvtier.disagg`` tests: a prefill or decode peer started with ``subprocess`` (its own
interpreter, its own Mooncake engine), and the KV every page must hold.

A request's KV is ``expected(seed, pages, geometry)``: random bytes, never zero, as [page, tensor, layer, slot, head,
byte], the same in every process. ``write_kv`` / ``read_kv`` put it into and read it out of any pool (host
pools through a CPU view in their own layout, device pools through the runtime's copies), so a test compares every
byte a transfer moved whatever the layouts on the two sides.

A peer prints one JSON line per event on stdout (``ready``, ``sent``, ``paused``, ``landed``, ``error``); ``Peer``
reads them. ``pause`` arms a pause point in the peer that prints ``paused`` and sleeps, for the test to SIGKILL it
there.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from helpers.paths import ROOT, TESTS
from kvtier.memory import CpuAddress
from kvtier.pools import DevicePool, HostPool, KVGeometry

GEOMETRY = KVGeometry.mha(layers=4, kv_heads=2, head_dim=32, itemsize=2, page_size=4)
"""Small, with two heads, so every layout differs from every other (rows of 128 bytes, heads of 64)."""
DEVICE = "device"


def expected(seed: int, pages: int, geometry: KVGeometry = GEOMETRY) -> np.ndarray:
    g = geometry
    shape = (pages, g.tensors, g.layers, g.page_size, g.heads, g.head_bytes)
    return np.random.default_rng(seed).integers(1, 256, shape, dtype=np.uint8)


def request_spec(rid: str, pages: Any, seed: int) -> dict[str, Any]:
    """A request as a prefill peer takes it: its id, its pages there, the seed of its KV."""
    return {"id": rid, "pages": [int(p) for p in pages], "seed": seed}


def make_pool(geometry: KVGeometry, layout: str, pages: int, runtime: Any) -> HostPool | DevicePool:
    """A host pool of ``layout``, or a device pool (``layout == "device"``) on device 0."""
    if layout == DEVICE:
        return DevicePool.allocate(geometry, pages, 0, runtime=runtime)
    return HostPool.allocate(geometry, layout, pages=pages, runtime=runtime)


def _host_view(pool: HostPool, tensor: int) -> np.ndarray:
    g, s = pool.geometry, pool.strides
    memory = np.ctypeslib.as_array((ctypes.c_uint8 * pool.buffer.nbytes).from_address(pool.buffer.cpu_address.value))
    start = pool.tensor_offset(tensor)
    return np.lib.stride_tricks.as_strided(memory[start:], (pool.pages, g.layers, g.page_size, g.heads, g.head_bytes),
                                           (s.page, s.layer, s.slot, s.head, 1), writeable=True)


def write_kv(pool: HostPool | DevicePool, pages: Any, data: np.ndarray) -> None:
    g = pool.geometry
    for i, page in enumerate(np.asarray(pages).tolist()):
        for tensor in range(g.tensors):
            if isinstance(pool, HostPool):
                _host_view(pool, tensor)[page] = data[i, tensor]
                continue
            for layer, base in enumerate(pool.layer_device_addresses(tensor)):
                chunk = np.ascontiguousarray(data[i, tensor, layer])
                pool.runtime.memcpy(base + page * g.page_bytes, CpuAddress(chunk.ctypes.data), chunk.nbytes)


def read_kv(pool: HostPool | DevicePool, pages: Any) -> np.ndarray:
    g = pool.geometry
    pages = np.asarray(pages).tolist()
    out = np.zeros((len(pages), g.tensors, g.layers, g.page_size, g.heads, g.head_bytes), dtype=np.uint8)
    for i, page in enumerate(pages):
        for tensor in range(g.tensors):
            if isinstance(pool, HostPool):
                out[i, tensor] = _host_view(pool, tensor)[page]
                continue
            for layer, base in enumerate(pool.layer_device_addresses(tensor)):
                chunk = np.zeros(g.page_bytes, dtype=np.uint8)
                pool.runtime.memcpy(CpuAddress(chunk.ctypes.data), base + page * g.page_bytes, chunk.nbytes)
                out[i, tensor, layer] = chunk.reshape(g.page_size, g.heads, g.head_bytes)
    return out


def geometry_json(g: KVGeometry) -> dict[str, Any]:
    return {"kind": g.kind.value, "layers": g.layers, "page_size": g.page_size, "row_bytes": g.row_bytes,
            "heads": g.heads}


class Peer:
    """A peer process (``role``: ``prefill`` or ``decode``). Its events are read on a thread; ``event(kind)`` waits
    for the next one of a kind."""

    def __init__(self, role: str, **spec: Any) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])}
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from helpers.disagg import {role}_main; {role}_main()", json.dumps(spec)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self._stderr.extend(self.process.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith("{"):
                with self._cond:
                    self.events.append(json.loads(line))
                    self._cond.notify_all()
        with self._cond:
            self.events.append({"event": "exit"})
            self._cond.notify_all()

    def event(self, kind: str, timeout: float = 60) -> dict[str, Any]:
        with self._cond:
            found = self._cond.wait_for(lambda: any(e["event"] in (kind, "exit", "error") for e in self.events),
                                        timeout)
            assert found, f"the peer sent no {kind!r} within {timeout} s"
            for i, e in enumerate(self.events):
                if e["event"] in (kind, "exit", "error"):
                    del self.events[i]
                    break
        if e["event"] != kind:
            self.process.wait(10)
            raise AssertionError(f"the peer ended ({e}) before {kind!r}; stderr:\n{self.stderr()[-3000:]}")
        return e

    def stderr(self) -> str:
        return "".join(line for line in self._stderr if line[:1] not in "IW")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def finish(self, timeout: float = 60) -> None:
        """Wait for a clean exit."""
        code = self.process.wait(timeout)
        assert code == 0, f"the peer exited {code}; stderr:\n{self.stderr()[-3000:]}"

    def close(self) -> None:
        self.kill()
        for stream in (self.process.stdout, self.process.stderr):
            if stream:
                stream.close()


def _say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _stop_here(name: str) -> None:
    _say("paused", at=name)
    time.sleep(3600)


def _spec() -> dict[str, Any]:
    return json.loads(sys.argv[-1])


def _pool(spec: dict[str, Any]) -> HostPool | DevicePool:
    from kvtier.runtime import create

    geometry = KVGeometry(**spec.get("geometry", geometry_json(GEOMETRY)))
    return make_pool(geometry, spec["layout"], spec["pages"], create(spec.get("runtime", "emulated:split")))


def prefill_main() -> None:
    """Fill each request's pages with ``expected(seed)``, connect, send the requests (on one thread each with
    ``threads``), then close. ``pause``: [point, nth time it is reached] where the process stops for a SIGKILL."""
    from kvtier import pause_points
    from kvtier.disagg import KVSender, MooncakeWire

    spec = _spec()
    pool = _pool(spec)
    for request in spec["requests"]:
        write_kv(pool, request["pages"], expected(request["seed"], len(request["pages"]), pool.geometry))
    wire = MooncakeWire(batch_entries=spec.get("batch_entries", 512))
    try:
        sender = KVSender(spec["address"], pool, dtype=spec.get("dtype", "bfloat16"), wire=wire,
                          staging_pages=spec.get("staging_pages"))
    except Exception as exc:
        _say("error", type=type(exc).__name__, message=str(exc))
        raise
    _say("ready", converts=sender.converts)
    count = [0]

    def pause() -> None:
        count[0] += 1
        if count[0] == spec["pause"][1]:
            _stop_here(spec["pause"][0])

    def send(request: dict[str, Any]) -> None:
        written = sender.send(request["id"], request["pages"])
        _say("sent", id=request["id"], bytes=written)

    with pause_points.armed(spec["pause"][0], pause) if spec.get("pause") else _nothing():
        if spec.get("threads"):
            threads = [threading.Thread(target=send, args=(r,)) for r in spec["requests"]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for request in spec["requests"]:
                send(request)
    sender.close()
    pool.close()


def decode_main() -> None:
    """Listen, accept one sender, expect the requests, report each landing (or its error), then wait to be
    killed."""
    from kvtier.disagg import KVReceiver

    spec = _spec()
    pool = _pool(spec)
    receiver = KVReceiver(pool, dtype=spec.get("dtype", "bfloat16"))
    _say("ready", address=receiver.address)
    link = receiver.accept(60)
    for request in spec["requests"]:
        landing = link.expect(request["id"], request["pages"])
        _say("expecting", id=request["id"])
        try:
            landing.wait(60)
            _say("landed", id=request["id"])
        except Exception as exc:
            _say("failed", id=request["id"], type=type(exc).__name__, message=str(exc))
    time.sleep(3600)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def pair(src: HostPool | DevicePool, dst: HostPool | DevicePool, **options: Any) -> tuple[Any, Any, Any]:
    """(sender, link, receiver) within this process (two Mooncake engines): for the misuse tests that need no
    second process. ``options`` go to both ends (``dtype``) or to one (``sender_*``, ``receiver_*``)."""
    from kvtier.disagg import KVReceiver, KVSender

    common = {k: v for k, v in options.items() if not k.startswith(("sender_", "receiver_"))}
    mine = {k[len("receiver_"):]: v for k, v in options.items() if k.startswith("receiver_")}
    theirs = {k[len("sender_"):]: v for k, v in options.items() if k.startswith("sender_")}
    receiver = KVReceiver(dst, **common, **mine)
    accepted: list[Any] = []
    thread = threading.Thread(target=lambda: accepted.append(receiver.accept(30)))
    thread.start()
    try:
        sender = KVSender(receiver.address, src, **common, **theirs)
    finally:
        thread.join()
    return sender, accepted[0], receiver
