"""How long queuing a load keeps the Python thread, against how long the load takes (H200 diagnosis of staged tails).

For 1 GiB of pages (MLA and Llama-3-8B, ``page_first_direct`` host, contiguous slots), each backend, per-layer and
one-launch loads: the time ``load()`` takes to return (queuing, including any wait for a free index slot), the time to
completion, and when layer 0 and layer L-2 completed. If queuing ends near completion, the GPU waited for Python.

Run on a GPU machine: ``python bench/enqueue.py``.
"""

from __future__ import annotations

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


def main() -> None:
    runtime = get("cuda")
    seed = HostBuffer.allocate(64 << 20, HostKind.PINNED, runtime=runtime)
    seed.as_tensor().numpy()[:] = np.random.default_rng().integers(1, 256, seed.nbytes, dtype=np.uint8)
    for name in ("dsv3-mla-p16", "llama3-8b-p16"):
        g = GEOMETRIES[name]
        pages = (1 << 30) // g.bytes_per_page
        dev = DevicePool.allocate(g, 2 * pages, 0, runtime=runtime)
        fill(runtime, dev, seed)
        host = HostPool.allocate(g, "page_first_direct", pages=2 * pages, runtime=runtime)
        src = np.random.default_rng(0).choice(dev.pages, pages, replace=False)
        for backend in ("staged", "kernel"):
            engine = TransferEngine(dev, host, backend=backend)
            for per_layer in (True, False, True, False, True):
                engine.synchronize()
                start = time.perf_counter()
                load = engine.load(np.arange(pages), src, per_layer=per_layer)
                queued = time.perf_counter()
                marks = ""
                if per_layer:
                    load.layer_events[0].synchronize()
                    first = time.perf_counter()
                    load.layer_events[g.layers - 2].synchronize()
                    marks = f", layer 0 at {(first - start) * 1e3:.2f} ms, layer L-2 at " \
                            f"{(time.perf_counter() - start) * 1e3:.2f} ms"
                load.wait()
                total = time.perf_counter() - start
                print(f"{name} {backend} per_layer={per_layer}: queued in {(queued - start) * 1e3:.2f} ms, done in "
                      f"{total * 1e3:.2f} ms ({pages * g.bytes_per_page / total / 1e9:.1f} GB/s){marks}", flush=True)
            engine.close()
        host.close()
        dev.close()
    seed.close()


if __name__ == "__main__":
    main()
