"""The demo's results: a dict (``--json``, ``--save``) and two tables.

What the cache did (hits, pages moved, evictions, checks) is the same in every run with the same flags and seed;
what the clock measured (wall time, transfer times and rates) is not, so it is kept apart: under ``"timing"`` in
the JSON and in a table of its own, after the results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.cache import KVCache, WritePolicy

GIB = 1 << 30


@dataclass
class Tally:
    """What the demo counted while serving (the cache's own counters come from ``cache.stats()``)."""

    planned: int = 0
    handled: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    loaded: int = 0
    computed: int = 0
    baseline_computed: int = 0
    pages_checked: int = 0
    mismatched_pages: int = 0
    states_checked: int = 0
    mismatched_states: int = 0
    declined: int = 0
    out_of_pages: int = 0
    interrupted: bool = False


def results(cache: KVCache, tally: Tally, elapsed: float, model: str, runtime: str, device_pages: int,
            host_pages: int) -> dict[str, Any]:
    s = cache.stats()
    g = cache.geometry
    declined_slow = int(s["decisions.slower_than_recompute"])
    return {
        "runtime": runtime, "model": model, "requests": tally.requests, "requests_planned": tally.planned,
        "interrupted": tally.interrupted, "prompt_tokens": tally.prompt_tokens,
        "device_pool_tokens": device_pages * g.page_size, "host_pool_tokens": host_pages * g.page_size,
        "write_policy": WritePolicy(cache.settings.write_policy).value, "load_backend": cache.load_backend,
        "backup_backend": cache.backup_backend,
        "device_hit_rate": tally.device_hit / max(tally.prompt_tokens, 1),
        "host_hit_rate": tally.host_hit / max(tally.prompt_tokens, 1),
        "prefill_tokens": tally.computed, "baseline_prefill_tokens": tally.baseline_computed,
        "prefill_saved_tokens": tally.baseline_computed - tally.computed,
        "pages_loaded": int(s["pages.load"]), "bytes_loaded": int(s["bytes.load"]),
        "pages_backed_up": int(s["pages.backup"]), "bytes_backed_up": int(s["bytes.backup"]),
        "declined_slower_than_recompute": declined_slow, "declined_other": tally.declined - declined_slow,
        "recompute_estimate_tokens_per_s": s["prefill_tokens_per_s"],
        "evicted_device_tokens": int(s["evicted.device"]), "evicted_host_tokens": int(s["evicted.host"]),
        "pages_checked": tally.pages_checked, "mismatched_pages": tally.mismatched_pages,
        "out_of_pages": tally.out_of_pages,
        "storage": cache.storage.kind if cache.storage is not None else None,
        "storage_hit_rate": tally.storage_hit / max(tally.prompt_tokens, 1),
        "storage_pages_read": int(s["storage_pages.read"]),
        "storage_pages_written": int(s["storage_pages.written"]),
        "storage_misses": {k[len("storage.miss."):]: int(v) for k, v in s.items() if k.startswith("storage.miss.")},
        "storage_errors": int(sum(v for k, v in s.items() if k.startswith("storage.errors."))),
        "storage_writes_skipped": int(sum(v for k, v in s.items() if k.startswith("storage_skipped."))),
        "hybrid": cache.states is not None, "states_checked": tally.states_checked,
        "mismatched_states": tally.mismatched_states, "states_loaded": int(s["states.load"]),
        "states_backed_up": int(s["states.backup"]),
        "states_evicted": int(s["states.evicted_device"] + s["states.evicted_host"]),
        "device_state_slots": cache.states.device.pages if cache.states is not None else 0,
        "host_state_slots": cache.states.host.pages if cache.states is not None else 0,
        "timing": {
            "emulated": runtime.startswith("emulated"), "seconds": elapsed,
            "load_seconds": s["seconds.load"], "backup_seconds": s["seconds.backup"],
            "load_gbps": s["gbps.load"], "backup_gbps": s["gbps.backup"],
            "storage_read_gbps": s.get("storage.get.gbps", 0.0), "storage_write_gbps": s.get("storage.set.gbps", 0.0),
        },
    }


def rate(gbps: float) -> str:
    if gbps <= 0:
        return "nothing moved"
    return f"{gbps:.1f} GB/s" if gbps >= 1 else f"{gbps * 1000:.0f} MB/s"


def show(console: Any, r: dict[str, Any]) -> None:
    from rich.table import Table

    served = f"{r['requests']} requests" + (f" of {r['requests_planned']} (interrupted)" if r["interrupted"] else "")
    table = Table(title=f"kvtier demo — {r['model']} on {r['runtime']}, {served}, {r['write_policy']}, "
                        f"loads by {r['load_backend']}, backups by {r['backup_backend']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    declined = f"{r['declined_slower_than_recompute']}"
    if not r["recompute_estimate_tokens_per_s"]:
        declined += " (no recompute speed known)"
    rows = [
        ("device pool / host pool", f"{r['device_pool_tokens']:,} / {r['host_pool_tokens']:,} tokens"),
        ("hit rate: device / host", f"{r['device_hit_rate']:.1%} / {r['host_hit_rate']:.1%}"),
        ("prefill tokens: kvtier / device-only", f"{r['prefill_tokens']:,} / {r['baseline_prefill_tokens']:,}"),
        ("prefill saved vs device-only", f"{r['prefill_saved_tokens']:,} tokens"),
        ("loaded back (host → device)", f"{r['pages_loaded']:,} pages, {r['bytes_loaded'] / GIB:.3f} GiB"),
        ("backed up (device → host)", f"{r['pages_backed_up']:,} pages, {r['bytes_backed_up'] / GIB:.3f} GiB"),
        ("load-backs declined as slower than recompute", declined),
        ("evicted tokens: device / host", f"{r['evicted_device_tokens']:,} / {r['evicted_host_tokens']:,}"),
        ("requests or replies dropped: device full", f"{r['out_of_pages']:,}"),
        ("loaded pages checked, byte for byte", f"{r['pages_checked']:,}, {r['mismatched_pages']} wrong"),
    ]
    if r["hybrid"]:
        rows += [
            ("state slots: device / host", f"{r['device_state_slots']} / {r['host_state_slots']}"),
            ("states: loaded back / backed up / evicted alone",
             f"{r['states_loaded']} / {r['states_backed_up']} / {r['states_evicted']}"),
            ("served states checked, byte for byte", f"{r['states_checked']:,}, {r['mismatched_states']} wrong"),
        ]
    if r["storage"]:
        rows[2:2] = [
            ("hit rate: storage (part of host)", f"{r['storage_hit_rate']:.1%} ({r['storage']})"),
            ("storage: pages read / written", f"{r['storage_pages_read']:,} / {r['storage_pages_written']:,}"),
            ("storage: misses (why), errors, writes skipped",
             f"{sum(r['storage_misses'].values())}"
             + "".join(f" {k}={v}" for k, v in r["storage_misses"].items())
             + f", {r['storage_errors']}, {r['storage_writes_skipped']}"),
        ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(timings(r))


def timings(r: dict[str, Any]) -> Any:
    """The clock's part, which differs from run to run; on the emulator its transfer rates are not a link's."""
    from rich.table import Table

    t = r["timing"]
    emulated = " (emulated)" if t["emulated"] else ""
    table = Table(title="Timings: they vary from run to run" + ("; emulated rates are not hardware rates"
                                                               if t["emulated"] else ""))
    for column in ("measure", "time", "rate"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    table.add_row("wall time", f"{t['seconds']:.1f} s", "")
    table.add_row("load-back transfers", f"{t['load_seconds']:.3f} s", rate(t["load_gbps"]) + emulated)
    table.add_row("backup transfers", f"{t['backup_seconds']:.3f} s", rate(t["backup_gbps"]) + emulated)
    if r["storage"]:
        table.add_row("storage reads / writes", "", f"{rate(t['storage_read_gbps'])} / {rate(t['storage_write_gbps'])}")
    return table
