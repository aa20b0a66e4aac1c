"""A bf16 GEMM beside one-direction copies: which copies slow the model's compute, and by how much.

For each copy (a kernel-backend backup or load of 1 GiB of Llama-3-8B pages at 2 SMs in a given kernel
specialization, a ``staged`` backup or load, or a plain contiguous DMA), a bf16 8192³ GEMM runs on torch's stream while
the copy is in flight; the table gives the copy's GB/s alone and the GEMM's slowdown against the GEMM alone. The
copy kernels take a whole SM each (1024 threads x 64 registers fill its register file), so two SMs out of 132
predict a ~2% slowdown; anything far above that comes from the copy's memory traffic, not from the SMs it holds.

Run on a GPU machine: ``python bench/gemm_beside.py [--variants 8x1024,8x1024+cached,8x512] [--json out.json]``.
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
from bidirectional import Gemm  # noqa: E402
from transfer import GEOMETRIES, fill, variant_launcher  # noqa: E402

from kvtier.memory import DeviceBuffer, HostBuffer, HostKind  # noqa: E402
from kvtier.pools import DevicePool, HostPool  # noqa: E402
from kvtier.runtime import get  # noqa: E402
from kvtier.transfer import TransferEngine  # noqa: E402


def slowdown(gemm: Gemm, start_copy, copy_seconds: float) -> float | None:
    """Median GEMM slowdown (%) while ``start_copy()`` (which returns something with ``done()``) is in flight; None
    when even one GEMM outlasts the copy."""
    n = max(1, int(0.25 * copy_seconds * 1e3 / gemm.alone))
    while n:
        times = []
        for _ in range(3):
            copy = start_copy()
            times.append(gemm.ms(n))
            outlasted = copy.done()
            copy.wait()
            if outlasted:
                break
        else:
            return 100 * (statistics.median(times) / gemm.alone - 1)
        n //= 2
    return None


def timed(start_copy) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        start_copy().wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


class Dma:
    """A contiguous copy on its own stream, with the ``done()``/``wait()`` of a Transfer."""

    def __init__(self, runtime, dst, src, nbytes: int) -> None:
        self.runtime, self.dst, self.src, self.nbytes = runtime, dst, src, nbytes
        self.stream = runtime.create_stream(0)
        self.event = runtime.create_event(0)

    def __call__(self) -> Dma:
        self.runtime.memcpy_async(self.dst, self.src, self.nbytes, stream=self.stream)
        self.event.record(self.stream)
        return self

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="8x1024,8x1024+cached,8x1024w8,8x512,8x1024+bulk",
                        help="kernel specializations (bench/transfer.py --variants); default: %(default)s")
    parser.add_argument("--blocks", type=int, default=2, help="kernel SM budget (default: 2)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    console = Console(width=160)
    runtime = get("cuda")
    gemm = Gemm()
    console.log(f"bf16 8192³ GEMM alone: {gemm.alone:.3f} ms")
    g = GEOMETRIES["llama3-8b-p16"]
    pages = (1 << 30) // g.bytes_per_page
    dev = DevicePool.allocate(g, pages, 0, runtime=runtime)
    host = HostPool.allocate(g, "page_first_direct", pages=pages, runtime=runtime)
    with HostBuffer.allocate(256 << 20, HostKind.PINNED, runtime=runtime) as seed:
        seed.as_tensor().numpy()[:] = np.random.default_rng().integers(0, 256, seed.nbytes, dtype=np.uint8)
        fill(runtime, dev, seed)
    rng = np.random.default_rng(0)
    src, slots = rng.permutation(pages), rng.permutation(pages)
    rows = []

    def measure(name: str, direction: str, start_copy) -> None:
        seconds = timed(start_copy)
        row = {"copy": name, "direction": direction, "gbps": pages * g.bytes_per_page / seconds / 1e9,
               "gemm_slowdown_pct": slowdown(gemm, start_copy, seconds)}
        rows.append(row)
        console.log(row)

    for variant in args.variants.split(","):
        launcher, options = variant_launcher(runtime, variant)
        engine = TransferEngine(dev, host, backend="kernel", launcher=launcher, max_blocks=args.blocks, **options)
        measure(f"kernel {variant} ({args.blocks} SMs)", "backup", lambda e=engine: e.backup(src, slots))
        measure(f"kernel {variant} ({args.blocks} SMs)", "load", lambda e=engine: e.load(slots, src))
        engine.close()
    engine = TransferEngine(dev, host, backend="staged")
    measure("staged", "backup", lambda: engine.backup(src, slots))
    measure("staged", "load", lambda: engine.load(slots, src))
    engine.close()
    nbytes = pages * g.bytes_per_page
    with HostBuffer.allocate(nbytes, HostKind.PINNED, runtime=runtime) as pinned, \
            DeviceBuffer(nbytes, 0, runtime=runtime) as scratch:
        measure("contiguous DMA", "backup", Dma(runtime, pinned.cpu_address, scratch.address, nbytes))
        measure("contiguous DMA", "load", Dma(runtime, scratch.address, pinned.cpu_address, nbytes))
    host.close(), dev.close()
    table = Table(title=f"bf16 8192³ GEMM ({gemm.alone:.3f} ms alone) beside one-direction copies of 1 GiB")
    for column in ("copy", "direction", "copy GB/s", "GEMM slowdown %"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["copy"], r["direction"], f"{r['gbps']:.1f}",
                      "outlasts the copy" if r["gemm_slowdown_pct"] is None else f"{r['gemm_slowdown_pct']:.1f}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"gemm_alone_ms": gemm.alone, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
