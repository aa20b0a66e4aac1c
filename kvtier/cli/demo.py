"""``kvtier demo``: a multi-turn chat workload driven through the cache, with a device pool too small for it.

N users share a system prompt and come back turn after turn with a growing history; by the time a user returns,
the device pool has been taken by the others, so the history is found in host memory and loaded back. A stand-in
model writes each page's KV (bytes derived from the page key), so every page loaded back is checked byte for byte.
Beside it runs a device-only radix cache of the same device size (index only), the baseline for "prefill saved".

The same flags and seed give the same results (not the same timings): between steps of a request the demo waits for
the cache's background work (backups, storage writes), as a model's prefill and decode and a user's pause would give
it time, so the background threads never race the next request; its KV bytes derive from the namespace; on the
emulator the cache estimates load times from its rate table instead of timing a calibration transfer; and storage
prefetches run to completion (``wait_complete``) instead of against a clock.

``--model qwen3.5-like`` runs a hybrid geometry (three linear-attention layers with Mamba-like state for every GQA
layer, scaled down to run on the emulator): the cache keeps a state snapshot at the end of every prompt and history,
a match ends only on one, and every state loaded back is checked byte for byte too.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from kvtier.cache import CacheRequest, CacheSettings, KVCache, Namespace, OutOfPages, RateTable, page_keys
from kvtier.cli import INTERRUPTED
from kvtier.cli.demo_model import DeviceOnlyBaseline, StandInModel, StandInState
from kvtier.cli.demo_progress import Reporter, StorageWatch, stop_on_interrupt
from kvtier.cli.demo_report import Tally, results, show
from kvtier.cli.demo_workload import (
    DEVICE_SHARE,
    MEMORY_CAP,
    MEMORY_SHARE,
    WORKLOAD,
    Plan,
    check_memory,
    conversations,
    gib,
    plan,
)
from kvtier.errors import KvtierError
from kvtier.pools import DevicePool, HostLayout, HostPool, KVGeometry
from kvtier.pools.state import StateDevicePool, StateGeometry, StateHostPool
from kvtier.storage import SPEC_HELP, open_store

MODELS = {
    "tiny": (KVGeometry.mha(layers=4, kv_heads=2, head_dim=64, itemsize=2, page_size=16), None),
    "llama3-8b": (KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=16), 20000.0),
    "qwen3.5-like": (KVGeometry.mha(layers=2, kv_heads=2, head_dim=64, itemsize=2, page_size=16), None),
}
STATES = {"qwen3.5-like": StateGeometry.mamba(6, (256, 3), (4, 32, 32))}
"""Hybrid models: the state of their linear-attention layers (the KV geometry above holds the attention layers)."""
ANNOUNCE_BYTES = 1 << 30
"""Pools at least this large are announced before they are allocated (registering them takes a while)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="auto", choices=("auto", *MODELS),
                        help="KV geometry: tiny (auto on the emulator), llama3-8b (auto on a GPU), or "
                             "qwen3.5-like (hybrid: 2 GQA + 6 linear-attention layers with state snapshots)")
    parser.add_argument("--users", type=int, default=WORKLOAD["users"], help="users sharing the system prompt")
    parser.add_argument("--turns", type=int, default=WORKLOAD["turns"], help="requests per user")
    parser.add_argument("--system-tokens", type=int, default=WORKLOAD["system_tokens"],
                        help="tokens of the system prompt every conversation starts with")
    parser.add_argument("--user-tokens", type=int, default=WORKLOAD["user_tokens"], help="new tokens per user message")
    parser.add_argument("--reply-tokens", type=int, default=WORKLOAD["reply_tokens"],
                        help="tokens per assistant reply")
    parser.add_argument("--device-tokens", type=int, default=0,
                        help="device pool size in tokens, rounded up to whole pages and raised to hold the longest "
                             "conversation plus a page (default 0: a third of the workload's distinct tokens)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the token ids: the same flags and seed give the same results")
    parser.add_argument("--verify", choices=("all", "none"), default="all",
                        help="check every loaded-back page byte for byte, or not")
    parser.add_argument("--json", action="store_true", help="print the results as JSON (and no progress)")
    parser.add_argument("--save", metavar="PATH", help="also write the results as JSON to PATH (default: no file)")
    parser.add_argument("--storage", metavar="SPEC",
                        help=f"a storage tier to prefetch from and write through to ({SPEC_HELP}); a second run of "
                             "the demo with the same storage is served from it (default: none)")
    CacheSettings.add_arguments(parser)
    parser.set_defaults(hicache_mem_layout=HostLayout.PAGE_FIRST_DIRECT.value,
                        hicache_storage_prefetch_policy="wait_complete")
    parser.epilog = (f"Sizes are checked before anything is allocated: the pools, scratch pages and token arrays may "
                     f"take at most {MEMORY_SHARE:.0%} of the memory this machine has available, and at most "
                     f"{gib(MEMORY_CAP)}; on a GPU the device pool at most {DEVICE_SHARE:.0%} of its memory. The "
                     f"demo's host layout defaults to page_first_direct (whole per-layer pieces: the fewest copies) "
                     f"and its storage prefetches to wait_complete (no clock in the results). Ctrl-C stops after the "
                     f"request in hand and shows the totals so far (exit code 130).")


