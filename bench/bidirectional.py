"""Both directions at once: a per-layer load-back beside an all-layer backup, against the same run's both-ways ceiling.

An engine that serves a prefix hit while it writes a fresh prompt through moves KV both ways at once, so the PCIe link
is full-duplex busy. For each host layout, pair of backends (the load's and the backup's), and host slot order
(random or contiguous), this queues a backup of N pages and a per-layer load of N other pages together and reports:
``both`` GB/s = 2 N pages / time until both are done, its share of the contiguous both-ways memcpy ceiling (measured
at the start and at the end of the run, the higher counts: a cold machine's first probe can read 25% low), and the
time each direction took on its own clock (``load ms``, ``backup ms``, polled), and when both calls had returned
(``queued ms``: queuing is host work on the caller's thread, so a slow queue delays the second direction). With
``--gemm``, a bf16 8192³ GEMM runs on the default stream meanwhile and its slowdown against the GEMM alone is reported
(a serving engine computes while the cache moves pages).

``--diagnose`` adds the rows that explain a kernel-path loss: a 2-SM kernel load (or backup) beside a plain contiguous
DMA the other way, at several SM budgets. If the kernel's rate recovers with more SMs, its loss beside a DMA comes
from longer read latency with a fixed number of bytes in flight per SM (Little's law), not from the link.

Run on a GPU machine: ``python bench/bidirectional.py [--gemm] [--diagnose] [--json out.json]``. ``--runtime
emulated:split`` runs it on the CPU emulator as a smoke test (Python reference kernels: the numbers are not speeds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from _options import name_list  # noqa: E402
from _verify import described, flat_device, flat_host, kv_device, kv_host, merged, poison, verify  # noqa: E402
from _verify import fill as fill_units  # noqa: E402
from transfer import GEOMETRIES, bench_runtime, fill  # noqa: E402

from kvtier.cli.doctor_probe import probe_bandwidth  # noqa: E402
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind  # noqa: E402
from kvtier.pools import DevicePool, HostPool  # noqa: E402
from kvtier.transfer import TransferEngine  # noqa: E402

PAIRS = ("kernel/kernel", "staged/staged", "kernel/staged", "staged/kernel")
EMULATED_NOTE = "note: {name} runs Python reference kernels on the CPU, so these numbers are not speeds"


@dataclass
class Row:
    geometry: str
    layout: str
    load: str
    backup: str
    slots: str
    blocks: int
    queue: str
    gbytes_each_way: float
    both_gbps: float
    pct: float
    load_ms: float
    backup_ms: float
    queued_ms: float
    gemm_slowdown_pct: float | None = None
    verified: dict | None = None
    """What the check after the timed repeats compared, both directions (bench/_verify.py)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", help="cuda, emulated:split or emulated:unified (default: kvtier's choice)")
    parser.add_argument("--geometry", action="append", choices=list(GEOMETRIES), help="default: llama3-8b-p16")
    parser.add_argument("--layout", action="append", choices=["page_first", "page_first_direct", "layer_first"],
                        help="host layout, repeatable (default: all three)")
    parser.add_argument("--pairs", default=",".join(PAIRS), type=name_list(PAIRS, "LOAD/BACKUP pair"),
                        help="LOAD/BACKUP backend pairs, comma-separated (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=2, help="the kernel backend's SM budget (default: 2)")
    parser.add_argument("--gib", type=float, help="GiB each way (default: 1; 1/256 on an emulated runtime)")
    parser.add_argument("--repeats", type=int, help="timed repeats after one warm-up (default: 3; 1 emulated)")
    parser.add_argument("--gemm", action="store_true", help="also measure a concurrent bf16 GEMM's slowdown (cuda)")
    parser.add_argument("--diagnose", action="store_true",
                        help="kernel copies beside a contiguous DMA the other way, at SM budgets 2, 4, 8 and 16")
    parser.add_argument("--pieces", action="store_true",
                        help="also time plain memcpys cut into pieces, host offsets in order or shuffled, one way and "
                             "both ways (isolates what random host slots cost the staged backend)")
    parser.add_argument("--queue", choices=["one", "two", "both"], default="one",
                        help="one: one thread queues the backup, then the load; two: two threads queue them at once, "
                             "one engine per direction (as an engine with a load thread and a write-back thread "
                             "does); both: each row both ways (default: %(default)s)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    args.pair_list = [tuple(p.split("/")) for p in args.pairs]
    if (args.gib is not None and args.gib <= 0) or (args.repeats is not None and args.repeats < 1):
        parser.error("--gib must be positive and --repeats at least 1")
    return args


def run_both(engines: dict[str, TransferEngine], src: np.ndarray, slots: np.ndarray, half: int, extra=None,
             threads: bool = False) -> tuple[float, float, float, float]:
    """Seconds until (load done, backup done, both done, both queued) for one backup of ``half`` pages beside one load
    of ``half`` others, polled on the host clock. ``extra`` (optional) runs right after both are queued, e.g. GEMMs; it
    must end before either transfer does (checked: otherwise it did not run beside both directions)."""
    for engine in engines.values():
        engine.synchronize()
    calls = {"backup": lambda: engines["backup"].backup(src[:half], slots[:half]),
             "load": lambda: engines["load"].load(slots[half:], src[half:])}
    start = time.perf_counter()
    if not threads:
        transfers = {name: call() for name, call in calls.items()}
    else:
        with ThreadPoolExecutor(2) as pool:
            futures = {name: pool.submit(call) for name, call in calls.items()}
            transfers = {name: future.result() for name, future in futures.items()}
    backup, load = transfers["backup"], transfers["load"]
    queued = time.perf_counter() - start
    if extra is not None:
        extra()
        if load.done() or backup.done():
            raise Outlasted
    ends: dict[str, float] = {}
    while len(ends) < 2:
        for name, transfer in (("load", load), ("backup", backup)):
            if name not in ends and transfer.done():
                ends[name] = time.perf_counter() - start
    return ends["load"], ends["backup"], max(ends.values()), queued


class Outlasted(Exception):
    """The concurrent work ended after a transfer did, so part of it ran beside only one direction or none."""


def median_both(engines, src, slots, half, repeats, threads) -> tuple[float, float, float, float]:
    runs = [run_both(engines, src, slots, half, threads=threads) for _ in range(repeats + 1)][1:]
    return tuple(statistics.median(r[i] for r in runs) for i in range(4))  # type: ignore[return-value]


class Gemm:
    """A bf16 8192³ GEMM on torch's current stream: its time alone and its time while ``busy()`` runs."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.ms(5)
        self.alone = statistics.median(self.ms(10) for _ in range(3))

    def ms(self, n: int) -> float:
        start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            self.a @ self.b
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    def slowdown_pct(self, engines, src, slots, half, both_seconds: float, threads: bool) -> float | None:
        """GEMMs while a backup and a load run. Copy kernels hold SMs, so the GEMMs slow down and may outlast the
        transfers: start with as many as fill a quarter of ``both_seconds`` (the pair's time alone) and halve the
        count until both directions run for the whole of the GEMMs. None when even one GEMM outlasts them."""
        n = max(1, int(0.25 * both_seconds * 1e3 / self.alone))
        while n:
            times: list[float] = []
            try:
                for _ in range(3):
                    box: list[float] = []
                    run_both(engines, src, slots, half, extra=lambda box=box, n=n: box.append(self.ms(n)),
                             threads=threads)
                    times.append(box[0])
            except Outlasted:
                n //= 2
                continue
            return 100 * (statistics.median(times) / self.alone - 1)
        return None


def engines_for(dev, host, load: str, backup: str, blocks: int, queue: str) -> dict[str, TransferEngine]:
    """One engine for both directions when one thread queues both with one backend; else one engine per direction,
    each queued from its own thread (an engine takes one call at a time)."""
    def make(backend: str) -> TransferEngine:
        return TransferEngine(dev, host, backend=backend, **({"max_blocks": blocks} if backend == "kernel" else {}))

    if load == backup and queue == "one":
        engine = make(load)
        return {"load": engine, "backup": engine}
    return {"load": make(load), "backup": make(backup)}


def close_all(engines: dict[str, TransferEngine]) -> None:
    for engine in set(engines.values()):
        engine.close()


def measure_layout(runtime, name, g, layout, dev, pages, args, ceiling, gemm, console) -> list[Row]:
    rows = []
    host = HostPool.allocate(g, layout, pages=2 * pages, runtime=runtime)
    device_pages, host_slots = kv_device(dev), kv_host(host)
    fill_units(host_slots, np.arange(host.pages))       # the loads' sources
    rng = np.random.default_rng(0)
    src = rng.choice(dev.pages, 2 * pages, replace=False)
    orders = {"random": rng.choice(host.pages, 2 * pages, replace=False), "contiguous": np.arange(2 * pages)}
    nbytes = pages * g.bytes_per_page
    for load, backup in args.pair_list:
        for queue in ("one", "two") if args.queue == "both" else (args.queue,):
            engines = engines_for(dev, host, load, backup, args.blocks, queue)
            threads = queue == "two"
            try:
                for kind, slots in orders.items():
                    poison(host_slots, slots[:pages])
                    poison(device_pages, src[pages:])
                    t_load, t_backup, t_both, t_queued = median_both(engines, src, slots, pages, args.repeats, threads)
                    what = f"{name} {layout} {load}/{backup} {kind} slots, {queue} thread{'s' * threads}"
                    check = merged(verify(f"{what}, backup", host_slots, slots[:pages], device_pages, src[:pages]),
                                   verify(f"{what}, load", device_pages, src[pages:], host_slots, slots[pages:]))
                    gbps = 2 * nbytes / t_both / 1e9
                    row = Row(name, layout, load, backup, kind, args.blocks, f"{queue} thread{'s' * threads}",
                              nbytes / 1e9, gbps, 100 * gbps / ceiling["bidirectional_gbps"], 1e3 * t_load,
                              1e3 * t_backup, 1e3 * t_queued, verified=check)
                    if gemm is not None and kind == "random":
                        row.gemm_slowdown_pct = gemm.slowdown_pct(engines, src, slots, pages, t_both, threads)
                    rows.append(row)
                    console.log(f"{name} {layout} {load}/{backup} {kind} {row.queue}: {gbps:.1f} GB/s ({row.pct:.0f}%),"
                                f" load {row.load_ms:.1f} ms, backup {row.backup_ms:.1f} ms, queued "
                                f"{row.queued_ms:.1f} ms, verified {described(check)}"
                                + ("" if row.gemm_slowdown_pct is None else f", GEMM +{row.gemm_slowdown_pct:.1f}%"))
            finally:
                close_all(engines)
    host.close()
    return rows


def diagnose(runtime, g, dev, pages, args, console) -> list[dict]:
    """A kernel load (backup) alone and beside a contiguous DMA the other way, per SM budget: GB/s of the kernel."""
    host = HostPool.allocate(g, "page_first", pages=pages, runtime=runtime)
    rng = np.random.default_rng(3)
    src, slots = rng.choice(dev.pages, pages, replace=False), rng.choice(host.pages, pages, replace=False)
    nbytes = pages * g.bytes_per_page
    device_pages, host_slots = kv_device(dev), kv_host(host)
    fill_units(host_slots, slots)
    pinned = HostBuffer.allocate(nbytes, HostKind.PINNED, runtime=runtime)
    scratch = DeviceBuffer(nbytes, 0, runtime=runtime)
    stream = runtime.create_stream(0)
    out = []
    try:
        for blocks in (2, 4, 8, 16):
            engine = TransferEngine(dev, host, backend="kernel", max_blocks=blocks)
            for direction in ("load", "backup"):
                def op(engine=engine, direction=direction):
                    return engine.load(slots, src) if direction == "load" else engine.backup(src, slots)
                copy = (device_pages, src, host_slots, slots) if direction == "load" else (host_slots, slots,
                                                                                           device_pages, src)
                poison(copy[0], copy[1])
                alone, beside = [], []
                for _ in range(args.repeats + 1):
                    engine.synchronize()
                    start = time.perf_counter()
                    op().wait()
                    alone.append(time.perf_counter() - start)
                    stream.synchronize()
                    if direction == "load":  # the DMA goes the other way, device to host
                        runtime.memcpy_async(pinned.cpu_address, scratch.address, nbytes, stream=stream)
                    else:
                        runtime.memcpy_async(scratch.address, pinned.cpu_address, nbytes, stream=stream)
                    start = time.perf_counter()
                    op().wait()
                    beside.append(time.perf_counter() - start)
                    stream.synchronize()
                check = verify(f"diagnose {g.layers}-layer kernel:{blocks} {direction}", *copy)
                rates = [nbytes / statistics.median(t[1:]) / 1e9 for t in (alone, beside)]
                out.append({"blocks": blocks, "direction": direction, "alone_gbps": rates[0],
                            "beside_dma_gbps": rates[1], "loss_pct": 100 * (1 - rates[1] / rates[0]),
                            "verified": check})
                console.log(f"diagnose {blocks} SMs {direction}: alone {rates[0]:.1f} GB/s, beside a DMA "
                            f"{rates[1]:.1f} GB/s")
            engine.close()
    finally:
        stream.close()
        scratch.close()
        pinned.close()
        host.close()
    return out


PIECES = (32 << 10, 256 << 10, 1 << 20, 4 << 20, 0)


def dma_pieces(runtime, nbytes: int, repeats: int, console) -> list[dict]:
    """Contiguous memcpys cut into pieces of one size, one call each (as the staged backend queues them), host offsets
    in order or shuffled; H2D alone, D2H alone and both at once (calls interleaved), wall time from the first call
    to both streams done. Piece size 0 means one copy."""
    streams = [runtime.create_stream(0), runtime.create_stream(0)]
    out = []
    with HostBuffer.allocate(2 * nbytes, HostKind.PINNED, runtime=runtime) as host, \
            DeviceBuffer(2 * nbytes, 0, runtime=runtime) as dev:
        h, d = host.cpu_address, dev.address
        rng = np.random.default_rng(5)
        fill_units(flat_host(host, 0, nbytes), [0])                      # the H2D source
        fill_units(flat_device(runtime, 0, d + nbytes, nbytes), [0])     # the D2H source
        try:
            for piece in (p for p in PIECES if p < nbytes):
                size = piece or nbytes
                count = nbytes // size
                for order in ("in order", "shuffled") if count > 1 else ("in order",):
                    host_at = np.arange(count) * size
                    if order == "shuffled":
                        host_at = rng.permutation(host_at)
                    calls = {"H2D": [(d + i * size, h + int(o)) for i, o in enumerate(host_at)],
                             "D2H": [(h + nbytes + int(o), d + nbytes + i * size) for i, o in enumerate(host_at)]}
                    pieces, at = np.arange(count), host_at // size
                    copies = {"H2D": (flat_device(runtime, 0, d, size), pieces, flat_host(host, 0, size), at),
                              "D2H": (flat_host(host, nbytes, size), at, flat_device(runtime, 0, d + nbytes, size),
                                      pieces)}
                    for mode in ("H2D", "D2H", "both"):
                        lanes = [calls["H2D"], calls["D2H"]] if mode == "both" else [calls[mode]]
                        checked = [copies[m] for m in (("H2D", "D2H") if mode == "both" else (mode,))]
                        for copy in checked:
                            poison(copy[0], copy[1])
                        times = []
                        for _ in range(repeats + 1):
                            for stream in streams:
                                stream.synchronize()
                            start = time.perf_counter()
                            for pair in zip(*lanes, strict=True):
                                for stream, (dst, src) in zip(streams, pair, strict=False):
                                    runtime.memcpy_async(dst, src, size, stream=stream)
                            for stream in streams:
                                stream.synchronize()
                            times.append(time.perf_counter() - start)
                        gbps = len(lanes) * nbytes / statistics.median(times[1:]) / 1e9
                        check = merged(*(verify(f"pieces of {size} bytes, {order}, {mode}", *copy)
                                         for copy in checked))
                        out.append({"piece_bytes": size, "order": order, "mode": mode, "gbps": gbps,
                                    "verified": check})
                        console.log(f"pieces of {size >> 10} KiB {order} {mode}: {gbps:.1f} GB/s")
        finally:
            for stream in streams:
                stream.close()
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console(width=200)
    runtime, emulated = bench_runtime(args, console, EMULATED_NOTE, emulated_gib=1 / 256)
    size = int(args.gib * (1 << 30))
    probe = min(1 << 30, max(1 << 20, size))
    ceiling = probe_bandwidth(runtime, probe)
    console.log(f"ceiling: H2D {ceiling['h2d_gbps']:.1f}, D2H {ceiling['d2h_gbps']:.1f}, "
                f"both {ceiling['bidirectional_gbps']:.1f} GB/s")
    gemm = Gemm() if args.gemm and runtime.name == "cuda" else None
    if gemm is not None:
        console.log(f"bf16 8192³ GEMM alone: {gemm.alone:.3f} ms")
    seed = HostBuffer.allocate(min(256 << 20, max(1 << 20, size)), HostKind.PINNED, runtime=runtime)
    seed.as_tensor().numpy()[:] = np.random.default_rng().integers(0, 256, seed.nbytes, dtype=np.uint8)
    rows: list[Row] = []
    diagnosis: dict[str, list[dict]] = {}
    for name in args.geometry or ["llama3-8b-p16"]:
        g = GEOMETRIES[name]
        pages = max(1, size // g.bytes_per_page)
        dev = DevicePool.allocate(g, 2 * pages, 0, runtime=runtime)
        fill(runtime, dev, seed)
        for layout in args.layout or ["page_first", "page_first_direct", "layer_first"]:
            rows += measure_layout(runtime, name, g, layout, dev, pages, args, ceiling, gemm, console)
        if args.diagnose:
            diagnosis[name] = diagnose(runtime, g, dev, pages, args, console)
        dev.close()
    seed.close()
    pieces = dma_pieces(runtime, probe, args.repeats or 3, console) if args.pieces else []
    after = probe_bandwidth(runtime, probe)
    console.log(f"ceiling again after the runs: H2D {after['h2d_gbps']:.1f}, D2H {after['d2h_gbps']:.1f}, "
                f"both {after['bidirectional_gbps']:.1f} GB/s; the higher of the two counts")
    if after["bidirectional_gbps"] > ceiling["bidirectional_gbps"]:
        for row in rows:
            row.pct = 100 * row.both_gbps / after["bidirectional_gbps"]
    ceiling = {key: max(ceiling[key], after[key]) for key in ceiling}
    table = Table(title=f"both directions at once ({runtime.device_attributes(0).name}; both-ways ceiling "
                        f"{ceiling['bidirectional_gbps']:.1f} GB/s)")
    for column in ("geometry", "layout", "load", "backup", "slots", "SMs", "queued by", "GB each way", "both GB/s",
                   "% ceiling", "load ms", "backup ms", "queued ms", "GEMM slowdown %", "verified"):
        table.add_column(column)
    for r in rows:
        table.add_row(r.geometry, r.layout, r.load, r.backup, r.slots, str(r.blocks), r.queue,
                      f"{r.gbytes_each_way:.2f}", f"{r.both_gbps:.1f}", f"{r.pct:.0f}", f"{r.load_ms:.1f}",
                      f"{r.backup_ms:.1f}", f"{r.queued_ms:.1f}",
                      "" if r.gemm_slowdown_pct is None else f"{r.gemm_slowdown_pct:.1f}", described(r.verified))
    console.print(table)
    for name, results in diagnosis.items():
        console.print(f"kernel copies beside a contiguous DMA the other way ({name}):")
        for d in results:
            console.print(f"  {d['blocks']:>2} SMs {d['direction']:<6} alone {d['alone_gbps']:.1f} GB/s, beside "
                          f"{d['beside_dma_gbps']:.1f} GB/s ({d['loss_pct']:.0f}% lost)")
    if pieces:
        table = Table(title="plain memcpys in pieces, one call each (GB/s; % of the same direction's ceiling)")
        for column in ("piece", "host offsets", "H2D", "D2H", "both"):
            table.add_column(column)
        keys = {"H2D": "h2d_gbps", "D2H": "d2h_gbps", "both": "bidirectional_gbps"}
        for (size, order) in dict.fromkeys((p["piece_bytes"], p["order"]) for p in pieces):
            cells = {p["mode"]: f"{p['gbps']:.1f} ({100 * p['gbps'] / ceiling[keys[p['mode']]]:.0f}%)"
                     for p in pieces if (p["piece_bytes"], p["order"]) == (size, order)}
            table.add_row(f"{size >> 10} KiB", order, cells["H2D"], cells["D2H"], cells["both"])
        console.print(table)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"runtime": runtime.name, "ceiling": ceiling, "rows": [asdict(r) for r in rows], "pieces": pieces,
                       "diagnosis": diagnosis, "gemm_alone_ms": None if gemm is None else gemm.alone}, out, indent=1)
    if emulated:
        console.print(EMULATED_NOTE.format(name=runtime.name))


if __name__ == "__main__":
    main()
