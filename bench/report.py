"""Turn ``bench/transfer.py --json`` output into the Markdown tables BENCHMARKS.md records.

Usage: python bench/report.py transfer.json > tables.md
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def cell(row: dict | None) -> str:
    return "-" if row is None else f"{row['gbps']:.1f} ({row['pct']:.0f}%)"


def main(path: str) -> None:
    with open(path) as source:
        data = json.load(source)
    ceiling = data["ceiling"]
    print(f"Ceiling (contiguous pinned memcpy, same run): H2D {ceiling['h2d_gbps']:.1f}, "
          f"D2H {ceiling['d2h_gbps']:.1f}, both ways {ceiling['bidirectional_gbps']:.1f} GB/s.\n")
    rows = defaultdict(dict)
    columns: list[str] = []
    for r in data["rows"]:
        name = r["backend"] if r["backend"] != "kernel" else f"kernel {r['blocks']} SM"
        if r["slots"] != "random":
            name += " (contiguous slots)"
        if name not in columns:
            columns.append(name)
        rows[(r["geometry"], r["layout"], r["direction"])][name] = r
    print("| geometry | layout | dir | " + " | ".join(columns) + " |")
    print("|" + "---|" * (3 + len(columns)))
    for (geometry, layout, direction), by_name in rows.items():
        print(f"| {geometry} | {layout} | {direction} | " + " | ".join(cell(by_name.get(c)) for c in columns) + " |")
    print("\nPer-layer load latency (one layer of the whole batch, kernel backend), µs:\n")
    print("| geometry | layout | " + " | ".join(c for c in columns if c.startswith("kernel")) + " |")
    print("|" + "---|" * (2 + sum(c.startswith("kernel") for c in columns)))
    for (geometry, layout, direction), by_name in rows.items():
        if direction == "load":
            values = [by_name.get(c, {}).get("layer_us") for c in columns if c.startswith("kernel")]
            print(f"| {geometry} | {layout} | " + " | ".join("-" if v is None else f"{v:.0f}" for v in values) + " |")
    print("\nStaged SM-busy time (relayout kernels / transfer time), contiguous slots:\n")
    for (geometry, layout, direction), by_name in rows.items():
        staged = by_name.get("staged (contiguous slots)")
        if staged and staged.get("sm_busy_pct") is not None:
            print(f"- {geometry} {layout} {direction}: {staged['sm_busy_pct']:.1f}%")
    print("\nBidirectional (backup and load at once):\n")
    for geometry, results in data.get("bidirectional", {}).items():
        for r in results if isinstance(results, list) else [results]:
            print(f"- {geometry} {r.get('backend', 'kernel')}: {r['gbps']:.1f} GB/s "
                  f"({r['pct']:.0f}% of both-ways ceiling)")
    print("\nbf16 8192³ GEMM slowed by a concurrent per-layer load (kernel backend):\n")
    for geometry, results in data.get("gemm", {}).items():
        for r in results:
            print(f"- {geometry}, {r['blocks']} blocks: {r['gemm_ms_alone']:.3f} → {r['gemm_ms_with_copy']:.3f} ms "
                  f"({r['slowdown_pct']:+.1f}%)")


if __name__ == "__main__":
    main(sys.argv[1])
