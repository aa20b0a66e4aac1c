"""Transfer benchmark: GB/s of every layout x backend x direction x SM budget, against the contiguous ceiling.

Run on a GPU machine: ``python bench/transfer.py [--quick] [--json out.json]``. Each table row is one configuration;
"% ceiling" divides by the contiguous pinned memcpy rate of the same direction measured at the start of this run.
"backup" is an all-layer D2H copy of random pages; "load" is a per-layer H2D load (one launch per layer, K and V
together); "load-1" (kernel and staged) is the same load with no per-layer events (one launch for all layers), which
separates the cost of the H2D direction from that of per-layer launches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.cli.doctor_probe import probe_bandwidth
from kvtier.kernels import KernelLauncher
from kvtier.memory import HostBuffer, HostKind
from kvtier.pools import DevicePool, HostLayout, HostPool, KVGeometry
from kvtier.runtime import get
from kvtier.transfer import TransferEngine

GEOMETRIES = {
    "llama3-8b-p16": KVGeometry.mha(32, kv_heads=8, head_dim=128, itemsize=2, page_size=16),
    "llama3-8b-p64": KVGeometry.mha(32, kv_heads=8, head_dim=128, itemsize=2, page_size=64),
    "dsv3-mla-p16": KVGeometry.mla(61, latent_bytes=576 * 2, page_size=16),
    "stress-64B-p16": KVGeometry.mla(32, latent_bytes=64, page_size=16),
}
MAX_DMA_CALLS = 40_000


@dataclass
class Row:
    geometry: str
    layout: str
    backend: str
    blocks: int
    direction: str
    gbytes: float
    gbps: float
    pct: float
    slots: str = "random"
    layer_us: float | None = None
    sm_busy_pct: float | None = None


def fill(runtime, pool: DevicePool, seed_buffer: HostBuffer) -> None:
    for layers in pool.layers:
        for address in layers:
            for offset in range(0, pool.layer_bytes, seed_buffer.nbytes):
                size = min(seed_buffer.nbytes, pool.layer_bytes - offset)
                runtime.memcpy(address.value + offset, seed_buffer.cpu_address.value, size)


def timed(runtime, engine: TransferEngine, op, repeats: int) -> float:
    """Median seconds of ``op`` (which returns a Transfer) on the engine's stream, by events."""
    times = []
    for i in range(repeats + 1):
        engine.synchronize()
        start = time.perf_counter()
        op().wait()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def relayout_seconds(engine: TransferEngine, src: np.ndarray, repeats: int) -> float:
    """The staged backend's SM time: its relayout kernels alone, all layers, one batch."""
    staging = engine.staging["d2h"]
    batch = src[:staging.capacity]
    arrays = engine.unit_arrays(batch, np.arange(batch.size, dtype=np.int64))
    stream = engine.streams["d2h"]
    times = []
    for i in range(repeats + 1):
        (src_index, dst_index), slot = engine.rings["d2h"].upload(arrays)
        stream.synchronize()
        start = time.perf_counter()
        engine.kernel("d2h", src_index, dst_index, arrays[0].size, 0, engine.geometry.layers, stream,
                      staging.table, staging.blocks)
        stream.synchronize()
        engine.rings["d2h"].fence(slot)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * src.size / batch.size


