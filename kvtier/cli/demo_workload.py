"""The demo's workload and what it will take, worked out from the flags before anything is allocated.

A user who asks for ``--users 100000`` should hear at once that it needs hundreds of GiB, not after a silent minute
of building token arrays; so every size the run depends on (device pool, host pool, state slots, scratch pages, the
token arrays) is computed here and checked against what this machine can give, and the requests themselves are
generated one at a time as they are served.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.cache import CacheSettings
from kvtier.errors import InvalidArgument
from kvtier.memory.budget import available_host_bytes
from kvtier.pools import KVGeometry
from kvtier.pools.state import StateGeometry

VOCAB = 128256
WORKLOAD = {"users": 8, "turns": 4, "system_tokens": 1024, "user_tokens": 256, "reply_tokens": 128}
"""The default workload: eight users sharing a system prompt, four turns each."""
MEMORY_SHARE = 0.5
"""Of the memory /proc/meminfo calls available, the share the demo may take (pinned pages cannot be swapped out)."""
MEMORY_CAP = 64 << 30
"""The most host memory the demo takes on any machine: it is a demonstration, not a load test."""
DEVICE_SHARE = 0.9
"""Of a real GPU's memory, the share the demo's device pools may take."""
TOKEN_BYTES = 8
DEFAULT_RATIO = CacheSettings.hicache_ratio
GIB = 1 << 30


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class Plan:
    """The sizes of one demo run, and the notes to tell the user about them."""

    geometry: KVGeometry
    state: StateGeometry | None
    requests: int
    longest: int
    distinct: int
    device_pages: int
    host_pages: int
    scratch_pages: int
    device_state_slots: int = 0
    host_state_slots: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def device_bytes(self) -> int:
        slots = self.state.slot_bytes * self.device_state_slots if self.state else 0
        return self.device_pages * self.geometry.bytes_per_page + slots

    @property
    def host_bytes(self) -> int:
        slots = self.state.slot_bytes * self.host_state_slots if self.state else 0
        return self.host_pages * self.geometry.bytes_per_page + slots


def plan(args: argparse.Namespace, geometry: KVGeometry, state: StateGeometry | None,
         settings: CacheSettings) -> Plan:
    """Check the workload flags and size every pool; raises InvalidArgument naming the flag when a size is out of
    reach (nothing has been allocated yet)."""
    for name in WORKLOAD:
        value = getattr(args, name)
        if value < (1 if name in ("users", "turns") else 0):
            raise InvalidArgument(f"{flag(name)} must be {'positive' if name in ('users', 'turns') else '>= 0'}, "
                                  f"got {value}")
    if args.device_tokens < 0:
        raise InvalidArgument(f"--device-tokens must be >= 0 (0: a third of the workload), got {args.device_tokens}")
    page = geometry.page_size
    longest = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    distinct = args.system_tokens + args.users * args.turns * (args.user_tokens + args.reply_tokens)
    smallest = -(-longest // page) + 1                 # the longest conversation and one page more
    asked = args.device_tokens or distinct // 3
    device_pages = max(-(-asked // page), smallest)
    notes = []
    if args.device_tokens and device_pages * page != args.device_tokens:
        why = (f"the device pool must hold the longest conversation ({longest:,} tokens) and one page more"
               if device_pages == smallest else f"whole pages of {page} tokens")
        notes.append(f"--device-tokens {args.device_tokens} raised to {device_pages * page:,}: {why}")
    result = Plan(geometry, state, args.users * args.turns, longest, distinct, device_pages,
                  settings.host_pages(device_pages, geometry.bytes_per_page), min(64, longest // page + 1),
                  notes=notes)
    if state is not None:
        result.device_state_slots = max(3, args.users // 2 + 2)
        result.host_state_slots = 2 * args.users * args.turns + 2
    return result


def check_memory(p: Plan, args: argparse.Namespace, runtime: Any) -> None:
    """Refuse a run whose pools and arrays do not fit this machine, naming the flags behind the largest part."""
    emulated = not getattr(runtime, "torch_device", None)
    indexed = min(p.distinct, (p.device_pages + p.host_pages) * p.geometry.page_size)
    parts = {"host pool": p.host_bytes,
             "token arrays": (args.users * p.longest + 2 * indexed) * TOKEN_BYTES,   # histories, two radix trees
             "scratch pages": p.scratch_pages * p.geometry.bytes_per_page}
    if emulated:
        parts = {"device pool (emulated in host memory)": p.device_bytes, **parts}
    else:
        total = runtime.device_attributes(0).total_memory
        if p.device_bytes > DEVICE_SHARE * total:
            raise InvalidArgument(f"{causes(args, 'device pool')} a device pool of {gib(p.device_bytes)}, more than "
                                  f"{DEVICE_SHARE:.0%} of device 0's {gib(total)}")
    need = sum(parts.values())
    available = available_memory()
    limit = min(MEMORY_CAP, int(MEMORY_SHARE * available))
    if need > limit:
        largest = max(parts, key=lambda k: parts[k])
        detail = ", ".join(f"{k} {gib(v)}" for k, v in parts.items() if v >= need // 100)
        raise InvalidArgument(f"{causes(args, largest)} {gib(need)} of memory ({detail}), more than the "
                              f"{gib(limit)} the demo takes here (half the {gib(available)} available, at most "
                              f"{gib(MEMORY_CAP)})")


def causes(args: argparse.Namespace, part: str) -> str:
    """'--users 100000 needs': the flags behind a part of the run's memory that the user set (or, when all of them
    are at their defaults, all of them)."""
    device = ["device_tokens"] if args.device_tokens else list(WORKLOAD)
    if part == "token arrays":
        candidates = list(WORKLOAD)
    elif part != "host pool":
        candidates = device
    else:
        candidates = ["hicache_size"] if args.hicache_size else ["hicache_ratio", *device]
    defaults = {**WORKLOAD, "device_tokens": 0, "hicache_size": 0.0, "hicache_ratio": DEFAULT_RATIO}
    names = [n for n in candidates if getattr(args, n) != defaults[n]] or candidates
    return ", ".join(f"{flag(n)} {getattr(args, n)}" for n in names) + (" needs" if len(names) == 1 else " need")


def available_memory() -> int:
    """Bytes this machine can give without swapping (MemAvailable), else its free pages, else the cap."""
    available = available_host_bytes()
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return MEMORY_CAP


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB // 10 else f"{nbytes / (1 << 20):,.1f} MiB"


def conversations(args: argparse.Namespace) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Requests in arrival order, made as they are served: (user, prompt tokens, reply tokens). Only each user's
    history is kept, so memory grows with users × the longest conversation, not with every request."""
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, VOCAB, args.system_tokens)
    histories = [system] * args.users
    for _ in range(args.turns):
        for user in range(args.users):
            prompt = np.concatenate([histories[user], rng.integers(0, VOCAB, args.user_tokens)])
            reply = rng.integers(0, VOCAB, args.reply_tokens)
            yield user, prompt, reply
            histories[user] = np.concatenate([prompt, reply])
