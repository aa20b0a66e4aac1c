"""How long queuing a load keeps the Python thread, against how long the load takes (H200 diagnosis of staged tails).

For 1 GiB of pages (``--gib``; MLA and Llama-3-8B, ``page_first_direct`` host, contiguous slots), each backend,
per-layer and one-launch loads: the time ``load()`` takes to return (queuing, including any wait for a free index
slot), the time to completion, and when layer 0 and layer L-2 completed. If queuing ends near completion, the GPU
waited for Python.

Run on a GPU machine: ``python bench/enqueue.py``. ``--runtime emulated:split --gib 0.01`` runs it on the CPU emulator
in seconds, as a smoke test: the emulator's kernels are Python reference code, so its timings are not speeds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from transfer import GEOMETRIES, fill  # noqa: E402

from kvtier.memory import HostBuffer, HostKind  # noqa: E402
from kvtier.pools import DevicePool, HostPool  # noqa: E402
from kvtier.runtime import get  # noqa: E402
from kvtier.transfer import TransferEngine  # noqa: E402

EMULATED_NOTE = "note: {name} runs Python reference kernels on the CPU, so these timings are not speeds"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", help="cuda, emulated:split or emulated:unified (default: kvtier's choice: "
                                          "$KVTIER_RUNTIME, else cuda when a GPU is usable, else emulated:split)")
    parser.add_argument("--gib", type=float, default=1.0,
                        help="GiB of pages per load (default: %(default)s; use e.g. 0.01 on an emulated runtime)")
    parser.add_argument("--primitives", action="store_true",
                        help="first, the CPU cost of each runtime call a load makes (event create / record / wait, "
                             "wait_value, a prepared kernel launch, an index upload, whole 1-page loads), µs per call")
    parser.add_argument("--profile", action="store_true",
                        help="after the table, profile the queuing of per-layer kernel loads (cProfile, top 25 by own "
                             "time): where the Python side of a launch goes")
    args = parser.parse_args(argv)
    if args.gib <= 0:
        parser.error(f"--gib must be positive, got {args.gib}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runtime = get(args.runtime)
    emulated = runtime.name.startswith("emulated")
    print(f"runtime {runtime.name}, {args.gib:g} GiB per load", flush=True)
    if emulated:
        print(EMULATED_NOTE.format(name=runtime.name), flush=True)
    if args.primitives:
        primitives(runtime)
    size = int(args.gib * (1 << 30))
    seed = HostBuffer.allocate(min(64 << 20, max(1 << 20, size)), HostKind.PINNED, runtime=runtime)
    seed.as_tensor().numpy()[:] = np.random.default_rng().integers(1, 256, seed.nbytes, dtype=np.uint8)
    for name in ("dsv3-mla-p16", "llama3-8b-p16"):
        g = GEOMETRIES[name]
        pages = max(1, size // g.bytes_per_page)
        dev = DevicePool.allocate(g, 2 * pages, 0, runtime=runtime)
        fill(runtime, dev, seed)
        host = HostPool.allocate(g, "page_first_direct", pages=2 * pages, runtime=runtime)
        src = np.random.default_rng(0).choice(dev.pages, pages, replace=False)
        for backend in ("staged", "kernel"):
            engine = TransferEngine(dev, host, backend=backend)
            for per_layer in (True, False, True, False, True):
                report(name, backend, engine, g, pages, src, per_layer)
            if args.profile and backend == "kernel" and name == "llama3-8b-p16":
                profile(engine, pages, src)
            engine.close()
        host.close()
        dev.close()
    seed.close()
    if emulated:
        print(EMULATED_NOTE.format(name=runtime.name), flush=True)


def per_call_us(call, settle, repeats: int = 100) -> float:
    """Median µs of ``call()`` alone (the CPU side: nothing it queued is waited for), with ``settle()`` run untimed
    after each call so a queue never fills."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        settle()
    return sorted(times)[len(times) // 2] * 1e6


def primitives(runtime) -> None:
    """What one load costs the CPU, call by call (Llama-3-8B geometry, 1 page, page_first_direct host)."""
    from kvtier.memory import DeviceBuffer

    g = GEOMETRIES["llama3-8b-p16"]
    dev = DevicePool.allocate(g, 8, 0, runtime=runtime)
    host = HostPool.allocate(g, "page_first_direct", pages=8, runtime=runtime)
    stream, other = runtime.create_stream(0), runtime.create_stream(0)
    counter = DeviceBuffer(8, 0, runtime=runtime)
    counter.upload(np.zeros(1, np.uint64))
    event = runtime.create_event(0)
    rows = [("create_event (untimed)", lambda: runtime.create_event(0)),
            ("create_event (timing)", lambda: runtime.create_event(0, timing=True)),
            ("event.record", lambda: event.record(stream)),
            ("stream.wait(event)", lambda: other.wait(event))]
    if runtime.supports_wait_value(0):
        rows.append(("wait_value (satisfied)", lambda: runtime.wait_value(other, counter.address, 0)))
    engines = {mode: TransferEngine(dev, host, backend="kernel", layer_signals=mode) for mode in (None, False)}
    for mode, engine in engines.items():
        label = "signals" if mode is None else "event per layer"
        rows += [(f"load 1 page, per layer ({label})", lambda e=engine: e.load([1], [3])),
                 (f"load 1 page, one launch ({label})", lambda e=engine: e.load([1], [3], per_layer=False))]
    rows.append(("backup 1 page", lambda: engines[None].backup([3], [1])))
    def settle() -> None:
        for engine in engines.values():
            engine.synchronize()
        stream.synchronize(), other.synchronize()

    for name, call in rows:
        print(f"{name:45s} {per_call_us(call, settle):9.1f} µs per call", flush=True)
    for engine in engines.values():
        engine.close()
    for handle in (event, counter, stream, other, host, dev):
        handle.close()


def profile(engine, pages, src) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(5):
        engine.synchronize()
        profiler.enable()
        load = engine.load(np.arange(pages), src)
        profiler.disable()
        load.wait()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def report(name, backend, engine, g, pages, src, per_layer) -> None:
    """Queue one load of ``pages`` contiguous host slots, then print how long queuing and completion took."""
    engine.synchronize()
    start = time.perf_counter()
    load = engine.load(np.arange(pages), src, per_layer=per_layer)
    queued = time.perf_counter()
    marks = ""
    if per_layer:
        load.wait_layer(0)
        first = time.perf_counter()
        load.wait_layer(max(0, g.layers - 2))
        marks = f", layer 0 at {(first - start) * 1e3:.2f} ms, layer L-2 at " \
                f"{(time.perf_counter() - start) * 1e3:.2f} ms"
    load.wait()
    total = time.perf_counter() - start
    print(f"{name} {backend} per_layer={per_layer}: queued in {(queued - start) * 1e3:.2f} ms, done in "
          f"{total * 1e3:.2f} ms ({pages * g.bytes_per_page / total / 1e9:.1f} GB/s){marks}", flush=True)


if __name__ == "__main__":
    main()
