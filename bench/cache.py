"""Cache benchmark: the control plane (match / insert / evict / page keys) on the CPU, and the data plane (load-back
of a long prefix, both directions at once) on a GPU.

Control-plane rows follow the inputs SGLang's radix caches were measured with (random token ids, vocab 128256): a
1k / 8k / 32k / 128k-token prompt into an empty index and into one holding 1,000 conversations of 2,048 tokens that
share a 512-token system prompt (also inserted in 8k-token chunks, as chunked prefill does); eviction of 1M tokens of
2k- and 768-token sequences; page keys of a 128k-token prompt. Times are medians, through ``KVCache`` (locks, page
checks and metrics included), on pools of the emulated runtime (no bytes move in these rows).

Data-plane rows (``--data``, CUDA): a Llama-3-8B prefix (default 32k tokens) loaded back from host memory with one
event per layer, against the contiguous memcpy ceiling of the same run; and a load-back beside a backup of the same
size, for every backend pair, against the both-ways ceiling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _options import name_list  # noqa: E402

from kvtier.cache import CacheSettings, KVCache, Namespace, page_keys  # noqa: E402
from kvtier.cache.settings import IO_BACKENDS  # noqa: E402
from kvtier.pools import DevicePool, HostPool, KVGeometry  # noqa: E402
from kvtier.runtime import get as get_runtime  # noqa: E402

VOCAB = 128256
K = 1024


def median_ms(fn, repeats: int, setup=None) -> float:
    times = []
    for _ in range(repeats):
        state = setup() if setup else None
        start = time.perf_counter()
        fn(state) if setup else fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def control_cache(runtime, page: int, tokens: int) -> tuple[KVCache, DevicePool, HostPool]:
    g = KVGeometry.k_only(layers=1, heads=1, head_dim=32, itemsize=2, page_size=page)
    dev = DevicePool.allocate(g, tokens // page + 8, 0, runtime=runtime)
    host = HostPool.allocate(g, "page_first", pages=1, kind="pinned", runtime=runtime)
    settings = CacheSettings(write_policy="write_through_selective", write_through_threshold=1 << 30,
                             io_backend="direct", calibrate=False)
    return KVCache(dev, host, Namespace("bench", g, "bfloat16"), settings), dev, host


def close(cache, dev, host) -> None:
    cache.close()
    host.close()
    dev.close()


def control(runtime, page_sizes, lengths, conversations, repeats, console) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []

    def row(**kw):
        rows.append(kw)
        console.log(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()))

    longest = max(lengths)
    for page in page_sizes:
        # empty index: insert into it, match the prompt just inserted (a full hit) and a fresh one (a miss)
        cache, dev, host = control_cache(runtime, page, 2 * longest)
        for length in lengths:
            prompt = rng.integers(0, VOCAB, length)

            def fresh(prompt=prompt, cache=cache, page=page):
                cache.evict(device_pages=cache.device.pages)
                return cache.allocate(len(prompt) // page)

            insert = median_ms(lambda pages, prompt=prompt, cache=cache: cache.insert(prompt, pages), repeats, fresh)
            hit = median_ms(lambda prompt=prompt, cache=cache: cache.match_prefix(prompt), repeats)
            misses = iter([rng.integers(0, VOCAB, length) for _ in range(repeats)])
            miss = median_ms(lambda cache=cache, misses=misses: cache.match_prefix(next(misses)), repeats)
            row(index="empty", page=page, tokens=length, insert_ms=insert, match_hit_ms=hit, match_miss_ms=miss)
        close(cache, dev, host)

        # 1,000 conversations of 2,048 tokens sharing a 512-token system prompt
        cache, dev, host = control_cache(runtime, page, conversations * 2 * K + 4 * longest + 8 * K)
        system = rng.integers(0, VOCAB, 512)
        start = time.perf_counter()
        for _ in range(conversations):
            convo = np.concatenate([system, rng.integers(0, VOCAB, 2 * K - 512)])
            cache.insert(convo, cache.allocate(len(convo) // page))
        fill_s = time.perf_counter() - start
        for length in lengths:
            prompts = [np.concatenate([system, rng.integers(0, VOCAB, length - 512)]) for _ in range(repeats)]
            pending = iter(prompts)

            def take(cache=cache, pending=pending, page=page):
                prompt = next(pending)
                return prompt, cache.allocate(len(prompt) // page)

            insert = median_ms(lambda state, cache=cache: cache.insert(*state), repeats, take)
            hit = median_ms(lambda prompt=prompts[0], cache=cache: cache.match_prefix(prompt), repeats)
            chunked = np.concatenate([system, rng.integers(0, VOCAB, length - 512)])
            chunk_ms = 0.0
            for end in range(8 * K, length + 8 * K, 8 * K):
                part = chunked[:min(end, length)]
                have = cache.match_prefix(part).device_pages
                pages = np.concatenate([have, cache.allocate(len(part) // page - len(have))])
                begin = time.perf_counter()
                cache.insert(part, pages)
                chunk_ms += 1e3 * (time.perf_counter() - begin)
            chunk_hit = median_ms(lambda chunked=chunked, cache=cache: cache.match_prefix(chunked), repeats)
            row(index="1000 conversations", page=page, tokens=length, insert_ms=insert, match_hit_ms=hit,
                chunked_insert_ms=chunk_ms, chunked_match_ms=chunk_hit, fill_s=fill_s)
        close(cache, dev, host)

        # eviction of 1M tokens
        for seq in (2 * K, 768):
            count = -(-1_000_000 // seq) + 1
            cache, dev, host = control_cache(runtime, page, count * seq + 8 * K)
            for _ in range(count):
                convo = rng.integers(0, VOCAB, seq)
                cache.insert(convo, cache.allocate(seq // page))
            begin = time.perf_counter()
            cache.evict(device_pages=1_000_000 // page)
            evict_ms = 1e3 * (time.perf_counter() - begin)
            row(index=f"{count} sequences of {seq}", page=page, tokens=1_000_000, evict_ms=evict_ms)
            close(cache, dev, host)

        g = KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=page)
        ns = Namespace("bench", g, "bfloat16")
        prompt = rng.integers(0, VOCAB, 128 * K)
        row(index="keys", page=page, tokens=128 * K,
            keys_ms=median_ms(lambda ns=ns, prompt=prompt: page_keys(ns, prompt), repeats))
    return rows


def data_plane(runtime, tokens: int, pairs, repeats, console) -> dict:
    """Load-back of a ``tokens``-long Llama-3-8B prefix and load + backup at once, per backend pair.

    Every byte a row times is checked (bench/_verify.py): the prefix's device pages hold random bytes before they are
    backed up; before each timed repeat every device page is poisoned (the load-back takes its pages from them) and,
    in the both-ways rows, every host page but the prefix's (the backup takes its pages from them), and the fresh
    prompt's pages get random bytes. After the repeats, the last load-back's device pages are compared with the host
    pages it read, and the last backup's host pages with the device pages it wrote from."""
    from _verify import described, fill, kv_device, kv_host, merged, poison, verify

    from kvtier.cli.doctor_probe import probe_bandwidth

    g = KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=16)
    pages = tokens // g.page_size
    nbytes = pages * g.bytes_per_page
    ceiling = probe_bandwidth(runtime, min(nbytes, 1 << 30))
    console.log(f"ceiling: H2D {ceiling['h2d_gbps']:.1f}, D2H {ceiling['d2h_gbps']:.1f}, "
                f"both {ceiling['bidirectional_gbps']:.1f} GB/s")
    dev = DevicePool.allocate(g, 2 * pages + 8, 0, runtime=runtime)
    host = HostPool.allocate(g, "page_first", pages=2 * pages + 8, kind="pinned", runtime=runtime)
    rng = np.random.default_rng(0)
    out = {"ceiling": ceiling, "tokens": tokens, "bytes": nbytes, "rows": []}
    device_pages, host_pages, every_device = kv_device(dev), kv_host(host), np.arange(dev.pages)

    def landed(load, what: str) -> dict:
        """The load-back's device pages against the host pages it read."""
        return verify(what, device_pages, load.device_pages, host_pages, load.host_pages)

    def written(inserted, what: str) -> dict:
        """The write-through backup's host pages against the device pages of the prompt it wrote."""
        nodes, node = [], inserted.node
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return verify(what, host_pages, np.concatenate([n.host for n in nodes]), device_pages,
                      np.concatenate([n.device for n in nodes]))

    try:
        for load_name, backup_name in pairs:
            settings = CacheSettings(load_backend=load_name, backup_backend=backup_name, io_backend=load_name,
                                     calibrate=False, load_back_min_tokens=0)
            cache = KVCache(dev, host, Namespace("bench", g, "bfloat16"), settings)
            try:
                prefix = rng.integers(0, VOCAB, tokens)
                prefix_pages = cache.allocate(pages)
                fill(device_pages, prefix_pages)            # the prefix's KV: random bytes, never zeros
                cache.insert(prefix, prefix_pages)
                cache.drain()
                loads, both = [], []
                for i in range(repeats + 1):
                    cache.evict(device_pages=dev.pages)
                    poison(device_pages, every_device)      # all free: the load-back takes its pages from them
                    runtime.synchronize(0)
                    match = cache.match_prefix(prefix)
                    start = time.perf_counter()
                    load = cache.load_back(match, force=True)
                    submitted = time.perf_counter() - start
                    load.wait_layer(0)
                    first_layer = time.perf_counter() - start
                    load.wait()
                    elapsed = time.perf_counter() - start
                    cache.drain()
                    if i:
                        loads.append((elapsed, first_layer, submitted))
                label = f"{tokens}-token prefix, {load_name}/{backup_name}"
                checks = [landed(load, f"{label} load-back")]
                # both directions: a load-back beside the write-through backup of a fresh prompt of the same size
                for i in range(repeats + 1):
                    cache.evict(device_pages=dev.pages)
                    cache.drain()
                    match = cache.match_prefix(prefix)
                    cache.lock(match)                       # keeps the prefix's host copy; the rest goes
                    cache.evict(host_pages=host.pages)
                    fresh = rng.integers(0, VOCAB, tokens)
                    new_pages = cache.allocate(pages)
                    poison(device_pages, every_device)      # the load-back's pages come from here
                    fill(device_pages, new_pages)           # the fresh prompt's KV, which the backup reads
                    kept = np.concatenate([node.host for node in match.host_nodes])
                    poison(host_pages, np.setdiff1d(np.arange(host.pages), kept))   # the backup's pages
                    runtime.synchronize(0)
                    start = time.perf_counter()
                    inserted = cache.insert(fresh, new_pages)   # queues the backup (write_through)
                    load = cache.load_back(match, force=True)
                    load.wait()
                    cache.drain()
                    elapsed = time.perf_counter() - start
                    cache.unlock(match)
                    if i:
                        both.append(elapsed)
                checks += [landed(load, f"{label} load-back beside a backup"),
                           written(inserted, f"{label} backup beside a load-back")]
                t, first, queued = min(loads)
                row = {"load": load_name, "backup": backup_name, "load_ms": 1e3 * t, "queue_ms": 1e3 * queued,
                       "first_layer_ms": 1e3 * first,
                       "load_gbps": nbytes / t / 1e9, "load_pct": 100 * nbytes / t / 1e9 / ceiling["h2d_gbps"],
                       "both_gbps": 2 * nbytes / min(both) / 1e9,
                       "both_pct": 100 * 2 * nbytes / min(both) / 1e9 / ceiling["bidirectional_gbps"],
                       "verified": described(merged(*checks))}   # a table cell: render() prints every value
                out["rows"].append(row)
                console.log(row)
            finally:
                cache.close()
    finally:
        host.close()
        dev.close()
    return out


