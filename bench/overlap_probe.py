"""Why a layer-wise load misses the overlap bound below ~24k tokens: the same overlap without transformers.

bench/e2e.py measures a transformers forward (a 64-token suffix over a 1k-64k prefix) whose layer i waits for layer
i's K/V copied from pinned memory. Below ~24k tokens even its plain-torch peer takes 1.2-1.4x max(link, compute).
This probe takes the model away and keeps the shapes (Llama-3-8B: hidden 4096, 32 heads, 8 KV heads, head dim 128,
MLP 14336, bf16, 32 layers, random weights): a decoder layer's GEMMs and attention in plain torch, and asks three
questions, each timed alone and with the prefix's K/V (2 x layers x prefix x 8 x 128 x 2 bytes) copied at once on a
side stream:

- ``enqueue ms``: CPU time to queue the 32 layers (no sync). If a copy in flight makes it grow, launches are slowed.
- ``gpu ms``: device time of the 32 layers (events on the compute stream). If it grows, the kernels run slower.
- ``layer-wise ms``: the 32 layers, layer i waiting on the GPU for event i of the copy (the peer's pattern), from
  the start of the copy to the end of the last layer, against max(copy alone, compute alone).

transformers' forward at a 64-token step is CPU-bound (~1.2 ms of Python a layer against well under that of GPU
work); ``--host-us`` adds that much CPU work before each layer's launches, so the probe can be run in both regimes.

The probe checks that every copied byte landed (a sample of each layer against its pinned source). Run on a GPU
machine: ``python3 bench/overlap_probe.py [--lengths 1k,4k,16k,32k] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _verify import fail, planted  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS = 4096, 32, 8, 128, 14336, 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1k,4k,16k,32k", help="prefix tokens (default: %(default)s)")
    parser.add_argument("--suffix", type=int, default=64, help="new tokens (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats, median (default: %(default)s)")
    parser.add_argument("--host-us", default="0,1200",
                        help="CPU microseconds spent before each layer, comma-separated (default: %(default)s)")
    parser.add_argument("--json", help="write the rows here")
    return parser.parse_args(argv)


def tokens(text: str) -> int:
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


class Layer:
    """A decoder layer's work at a ``suffix``-token step over a ``prefix``-token cache, in plain torch."""

    def __init__(self, torch, suffix: int) -> None:
        bf16, dev = torch.bfloat16, "cuda"
        self.torch = torch
        self.wqkv = torch.randn(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=bf16, device=dev) * 0.02
        self.wo = torch.randn(HEADS * HEAD_DIM, HIDDEN, dtype=bf16, device=dev) * 0.02
        self.up = torch.randn(HIDDEN, 2 * MLP, dtype=bf16, device=dev) * 0.02
        self.down = torch.randn(MLP, HIDDEN, dtype=bf16, device=dev) * 0.02
        self.suffix = suffix

    def __call__(self, x, k, v):
        torch, s = self.torch, self.suffix
        F = torch.nn.functional
        h = F.rms_norm(x, (HIDDEN,))
        q, _, _ = (h @ self.wqkv).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q = q.view(1, s, HEADS, HEAD_DIM).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        x = x + a.transpose(1, 2).reshape(s, HEADS * HEAD_DIM) @ self.wo
        gate, up = (F.rms_norm(x, (HIDDEN,)) @ self.up).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.down


def busy(microseconds: float) -> None:
    """Python work of a layer (a spin, not a sleep: the thread keeps the CPU as transformers' Python does)."""
    end = time.perf_counter() + microseconds / 1e6
    while time.perf_counter() < end:
        pass


