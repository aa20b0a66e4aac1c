"""Transfer benchmark: GB/s of every layout x backend x direction x SM budget, against the contiguous ceiling.

Run on a GPU machine: ``python bench/transfer.py [--quick] [--json out.json]``. Each table row is one configuration;
"% ceiling" divides by the contiguous pinned memcpy rate of the same direction measured at the start of this run.
"backup" is an all-layer D2H copy of random pages; "load" is a per-layer H2D load (one launch per layer, K and V
together); "load-1" (kernel and staged) is the same load with no per-layer events (one launch for all layers), which
separates the cost of the H2D direction from that of per-layer launches. Make Markdown tables from the JSON with
``python bench/report.py out.json``; see docs/benchmarking.md for the method.

``--runtime emulated:split`` (or ``emulated:unified``) runs the script on the CPU emulator as a smoke test: its
kernels are Python reference code, so the numbers are not speeds. ``--quick`` there takes well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _verify import described, kv_device, kv_host, merged, poison, verify  # noqa: E402
from _verify import fill as fill_units  # noqa: E402

from kvtier.cli.doctor_probe import probe_bandwidth  # noqa: E402
from kvtier.kernels import KernelLauncher  # noqa: E402
from kvtier.kernels.source import Specialization  # noqa: E402
from kvtier.memory import HostBuffer, HostKind  # noqa: E402
from kvtier.pools import DevicePool, HostLayout, HostPool, KVGeometry  # noqa: E402
from kvtier.runtime import ENV_VAR, get  # noqa: E402
from kvtier.transfer import TransferEngine  # noqa: E402

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
    verified: dict | None = None
    """What the check after the timed repeats compared (bench/_verify.py): pages checked, of how many, bytes."""


def fill(runtime, pool: DevicePool, seed_buffer: HostBuffer) -> None:
    """Random bytes in every layer of the pool (never time zeros)."""
    for tensor in range(pool.geometry.tensors):
        for address in pool.layer_device_addresses(tensor):
            for offset in range(0, pool.layer_bytes, seed_buffer.nbytes):
                size = min(seed_buffer.nbytes, pool.layer_bytes - offset)
                runtime.memcpy(address + offset, seed_buffer.cpu_address, size)


def timed(runtime, engine: TransferEngine, op, repeats: int) -> float:
    """Median seconds of ``op`` (which returns a Transfer), host clock from submission until it completes."""
    times = []
    for i in range(repeats + 1):
        engine.synchronize()
        start = time.perf_counter()
        op().wait()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def relayout_seconds(engine: TransferEngine, src: np.ndarray, repeats: int) -> float | None:
    """The staged backend's SM time: its relayout kernels alone, all layers, one batch, scaled to ``src``.

    kvtier has no public hook for this, so it reaches into the staged backend (``StagingArea`` and ``launch_copy``);
    when those are not where this expects them, it returns None and the SM-busy column stays empty."""
    area = getattr(getattr(engine, "_backend", None), "areas", {}).get("d2h")
    if area is None or not hasattr(area, "ring"):
        return None
    from kvtier.transfer.kernel import launch_copy
    from kvtier.transfer.plan import index_values

    batch = src[:area.capacity]
    arrays = [index_values(engine.plan.units(pages), engine.index_bytes)
              for pages in (batch, np.arange(batch.size, dtype=np.int64))]
    times = []
    for i in range(repeats + 1):
        indices, lease = area.ring.upload(arrays)
        area.stream.synchronize()
        start = time.perf_counter()
        launch_copy(area.context, "d2h", indices, arrays[0].size, [(0, engine.geometry.layers)], area.stream,
                    area.table, area.device_table, area.blocks)
        area.stream.synchronize()
        area.ring.fence(lease)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * src.size / batch.size


def measure(runtime, name, g, layout, backend, blocks, dev, host, ceiling, pages, repeats, console,
            slots_kind="random", launcher=None, threads=1024, **options) -> list[Row]:
    rng = np.random.default_rng(0)
    budget = {"max_blocks": blocks} if backend == "kernel" else {}  # the SM budget is the kernel backend's only
    engine = TransferEngine(dev, host, backend=backend, launcher=launcher, threads=threads, **budget, **options)
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
    pages, host_slots = kv_device(dev), kv_host(host)
    to_host = (host_slots, slots, pages, src)
    to_device = (pages, src, host_slots, slots)
    operations = [("backup", lambda: engine.backup(src, slots), to_host),
                  ("load", lambda: engine.load(slots, src), to_device)]
    if backend in ("kernel", "staged"):
        operations.append(("load-1", lambda: engine.load(slots, src, per_layer=False), to_device))
    label = f"{name} {layout} {backend}:{blocks} {slots_kind} slots"
    for direction, op, copy in operations:
        poison(copy[0], copy[1])
        seconds = timed(runtime, engine, op, repeats)
        check = verify(f"{label} {direction}", *copy)
        gbps = nbytes / seconds / 1e9
        key = "d2h_gbps" if direction == "backup" else "h2d_gbps"
        rows.append(Row(name, layout, backend, blocks, direction, nbytes / 1e9, gbps, 100 * gbps / ceiling[key],
                        slots_kind, verified=check))
        if backend == "staged":
            relayout = relayout_seconds(engine, src, repeats)
            rows[-1].sm_busy_pct = None if relayout is None else 100 * relayout / seconds
    if backend == "kernel":
        middle = [g.layers // 2]
        layer_pages, layer_slots = kv_device(dev, layers=middle), kv_host(host, layers=middle)
        poison(layer_pages, src)
        one = timed(runtime, engine, lambda: engine.load(slots, src, layers=middle), repeats)
        rows[1].layer_us = one * 1e6
        rows[1].verified = merged(rows[1].verified, verify(f"{label} load of layer {middle[0]}", layer_pages, src,
                                                           layer_slots, slots))
    engine.close()
    for row in rows:
        console.log(f"{row.geometry} {row.layout} {row.backend}:{row.blocks} {row.direction} "
                    f"{row.gbps:.1f} GB/s ({row.pct:.0f}%), verified {described(row.verified)}")
    return rows


def variant_launcher(runtime, variant: str) -> tuple[KernelLauncher, dict]:
    """The launcher for a kernel specialization ``UNROLLxTHREADS[wWIDTH][+cached][+noskip][+bulk]`` (see
    ``--variants``) and the TransferEngine options that go with it."""
    shape_width, *flags = variant.split("+")
    shape, _, width = shape_width.partition("w")
    unroll, threads = (int(x) for x in shape.split("x"))
    spec = Specialization(unroll, threads, streaming="cached" not in flags, skip_absent="noskip" not in flags)
    launcher = KernelLauncher(runtime, mode=None if spec.prebuilt else "jit", unroll=unroll, max_threads=threads,
                              max_width=int(width or 16), streaming=spec.streaming, skip_absent=spec.skip_absent,
                              bulk="bulk" in flags)
    options: dict = {"threads": threads, "backup_threads": threads}  # the variant's blocks both ways
    if "bulk" in flags:
        options["layer_signals"] = False  # bulk copies do not count layers
    return launcher, options


def bidirectional(runtime, g, dev, host, ceiling, pages, blocks, backend="kernel", label="") -> dict:
    """Backup and load at once, on their two streams; staged uses contiguous host slots."""
    rng = np.random.default_rng(1)
    engine = TransferEngine(dev, host, backend=backend, max_blocks=blocks)
    half = max(1, pages // 2)
    src = rng.choice(dev.pages, 2 * half, replace=False)
    slots = rng.choice(host.pages, 2 * half, replace=False) if backend == "kernel" else np.arange(2 * half)
    device_pages, host_slots = kv_device(dev), kv_host(host)
    fill_units(host_slots, slots[half:])                # the load's source
    poison(host_slots, slots[:half])
    poison(device_pages, src[half:])
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
    what = f"{label} both ways, {backend}:{blocks}"
    check = merged(verify(f"{what}, backup", host_slots, slots[:half], device_pages, src[:half]),
                   verify(f"{what}, load", device_pages, src[half:], host_slots, slots[half:]))
    gbps = 2 * half * g.bytes_per_page / statistics.median(times) / 1e9
    return {"backend": backend, "blocks": blocks, "gbps": gbps, "pct": 100 * gbps / ceiling["bidirectional_gbps"],
            "verified": check}


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
    device_pages, host_slots = kv_device(dev), kv_host(host)
    fill_units(host_slots, slots)
    for blocks in blocks_list:
        engine = TransferEngine(dev, host, backend="kernel", max_blocks=blocks)
        poison(device_pages, src)
        alone, busy = [], []
        for _ in range(3):
            alone.append(gemms(15))
            transfers = [engine.load(slots, src) for _ in range(4)]
            busy.append(gemms(15))
            for t in transfers:
                t.wait()
        engine.close()
        check = verify(f"loads beside GEMMs, kernel:{blocks}", device_pages, src, host_slots, slots)
        quiet, loaded = statistics.median(alone), statistics.median(busy)
        out.append({"blocks": blocks, "gemm_ms_alone": quiet, "gemm_ms_with_copy": loaded,
                    "slowdown_pct": 100 * (loaded / quiet - 1), "verified": check})
    return out


QUICK_EMULATED_LAYOUT = {"kernel": "page_first", "staged": "page_first_direct", "direct": "layer_first",
                         "batch": "page_head"}
EMULATED_NOTE = ("note: {name} runs Python reference kernels on the CPU, so its GB/s are not speeds: this run only "
                 "checks that the benchmark works (sizes and repeats are cut down unless given)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", action="append", choices=list(GEOMETRIES), help="repeatable; default: all")
    parser.add_argument("--layout", action="append", choices=[x.value for x in HostLayout],
                        help="host layout, repeatable; default: all")
    parser.add_argument("--backend", action="append", choices=["kernel", "staged", "direct", "batch"],
                        help="io backend, repeatable; default: all")
    parser.add_argument("--variants", default="",
                        help="kernel specializations UNROLLxTHREADS[wWIDTH][+cached][+noskip][+bulk] to compare "
                             "at every --blocks budget on the first geometry, e.g. 4x1024,8x1024w8,8x1024+cached,"
                             "8x1024+bulk (WIDTH caps the bytes per access, +cached drops the streaming cache hints, "
                             "+noskip the test for absent units, +bulk copies through the TMA, sm_90+, per-layer "
                             "loads without layer counters; the shipped 8x1024 runs the prebuilt kernels, others "
                             "JIT; default: none)")
    parser.add_argument("--blocks", default="1,2,4,8,0", help="kernel SM budgets; 0 = one block per SM "
                                                              "(default: %(default)s)")
    parser.add_argument("--gib", type=float, help="GiB moved per measurement (default: 1; 1/64 on an emulated "
                                                  "runtime)")
    parser.add_argument("--repeats", type=int, help="timed repeats after one warm-up, median reported (default: 3; "
                                                    "1 on an emulated runtime)")
    parser.add_argument("--quick", action="store_true",
                        help="llama p16 only, budgets 2 and 0; on an emulated runtime also budget 2 only and one "
                             "host layout per backend")
    parser.add_argument("--json", help="write all rows here (for bench/report.py)")
    parser.add_argument("--runtime", default=os.environ.get(ENV_VAR) or "cuda",
                        help=f"cuda, emulated:split or emulated:unified (default: ${ENV_VAR}, else cuda); an "
                             "emulated runtime makes this a smoke test of the script")
    args = parser.parse_args(argv)
    if args.gib is not None and args.gib <= 0:
        parser.error(f"--gib must be positive, got {args.gib}")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def layout_plan(args: argparse.Namespace, emulated: bool) -> list[tuple[str, list[str]]]:
    """(host layout, backends measured on it) pairs: every backend on every layout, except a quick emulated run
    (with no --layout), which gives each backend one layout so all four layouts are still exercised once."""
    backends = args.backend or ["kernel", "staged", "direct", "batch"]
    if args.layout or not (args.quick and emulated):
        return [(layout, backends) for layout in args.layout or [x.value for x in HostLayout]]
    return [(layout, [b for b in backends if QUICK_EMULATED_LAYOUT[b] == layout]) for layout in
            [x.value for x in HostLayout] if any(QUICK_EMULATED_LAYOUT[b] == layout for b in backends)]


def run_layout(runtime, args, name, g, layout, backends, budgets, dev, pages, ceiling, extras, first, console):
    rows: list[Row] = []
    host = HostPool.allocate(g, layout, pages=2 * pages, runtime=runtime)
    for backend in backends:
        for blocks in budgets if backend == "kernel" else [0]:
            rows += measure(runtime, name, g, layout, backend, blocks, dev, host, ceiling, pages, args.repeats,
                            console)
        if backend in ("staged", "batch"):
            rows += measure(runtime, name, g, layout, backend, 0, dev, host, ceiling, pages, args.repeats,
                            console, slots_kind="contiguous")
    for variant in args.variants.split(",") if first and args.variants else []:
        launcher, options = variant_launcher(runtime, variant)
        for blocks in budgets:
            for row in measure(runtime, name, g, layout, "kernel", blocks, dev, host, ceiling, pages, args.repeats,
                               console, launcher=launcher, **options):
                row.backend = f"kernel {variant}"
                rows.append(row)
    if layout == "page_first_direct":
        extras["bidirectional"][name] = [bidirectional(runtime, g, dev, host, ceiling, pages, 2, backend,
                                                       f"{name} {layout}") for backend in ("kernel", "staged")]
        if first and not args.quick and runtime.name == "cuda":
            extras["gemm"][name] = gemm_slowdown(runtime, g, dev, host, pages, [2, 8, 32])
    host.close()
    return rows


def render(runtime, sms: int, rows: list[Row], extras: dict, console: Console) -> None:
    table = Table(title=f"kvtier transfer ({runtime.device_attributes(0).name}, {sms} SMs)")
    for column in ("geometry", "layout", "backend", "slots", "SMs", "dir", "GB", "GB/s", "% ceiling", "layer µs",
                   "SM busy %", "verified"):
        table.add_column(column)
    for r in rows:
        sms_used = str(r.blocks) if r.backend.startswith("kernel") else (
            f"{sms}*" if r.backend == "staged" else "0")
        table.add_row(r.geometry, r.layout, r.backend, r.slots, sms_used, r.direction, f"{r.gbytes:.2f}",
                      f"{r.gbps:.1f}", f"{r.pct:.0f}", "" if r.layer_us is None else f"{r.layer_us:.0f}",
                      "" if r.sm_busy_pct is None else f"{r.sm_busy_pct:.1f}", described(r.verified))
    console.print(table)
    console.print({"bidirectional": extras["bidirectional"], "gemm": extras["gemm"]})


def bench_runtime(args: argparse.Namespace, console: Console, note: str, emulated_gib: float | None = None):
    """The runtime a benchmark runs on (``args.runtime``), with the emulator's note printed when it is emulated, and
    ``--gib`` / ``--repeats`` defaults filled in (cut down on the emulator) where the script has them."""
    runtime = get(args.runtime)
    emulated = runtime.name.startswith("emulated")
    if emulated:
        console.print(note.format(name=runtime.name))
    if emulated_gib is not None:
        args.gib = args.gib if args.gib is not None else (emulated_gib if emulated else 1.0)
        args.repeats = args.repeats if args.repeats is not None else (1 if emulated else 3)
    return runtime, emulated


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console(width=200)
    runtime, emulated = bench_runtime(args, console, EMULATED_NOTE, emulated_gib=1 / 64)
    sms = runtime.device_attributes(0).multiprocessors
    blocks = ("2" if emulated else "2,0") if args.quick else args.blocks
    budgets = list(dict.fromkeys(int(x) or sms for x in blocks.split(",")))
    geometries = args.geometry or (["llama3-8b-p16"] if args.quick else list(GEOMETRIES))
    size = int(args.gib * (1 << 30))
    probe = min(1 << 30, max(1 << 20, size))
    console.log(f"measuring the contiguous ceiling ({probe / (1 << 20):.0f} MiB each way)")
    ceiling = probe_bandwidth(runtime, probe)
    console.log(f"ceiling: H2D {ceiling['h2d_gbps']:.1f}, D2H {ceiling['d2h_gbps']:.1f}, "
                f"both {ceiling['bidirectional_gbps']:.1f} GB/s")
    seed = HostBuffer.allocate(min(256 << 20, max(1 << 20, size)), HostKind.PINNED, runtime=runtime)
    seed.as_tensor().numpy()[:] = np.random.default_rng().integers(0, 256, seed.nbytes, dtype=np.uint8)
    rows: list[Row] = []
    extras: dict = {"runtime": runtime.name, "ceiling": ceiling, "bidirectional": {}, "gemm": {}}
    for name in geometries:
        g = GEOMETRIES[name]
        pages = max(1, size // g.bytes_per_page)
        dev = DevicePool.allocate(g, 2 * pages, 0, runtime=runtime)
        fill(runtime, dev, seed)
        for layout, backends in layout_plan(args, emulated):
            rows += run_layout(runtime, args, name, g, layout, backends, budgets, dev, pages, ceiling, extras,
                               name == geometries[0], console)
        dev.close()
    seed.close()
    render(runtime, sms, rows, extras, console)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": [asdict(r) for r in rows], **extras}, out, indent=1)
    if emulated:
        console.print(EMULATED_NOTE.format(name=runtime.name))


if __name__ == "__main__":
    main()