def render(console, rows, data) -> None:
    table = Table(title="control plane (ms, median)")
    columns = ["index", "page", "tokens", "insert_ms", "match_hit_ms", "match_miss_ms", "chunked_insert_ms",
               "chunked_match_ms", "evict_ms", "keys_ms"]
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*[("" if c not in r else f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]))
                        for c in columns])
    console.print(table)
    if data:
        table = Table(title=f"data plane: {data['tokens']} tokens of Llama-3-8B ({data['bytes'] / 2**30:.2f} GiB)")
        for c in ("load", "backup", "load_ms", "queue_ms", "first_layer_ms", "load_gbps", "load_pct", "both_gbps",
                  "both_pct"):
            table.add_column(c, justify="right")
        for r in data["rows"]:
            table.add_row(*[f"{v:.1f}" if isinstance(v, float) else str(v) for v in r.values()])
        console.print(table)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", help="runtime of the data-plane rows (default: kvtier's choice); the control "
                                           "plane always runs on emulated:split")
    parser.add_argument("--page-sizes", default="1,16,64",
                        help="tokens per page of the control-plane rows, comma-separated (default: %(default)s)")
    parser.add_argument("--lengths", default="1024,8192,32768,131072",
                        help="prompt lengths in tokens of the control-plane rows, comma-separated "
                             "(default: %(default)s)")
    parser.add_argument("--conversations", type=int, default=1000,
                        help="conversations already in the index the control-plane rows match and insert into "
                             "(default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed repeats, median reported; the data plane runs half as many "
                             "(default: %(default)s)")
    parser.add_argument("--no-control", action="store_true", help="skip the control-plane rows")
    parser.add_argument("--data", action="store_true", help="data-plane rows (on the runtime; meant for CUDA)")
    parser.add_argument("--data-tokens", type=int, default=32 * K,
                        help="prefix length of the data-plane rows in tokens (default: %(default)s)")
    parser.add_argument("--pairs", default="kernel/kernel,staged/staged,kernel/staged",
                        type=name_list([f"{a}/{b}" for a in IO_BACKENDS for b in IO_BACKENDS], "LOAD/BACKUP pair"),
                        help="LOAD/BACKUP backend pairs of the data-plane rows, comma-separated "
                             "(default: %(default)s)")
    parser.add_argument("--json", help="write rows here")
    args = parser.parse_args(argv)
    console = Console()
    rows, data = [], None
    if not args.no_control:
        control_runtime = get_runtime("emulated:split")
        rows = control(control_runtime, [int(x) for x in args.page_sizes.split(",")],
                       [int(x) for x in args.lengths.split(",")], args.conversations, args.repeats, console)
    if args.data:
        runtime = get_runtime(args.runtime)
        pairs = [tuple(p.split("/")) for p in args.pairs]
        data = data_plane(runtime, args.data_tokens, pairs, max(1, args.repeats // 2), console)
    render(console, rows, data)
    if args.json:
        Path(args.json).write_text(json.dumps({"control": rows, "data": data}, indent=1))


if __name__ == "__main__":
    main()