def measure(torch, prefix: int, suffix: int, repeats: int, host_us: float) -> dict:
    dev = "cuda"
    layer = Layer(torch, suffix)
    shape = (1, KV_HEADS, prefix, HEAD_DIM)
    pinned = [(torch.randn(shape, dtype=torch.bfloat16).pin_memory(), torch.randn(shape, dtype=torch.bfloat16)
               .pin_memory()) for _ in range(LAYERS)]
    device = [(torch.empty(shape, dtype=torch.bfloat16, device=dev), torch.empty(shape, dtype=torch.bfloat16,
                                                                                 device=dev)) for _ in range(LAYERS)]
    x0 = torch.randn(suffix, HIDDEN, dtype=torch.bfloat16, device=dev)
    side, compute = torch.cuda.Stream(), torch.cuda.current_stream()
    nbytes = 2 * LAYERS * pinned[0][0].numel() * 2

    def copy(events=None):
        with torch.cuda.stream(side):
            for i, ((hk, hv), (dk, dv)) in enumerate(zip(pinned, device, strict=True)):
                dk.copy_(hk, non_blocking=True)
                dv.copy_(hv, non_blocking=True)
                if events is not None:
                    events[i].record(side)

    def forward(events=None):
        x = x0
        for i, (k, v) in enumerate(device):
            if host_us:
                busy(host_us)
            if events is not None:
                compute.wait_event(events[i])
            x = layer(x, k, v)
        return x

    def poison():
        for dk, dv in device:
            dk.fill_(float("nan"))
            dv.fill_(float("nan"))
        torch.cuda.synchronize()

    def timed_gpu(run):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(compute)
        t0 = time.perf_counter()
        run()
        queued = time.perf_counter() - t0
        end.record(compute)
        torch.cuda.synchronize()
        return 1e3 * queued, start.elapsed_time(end), 1e3 * (time.perf_counter() - t0)

    def with_copy(run):
        def both():
            copy()
            run()
        return both

    samples: dict[str, list] = {k: [] for k in ("alone", "beside a copy", "copy alone", "layer-wise")}
    for i in range(repeats + 1):
        results = {"alone": timed_gpu(forward), "beside a copy": timed_gpu(with_copy(forward))}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copy()
        side.synchronize()
        results["copy alone"] = (0.0, 0.0, 1e3 * (time.perf_counter() - t0))
        poison()
        events = [torch.cuda.Event() for _ in range(LAYERS)]
        t0 = time.perf_counter()
        copy(events)
        forward(events)
        torch.cuda.synchronize()
        results["layer-wise"] = (0.0, 0.0, 1e3 * (time.perf_counter() - t0))
        if planted():
            device[0][0][0, 0, 0, 0] += 1
        for n, ((hk, hv), (dk, dv)) in enumerate(zip(pinned, device, strict=True)):   # every layer landed
            rows = torch.cat([torch.tensor([0, prefix - 1]), torch.randint(0, prefix, (14,))])
            for h, d, what in ((hk, dk, "K"), (hv, dv, "V")):
                if not torch.equal(h[:, :, rows].to(dev), d[:, :, rows]):
                    raise fail(f"{prefix}-token prefix, layer-wise run", f"layer {n}'s {what} differs from its "
                               f"pinned source in the 16 sampled token rows")
        if i:
            for key, value in results.items():
                samples[key].append(value)
    med = {key: tuple(statistics.median(s[j] for s in values) for j in range(3)) for key, values in samples.items()}
    copy_ms, alone_ms = med["copy alone"][2], med["alone"][2]
    return {"prefix": prefix, "suffix": suffix, "host_us": host_us, "copy_gb": nbytes / 1e9, "copy_ms": copy_ms,
            "copy_gbps": nbytes / copy_ms / 1e6,
            "enqueue_ms": med["alone"][0], "enqueue_beside_copy_ms": med["beside a copy"][0],
            "gpu_ms": med["alone"][1], "gpu_beside_copy_ms": med["beside a copy"][1],
            "compute_wall_ms": alone_ms, "layer_wise_ms": med["layer-wise"][2],
            "bound_ms": max(copy_ms, alone_ms), "x_bound": med["layer-wise"][2] / max(copy_ms, alone_ms)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("overlap_probe: needs a CUDA GPU")
    rows = []
    header = ("prefix", "host µs / layer", "copy ms (GB/s)", "enqueue ms: alone / beside copy",
              "gpu ms: alone / beside copy", "compute wall ms", "layer-wise ms", "x max(copy, compute)")
    print(" | ".join(header))
    for text, host_us in [(t, float(h)) for h in args.host_us.split(",") for t in args.lengths.split(",")]:
        r = measure(torch, tokens(text), args.suffix, args.repeats, host_us)
        rows.append(r)
        print(f"{text} | {host_us:.0f} | {r['copy_ms']:.1f} ({r['copy_gbps']:.1f}) | {r['enqueue_ms']:.2f} / "
              f"{r['enqueue_beside_copy_ms']:.2f} | {r['gpu_ms']:.2f} / {r['gpu_beside_copy_ms']:.2f} | "
              f"{r['compute_wall_ms']:.2f} | {r['layer_wise_ms']:.2f} | {r['x_bound']:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
