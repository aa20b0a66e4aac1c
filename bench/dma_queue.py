"""Host time to queue scattered DMA copies: batched (``cudaMemcpyBatchAsync``) or one ``cudaMemcpyAsync`` each, by copy
size, host alignment and direction (the measurements behind ``Runtime.memcpy_runs_async``'s rules).

Each case queues ``--copies`` copies with random offsets on both sides (so no two form a strided copy) through
``Runtime.memcpy_runs_async``, with every copy sent to the batch (or none), and reports µs of host time per copy until
the call returned ("queue") and until the stream drained ("done"), the median of ``--repeats`` after a warm-up. The
rules under test are switched off here, so the table shows the driver's costs, not kvtier's choices.

Run on a GPU machine: ``python bench/dma_queue.py [--json out.json]``; ``--runtime emulated:split`` is a smoke test
(its numbers are not speeds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.memory import DeviceBuffer, HostBuffer, HostKind
from kvtier.runtime import get

SIZES = (16 << 10, 18 << 10, (18 << 10) + 64, 20 << 10, 32 << 10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", help="cuda, emulated:split or emulated:unified (default: kvtier's choice)")
    parser.add_argument("--copies", type=int, default=2048, help="copies per call (default: 2048)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after one warm-up (default: 3)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.copies < 2 or args.repeats < 1:
        parser.error("--copies must be >= 2 and --repeats >= 1")
    return args


def rules_off(runtime) -> None:
    """Every copy to the batch when batching: the driver's costs, not kvtier's choices."""
    if runtime.name == "cuda":
        import kvtier.runtime.cuda as cuda

        cuda.STRIDED_MIN_ROWS_BATCHED, cuda.BATCH_H2D_MIN_BYTES = 1 << 30, 0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console(width=160)
    runtime = get(args.runtime)
    rules_off(runtime)
    n, widest = args.copies, -(-max(SIZES) // 4096) * 4096
    rng = np.random.default_rng(0)
    rows = []
    with HostBuffer.allocate(n * widest, HostKind.PINNED, runtime=runtime) as host, \
            DeviceBuffer(n * widest, 0, runtime=runtime) as dev:
        view = host.as_tensor().numpy()
        view[:] = rng.integers(1, 256, view.size, dtype=np.uint8)
        del view
        stream = runtime.create_stream(0)
        for size in SIZES:
            for pitch_name, pitch in (("packed", size), ("4 KiB-aligned", -(-size // 4096) * 4096)):
                for direction in ("H2D", "D2H"):
                    for batched in (True, False):
                        host_at, dev_at = rng.permutation(n) * pitch, rng.permutation(n) * pitch
                        ends = ((dev.address, dev_at, host.cpu_address, host_at) if direction == "H2D"
                                else (host.cpu_address, host_at, dev.address, dev_at))
                        queued, done = [], []
                        for i in range(args.repeats + 1):
                            stream.synchronize()
                            start = time.perf_counter()
                            runtime.memcpy_runs_async(*ends, np.full(n, size), stream=stream, batched=batched)
                            returned = time.perf_counter()
                            stream.synchronize()
                            if i:
                                queued.append(returned - start)
                                done.append(time.perf_counter() - start)
                        q, d = statistics.median(queued), statistics.median(done)
                        rows.append({"size": size, "host_pitch": pitch_name, "direction": direction,
                                     "mode": "batch" if batched else "one call each", "gbps": n * size / d / 1e9,
                                     "queue_us_per_copy": 1e6 * q / n, "done_us_per_copy": 1e6 * d / n})
        stream.close()
    table = Table(title=f"queuing {n} scattered copies ({runtime.device_attributes(0).name})")
    for column in ("size", "host pitch", "dir", "mode", "GB/s", "queue µs / copy", "done µs / copy"):
        table.add_column(column)
    for r in rows:
        table.add_row(str(r["size"]), r["host_pitch"], r["direction"], r["mode"], f"{r['gbps']:.1f}",
                      f"{r['queue_us_per_copy']:.2f}", f"{r['done_us_per_copy']:.2f}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": runtime.device_attributes(0).name, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
