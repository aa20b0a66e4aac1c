"""Turn ``bench/transfer.py --json`` output into the Markdown tables BENCHMARKS.md records.

Usage: python bench/report.py transfer.json > tables.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def cell(row: dict | None) -> str:
    return "-" if row is None else f"{row['gbps']:.1f} ({row['pct']:.0f}%)"


def load(path: str) -> dict:
    """The parsed results file, or SystemExit with a message that says what is wrong with it."""
    try:
        with open(path) as source:
            data = json.load(source)
    except OSError as exc:
        raise SystemExit(f"report.py: cannot read {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SystemExit(f"report.py: {path} is not JSON ({exc}); pass the file written by "
                         "`bench/transfer.py --json`") from None
    if not (isinstance(data, dict) and isinstance(data.get("rows"), list) and isinstance(data.get("ceiling"), dict)):
        raise SystemExit(f"report.py: {path} is JSON but not bench/transfer.py output: it needs a 'ceiling' object "
                         "and a 'rows' list")
    return data


def render(data: dict) -> None:
    ceiling = data["ceiling"]
    if str(data.get("runtime", "")).startswith("emulated"):
        print(f"Runtime {data['runtime']}: Python reference kernels on the CPU, so these are not speeds.\n")
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Turn the JSON that `bench/transfer.py --json FILE` writes into the Markdown tables of "
                    "BENCHMARKS.md (ceiling, GB/s and % of ceiling per configuration, per-layer latency, staged "
                    "SM-busy time, bidirectional and GEMM results), printed to standard output.",
        epilog="example: python bench/report.py bench/results/2026-12-02-h200-transfer-full.json > tables.md")
    parser.add_argument("json_file", help="results file written by bench/transfer.py --json")
    args = parser.parse_args(argv)
    data = load(args.json_file)
    try:
        render(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise SystemExit(f"report.py: {args.json_file} does not look like bench/transfer.py output "
                         f"({type(exc).__name__}: {exc})") from None


if __name__ == "__main__":
    main(sys.argv[1:])
