"""Link rates per io backend and direction: what the cache chooses backends by and estimates load time with.

Mixing backends is not free, and a fast load is useless to layer-wise overlap if layer 0 lands with the last layer.
Measured through the cache on the H200 (Llama-3-8B, a 32k-token prefix, 4 GiB; bench/cache.py): ``staged`` loads
reach 95% of the link but its layer 0 is ready only when the whole load is (81 of 82 ms), while ``kernel`` loads
reach 90% with layer 0 ready after 4 ms; with a backup running beside, ``kernel`` both ways moved 75 GB/s,
``staged`` both ways 78, ``kernel`` loads beside ``staged`` backups 74. So ``auto`` takes the pair with the best
both-ways rate among those whose loads are layer-wise, from a table: the default holds those H200 figures, and
``measure_rates`` measures one for the machine at hand (``bench/cache.py`` reports the cache's own figures).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import InvalidArgument


@dataclass(frozen=True)
class PairRate:
    """GB/s of a (load backend, backup backend) pair: each direction alone, and both at once (sum of the two)."""

    load: str
    backup: str
    load_gbps: float
    backup_gbps: float
    both_gbps: float | None = None
    layerwise: bool | None = None
    """Layer 0 of a per-layer load is ready well before the whole load (None: not measured)."""


@dataclass
class RateTable:
    rows: list[PairRate]
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def best_pair(self) -> PairRate:
        """The pair with the highest both-ways rate among those with layer-wise loads (all pairs when none is
        known to be); pairs never measured both ways rank by their slower side."""
        if not self.rows:
            raise InvalidArgument("an empty rate table cannot choose backends")
        candidates = [r for r in self.rows if r.layerwise] or self.rows
        return max(candidates, key=lambda r: r.both_gbps if r.both_gbps else min(r.load_gbps, r.backup_gbps))

    def rate(self, backend: str, direction: str) -> float | None:
        """The best alone-rate of ``backend`` in ``direction`` ("load" or "backup") the table knows."""
        values = [r.load_gbps if direction == "load" else r.backup_gbps for r in self.rows
                  if (r.load if direction == "load" else r.backup) == backend]
        return max(values) if values else None

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "rows": [asdict(r) for r in self.rows], **self.extra}, indent=1)

    @classmethod
    def load(cls, path: str | Path) -> RateTable:
        """Read a table ``to_json`` (or ``kvtier doctor --cache-rates``) wrote; every field is checked."""
        try:
            data = json.loads(Path(path).read_text())
            rows = [PairRate(**row) for row in data["rows"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"{path} is not a kvtier rate table: {exc}") from exc
        from kvtier.cache.settings import IO_BACKENDS

        for row in rows:
            rates = [row.load_gbps, row.backup_gbps] + ([row.both_gbps] if row.both_gbps is not None else [])
            if row.load not in IO_BACKENDS or row.backup not in IO_BACKENDS or not all(
                    isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0
                    for r in rates) or row.layerwise not in (True, False, None):
                raise InvalidArgument(f"{path} is not a kvtier rate table: bad row {row}")
        return cls(rows, data.get("source", str(path)))


H200_TABLE = RateTable([
    PairRate("kernel", "kernel", 50.0, 48.0, 75.3, layerwise=True),
    PairRate("staged", "staged", 52.6, 53.5, 78.0, layerwise=False),
    PairRate("kernel", "staged", 50.5, 53.5, 73.6, layerwise=True),
    PairRate("direct", "direct", 42.1, 38.8),
    PairRate("batch", "batch", 42.1, 38.8),
], source="H200 PCIe Gen5 x16, Llama-3-8B pages of 16 tokens: loads and both-ways through the cache 2026-12-03, "
          "backups alone and direct/batch from the engine benchmarks 2026-12-01/02 (BENCHMARKS.md)")


def measure_rates(device_pool: Any, host_pool: Any, pairs: list[tuple[str, str]], *, pages: int | None = None,
                  repeats: int = 3, max_blocks: int = 2) -> RateTable:
    """Time each pair on these pools: loads alone, backups alone, then both at once (contiguous host pages, the
    cache's allocation habit). Overwrites the pools' contents; run it before the pools hold KV."""
    from kvtier.transfer import TransferEngine

    count = min(device_pool.pages, host_pool.pages) // 2 if pages is None else pages
    if count < 1:
        raise InvalidArgument("the pools are too small to measure rates")
    nbytes = count * device_pool.geometry.bytes_per_page
    dev_a, dev_b = np.arange(count), np.arange(count, 2 * count) % device_pool.pages
    host_a, host_b = np.arange(count), np.arange(count, 2 * count) % host_pool.pages
    rows = []
    for load_name, backup_name in pairs:
        engines = {"load": TransferEngine(device_pool, host_pool, backend=load_name, max_blocks=max_blocks)}
        engines["backup"] = engines["load"] if backup_name == load_name else TransferEngine(
            device_pool, host_pool, backend=backup_name, max_blocks=max_blocks)
        try:
            rows.append(_measure_pair(engines["load"], engines["backup"], (dev_a, host_a, dev_b, host_b), nbytes,
                                      repeats))
        finally:
            for engine in {id(e): e for e in engines.values()}.values():
                engine.close()
    return RateTable(rows, source=f"measured on {device_pool.runtime.name}, {count} pages each way")


def _measure_pair(load: Any, backup: Any, pages: tuple[np.ndarray, ...], nbytes: int, repeats: int) -> PairRate:
    dev_a, host_a, dev_b, host_b = pages

    def load_op() -> Any:
        return load.load(host_a, dev_a, per_layer=False)

    def backup_op() -> Any:
        return backup.backup(dev_b, host_b)

    load.drain()
    start = time.perf_counter()
    layered = load.load(host_a, dev_a)
    layered.wait_layer(0)
    first = time.perf_counter() - start
    layered.wait()
    whole = time.perf_counter() - start
    return PairRate(load.backend, backup.backend, nbytes / _best_time([load_op], repeats) / 1e9,
                    nbytes / _best_time([backup_op], repeats) / 1e9,
                    2 * nbytes / _best_time([load_op, backup_op], repeats) / 1e9,
                    layerwise=first < 0.5 * whole)


def _best_time(ops: list[Any], repeats: int) -> float:
    """Fastest of ``repeats`` runs (after one warm-up) of queuing every op and waiting for all of them."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for transfer in [op() for op in ops]:
            transfer.wait()
        times.append(time.perf_counter() - start)
    return min(times[1:])


MEASURED_READ_BYTES = 64 << 20
"""A store's own read rate counts once this much was read through it; before that, the configured one."""


def storage_read_gbps(stats: dict[str, Any], configured: float | None) -> float | None:
    """The read rate to judge a storage read by: the store's measured ``get.gbps`` once ``MEASURED_READ_BYTES`` were
    read (``StorageBackend.stats()``), else ``configured`` (None: unknown)."""
    return stats["get.gbps"] if stats.get("get.bytes", 0) >= MEASURED_READ_BYTES else configured


def read_beats_recompute(tokens: int, nbytes: int, prefill_tokens_per_s: float | None, read_gbps: float | None,
                         load_gbps: float | None = None) -> bool:
    """Whether reading ``nbytes`` (then loading them to the device at ``load_gbps``, if given) takes less time than
    prefilling ``tokens`` again. Users report storage hits slower than recompute, so a read is worth it only when it
    wins; with a rate unknown, it is taken."""
    if not prefill_tokens_per_s or not read_gbps:
        return True
    seconds = nbytes / (read_gbps * 1e9) + (nbytes / (load_gbps * 1e9) if load_gbps else 0.0)
    return seconds < tokens / prefill_tokens_per_s
