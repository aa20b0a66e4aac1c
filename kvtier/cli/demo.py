"""``kvtier demo``: a multi-turn chat workload driven through the cache, with a device pool too small for it.

N users share a system prompt and come back turn after turn with a growing history; by the time a user returns,
the device pool has been taken by the others, so the history is found in host memory and loaded back. A stand-in
model writes each page's KV (bytes derived from the page key), so every page loaded back is checked byte for byte.
Beside it runs a device-only radix cache of the same device size (index only), the baseline for "prefill saved".

``--model qwen3.5-like`` runs a hybrid geometry (three linear-attention layers with Mamba-like state for every GQA
layer, scaled down to run on the emulator): the cache keeps a state snapshot at the end of every prompt and history,
a match ends only on one, and every state loaded back is checked byte for byte too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.cache import (
    CacheSettings,
    KVCache,
    Namespace,
    OutOfPages,
    PageAllocator,
    RadixIndex,
    RateTable,
    WritePolicy,
    page_keys,
    token_array,
)
from kvtier.errors import KvtierError
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.pools.state import StateDevicePool, StateGeometry, StateHostPool
from kvtier.storage import SPEC_HELP, open_store
from kvtier.transfer import TransferEngine
from kvtier.transfer.family import FamilyEngine

MODELS = {
    "tiny": (KVGeometry.mha(layers=4, kv_heads=2, head_dim=64, itemsize=2, page_size=16), None),
    "llama3-8b": (KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=16), 20000.0),
    "qwen3.5-like": (KVGeometry.mha(layers=2, kv_heads=2, head_dim=64, itemsize=2, page_size=16), None),
}
STATES = {"qwen3.5-like": StateGeometry.mamba(6, (256, 3), (4, 32, 32))}
"""Hybrid models: the state of their linear-attention layers (the KV geometry above holds the attention layers)."""
VOCAB = 128256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="auto", choices=("auto", *MODELS),
                        help="KV geometry: tiny (default on the emulator), llama3-8b (default on CUDA), or "
                             "qwen3.5-like (hybrid: 2 GQA + 6 linear-attention layers with state snapshots)")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=256, help="new tokens per user message")
    parser.add_argument("--reply-tokens", type=int, default=128, help="tokens per assistant reply")
    parser.add_argument("--device-tokens", type=int, default=0,
                        help="device pool size in tokens (default: a third of the workload's distinct tokens)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token ids (the KV salt is always fresh)")
    parser.add_argument("--verify", choices=("all", "none"), default="all",
                        help="check every loaded-back page byte for byte (default) or not")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--save", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--storage", metavar="SPEC",
                        help=f"a storage tier to prefetch from and write through to ({SPEC_HELP}); a second run of "
                             "the demo with the same storage is served from it")
    CacheSettings.add_arguments(parser)


@dataclass
class Tally:
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


class StandInModel:
    """Writes the KV of new pages (bytes derived from the page key, different in every 16-byte piece) through a
    pinned scratch pool, and reads pages back to check them. The salt is fresh in every run, except with storage:
    then it is derived from the namespace, so that pages a previous run stored are the KV this run expects."""

    state: StandInState | None = None
    """Hybrid models: the stand-in for the linear-attention layers' state."""

    def __init__(self, device: DevicePool, namespace: Namespace, scratch_pages: int, *, stable: bool = False) -> None:
        g = device.geometry
        self.namespace, self.bytes_per_page = namespace, g.bytes_per_page
        self.salt = hashlib.sha256(b"kvtier-demo" + namespace.digest).digest()[:16] if stable else \
            np.random.default_rng().bytes(16)
        self.scratch = HostPool.allocate(g, "page_first", pages=scratch_pages, kind="pinned", runtime=device.runtime)
        self.engine = TransferEngine(device, self.scratch, backend="direct")
        self.view = self.scratch.buffer.as_tensor().numpy().reshape(g.tensors, scratch_pages, -1)
        self.ramp = (np.arange(g.bytes_per_page) // 16 % 251).astype(np.uint8).reshape(g.tensors, -1)

    def expected(self, key: bytes) -> np.ndarray:
        digest = np.frombuffer(hashlib.sha256(self.salt + key).digest(), np.uint8)
        return np.tile(digest, self.bytes_per_page // 32).reshape(self.ramp.shape) + self.ramp

    def write(self, keys: list[bytes], pages: np.ndarray) -> None:
        step = self.scratch.pages
        for start in range(0, len(pages), step):
            chunk = pages[start:start + step]
            for i, key in enumerate(keys[start:start + step]):
                self.view[:, i] = self.expected(key)
            self.engine.load(np.arange(len(chunk)), chunk, per_layer=False).wait()

    def mismatches(self, keys: list[bytes], pages: np.ndarray) -> int:
        bad, step = 0, self.scratch.pages
        for start in range(0, len(pages), step):
            chunk = pages[start:start + step]
            self.view[:] = 0
            self.engine.backup(chunk, np.arange(len(chunk))).wait()
            bad += sum(not np.array_equal(self.view[:, i], self.expected(key))
                       for i, key in enumerate(keys[start:start + step]))
        return bad

    def close(self) -> None:
        if self.state is not None:
            self.state.close()
        del self.view
        self.engine.close()
        self.scratch.close()


class StandInState:
    """A hybrid model's recurrent state after a prefix: bytes derived from the prefix's last page key, written into a
    device slot and read back through a one-slot scratch host pool and the state engine."""

    def __init__(self, device: StateDevicePool, salt: bytes) -> None:
        self.salt, self.nbytes = salt, device.geometry.slot_bytes
        self.scratch = StateHostPool.allocate(device.geometry, "page_first", slots=1, kind="pinned",
                                              runtime=device.runtime)
        self.engine = FamilyEngine(device, self.scratch)
        self.view = self.scratch.buffer.as_tensor().numpy()

    def expected(self, key: bytes) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(self.salt + b"state" + key).digest()[:8], "little")
        return np.random.default_rng(seed).integers(1, 256, self.nbytes, dtype=np.uint8)

    def write(self, key: bytes, slot: int) -> None:
        self.view[:] = self.expected(key)
        self.engine.load([0], [slot], per_layer=False).wait()

    def matches(self, key: bytes, slot: int) -> bool:
        self.view[:] = 0
        self.engine.backup([slot], [0]).wait()
        return bool(np.array_equal(self.view, self.expected(key)))

    def close(self) -> None:
        del self.view
        self.engine.close()
        self.scratch.close()


class DeviceOnlyBaseline:
    """A radix cache with the same device pool and no host tier: what an engine without kvtier would hit. For a
    hybrid model (``hybrid``) a match ends only where a request ended (where it would hold a state)."""

    def __init__(self, pages: int, page_size: int, *, hybrid: bool = False) -> None:
        self.index = RadixIndex(page_size, b"\0" * 32)
        self.pages, self.page_size = PageAllocator(pages, name="baseline"), page_size
        self.ends: set[Any] | None = set() if hybrid else None

    def serve(self, tokens: np.ndarray) -> int:
        tokens = token_array(tokens)
        ends = self.ends
        match = self.index.match(tokens, usable=None if ends is None else (lambda n: n in ends))
        need = len(tokens) // self.page_size - len(match.device_pages)
        self.index.lock(match.last_node)
        try:
            new = self.pages.allocate(need)
            while new is None:
                victims = self.index.lru_leaves("device", need - self.pages.free_pages)
                if not victims:
                    return match.device_tokens
                for victim in victims:
                    self.pages.free(victim.device)
                    self.index.set_device(victim, None)
                    self.index.remove(victim)
                new = self.pages.allocate(need)
        finally:
            self.index.unlock(match.last_node)
        placed = self.index.place(tokens, np.concatenate([match.device_pages, new]))
        self.pages.free(placed.duplicates)
        if ends is not None:
            ends.add(placed.last_node)
        return match.device_tokens


def conversations(args: argparse.Namespace) -> tuple[list[tuple[int, np.ndarray, np.ndarray]], int]:
    """Requests in arrival order: (user, prompt tokens, reply tokens); and the distinct tokens of the workload."""
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, VOCAB, args.system_tokens)
    histories = [system.copy() for _ in range(args.users)]
    requests = []
    for _ in range(args.turns):
        for user in range(args.users):
            prompt = np.concatenate([histories[user], rng.integers(0, VOCAB, args.user_tokens)])
            reply = rng.integers(0, VOCAB, args.reply_tokens)
            requests.append((user, prompt, reply))
            histories[user] = np.concatenate([prompt, reply])
    distinct = args.system_tokens + args.users * args.turns * (args.user_tokens + args.reply_tokens)
    return requests, distinct


