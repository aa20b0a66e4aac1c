"""Probe: can the copy engines move one layer of many KV pages at the link's ceiling with one strided (2D) copy?

A layer-wise load wants layer i of every page to land before layer i+1. With a page-major host layout, layer i of a
run of pages is a strided pattern: ``width`` contiguous bytes per page, ``pitch`` bytes apart. This times
``cudaMemcpy2DAsync`` H2D for such patterns (one call per layer, an event after each) against a contiguous pinned
copy of the same bytes, and reports when the first layer landed.

Usage: python3 bench/memcpy2d.py [--mib 1024] [--layers 32]
"""

from __future__ import annotations

import argparse
import functools
import statistics
from typing import Any


def check(result: tuple) -> object:
    from cuda.bindings import runtime as cudart

    if result[0] != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA error {result[0]}")
    return result[1] if len(result) > 1 else None


def timed(fn, repeats: int = 5) -> float:
    """Median seconds of ``fn`` on the current stream (after one warm-up)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(repeats + 1):
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def by_layer(device: int, host: int, width: int, pitch: int, pages: int, begin: Any, events: list, stream: int
             ) -> None:
    """One strided copy per layer (layer i of every page), an event after each."""
    from cuda.bindings import runtime as cudart

    begin.record()
    for layer, event in enumerate(events):
        check(cudart.cudaMemcpy2DAsync(device + layer * pages * width, width, host + layer * width, pitch, width,
                                       pages, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, stream))
        event.record()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024,
                        help="MiB copied per measurement (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=32,
                        help="layers per page: the strided copies per load (default: %(default)s)")
    args = parser.parse_args()
    import torch  # after parsing: --help answers without it

    total = args.mib << 20
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    device = torch.empty(total, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    ceiling = total / timed(lambda: device.copy_(host, non_blocking=True)) / 1e9
    print(f"contiguous pinned H2D: {ceiling:.1f} GB/s")
    print("| width | pitch | GB/s | % of ceiling | first layer lands (% of total) |")
    print("|---|---|---|---|---|")
    for width in (2 << 10, 8 << 10, 32 << 10, 64 << 10, 256 << 10):
        pitch = width * args.layers
        pages = total // pitch
        events = [torch.cuda.Event(enable_timing=True) for _ in range(args.layers)]
        begin = torch.cuda.Event(enable_timing=True)
        copy = functools.partial(by_layer, device.data_ptr(), host.data_ptr(), width, pitch, pages, begin, events,
                                 stream)
        seconds = timed(copy)
        first = begin.elapsed_time(events[0]) / (begin.elapsed_time(events[-1]) or 1)
        moved = pages * pitch
        expected = host.view(pages, args.layers, width).transpose(0, 1).reshape(-1)[:16 << 20]
        assert torch.equal(device[:16 << 20].cpu(), expected), "2D copy landed the wrong bytes"
        print(f"| {width >> 10} KiB | {pitch >> 10} KiB | {moved / seconds / 1e9:.1f} | "
              f"{moved / seconds / 1e9 / ceiling:.0%} | {first:.1%} |")


if __name__ == "__main__":
    main()
