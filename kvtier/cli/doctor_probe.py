"""What ``kvtier doctor`` measures: runtime, device attributes, each host buffer kind, and contiguous copy speed.

Kept apart from the rendering so ``--json`` and the tables report the same facts, and tests can check the facts.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

import kvtier
from kvtier.memory import CpuAddress, DeviceAddress, DeviceBuffer, HostBuffer, HostKind, get_device_accessible_ptr
from kvtier.runtime import Runtime

GIB = 1 << 30
Step = Callable[[str], None]


@dataclass
class HostKindReport:
    kind: str
    ok: bool
    error: str | None = None
    device_accessible: bool = False
    alias_equals_cpu: dict[int, bool] = field(default_factory=dict)
    register_s_per_gib: float | None = None
    chunks: int = 0


def probe_devices(runtime: Runtime) -> list[dict[str, Any]]:
    return [{"index": d, **asdict(runtime.device_attributes(d))} for d in range(runtime.device_count())]


def probe_host_kind(runtime: Runtime, kind: HostKind, nbytes: int) -> HostKindReport:
    try:
        buffer = HostBuffer.allocate(nbytes, kind, runtime=runtime)
    except Exception as exc:
        return HostKindReport(kind.value, ok=False, error=f"{type(exc).__name__}: {exc}")
    with buffer:
        report = HostKindReport(kind.value, ok=True, device_accessible=buffer.device_accessible,
                                chunks=len(buffer.chunks))
        if buffer.device_accessible:
            report.register_s_per_gib = buffer.register_seconds / (nbytes / GIB)
        if buffer.device_accessible:
            for device in range(runtime.device_count()):
                alias = get_device_accessible_ptr(buffer, device)
                report.alias_equals_cpu[device] = alias.value == buffer.cpu_address.value
    return report


Copy = tuple[CpuAddress | DeviceAddress, CpuAddress | DeviceAddress]


def _timed_copies(runtime: Runtime, copies: list[Copy], nbytes: int, repeats: int) -> float:
    """Median GB/s of running ``copies`` (dst, src) concurrently, one stream each."""
    streams = [runtime.create_stream(0) for _ in copies]
    start, stop = runtime.create_event(0, timing=True), runtime.create_event(0, timing=True)
    ends = [runtime.create_event(0, timing=True) for _ in copies]
    rates = []
    for _ in range(repeats + 1):
        start.record(streams[0])
        for stream, end, (dst, src) in zip(streams, ends, copies, strict=True):
            stream.wait(start)
            runtime.memcpy_async(dst, src, nbytes, stream=stream)
            end.record(stream)
        for end in ends:
            streams[0].wait(end)
        stop.record(streams[0])
        stop.synchronize()
        rates.append(len(copies) * nbytes / (start.elapsed_ms(stop) * 1e-3) / 1e9)
    for stream in streams:
        stream.close()
    for event in (start, stop, *ends):
        event.close()
    return statistics.median(rates[1:])


def probe_bandwidth(runtime: Runtime, nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Contiguous pinned ↔ device copy rates on device 0: the ceiling every transfer is measured against."""
    with HostBuffer.allocate(2 * nbytes, HostKind.PINNED, runtime=runtime) as host, \
            DeviceBuffer(2 * nbytes, 0, runtime=runtime) as dev:
        host.as_tensor().numpy()[:] = np.random.default_rng().integers(0, 256, 2 * nbytes, dtype=np.uint8)
        h, d = host.cpu_address, dev.address
        return {
            "bytes": nbytes,
            "h2d_gbps": _timed_copies(runtime, [(d, h)], nbytes, repeats),
            "d2h_gbps": _timed_copies(runtime, [(h, d)], nbytes, repeats),
            "bidirectional_gbps": _timed_copies(runtime, [(d, h), (h + nbytes, d + nbytes)], nbytes, repeats),
        }


def verdict(devices: list[dict[str, Any]], kinds: list[HostKindReport]) -> list[str]:
    lines = []
    split = [d["index"] for d in devices if not d["can_use_host_pointer_for_registered_mem"]]
    observed_split = any(not same for k in kinds for same in k.alias_equals_cpu.values())
    if split or observed_split:
        lines.append("registered host memory has separate device aliases here: kernels must use aliases "
                     "(get_device_accessible_ptr), never CPU addresses")
    else:
        lines.append("registered host memory has the same address on CPU and devices here; kvtier still resolves "
                     "aliases, so the same code is correct where they differ")
    if bool(split) != observed_split:
        lines.append("warning: CanUseHostPointerForRegisteredMem disagrees with the aliases observed")
    if not all(d["pageable_memory_access"] for d in devices):
        lines.append("pageable host memory is not device-accessible: host pools must be registered, pinned or shm")
    lines += [f"{k.kind} buffers unavailable: {k.error}" for k in kinds if not k.ok]
    return lines


def run(runtime: Runtime, probe_bytes: int, step: Step = lambda _: None, bandwidth: bool = True) -> dict[str, Any]:
    step("devices")
    devices = probe_devices(runtime)
    kinds = []
    for kind in HostKind:
        step(f"host buffer: {kind.value}")
        kinds.append(probe_host_kind(runtime, kind, probe_bytes))
    report: dict[str, Any] = {"kvtier": kvtier.__version__, "runtime": runtime.name, "devices": devices,
                              "host_buffers": [asdict(k) for k in kinds], "bandwidth": None}
    if runtime.name.startswith("emulated"):
        report["bandwidth_note"] = "not measured: the emulated runtime has no link to measure"
    elif bandwidth:
        step("contiguous copy bandwidth")
        report["bandwidth"] = probe_bandwidth(runtime, probe_bytes)
    report["verdict"] = verdict(devices, kinds)
    return report