def command(runtime: Any, args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=args.json)
    model = args.model if args.model != "auto" else ("llama3-8b" if runtime.torch_device else "tiny")
    geometry, prefill_default = MODELS[model]
    settings = CacheSettings.from_arguments(args)
    if settings.prefill_tokens_per_s is None and prefill_default is not None:
        settings.prefill_tokens_per_s = prefill_default
    for name in ("users", "turns", "system_tokens", "user_tokens", "reply_tokens"):
        if getattr(args, name) < (1 if name in ("users", "turns") else 0):
            raise KvtierError(f"--{name.replace('_', '-')} must be positive")
    requests, distinct = conversations(args)
    page = geometry.page_size
    longest = max(len(p) + len(r) for _, p, r in requests)
    device_pages = max(args.device_tokens or distinct // 3, longest + page) // page + 1
    namespace = Namespace(f"kvtier-demo/{model}", geometry, "bfloat16")
    device = DevicePool.allocate(geometry, device_pages, 0, runtime=runtime)
    host_pages = settings.host_pages(device_pages, geometry.bytes_per_page)
    host = HostPool.allocate(geometry, settings.hicache_mem_layout, pages=host_pages,
                             kind=settings.hicache_host_kind, runtime=runtime)
    cache = stand_in = storage = None
    state_pools: tuple[StateDevicePool, StateHostPool] | None = None
    try:
        if model in STATES:
            if args.storage:
                raise KvtierError("--storage does not take hybrid models yet: state snapshots are not stored")
            state_pools = state_pools_for(STATES[model], args, runtime)
        rates = RateTable.load(args.hicache_rate_table) if args.hicache_rate_table else None
        storage = open_store(args.storage, namespace, layout=settings.hicache_mem_layout) if args.storage else None
        cache = KVCache(device, host, namespace, settings, rates=rates, storage=storage, state=state_pools)
        stand_in = StandInModel(device, namespace, min(64, longest // page + 1), stable=storage is not None)
        if state_pools is not None:
            stand_in.state = StandInState(state_pools[0], stand_in.salt)
        baseline = DeviceOnlyBaseline(device_pages, page, hybrid=state_pools is not None)
        tally = Tally()
        started = time.perf_counter()
        with Progress(TextColumn("[bold]kvtier demo"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.description}"), console=console, transient=args.json) as progress:
            task = progress.add_task("", total=len(requests))
            for _, prompt, reply in requests:
                serve_turn(cache, stand_in, baseline, tally, prompt, reply, args.verify == "all")
                seen = max(tally.prompt_tokens, 1)
                progress.update(task, advance=1, description=(
                    f"hits: device {tally.device_hit / seen:.0%}, host {tally.host_hit / seen:.0%}"
                    + (f" (storage {tally.storage_hit / seen:.0%})" if storage is not None else "")))
        cache.drain()
        elapsed = time.perf_counter() - started
        report = results(cache, tally, elapsed, model, runtime.name, device_pages, host_pages)
    finally:
        if stand_in is not None:
            stand_in.close()
        if cache is not None:
            cache.close()
        if storage is not None:
            storage.close()
        for pool in state_pools or ():
            pool.close()
        host.close()
        device.close()
    if args.save:
        with open(args.save, "w") as file:
            json.dump(report, file, indent=1)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        show(console, report)
    return 1 if tally.mismatched_pages or tally.mismatched_states else 0


def state_pools_for(geometry: StateGeometry, args: argparse.Namespace, runtime: Any
                    ) -> tuple[StateDevicePool, StateHostPool]:
    """Device slots for about half the users' snapshots plus the request in flight; host slots for all of them."""
    device = StateDevicePool.allocate(geometry, max(3, args.users // 2 + 2), 0, runtime=runtime)
    try:
        host = StateHostPool.allocate(geometry, "page_first", slots=2 * args.users * args.turns + 2, kind="pinned",
                                      runtime=runtime)
    except BaseException:
        device.close()
        raise
    return device, host


def serve_turn(cache: KVCache, model: StandInModel, baseline: DeviceOnlyBaseline, tally: Tally, prompt: np.ndarray,
               reply: np.ndarray, verify: bool) -> None:
    if cache.states is not None:
        serve_hybrid_turn(cache, model, baseline, tally, prompt, reply, verify)
        return
    page = cache.page_size
    full = np.concatenate([prompt, reply])
    keys = page_keys(cache.namespace, full)
    fetched = cache.prefetch(prompt).settle() if cache.storage is not None else 0
    match = cache.match_prefix(prompt, lock=True)
    try:
        prefix = match.device_pages
        for op in match.pending:
            op.wait()
        if match.host_tokens:
            load = cache.load_back(match)
            if load is None:
                tally.declined += 1
            else:
                load.wait()
                prefix = load.prefix_pages
                tally.loaded += load.loaded_tokens
                if verify:
                    loaded = prefix[len(match.device_pages):]
                    tally.pages_checked += len(loaded)
                    tally.mismatched_pages += model.mismatches(keys[len(match.device_pages):len(prefix)], loaded)
        cached = len(prefix) * page
        whole = len(prompt) // page
        try:
            new = cache.allocate(whole - len(prefix))
        except OutOfPages:
            tally.out_of_pages += 1
            return
        model.write(keys[len(prefix):whole], new)
        cache.insert(prompt, np.concatenate([prefix, new]))
        tally.requests += 1
        tally.prompt_tokens += len(prompt)
        tally.device_hit += match.device_tokens
        tally.host_hit += cached - match.device_tokens
        tally.storage_hit += min(fetched, cached - match.device_tokens)
        tally.computed += len(prompt) - cached
        tally.baseline_computed += len(prompt) - baseline.serve(prompt)
    finally:
        cache.unlock(match)
    if len(reply):                                   # decode: the reply's KV joins the history
        history = cache.match_prefix(full, lock=True)
        try:
            for op in history.pending:
                op.wait()
            extra = cache.allocate(len(full) // page - len(history.device_pages))
            model.write(keys[len(history.device_pages):], extra)
            cache.insert(full, np.concatenate([history.device_pages, extra]))
        except OutOfPages:
            tally.out_of_pages += 1
        finally:
            cache.unlock(history)


def serve_hybrid_turn(cache: KVCache, model: StandInModel, baseline: DeviceOnlyBaseline, tally: Tally,
                      prompt: np.ndarray, reply: np.ndarray, verify: bool) -> None:
    """One turn of a hybrid model: the prompt's whole pages are served from the deepest prefix with a state (loaded
    back with its state when it is in host memory; from the deepest device snapshot when the load is declined), then
    the prompt and, after decode, the history are inserted, each with the state after its last token."""
    page = cache.page_size
    prompt = prompt[:len(prompt) // page * page]
    keys = page_keys(cache.namespace, np.concatenate([prompt, reply]))
    match = cache.match_prefix(prompt, lock=True)
    try:
        prefix, state = match.device_pages, match.device_state
        for op in match.pending:
            op.wait()
        if match.host_tokens or (match.cached_tokens and state is None):
            load = cache.load_back(match)
            if load is None:
                tally.declined += 1
                cache.unlock(match)
                match = cache.match_prefix(prompt, lock=True, device_only=True)
                prefix, state = match.device_pages, match.device_state
            else:
                load.wait()
                prefix, state = load.prefix_pages, load.device_state
                tally.loaded += load.loaded_tokens
                if verify:
                    loaded = prefix[len(match.device_pages):]
                    tally.pages_checked += len(loaded)
                    tally.mismatched_pages += model.mismatches(keys[len(match.device_pages):len(prefix)], loaded)
        if verify and len(prefix):
            assert model.state is not None and state is not None
            tally.states_checked += 1
            tally.mismatched_states += not model.state.matches(keys[len(prefix) - 1], state)
        if not insert_with_state(cache, model, tally, prompt, prefix, keys):
            return
        tally.requests += 1
        tally.prompt_tokens += len(prompt)
        tally.device_hit += min(match.device_tokens, len(prefix) * page)
        tally.host_hit += len(prefix) * page - min(match.device_tokens, len(prefix) * page)
        tally.computed += len(prompt) - len(prefix) * page
        tally.baseline_computed += len(prompt) - baseline.serve(prompt)
    finally:
        cache.unlock(match)
    full = np.concatenate([prompt, reply])
    full = full[:len(full) // page * page]
    if len(full) > len(prompt):                      # decode: the reply's KV and the state after it join
        history = cache.match_prefix(full, lock=True, device_only=True)
        try:
            for op in history.pending:
                op.wait()
            insert_with_state(cache, model, tally, full, history.device_pages, keys)
        finally:
            cache.unlock(history)


def insert_with_state(cache: KVCache, model: StandInModel, tally: Tally, tokens: np.ndarray, prefix: np.ndarray,
                      keys: list[bytes]) -> bool:
    """Prefill ``tokens`` past ``prefix`` (KV and the state after the last token) and insert both."""
    assert model.state is not None
    whole = len(tokens) // cache.page_size
    try:
        slot = cache.allocate_state()
    except OutOfPages:
        tally.out_of_pages += 1
        return False
    try:
        new = cache.allocate(whole - len(prefix))
    except OutOfPages:
        cache.free_state(slot)
        tally.out_of_pages += 1
        return False
    model.write(keys[len(prefix):whole], new)
    model.state.write(keys[whole - 1], slot)
    cache.insert(tokens, np.concatenate([prefix, new]), state=slot)
    return True


def results(cache: KVCache, tally: Tally, elapsed: float, model: str, runtime: str, device_pages: int,
            host_pages: int) -> dict[str, Any]:
    s = cache.stats()
    g = cache.geometry
    return {
        "runtime": runtime, "model": model, "requests": tally.requests, "prompt_tokens": tally.prompt_tokens,
        "device_pool_tokens": device_pages * g.page_size, "host_pool_tokens": host_pages * g.page_size,
        "write_policy": WritePolicy(cache.settings.write_policy).value, "load_backend": cache.load_backend,
        "backup_backend": cache.backup_backend,
        "device_hit_rate": tally.device_hit / max(tally.prompt_tokens, 1),
        "host_hit_rate": tally.host_hit / max(tally.prompt_tokens, 1),
        "prefill_tokens": tally.computed, "baseline_prefill_tokens": tally.baseline_computed,
        "prefill_saved_tokens": tally.baseline_computed - tally.computed,
        "pages_loaded": int(s.get("pages.load", 0)), "bytes_loaded": int(s.get("bytes.load", 0)),
        "pages_backed_up": int(s.get("pages.backup", 0)), "bytes_backed_up": int(s.get("bytes.backup", 0)),
        "load_seconds": s.get("seconds.load", 0.0), "backup_seconds": s.get("seconds.backup", 0.0),
        "load_gbps": s.get("gbps.load", 0.0), "backup_gbps": s.get("gbps.backup", 0.0),
        "declined_slower_than_recompute": int(s.get("decisions.slower_than_recompute", 0)),
        "declined_other": tally.declined - int(s.get("decisions.slower_than_recompute", 0)),
        "recompute_estimate_tokens_per_s": s.get("prefill_tokens_per_s"),
        "evicted_device_tokens": int(s.get("evicted.device", 0)), "evicted_host_tokens": int(s.get("evicted.host", 0)),
        "pages_checked": tally.pages_checked, "mismatched_pages": tally.mismatched_pages,
        "out_of_pages": tally.out_of_pages, "seconds": elapsed,
        "storage": cache.storage.kind if cache.storage is not None else None,
        "storage_hit_rate": tally.storage_hit / max(tally.prompt_tokens, 1),
        "storage_pages_read": int(s.get("storage_pages.read", 0)),
        "storage_pages_written": int(s.get("storage_pages.written", 0)),
        "storage_read_gbps": s.get("storage.get.gbps", 0.0), "storage_write_gbps": s.get("storage.set.gbps", 0.0),
        "storage_misses": {k[len("storage.miss."):]: int(v) for k, v in s.items() if k.startswith("storage.miss.")},
        "storage_errors": int(sum(v for k, v in s.items() if k.startswith("storage.errors."))),
        "storage_writes_skipped": int(sum(v for k, v in s.items() if k.startswith("storage_skipped."))),
        "hybrid": cache.states is not None, "states_checked": tally.states_checked,
        "mismatched_states": tally.mismatched_states, "states_loaded": int(s.get("states.load", 0)),
        "states_backed_up": int(s.get("states.backup", 0)),
        "states_evicted": int(s.get("states.evicted_device", 0) + s.get("states.evicted_host", 0)),
        "device_state_slots": cache.states.device.pages if cache.states is not None else 0,
        "host_state_slots": cache.states.host.pages if cache.states is not None else 0,
    }


def show(console: Any, r: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"kvtier demo — {r['model']} on {r['runtime']}, {r['requests']} requests, "
                        f"{r['write_policy']}, load={r['load_backend']} backup={r['backup_backend']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    gib = 1 << 30
    rows = [
        ("device pool / host pool", f"{r['device_pool_tokens']:,} / {r['host_pool_tokens']:,} tokens"),
        ("hit rate: device / host", f"{r['device_hit_rate']:.1%} / {r['host_hit_rate']:.1%}"),
        ("prefill tokens: kvtier / device-only", f"{r['prefill_tokens']:,} / {r['baseline_prefill_tokens']:,}"),
        ("prefill saved vs device-only", f"{r['prefill_saved_tokens']:,} tokens"),
        ("loaded back (host → device)", f"{r['pages_loaded']:,} pages, {r['bytes_loaded'] / gib:.3f} GiB"),
        ("  transfer time, rate", f"{r['load_seconds']:.3f} s, {r['load_gbps']:.2f} GB/s"),
        ("backed up (device → host)", f"{r['pages_backed_up']:,} pages, {r['bytes_backed_up'] / gib:.3f} GiB"),
        ("  transfer time, rate", f"{r['backup_seconds']:.3f} s, {r['backup_gbps']:.2f} GB/s"),
        ("load-backs declined: slower than recompute", f"{r['declined_slower_than_recompute']}"
         + ("" if r["recompute_estimate_tokens_per_s"] else " (no estimate given)")),
        ("evicted tokens: device / host", f"{r['evicted_device_tokens']:,} / {r['evicted_host_tokens']:,}"),
        ("loaded pages checked, byte for byte", f"{r['pages_checked']:,}, {r['mismatched_pages']} wrong"),
        ("wall time", f"{r['seconds']:.1f} s"),
    ]
    if r["hybrid"]:
        rows[-1:-1] = [
            ("state slots: device / host", f"{r['device_state_slots']} / {r['host_state_slots']}"),
            ("states: loaded back / backed up / evicted alone",
             f"{r['states_loaded']} / {r['states_backed_up']} / {r['states_evicted']}"),
            ("served states checked, byte for byte", f"{r['states_checked']:,}, {r['mismatched_states']} wrong"),
        ]
    if r["storage"]:
        rows[2:2] = [
            ("hit rate: storage (part of host)", f"{r['storage_hit_rate']:.1%} ({r['storage']})"),
            ("storage: pages read / written", f"{r['storage_pages_read']:,} / {r['storage_pages_written']:,}"),
            ("storage: read / write rate", f"{r['storage_read_gbps']:.2f} / {r['storage_write_gbps']:.2f} GB/s"),
            ("storage: misses (why), errors, writes skipped",
             f"{sum(r['storage_misses'].values())}"
             + "".join(f" {k}={v}" for k, v in r["storage_misses"].items())
             + f", {r['storage_errors']}, {r['storage_writes_skipped']}"),
        ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
