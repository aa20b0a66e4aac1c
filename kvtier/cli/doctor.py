"""``kvtier doctor``: tell an engineer, in a minute, what this machine's memory domains look like."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.cli import doctor_probe
from kvtier.errors import InvalidArgument
from kvtier.runtime import Runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument("--probe-mib", type=int, default=256, help="size of each probe buffer in MiB")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the copy-bandwidth measurement")
    parser.add_argument("--cache-rates", metavar="PATH",
                        help="also measure the io backend pairs the cache chooses from (Llama-3-8B pages, "
                             "--probe-mib each way) and write the rate table to PATH (kvtier demo "
                             "--hicache-rate-table PATH, KVCache(rates=RateTable.load(PATH))); default: not "
                             "measured")


def command(runtime: Runtime, args: argparse.Namespace) -> int:
    if args.probe_mib <= 0:
        raise InvalidArgument(f"--probe-mib must be positive (MiB per probe buffer), got {args.probe_mib}")
    err = Console(stderr=True)
    with err.status("kvtier doctor") as status:
        report = doctor_probe.run(runtime, args.probe_mib << 20, lambda s: status.update(f"kvtier doctor: {s}"),
                                  bandwidth=not args.no_bandwidth)
    if args.cache_rates:
        with err.status("kvtier doctor: cache rates (every backend pair)"):
            table = cache_rates(runtime, args.probe_mib << 20)
        with open(args.cache_rates, "w") as file:
            file.write(table.to_json())
        report["cache_rates"] = json.loads(table.to_json())
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report, Console())
    return 0


def cache_rates(runtime: Runtime, nbytes: int) -> Any:
    """The cache's rate table for this machine: every (load, backup) backend pair on Llama-3-8B pages."""
    from kvtier.cache import measure_rates
    from kvtier.pools import DevicePool, HostPool, KVGeometry

    g = KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=16)
    pages = max(2, 2 * nbytes // g.bytes_per_page)
    pairs = [("kernel", "kernel"), ("staged", "staged"), ("kernel", "staged"), ("direct", "direct"),
             ("batch", "batch")]
    with DevicePool.allocate(g, pages, 0, runtime=runtime) as dev, \
            HostPool.allocate(g, "page_first", pages=pages, kind="pinned", runtime=runtime) as host:
        return measure_rates(dev, host, pairs)


def _yes(value: Any) -> str:
    return "[green]yes[/]" if value else "[red]no[/]"


_ATTRIBUTES = (("name", "name"), ("compute capability", "compute_capability"), ("memory", "total_memory"),
               ("multiprocessors", "multiprocessors"),
               ("host pointer usable for registered memory", "can_use_host_pointer_for_registered_mem"),
               ("unified addressing", "unified_addressing"), ("can map host memory", "can_map_host_memory"),
               ("pageable memory access", "pageable_memory_access"),
               ("host register supported", "host_register_supported"))


def _cell(key: str, value: Any) -> str:
    if key == "total_memory":
        return f"{value / (1 << 30):.0f} GiB"
    if key == "compute_capability":
        return f"{value[0]}.{value[1]}"
    return _yes(value) if isinstance(value, bool) else str(value)


def _aliases(same: dict[Any, bool]) -> str:
    if not same:
        return "-"
    if len(set(same.values())) == 1:
        return ("same" if next(iter(same.values())) else "differs") + (" (all devices)" if len(same) > 1 else "")
    return ", ".join(f"dev{d}: {'same' if s else 'differs'}" for d, s in same.items())


def render(report: dict[str, Any], console: Console) -> None:
    console.print(f"[bold]kvtier {report['kvtier']}[/] on runtime [bold]{report['runtime']}[/]")
    devices = Table(title="Devices")
    devices.add_column("attribute")
    for d in report["devices"]:
        devices.add_column(f"device {d['index']}")
    for label, key in _ATTRIBUTES:
        devices.add_row(label, *(_cell(key, d[key]) for d in report["devices"]))
    console.print(devices)
    kinds = Table(title="Host buffers")
    for column in ("kind", "works", "device-accessible", "alias == CPU address", "register s/GiB"):
        kinds.add_column(column)
    for k in report["host_buffers"]:
        seconds = "-" if k["register_s_per_gib"] is None else f"{k['register_s_per_gib']:.3f}"
        kinds.add_row(k["kind"], _yes(k["ok"]), _yes(k["device_accessible"]) if k["ok"] else "-",
                      _aliases(k["alias_equals_cpu"]), seconds)
    console.print(kinds)
    bandwidth = report["bandwidth"]
    if bandwidth:
        table = Table(title=f"Contiguous copies, {bandwidth['bytes'] >> 20} MiB, pinned host <-> device 0")
        for column in ("H2D GB/s", "D2H GB/s", "both ways GB/s"):
            table.add_column(column)
        table.add_row(*(f"{bandwidth[k]:.1f}" for k in ("h2d_gbps", "d2h_gbps", "bidirectional_gbps")))
        console.print(table)
    elif "bandwidth_note" in report:
        console.print(f"Copy bandwidth {report['bandwidth_note']}")
    console.print("[bold]Verdict[/]")
    for line in report["verdict"]:
        console.print(f" - {line}")
    if report.get("cache_rates"):
        rates = Table(title=f"Cache rate table ({report['cache_rates']['source']})")
        for column in ("load", "backup", "load GB/s", "backup GB/s", "both ways GB/s", "layer-wise loads"):
            rates.add_column(column)
        for row in report["cache_rates"]["rows"]:
            rates.add_row(row["load"], row["backup"], f"{row['load_gbps']:.2f}", f"{row['backup_gbps']:.2f}",
                          f"{row['both_gbps']:.2f}", _yes(row["layerwise"]))
        console.print(rates)
