"""Model-family transfer benchmark: Mamba state, DSA indexer, DeepSeek-V4 pools and HiSparse swap-in latency.

Run on a GPU machine: ``python bench/families.py [--json out.json]``. Rows: GB/s of each family's all-layer backup
(D2H) and per-layer load (H2D, one event per layer) of random units, at 1, 2 and 4 blocks (the SM budget), against
the contiguous pinned memcpy ceiling measured at the start of the same run ("% ceiling"). DeepSeek-V4 C4 KV also moves
random single tokens (two regions each: 576-byte values and 8-byte scales). The swap-in table gives the latency of one
HiSparse step for one layer: top-k 2048 of a 64k-token context, a hot buffer of 4096 + 1 rows, with 0% (fast path /
all hits), 20% and 100% of the top-k missing, timed with device events over many graph replays. "load-1" is the
load with no per-layer events (runs of layers in one launch): the gap to "load" is the cost of per-layer launches.

``--runtime emulated:split`` runs a small version on the CPU emulator as a smoke test (numbers are not speeds).
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
from _verify import described, family_device, family_host, kv_device, kv_host, poison, verify  # noqa: E402
from _verify import fill as fill_units  # noqa: E402

from kvtier.cli.doctor_probe import probe_bandwidth  # noqa: E402
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind  # noqa: E402
from kvtier.pools import DevicePool, HostPool, KVGeometry  # noqa: E402
from kvtier.pools.paged_rows import PagedRowDevicePool, PagedRowGeometry, PagedRowHostPool  # noqa: E402
from kvtier.pools.state import StateDevicePool, StateGeometry, StateHostPool  # noqa: E402
from kvtier.runtime import ENV_VAR, get  # noqa: E402
from kvtier.transfer.family import FamilyEngine  # noqa: E402
from kvtier.transfer.hisparse import HotBuffer  # noqa: E402


def families(small: bool) -> dict:
    layers = 4 if small else 61
    return {
        "mamba-qwen3next (48K conv bf16 + 2M ssm fp32)": (
            "state", StateGeometry.mamba(4 if small else 36, (64, 3) if small else (8192, 3),
                                         (2, 16, 16) if small else (32, 128, 128)), "page_first"),
        "mamba-small-rows (fp16, 1.5K+12K)": (
            "state", StateGeometry.mamba(4 if small else 36, (256, 3), (6, 16, 32), conv_dtype="float16",
                                         temporal_dtype="float16"), "page_first_direct"),
        "dsv4-compress-state (16K fp32)": ("state", StateGeometry.compress_state(layers, (4, 1024)), "page_first"),
        "dsa-indexer p64 (132 B/token)": ("rows", PagedRowGeometry.dsa_indexer(layers), "page_first"),
        "dsv4-c4-kv p64 (584 B/token)": ("rows", PagedRowGeometry.dsv4_c4_kv(layers), "layer_first"),
        "dsv4-c4-indexer-fp4 p64 (68 B/token)": ("rows", PagedRowGeometry.dsv4_c4_indexer(layers), "page_first"),
        "dsv4-c128 p64": ("rows", PagedRowGeometry.dsv4_c128(layers), "page_first"),
    }


@dataclass
class Row:
    family: str
    unit: str
    direction: str
    blocks: int
    gbytes: float
    gbps: float
    pct: float
    verified: dict | None = None
    """What the check after the timed repeats compared (bench/_verify.py)."""


def median_seconds(op, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        op().wait()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def fill_host(host) -> None:
    view = host.buffer.as_tensor().numpy()
    view[:] = np.random.default_rng().integers(1, 256, view.size, dtype=np.uint8)
    del view


def measure_family(runtime, name, kind, g, layout, size, blocks, ceiling, repeats) -> list[Row]:
    rng = np.random.default_rng(0)
    unit_bytes = g.slot_bytes if kind == "state" else g.bytes_per_page
    count = max(2, size // unit_bytes)
    if kind == "state":
        dev = StateDevicePool.allocate(g, count, 0, runtime=runtime, pad=256)
        host = StateHostPool.allocate(g, layout, slots=2 * count, runtime=runtime)
    else:
        dev = PagedRowDevicePool.allocate(g, count, 0, runtime=runtime)
        host = PagedRowHostPool.allocate(g, layout, pages=2 * count, runtime=runtime)
    fill_host(host)
    whole = "slot" if kind == "state" else "page"
    fill_units(family_device(dev, whole), np.arange(count))    # the backups' sources (the loads' are the host's)
    rows = []
    units = [(whole, count)]
    if kind == "rows" and g.token_granular:
        units.append(("token", count * g.page_size // 4))
    try:
        for b in blocks:
            with FamilyEngine(dev, host, max_blocks=b) as engine:
                for unit, n in units:
                    per = g.page_size if unit == "token" else 1
                    dev_units = rng.permutation(count * per)[:n]
                    host_units = rng.permutation(2 * count * per)[:n]
                    moved = n * (unit_bytes // per)
                    on_device, on_host = family_device(dev, unit), family_host(host, dev, unit)
                    for direction in ("backup", "load", "load-1"):
                        def op(d=direction, e=engine, du=dev_units, hu=host_units, u=unit):
                            if d == "backup":
                                return e.backup(du, hu, unit=u)
                            return e.load(hu, du, unit=u, per_layer=d == "load")
                        copy = (on_host, host_units, on_device, dev_units) if direction == "backup" else (
                            on_device, dev_units, on_host, host_units)
                        poison(copy[0], copy[1])
                        seconds = median_seconds(op, repeats)
                        check = verify(f"{name} {unit}s {direction} at {b} blocks", *copy)
                        gbps = moved / seconds / 1e9
                        ref = ceiling["d2h_gbps" if direction == "backup" else "h2d_gbps"]
                        rows.append(Row(name, unit, direction, b, moved / 1e9, gbps, 100 * gbps / ref, check))
    finally:
        dev.close()
        host.close()
    return rows


def swap_in_latency(runtime, small: bool, steps: int) -> list[dict]:
    """One layer's swap-in per step: top-k K of T tokens, N hot rows; a fraction of the top-k is new each step.

    The step is captured once as a graph over device inputs (as an engine captures its decode step); each step
    uploads that step's top-k on the stream and replays the graph, and all steps are queued back to back, so the
    events between steps time the GPU work, not Python. ``call_us`` is the CPU cost of one plain ``swap_in`` call
    with host arrays (checks, upload, launch), measured apart.

    Each case starts as the contract says prefill leaves it: tokens 0..slots-1 in rows 0..slots-1 (their host
    bytes, written here), so a row the kernel should have refilled still holds another token's random bytes; after
    the timed steps the row of every top-k token of the last step is compared with that token's host row."""
    k, n, t = (64, 128, 2048) if small else (2048, 4096, 65536)
    g_host = KVGeometry.mla(1, 656, 64)
    g_dev = KVGeometry.mla(1, 656, 1)
    rng = np.random.default_rng(0)
    out = []
    with DevicePool.allocate(g_dev, n + 1, 0, runtime=runtime) as dev, \
            HostPool.allocate(g_host, "layer_first", pages=t // 64, runtime=runtime) as host, \
            DeviceBuffer(8, 0, runtime=runtime) as requests, DeviceBuffer(8, 0, runtime=runtime) as seq_lens, \
            DeviceBuffer(k * 4, 0, runtime=runtime) as topk, \
            HostBuffer.allocate(steps * k * 4, HostKind.PINNED, runtime=runtime) as plan:
        fill_host(host)
        hot_rows, host_tokens = kv_device(dev), kv_host(host, unit="token")
        requests.upload(np.zeros(1, np.int64))
        stream = runtime.create_stream(0)
        with HotBuffer(dev, host, requests=1, slots=n, top_k=k, max_tokens=t) as hot:
            for label, fraction, seq in (("fast path (seq <= slots)", 0.0, n), ("all hits", 0.0, t),
                                         ("20% missing", 0.2, t), ("100% missing", 1.0, t)):
                hot.assign(0, np.arange(t))
                hot_rows.write(np.arange(n), host_tokens.read(np.arange(n)))    # as prefill leaves them
                seq_lens.upload(np.array([seq], np.int64))
                current = rng.choice(n, k, replace=False) if fraction == 0.0 else rng.choice(seq - 1, k,
                                                                                                replace=False)
                topk.upload(current.astype(np.int32))
                hot.swap_in(0, requests, topk, seq_lens, stream=stream)
                stream.synchronize()
                schedule = plan.as_tensor().numpy().view(np.int32).reshape(steps, k)
                for step in range(steps):
                    if fraction:
                        fresh = rng.choice(seq - 1, int(k * fraction), replace=False)
                        keep = current[rng.permutation(k)[:k - fresh.size]]
                        current = np.unique(np.concatenate([keep, fresh]))
                        while current.size < k:
                            current = np.unique(np.concatenate([current, rng.choice(seq - 1, k - current.size)]))
                        current = current[:k]
                    schedule[step] = current
                del schedule
                stream.begin_capture()
                try:
                    hot.swap_in(0, requests, topk, seq_lens, stream=stream)
                finally:
                    graph = stream.end_capture()
                events = [runtime.create_event(0, timing=True) for _ in range(steps + 1)]
                events[0].record(stream)
                for step in range(steps):
                    runtime.memcpy_async(topk.address, plan.cpu_address + step * k * 4, k * 4, stream=stream)
                    graph.launch(stream)
                    events[step + 1].record(stream)
                events[-1].synchronize()
                times = [events[i].elapsed_ms(events[i + 1]) * 1000 for i in range(steps)]
                graph.close()
                calls = []
                top = current[None, :k].astype(np.int32)
                for _ in range(min(steps, 20)):
                    stream.synchronize()
                    start = time.perf_counter()
                    hot.swap_in(0, [0], top, [seq], stream=stream)
                    calls.append((time.perf_counter() - start) * 1e6)
                stream.synchronize()
                landed = np.frombuffer(hot.out.download(0, k * 8), np.int64)
                check = verify(f"swap-in, {label}", hot_rows, landed, host_tokens, top[0])
                out.append({"case": label, "top_k": k, "tokens": seq, "slots": n, "row_bytes": 656,
                            "median_us": statistics.median(times), "p90_us": float(np.percentile(times, 90)),
                            "missing_rows": int(k * fraction) if seq == t else 0,
                            "call_us": statistics.median(calls), "verified": check})
        stream.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", default=os.environ.get(ENV_VAR) or "cuda",
                        help=f"cuda, emulated:split or emulated:unified (default: ${ENV_VAR}, else cuda)")
    parser.add_argument("--gib", type=float, help="GiB per measurement (default: 0.5; 1/512 on the emulator)")
    parser.add_argument("--blocks", default="1,2,4",
                        help="kernel SM budgets, comma-separated (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed repeats, median reported; 1 on the emulator (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=50, help="swap-in steps timed per case (default: %(default)s)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    console = Console(width=200)
    runtime = get(args.runtime)
    small = runtime.name.startswith("emulated")
    size = int((args.gib if args.gib is not None else (1 / 512 if small else 0.5)) * (1 << 30))
    ceiling = probe_bandwidth(runtime, min(1 << 30, max(1 << 20, size)))
    console.log(f"ceiling: H2D {ceiling['h2d_gbps']:.1f}, D2H {ceiling['d2h_gbps']:.1f} GB/s")
    blocks = [int(b) for b in args.blocks.split(",")]
    rows: list[Row] = []
    for name, (kind, g, layout) in families(small).items():
        console.log(f"{name} ({layout})")
        rows += measure_family(runtime, name, kind, g, layout, size, blocks, ceiling, 1 if small else args.repeats)
    table = Table(title=f"family transfers on {runtime.name} (random units, % of the same-run ceiling)")
    for col in ("family", "unit", "direction", "blocks", "GB", "GB/s", "% ceiling", "verified"):
        table.add_column(col, justify="right" if col not in ("family", "unit", "direction", "verified") else "left")
    for r in rows:
        table.add_row(r.family, r.unit, r.direction, str(r.blocks), f"{r.gbytes:.3f}", f"{r.gbps:.1f}",
                      f"{r.pct:.0f}%", described(r.verified))
    console.print(table)
    swaps = swap_in_latency(runtime, small, 3 if small else args.steps)
    table = Table(title="HiSparse swap-in, one layer, one request (656-byte MLA fp8 rows)")
    for col in ("case", "top-k", "tokens", "hot rows", "rows copied", "GPU median µs", "GPU p90 µs",
                "CPU call µs", "verified"):
        table.add_column(col)
    for s in swaps:
        table.add_row(s["case"], str(s["top_k"]), str(s["tokens"]), str(s["slots"] + 1), str(s["missing_rows"]),
                      f"{s['median_us']:.1f}", f"{s['p90_us']:.1f}", f"{s['call_us']:.0f}", described(s["verified"]))
    console.print(table)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"runtime": runtime.name, "ceiling": ceiling, "rows": [asdict(r) for r in rows],
                       "swap_in": swaps}, out, indent=1)


if __name__ == "__main__":
    main()