def command(runtime: Any, args: argparse.Namespace) -> int:
    from rich.console import Console

    reporter = Reporter(quiet=args.json)
    model = args.model if args.model != "auto" else ("llama3-8b" if runtime.torch_device else "tiny")
    geometry, prefill_default = MODELS[model]
    settings = CacheSettings.from_arguments(args)
    if settings.prefill_tokens_per_s is None and prefill_default is not None:
        settings.prefill_tokens_per_s = prefill_default
    settings.calibrate = bool(runtime.torch_device)   # the emulator's timings are no link's: use the rate table
    if args.storage and model in STATES:
        raise KvtierError("--storage does not take hybrid models yet: state snapshots are not stored")
    sizes = plan(args, geometry, STATES.get(model), settings)
    check_memory(sizes, args, runtime)
    for note in sizes.notes:
        reporter.note(note)
    if sizes.device_bytes + sizes.host_bytes >= ANNOUNCE_BYTES:
        reporter.note(f"allocating a {gib(sizes.device_bytes)} device pool and a {gib(sizes.host_bytes)} host pool")
    rates = RateTable.load(args.hicache_rate_table) if args.hicache_rate_table else None
    report, tally = serve_all(runtime, args, model, settings, sizes, rates, reporter)
    if args.save:
        with open(args.save, "w") as file:
            json.dump(report, file, indent=1)
    if tally.interrupted:
        reporter.note(f"interrupted after {tally.handled:,} of {tally.planned:,} requests; "
                      f"the results below count those")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        show(Console(), report)
    if tally.interrupted:
        return INTERRUPTED
    return 1 if tally.mismatched_pages or tally.mismatched_states else 0


def serve_all(runtime: Any, args: argparse.Namespace, model: str, settings: CacheSettings, sizes: Plan,
              rates: RateTable | None, reporter: Reporter) -> tuple[dict[str, Any], Tally]:
    """Build the pools, cache and stand-ins, serve every request (or those before a Ctrl-C), and take everything
    down again, the cache's threads included."""
    geometry = sizes.geometry
    namespace = Namespace(f"kvtier-demo/{model}", geometry, "bfloat16")
    device = DevicePool.allocate(geometry, sizes.device_pages, 0, runtime=runtime)
    cache = stand_in = storage = host = None
    state_pools: tuple[StateDevicePool, StateHostPool] | None = None
    try:
        host = HostPool.allocate(geometry, settings.hicache_mem_layout, pages=sizes.host_pages,
                                 kind=settings.hicache_host_kind, runtime=runtime)
        if sizes.state is not None:
            state_pools = state_pools_for(sizes, runtime)
        storage = open_store(args.storage, namespace, layout=settings.hicache_mem_layout) if args.storage else None
        cache = KVCache(device, host, namespace, settings, rates=rates, storage=storage, state=state_pools)
        stand_in = StandInModel(device, namespace, sizes.scratch_pages)
        if state_pools is not None:
            stand_in.state = StandInState(state_pools[0], stand_in.salt)
        baseline = DeviceOnlyBaseline(sizes.device_pages, geometry.page_size, hybrid=state_pools is not None)
        watch = StorageWatch(storage, args.storage, reporter) if storage is not None else None
        tally = Tally(planned=sizes.requests)
        started = time.perf_counter()
        with stop_on_interrupt() as stop:
            reporter.start(sizes.requests, f"{sizes.requests:,} requests ({args.users:,} users, {args.turns:,} "
                                           f"turns each)")
            try:
                for _, prompt, reply in conversations(args):
                    if stop.is_set():
                        break
                    serve_turn(cache, stand_in, baseline, tally, prompt, reply, args.verify == "all")
                    tally.handled += 1
                    if watch is not None:
                        watch.check()
                    reporter.advance(hits(tally, storage is not None))
            finally:
                reporter.stop()
            tally.interrupted = stop.is_set()
            cache.drain()
        elapsed = time.perf_counter() - started
        return results(cache, tally, elapsed, model, runtime.name, sizes.device_pages, sizes.host_pages), tally
    finally:
        if stand_in is not None:
            stand_in.close()
        if cache is not None:
            cache.close()
        if storage is not None:
            storage.close()
        for pool in state_pools or ():
            pool.close()
        if host is not None:
            host.close()
        device.close()


