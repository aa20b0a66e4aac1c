"""Small load-backs as an engine issues them: time against bytes / ceiling, from 1 page up to 2048 (32k tokens).

For each geometry and page count: a load of every layer with an event per layer (``load``), the same load as one
launch (``load-1``) and as a replay of a graph captured for that page count (``graph``, ``capture_shape``), all
through the ``kernel`` backend at 2 SMs with random host slots, and ``staged`` per-layer loads with contiguous host
slots. Columns: the time ``load()`` keeps the Python thread (``queued``), the time from the call
until the load completes on the host clock (``done``, median), the link bound (bytes / the same run's contiguous H2D
ceiling), and done / bound. Where done / bound climbs as pages shrink, per-launch and per-event costs dominate.

Run on a GPU machine: ``python bench/small_loads.py [--json out.json]``. ``--runtime emulated:split --pages 1,4``
runs it on the CPU emulator as a smoke test (its kernels are Python reference code: the timings are not speeds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from _verify import described, kv_device, kv_host, poison, verify  # noqa: E402
from _verify import fill as fill_units  # noqa: E402
from transfer import GEOMETRIES, bench_runtime, fill  # noqa: E402

from kvtier.cli.doctor_probe import probe_bandwidth  # noqa: E402
from kvtier.memory import HostBuffer, HostKind  # noqa: E402
from kvtier.pools import DevicePool, HostPool  # noqa: E402
from kvtier.transfer import TransferEngine  # noqa: E402

EMULATED_NOTE = "note: {name} runs Python reference kernels on the CPU, so these timings are not speeds"
MODES = (("kernel", "load", True, "random"), ("kernel", "load-1", False, "random"),
         ("kernel", "graph", False, "random"), ("staged", "load", True, "contiguous"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", help="cuda, emulated:split or emulated:unified (default: kvtier's choice)")
    parser.add_argument("--geometry", action="append", choices=list(GEOMETRIES),
                        help="repeatable; default: llama3-8b-p16 and dsv3-mla-p16")
    parser.add_argument("--pages", default="1,4,16,32,128,512,2048", help="page counts (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats after one warm-up (default: 7)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    args.page_counts = sorted({int(x) for x in args.pages.split(",")})
    if min(args.page_counts) < 1 or args.repeats < 1:
        parser.error("--pages must be positive counts and --repeats at least 1")
    return args


def measure(loader, engine: TransferEngine, slots: np.ndarray, dst: np.ndarray, per_layer: bool, repeats: int
            ) -> tuple[float, float]:
    """Median (queued, done) seconds of ``loader.load(slots, dst)`` (an engine, or a shape it captured)."""
    queued, done = [], []
    for i in range(repeats + 1):
        engine.synchronize()
        start = time.perf_counter()
        load = loader.load(slots, dst, per_layer=per_layer) if loader is engine else loader.load(slots, dst)
        returned = time.perf_counter()
        load.wait()
        end = time.perf_counter()
        if i:
            queued.append(returned - start)
            done.append(end - start)
    return statistics.median(queued), statistics.median(done)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console(width=160)
    runtime, emulated = bench_runtime(args, console, EMULATED_NOTE)
    ceiling = probe_bandwidth(runtime, (1 << 20) if emulated else (1 << 30))["h2d_gbps"]
    console.log(f"H2D ceiling {ceiling:.1f} GB/s")
    rng = np.random.default_rng(0)
    rows = []
    for name in args.geometry or ["llama3-8b-p16", "dsv3-mla-p16"]:
        g = GEOMETRIES[name]
        most = max(args.page_counts)
        dev = DevicePool.allocate(g, most, 0, runtime=runtime)
        seed = HostBuffer.allocate(min(64 << 20, most * g.bytes_per_page), HostKind.PINNED, runtime=runtime)
        seed.as_tensor().numpy()[:] = rng.integers(1, 256, seed.nbytes, dtype=np.uint8)
        fill(runtime, dev, seed)
        seed.close()
        host = HostPool.allocate(g, "page_first_direct", pages=2 * most, runtime=runtime)
        device_pages, host_slots = kv_device(dev), kv_host(host)
        fill_units(host_slots, np.arange(host.pages))     # the loads' sources
        engines = {backend: TransferEngine(dev, host, backend=backend) for backend in ("kernel", "staged")}
        for pages in args.page_counts:
            dst = rng.choice(dev.pages, pages, replace=False)
            bound = pages * g.bytes_per_page / (ceiling * 1e9)
            shape = engines["kernel"].capture_shape(pages)
            for backend, label, per_layer, kind in MODES:
                slots = (rng.choice(host.pages, pages, replace=False) if kind == "random"
                         else np.arange(pages) + int(rng.integers(0, host.pages - pages + 1)))
                loader = shape if label == "graph" else engines[backend]
                poison(device_pages, dst)
                queued, done = measure(loader, engines[backend], slots, dst, per_layer, args.repeats)
                check = verify(f"{name} {pages} pages {backend} {label}", device_pages, dst, host_slots, slots)
                rows.append({"geometry": name, "pages": pages, "tokens": pages * g.page_size, "backend": backend,
                             "op": label, "slots": kind, "mib": pages * g.bytes_per_page / 2**20,
                             "queued_us": queued * 1e6, "done_us": done * 1e6, "bound_us": bound * 1e6,
                             "ratio": done / bound, "verified": check})
                console.log(f"{name} {pages:5d} pages {backend} {label}: queued {queued * 1e6:8.0f} µs, done "
                            f"{done * 1e6:8.0f} µs, bound {bound * 1e6:8.0f} µs ({done / bound:.2f}x), verified "
                            f"{described(check)}")
        for engine in engines.values():
            engine.close()
        host.close()
        dev.close()
    table = Table(title=f"small load-backs ({runtime.device_attributes(0).name}, H2D ceiling {ceiling:.1f} GB/s)")
    for column in ("geometry", "pages", "tokens", "MiB", "backend", "op", "slots", "queued µs", "done µs",
                   "bound µs", "done/bound", "verified"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["geometry"], str(r["pages"]), str(r["tokens"]), f"{r['mib']:.1f}", r["backend"], r["op"],
                      r["slots"], f"{r['queued_us']:.0f}", f"{r['done_us']:.0f}", f"{r['bound_us']:.0f}",
                      f"{r['ratio']:.2f}", described(r["verified"]))
    console.print(table)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"runtime": runtime.name, "h2d_ceiling_gbps": ceiling, "rows": rows}, out, indent=1)
    if emulated:
        console.print(EMULATED_NOTE.format(name=runtime.name))


if __name__ == "__main__":
    main()
