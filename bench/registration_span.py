"""What the copy APIs accept across two host registrations (the question behind kvtier's cut-at-boundaries rule).

One anonymous mapping is registered as two adjacent ranges (as ``HostBuffer`` registers a pool past
``register_chunk_bytes``); copies that stay inside one range, end at the boundary, or cross it are tried with
``cudaMemcpyAsync``, ``cudaMemcpy`` and ``cudaMemcpyBatchAsync`` in both directions, and every byte that a reported
success should have moved is checked. A second case crosses from a registered range into pageable memory.

Run on a GPU machine: ``python bench/registration_span.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier import osmem
from kvtier.errors import KvtierError
from kvtier.memory import CpuAddress, DeviceBuffer
from kvtier.runtime import get

MIB = 1 << 20
CHUNK = 32 * MIB
CASES = [("inside one registration", 4 * MIB, MIB), ("ends at the boundary", CHUNK - MIB, MIB),
         ("crosses by 4 KiB", CHUNK - 4096, 8192), ("crosses, 2 MiB", CHUNK - MIB, 2 * MIB),
         ("crosses, 32 MiB", 16 * MIB, CHUNK)]


def _copy(runtime, api: str, dst, src, nbytes: int, stream) -> str:
    try:
        if api == "memcpy":
            runtime.memcpy(dst, src, nbytes)
        elif api == "memcpy_async":
            runtime.memcpy_async(dst, src, nbytes, stream=stream)
        else:
            runtime.memcpy_runs_async(dst, [0], src, [0], [nbytes], stream=stream, batched=True)
        stream.synchronize()
        return "ok"
    except KvtierError as exc:
        return getattr(exc, "error", type(exc).__name__)


def probe(runtime, second_registered: bool) -> list[dict]:
    address = osmem.map_memory(2 * CHUNK)
    osmem.populate(address, 2 * CHUNK)
    host = np.ctypeslib.as_array(osmem.byte_array(address, 2 * CHUNK))
    runtime.host_register(address, CHUNK)
    if second_registered:
        runtime.host_register(address + CHUNK, CHUNK)
    rows = []
    try:
        with DeviceBuffer(2 * CHUNK, 0, runtime=runtime) as dev:
            stream = runtime.create_stream(0)
            rng = np.random.default_rng()
            for name, offset, nbytes in CASES:
                for direction in ("h2d", "d2h"):
                    for api in ("memcpy_async", "memcpy", "batch"):
                        data = rng.integers(1, 256, nbytes, dtype=np.uint8)
                        if direction == "h2d":
                            host[offset:offset + nbytes] = data
                            dev.upload(np.full(nbytes, 0xEE, np.uint8), offset)
                            status = _copy(runtime, api, dev.address + offset, CpuAddress(address + offset), nbytes,
                                           stream)
                            landed = np.frombuffer(dev.download(offset, nbytes), np.uint8)
                        else:
                            dev.upload(data, offset)
                            host[offset:offset + nbytes] = 0xEE
                            status = _copy(runtime, api, CpuAddress(address + offset), dev.address + offset, nbytes,
                                           stream)
                            landed = host[offset:offset + nbytes].copy()
                        exact = bool(np.array_equal(landed, data))
                        rows.append({"second": "registered" if second_registered else "pageable", "case": name,
                                     "offset": offset, "bytes": nbytes, "direction": direction, "api": api,
                                     "status": status, "bytes_exact": exact})
            stream.close()
    finally:
        runtime.host_unregister(address)
        if second_registered:
            runtime.host_unregister(address + CHUNK)
        del host
        osmem.unmap_memory(address, 2 * CHUNK)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", default="cuda", help="runtime spec (default cuda)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    runtime = get(args.runtime)
    rows = probe(runtime, True) + probe(runtime, False)
    table = Table(title="Copies across two host registrations (second range registered / pageable)")
    for column in ("second", "case", "dir", "api", "status", "bytes exact"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["second"], r["case"], r["direction"], r["api"], r["status"],
                      "yes" if r["bytes_exact"] else "no")
    Console(width=150).print(table)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