def measure(runtime, name, g, layout, backend, blocks, dev, host, ceiling, pages, repeats, console,
            slots_kind="random", launcher=None, threads=1024) -> list[Row]:
    rng = np.random.default_rng(0)
    engine = TransferEngine(dev, host, backend=backend, max_blocks=blocks, launcher=launcher, threads=threads)
    count = pages
    if backend in ("direct", "batch"):
        runs_per_page = g.tensors * g.layers * (1 if engine.plan.unit == "page" else g.page_size * engine.plan.pieces)
        count = max(1, min(pages, MAX_DMA_CALLS // runs_per_page))
    src = rng.choice(dev.pages, count, replace=False)
    if slots_kind == "random":
        slots = rng.choice(host.pages, count, replace=False)
    else:
        first = int(rng.integers(0, host.pages - count + 1))
        slots = np.arange(first, first + count)
    nbytes = count * g.bytes_per_page
    rows = []
    operations = [("backup", lambda: engine.backup(src, slots)), ("load", lambda: engine.load(slots, src))]
    if backend in ("kernel", "staged"):
        operations.append(("load-1", lambda: engine.load(slots, src, per_layer=False)))
    for direction, op in operations:
        seconds = timed(runtime, engine, op, repeats)
        gbps = nbytes / seconds / 1e9
        key = "d2h_gbps" if direction == "backup" else "h2d_gbps"
        rows.append(Row(name, layout, backend, blocks, direction, nbytes / 1e9, gbps, 100 * gbps / ceiling[key],
                        slots_kind))
        if backend == "staged":
            rows[-1].sm_busy_pct = 100 * relayout_seconds(engine, src, repeats) / seconds
    if backend == "kernel":
        one = timed(runtime, engine, lambda: engine.load(slots, src, layers=[g.layers // 2]), repeats)
        rows[1].layer_us = one * 1e6
    engine.close()
    for row in rows:
        console.log(f"{row.geometry} {row.layout} {row.backend}:{row.blocks} {row.direction} "
                    f"{row.gbps:.1f} GB/s ({row.pct:.0f}%)")
    return rows


def bidirectional(runtime, g, dev, host, ceiling, pages, blocks, backend="kernel") -> dict:
    """Backup and load at once, on their two streams; staged uses contiguous host slots."""
    rng = np.random.default_rng(1)
    engine = TransferEngine(dev, host, backend=backend, max_blocks=blocks)
    half = pages // 2
    src = rng.choice(dev.pages, 2 * half, replace=False)
    slots = rng.choice(host.pages, 2 * half, replace=False) if backend == "kernel" else np.arange(2 * half)
    times = []
    for i in range(4):
        engine.synchronize()
        start = time.perf_counter()
        backup = engine.backup(src[:half], slots[:half])
        load = engine.load(slots[half:], src[half:])
        backup.wait(), load.wait()
        if i:
            times.append(time.perf_counter() - start)
    engine.close()
    gbps = 2 * half * g.bytes_per_page / statistics.median(times) / 1e9
    return {"backend": backend, "blocks": blocks, "gbps": gbps, "pct": 100 * gbps / ceiling["bidirectional_gbps"]}


def gemm_slowdown(runtime, g, dev, host, pages, blocks_list) -> list[dict]:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def gemms(n: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            a @ b
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    gemms(5)
    out = []
    rng = np.random.default_rng(2)
    src, slots = rng.choice(dev.pages, pages, replace=False), rng.choice(host.pages, pages, replace=False)
    for blocks in blocks_list:
        engine = TransferEngine(dev, host, backend="kernel", max_blocks=blocks)
        alone, busy = [], []
        for _ in range(3):
            alone.append(gemms(15))
            transfers = [engine.load(slots, src) for _ in range(4)]
            busy.append(gemms(15))
            for t in transfers:
                t.wait()
        engine.close()
        quiet, loaded = statistics.median(alone), statistics.median(busy)
        out.append({"blocks": blocks, "gemm_ms_alone": quiet, "gemm_ms_with_copy": loaded,
                    "slowdown_pct": 100 * (loaded / quiet - 1)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--geometry", action="append", choices=list(GEOMETRIES))
    parser.add_argument("--layout", action="append", choices=[x.value for x in HostLayout])
    parser.add_argument("--backend", action="append", choices=["kernel", "staged", "direct", "batch"])
    parser.add_argument("--variants", default="", help="kernel specializations UNROLLxTHREADS to compare at 2 "
                                                       "blocks on the first geometry, e.g. 4x1024,8x512,16x512")
    parser.add_argument("--blocks", default="1,2,4,8,0", help="kernel SM budgets; 0 = one block per SM")
    parser.add_argument("--gib", type=float, default=1.0, help="bytes moved per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="llama p16 only, budgets 2 and 0")
    parser.add_argument("--json", help="write all rows here")
    parser.add_argument("--runtime", default="cuda", help="emulated:unified runs a tiny smoke test of this script")
    args = parser.parse_args()
    console = Console(width=200)
    runtime = get(args.runtime)
    sms = runtime.device_attributes(0).multiprocessors
    budgets = [int(x) or sms for x in ("2,0" if args.quick else args.blocks).split(",")]
    geometries = args.geometry or (["llama3-8b-p16"] if args.quick else list(GEOMETRIES))
    layouts = args.layout or [x.value for x in HostLayout]
    backends = args.backend or ["kernel", "staged", "direct", "batch"]
    console.log("measuring the contiguous ceiling (1 GiB each way)")
    ceiling = probe_bandwidth(runtime, min(1 << 30, max(1 << 20, int(args.gib * (1 << 30)))))
    console.log(f"ceiling: H2D {ceiling['h2d_gbps']:.1f}, D2H {ceiling['d2h_gbps']:.1f}, "
                f"both {ceiling['bidirectional_gbps']:.1f} GB/s")
    seed = HostBuffer.allocate(min(256 << 20, max(1 << 20, int(args.gib * (1 << 30)))), HostKind.PINNED,
                               runtime=runtime)
    seed.as_tensor().numpy()[:] = np.random.default_rng().integers(0, 256, seed.nbytes, dtype=np.uint8)
    rows: list[Row] = []
    extras: dict = {"ceiling": ceiling, "bidirectional": {}, "gemm": {}}
    for name in geometries:
        g = GEOMETRIES[name]
        pages = max(1, int(args.gib * (1 << 30)) // g.bytes_per_page)
        dev = DevicePool.allocate(g, 2 * pages, 0, runtime=runtime)
        fill(runtime, dev, seed)
        for layout in layouts:
            host = HostPool.allocate(g, layout, pages=2 * pages, runtime=runtime)
            for backend in backends:
                for blocks in budgets if backend == "kernel" else [0]:
                    rows += measure(runtime, name, g, layout, backend, blocks, dev, host, ceiling, pages,
                                    args.repeats, console)
                if backend in ("staged", "batch"):
                    rows += measure(runtime, name, g, layout, backend, 0, dev, host, ceiling, pages, args.repeats,
                                    console, slots_kind="contiguous")
            for variant in args.variants.split(",") if name == geometries[0] and args.variants else []:
                unroll, threads = (int(x) for x in variant.split("x"))
                launcher = KernelLauncher(runtime, mode="jit", unroll=unroll, max_threads=threads)
                for row in measure(runtime, name, g, layout, "kernel", 2, dev, host, ceiling, pages, args.repeats,
                                   console, launcher=launcher, threads=threads):
                    row.backend = f"kernel u{unroll}x{threads}"
                    rows.append(row)
            if layout == "page_first_direct":
                extras["bidirectional"][name] = [bidirectional(runtime, g, dev, host, ceiling, pages, 2, backend)
                                                 for backend in ("kernel", "staged")]
                if name == geometries[0] and not args.quick and runtime.name == "cuda":
                    extras["gemm"][name] = gemm_slowdown(runtime, g, dev, host, pages, [2, 8, 32])
            host.close()
        dev.close()
    table = Table(title=f"kvtier transfer ({runtime.device_attributes(0).name}, {sms} SMs)")
    for column in ("geometry", "layout", "backend", "slots", "SMs", "dir", "GB", "GB/s", "% ceiling", "layer µs",
                   "SM busy %"):
        table.add_column(column)
    for r in rows:
        sms_used = str(r.blocks) if r.backend.startswith("kernel") else (
            f"{sms}*" if r.backend == "staged" else "0")
        table.add_row(r.geometry, r.layout, r.backend, r.slots, sms_used, r.direction, f"{r.gbytes:.2f}",
                      f"{r.gbps:.1f}", f"{r.pct:.0f}", "" if r.layer_us is None else f"{r.layer_us:.0f}",
                      "" if r.sm_busy_pct is None else f"{r.sm_busy_pct:.1f}")
    console.print(table)
    console.print({"bidirectional": extras["bidirectional"], "gemm": extras["gemm"]})
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": [asdict(r) for r in rows], **extras}, out, indent=1)


if __name__ == "__main__":
    main()