def hits(tally: Tally, storage: bool) -> str:
    seen = max(tally.prompt_tokens, 1)
    return (f"hits: device {tally.device_hit / seen:.0%}, host {tally.host_hit / seen:.0%}"
            + (f" (storage {tally.storage_hit / seen:.0%})" if storage else ""))


def state_pools_for(sizes: Plan, runtime: Any) -> tuple[StateDevicePool, StateHostPool]:
    """Device slots for about half the users' snapshots plus the request in flight; host slots for all of them
    (:func:`~kvtier.cli.demo_workload.plan` counts them)."""
    assert sizes.state is not None
    device = StateDevicePool.allocate(sizes.state, sizes.device_state_slots, 0, runtime=runtime)
    try:
        host = StateHostPool.allocate(sizes.state, "page_first", slots=sizes.host_state_slots, kind="pinned",
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
    with cache.request(prompt) as request:          # storage prefetch settled, matched, host part loading
        request.wait()
        check_loaded(request, model, tally, keys, verify)
        prefix = request.prefix_pages
        cached = len(prefix) * page
        whole = len(prompt) // page
        try:
            new = request.allocate()
        except OutOfPages:
            tally.out_of_pages += 1
            return
        model.write(keys[len(prefix):whole], new)
        request.insert()
        tally.requests += 1
        tally.prompt_tokens += len(prompt)
        tally.device_hit += request.device_tokens
        tally.host_hit += cached - request.device_tokens
        tally.storage_hit += min(request.fetched_tokens, cached - request.device_tokens)
        tally.computed += len(prompt) - cached
        tally.baseline_computed += len(prompt) - baseline.serve(prompt)
    cache.drain()                                    # the prompt's backups land while the model decodes
    if len(reply):                                   # decode: the reply's KV joins the history
        with cache.request(full, load_back=False, prefetch=False) as history:
            history.wait()
            try:
                extra = history.allocate()
                model.write(keys[len(history.prefix_pages):], extra)
                history.insert()
            except OutOfPages:
                tally.out_of_pages += 1
        cache.drain()                                # and the reply's while the user reads it


def check_loaded(request: CacheRequest, model: StandInModel, tally: Tally, keys: list[bytes], verify: bool) -> None:
    """Count the request's load-back (or that it was declined) and check every page it loaded, byte for byte."""
    tally.declined += request.declined
    if request.load is None:
        return
    tally.loaded += request.loaded_tokens
    if verify:
        assert request.match is not None                 # a request with a load has matched
        prefix, start = request.prefix_pages, len(request.match.device_pages)
        tally.pages_checked += len(prefix) - start
        tally.mismatched_pages += model.mismatches(keys[start:len(prefix)], prefix[start:])


def serve_hybrid_turn(cache: KVCache, model: StandInModel, baseline: DeviceOnlyBaseline, tally: Tally,
                      prompt: np.ndarray, reply: np.ndarray, verify: bool) -> None:
    """One turn of a hybrid model: the prompt's whole pages are served from the deepest prefix with a state (loaded
    back with its state when it is in host memory; from the deepest device snapshot when the load is declined), then
    the prompt and, after decode, the history are inserted, each with the state after its last token."""
    page = cache.page_size
    prompt = prompt[:len(prompt) // page * page]
    keys = page_keys(cache.namespace, np.concatenate([prompt, reply]))
    with cache.request(prompt) as request:
        request.wait()
        check_loaded(request, model, tally, keys, verify)
        prefix, state = request.prefix_pages, request.state
        if verify and len(prefix):
            assert model.state is not None and state is not None
            tally.states_checked += 1
            tally.mismatched_states += not model.state.matches(keys[len(prefix) - 1], state)
        if not insert_with_state(request, model, tally, keys):
            return
        served = len(prefix) * page
        tally.requests += 1
        tally.prompt_tokens += len(prompt)
        tally.device_hit += min(request.device_tokens, served)
        tally.host_hit += served - min(request.device_tokens, served)
        tally.computed += len(prompt) - served
        tally.baseline_computed += len(prompt) - baseline.serve(prompt)
    cache.drain()
    full = np.concatenate([prompt, reply])
    full = full[:len(full) // page * page]
    if len(full) > len(prompt):                      # decode: the reply's KV and the state after it join
        with cache.request(full, load_back=False, device_only=True, prefetch=False) as history:
            history.wait()
            insert_with_state(history, model, tally, keys)
        cache.drain()


def insert_with_state(request: CacheRequest, model: StandInModel, tally: Tally, keys: list[bytes]) -> bool:
    """Prefill the request's tokens past its prefix (KV and the state after the last token) and insert both."""
    assert model.state is not None
    whole = len(request.tokens) // request.cache.page_size
    try:
        slot = request.allocate_state()
        new = request.allocate()
    except OutOfPages:
        tally.out_of_pages += 1
        return False
    model.write(keys[len(request.prefix_pages):whole], new)
    model.state.write(keys[whole - 1], slot)
    request.insert()
    return True
