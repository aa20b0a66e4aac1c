"""The cache's settings: one dataclass, checked when built, with CLI flags named like SGLang's ``--hicache-*``
where the meaning is the same."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

from kvtier.checks import Choice, integer
from kvtier.errors import InvalidArgument
from kvtier.pools.geometry import HostLayout
from kvtier.runtime.base import HostKind


class WritePolicy(Choice):
    __what__ = "write policy"
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class PrefetchPolicy(Choice):
    __what__ = "prefetch policy"
    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


IO_BACKENDS = ("kernel", "staged", "direct", "batch")
COPY_ENGINE_BACKENDS = ("direct", "batch")
"""Backends that copy device pages in place with the copy engines: a run of consecutive pages is one strided copy."""
AUTO = "auto"


@dataclass
class CacheSettings:
    """``write_policy``: ``write_through`` backs up every new page at once; ``write_through_selective`` after
    ``write_through_threshold`` hits; ``write_back`` only when the device evicts it. ``io_backend``: ``auto`` picks
    the load and backup backends from a measured rate table (:mod:`kvtier.cache.rates`); ``load_backend`` /
    ``backup_backend`` override one direction. A load-back shorter than ``load_back_min_tokens`` is recomputed, and so
    is one whose estimated time (bytes / measured link rate) is not below the recompute estimate
    (``prefill_tokens_per_s`` when given, else what ``KVCache.record_prefill`` measured; with neither, loading is
    taken). ``hicache_ratio`` / ``hicache_size`` (GB) size a host pool the cache builds itself.

    Storage (when the cache has a storage backend): ``prefetch_policy`` says what ``Prefetch.settle()`` does with a
    prefetch still reading — ``best_effort`` keeps what has landed and stops, ``wait_complete`` waits for all of it,
    ``timeout`` waits up to ``prefetch_timeout_base + prefetch_timeout_per_1k_tokens × tokens / 1000`` seconds,
    at most ``prefetch_timeout_max``. ``storage_write`` writes every backed-up page to storage too, off the
    caller's thread, with at most ``storage_queue_pages`` pages queued (more are skipped and counted).
    ``storage_gbps`` is the storage read rate assumed before one is measured (None: fetching is always taken)."""

    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = 2
    io_backend: str = AUTO
    load_backend: str | None = None
    backup_backend: str | None = None
    max_blocks: int = 2
    load_back_min_tokens: int = 64
    prefill_tokens_per_s: float | None = None
    calibrate: bool = True
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_mem_layout: HostLayout | str = HostLayout.PAGE_FIRST
    hicache_host_kind: HostKind | str = HostKind.PINNED
    prefetch_policy: PrefetchPolicy | str = PrefetchPolicy.TIMEOUT
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_1k_tokens: float = 0.25
    prefetch_timeout_max: float = 30.0
    storage_write: bool = True
    storage_queue_pages: int = 8192
    storage_batch_pages: int = 32
    storage_threads: int = 2
    storage_gbps: float | None = None

    def __post_init__(self) -> None:
        self.write_policy = WritePolicy(self.write_policy)
        self.hicache_mem_layout = HostLayout(self.hicache_mem_layout)
        self.hicache_host_kind = HostKind(self.hicache_host_kind)
        self.prefetch_policy = PrefetchPolicy(self.prefetch_policy)
        for name in ("prefetch_timeout_base", "prefetch_timeout_per_1k_tokens", "prefetch_timeout_max"):
            value = getattr(self, name)
            if not (_finite(value, low=0.0) or value == 0):
                raise InvalidArgument(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if self.storage_gbps is not None and not _finite(self.storage_gbps, low=0.0):
            raise InvalidArgument(f"storage_gbps must be a finite positive number or None, got {self.storage_gbps!r}")
        self.storage_queue_pages = integer(self.storage_queue_pages, "storage_queue_pages", low=0)
        self.storage_batch_pages = integer(self.storage_batch_pages, "storage_batch_pages", low=1)
        self.storage_threads = integer(self.storage_threads, "storage_threads", low=1)
        self.write_through_threshold = integer(self.write_through_threshold, "write_through_threshold", low=1)
        self.max_blocks = integer(self.max_blocks, "max_blocks", low=1)
        self.load_back_min_tokens = integer(self.load_back_min_tokens, "load_back_min_tokens", low=0)
        for name in ("io_backend", "load_backend", "backup_backend"):
            value = getattr(self, name)
            allowed = IO_BACKENDS + ((AUTO,) if name == "io_backend" else ())
            if (value is not None or name == "io_backend") and value not in allowed:
                raise InvalidArgument(f"unknown {name} {value!r}: choose one of {allowed}")
        if self.prefill_tokens_per_s is not None and not _finite(self.prefill_tokens_per_s, low=0.0):
            raise InvalidArgument(f"prefill_tokens_per_s must be a finite positive number, got "
                                  f"{self.prefill_tokens_per_s!r}")
        if not _finite(self.hicache_ratio, low=0.0) or not (_finite(self.hicache_size, low=0.0)
                                                             or self.hicache_size == 0):
            raise InvalidArgument(f"hicache_ratio must be finite and > 0, hicache_size finite and >= 0; got "
                                  f"{self.hicache_ratio!r} and {self.hicache_size!r}")

    def prefetch_timeout(self, tokens: int) -> float:
        """Seconds ``timeout`` waits for a prefetch of ``tokens``."""
        return min(self.prefetch_timeout_max,
                   self.prefetch_timeout_base + self.prefetch_timeout_per_1k_tokens * tokens / 1000)

    def host_pages(self, device_pages: int, bytes_per_page: int) -> int:
        """Pages of a host pool sized by ``hicache_size`` (GB) when set, else ``hicache_ratio`` × the device pool."""
        if self.hicache_size:
            return max(1, int(self.hicache_size * 1e9) // bytes_per_page)
        return max(1, int(device_pages * self.hicache_ratio))

    # -- command line ---------------------------------------------------------------------------------------------
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("cache (names follow SGLang's --hicache-* where the meaning is the same)")
        group.add_argument("--hicache-ratio", type=float, default=2.0,
                           help="host pool pages per device pool page (default: %(default)s)")
        group.add_argument("--hicache-size", type=float, default=0.0,
                           help="host pool size in GB; overrides --hicache-ratio when > 0 (default: %(default)s)")
        group.add_argument("--hicache-write-policy", default="write_through",
                           choices=[p.value for p in WritePolicy],
                           help="when a device page is backed up to host memory: at once, after "
                                "--hicache-write-through-threshold hits, or when the device evicts it "
                                "(default: %(default)s)")
        group.add_argument("--hicache-write-through-threshold", type=int, default=2,
                           help="hits before a page is backed up under write_through_selective")
        group.add_argument("--hicache-io-backend", default=AUTO, choices=(AUTO,) + IO_BACKENDS,
                           help="io backend for both directions; auto chooses from the measured rate table")
        group.add_argument("--hicache-load-backend", choices=IO_BACKENDS,
                           help="override the load backend (default: --hicache-io-backend's)")
        group.add_argument("--hicache-backup-backend", choices=IO_BACKENDS,
                           help="override the backup backend (default: --hicache-io-backend's)")
        group.add_argument("--hicache-mem-layout", default="page_first", choices=[x.value for x in HostLayout],
                           help="byte order of the host pool (default: %(default)s)")
        group.add_argument("--hicache-host-kind", default="pinned", choices=["pinned", "registered", "shm"],
                           help="memory of the host pool (default: %(default)s)")
        group.add_argument("--load-back-min-tokens", type=int, default=64,
                           help="shorter host hits are recomputed (default: %(default)s)")
        group.add_argument("--prefill-tokens-per-s", type=float,
                           help="recompute estimate; default: learned from the prefills the caller reports (with "
                                "none, every load-back is taken)")
        group.add_argument("--hicache-storage-prefetch-policy", default="timeout",
                           choices=[p.value for p in PrefetchPolicy],
                           help="what a request does with a storage prefetch still reading (default: "
                                "%(default)s)")
        group.add_argument("--prefetch-timeout-base", type=float, default=1.0, help="seconds (timeout policy)")
        group.add_argument("--prefetch-timeout-per-1k-tokens", type=float, default=0.25,
                           help="seconds per 1000 tokens (timeout policy)")
        group.add_argument("--prefetch-timeout-max", type=float, default=30.0, help="cap in seconds")
        group.add_argument("--storage-queue-pages", type=int, default=8192,
                           help="pages queued for storage writes before more are skipped (counted)")
        group.add_argument("--hicache-rate-table", metavar="PATH",
                           help="rate table to choose backends from (kvtier doctor --cache-rates PATH); default: "
                                "the H200 table")

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> CacheSettings:
        values = {"hicache_ratio": args.hicache_ratio, "hicache_size": args.hicache_size,
                  "write_policy": args.hicache_write_policy,
                  "write_through_threshold": args.hicache_write_through_threshold,
                  "io_backend": args.hicache_io_backend, "load_backend": args.hicache_load_backend,
                  "backup_backend": args.hicache_backup_backend, "hicache_mem_layout": args.hicache_mem_layout,
                  "hicache_host_kind": args.hicache_host_kind, "load_back_min_tokens": args.load_back_min_tokens,
                  "prefill_tokens_per_s": args.prefill_tokens_per_s,
                  "prefetch_policy": args.hicache_storage_prefetch_policy,
                  "prefetch_timeout_base": args.prefetch_timeout_base,
                  "prefetch_timeout_per_1k_tokens": args.prefetch_timeout_per_1k_tokens,
                  "prefetch_timeout_max": args.prefetch_timeout_max, "storage_queue_pages": args.storage_queue_pages}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


def _finite(value: object, *, low: float) -> bool:
    """A real, finite number above ``low`` (NaN and infinities fail every comparison we rely on)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > low
