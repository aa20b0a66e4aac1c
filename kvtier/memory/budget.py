"""Refuse host buffers the machine cannot hold, before touching a byte: an OOM kill mid-serve is worse (every kind
but pageable is populated or pinned at once, and pageable ones are pre-faulted too)."""

from __future__ import annotations

from kvtier.errors import OutOfMemory

RESERVE_FRACTION = 0.1


def available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_budget(nbytes: int) -> None:
    available = available_host_bytes()
    if available is None:
        return
    allowed = int(available * (1 - RESERVE_FRACTION))
    if nbytes > allowed:
        raise OutOfMemory(
            f"host buffer of {nbytes / 2**30:.1f} GiB exceeds the budget: {available / 2**30:.1f} GiB available, "
            f"{RESERVE_FRACTION:.0%} kept for the rest of the process; size the pool smaller "
            f"(pages=, tokens=, nbytes=)")
