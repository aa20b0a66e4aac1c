"""Cache benchmark: the control plane (match / insert / evict / page keys) on the CPU, beside SGLang's own radix
caches in the same process, and the data plane (load-back of a long prefix, both directions at once) on a GPU.

Control-plane rows follow the inputs SGLang's radix caches were measured with (random token ids, vocab 128256): a
1k / 8k / 32k / 128k-token prompt into an empty index (and a miss: a fresh prompt), and into one holding 1,000
conversations of 2,048 tokens that share a 512-token system prompt (also inserted in 8k-token chunks, as chunked
prefill does, each chunk after a match of the earlier ones); eviction of 1M tokens of 2k- and 768-token sequences;
page keys of a 128k-token prompt beside SGLang's native page hashes. Every row runs on each subject of
bench/_radix_peers.py on the same inputs, interleaved (each repeat runs every subject once, in a rotated order):
kvtier's ``KVCache`` (locks, page checks, events and metrics included, on pools of the emulated runtime: no bytes
move), kvtier's ``RadixIndex`` alone, SGLang 0.5.23's ``RadixCache`` (Python) and ``UnifiedRadixCache`` (its default
Rust tree core), each fed tokens in its engine's own form and slots from its own allocator. Times are the CPU time
of the calling thread per call (median; worst and wall time in the JSON). The subjects' answers (matched tokens) must
agree or the run fails.

Data-plane rows (``--data``, CUDA): a Llama-3-8B prefix (default 32k tokens) loaded back from host memory with one
event per layer, against the contiguous memcpy ceiling of the same run; and a load-back beside a backup of the same
size, for every backend pair, against the both-ways ceiling.
"""

from __future__ import annotations

import argparse
import gc
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
from _radix_peers import KVTierIndex, sglang_missing, subjects  # noqa: E402
from _verify import fail, planted  # noqa: E402

from kvtier.cache import CacheSettings, KVCache, Namespace, page_keys  # noqa: E402
from kvtier.cache.settings import IO_BACKENDS  # noqa: E402
from kvtier.pools import DevicePool, HostPool, KVGeometry  # noqa: E402
from kvtier.runtime import get as get_runtime  # noqa: E402

VOCAB = 128256
K = 1024


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


class Rows:
    """Control-plane rows: each case timed on every subject in the same process, interleaved (each repeat runs every
    subject once, in an order rotated per repeat), CPU time of this thread per call (what a scheduler step spends;
    steadier than wall time on a loaded machine; wall time is kept beside it). Every subject must give the same
    answer (matched tokens) for the same input, or the run fails: a fast wrong match would look like a win."""

    def __init__(self, names: list[str], console) -> None:
        self.names, self.console, self.rows = names, console, []

    def time(self, case: str, page: int, tokens: int, subjects: list, repeats: int, setup, call,
             expect: int | None = None) -> None:
        cpu = {s.name: [] for s in subjects}
        wall = {s.name: [] for s in subjects}
        answers: dict[str, list] = {s.name: [None] * repeats for s in subjects}
        for r in range(repeats):
            for s in subjects[r % len(subjects):] + subjects[: r % len(subjects)]:
                state = setup(s, r)
                c0, w0 = time.thread_time(), time.perf_counter()
                answer = call(s, state)
                w1, c1 = time.perf_counter(), time.thread_time()
                s.settle()
                cpu[s.name].append(c1 - c0)
                wall[s.name].append(w1 - w0)
                answers[s.name][r] = answer
        check_answers(f"{case}, page {page}, {tokens} tokens", answers, expect)
        row = {"case": case, "page": page, "tokens": tokens, "answers": next(iter(answers.values())),
               "cpu_ms": {n: 1e3 * statistics.median(v) for n, v in cpu.items()},
               "cpu_ms_worst": {n: 1e3 * max(v) for n, v in cpu.items()},
               "wall_ms": {n: 1e3 * statistics.median(v) for n, v in wall.items()}}
        self.rows.append(row)
        self.console.log(f"{case} page {page} {tokens}: " +
                         ", ".join(f"{n} {v:.3f}" for n, v in row["cpu_ms"].items()))


def check_answers(what: str, answers: dict[str, list], expect: int | None) -> None:
    """Every subject gave the same answer (matched tokens) in every repeat, and ``expect`` where the row knows it (a
    full hit); ``KVTIER_BENCH_PLANT=1`` changes one answer to show the check failing the run."""
    if planted():
        last = list(answers)[-1]
        answers[last][-1] = f"{answers[last][-1]} (planted)"
    first, reference = next(iter(answers.items()))
    for name, values in answers.items():
        if values != reference:
            r = next(i for i, (a, b) in enumerate(zip(values, reference, strict=True)) if a != b)
            raise fail(what, f"{name!r} answered {values[r]!r} in repeat {r}, {first!r} {reference[r]!r}")
        if expect is not None and any(v != expect for v in values):
            raise fail(what, f"{name!r} answered {[v for v in values if v != expect][0]!r}, a full hit is {expect}")


def build(kinds, page: int, capacity: int) -> list:
    return [kind(page, capacity) for kind in kinds]


def close_all(subjects) -> None:
    for s in subjects:
        s.close()
    gc.collect()                  # the next rows' timings should not pay for collecting these trees' cycles


def warm_up(subjects, page: int, length: int, rounds: int = 12) -> None:
    """Untimed rounds of inserts and matches through every subject, which it leaves empty, before their first row:
    first calls pay once for what no scheduler step pays in steady state (code and data first touched, allocators
    growing, the core's clock); measured, a run's first row's first repeats ran 2-4x their steady cost for every
    subject, and with a median of 7 that moved the row by up to 1.7x."""
    rng = np.random.default_rng(1)
    for _ in range(rounds):
        prompt = rng.integers(0, VOCAB, length)
        for s in subjects:
            s.evict_all()
            tokens = s.tokens(prompt)
            s.insert(tokens, s.pages(length // page))
            s.settle()
            s.match(tokens)
    for s in subjects:
        s.evict_all()


def control(kinds, page_sizes, lengths, conversations, repeats, console) -> list[dict]:
    """The rows of SGLang's radix-cache measurements, through every subject (bench/_radix_peers.py)."""
    rng = np.random.default_rng(0)
    rows = Rows([k.name for k in kinds], console)
    longest = max(lengths)
    evictors = [k for k in kinds if k is not KVTierIndex]
    for page in page_sizes:
        # empty index: insert a prompt into it, match that prompt (a full hit) and a fresh one (cold: a miss)
        subjects = build(kinds, page, 2 * longest + 8 * page)
        try:
            warm_up(subjects, page, min(lengths))
            for length in lengths:
                prompts = [rng.integers(0, VOCAB, length) for _ in range(repeats)]
                misses = [rng.integers(0, VOCAB, length) for _ in range(repeats)]

                def fresh(s, r, prompts=prompts, length=length, page=page):
                    s.evict_all()
                    return s.tokens(prompts[r]), s.pages(length // page)

                rows.time("insert, empty index", page, length, subjects, repeats, fresh,
                          lambda s, state: s.insert(*state))
                rows.time("match hit, one prompt", page, length, subjects, repeats,
                          lambda s, r, prompts=prompts: s.tokens(prompts[-1]), lambda s, t: s.match(t), expect=length)
                rows.time("match cold (miss)", page, length, subjects, repeats,
                          lambda s, r, misses=misses: s.tokens(misses[r]), lambda s, t: s.match(t))
        finally:
            close_all(subjects)

        # populated: conversations of 2,048 tokens sharing a 512-token system prompt
        chunk = 8 * K
        inserted = sum(lengths) * (repeats + 1) + conversations * 2 * K
        subjects = build(kinds, page, inserted + 8 * K)
        try:
            system = rng.integers(0, VOCAB, 512)
            for _ in range(conversations):
                convo = np.concatenate([system, rng.integers(0, VOCAB, 2 * K - 512)])
                for s in subjects:
                    s.insert(s.tokens(convo), s.pages(len(convo) // page))
            for length in lengths:
                prompts = [np.concatenate([system, rng.integers(0, VOCAB, length - 512)]) for _ in range(repeats)]
                rows.time("insert, populated", page, length, subjects, repeats,
                          lambda s, r, prompts=prompts, length=length, page=page:
                          (s.tokens(prompts[r]), s.pages(length // page), 0),
                          lambda s, state: s.insert(*state))
                rows.time("match hit, populated", page, length, subjects, repeats,
                          lambda s, r, prompts=prompts: s.tokens(prompts[0]), lambda s, t: s.match(t), expect=length)
                chunked = np.concatenate([system, rng.integers(0, VOCAB, length - 512)])
                ends = list(range(chunk, length, chunk)) + [length]

                def one_chunk(s, r, chunked=chunked, ends=ends, page=page):
                    part = s.tokens(chunked[:ends[r]])
                    slots, owned = s.with_prefix(part, ends[r] // page)
                    return part, slots, owned

                rows.time("insert, chunked (one 8k chunk)", page, length, subjects, len(ends), one_chunk,
                          lambda s, state: s.insert(*state))
                rows.time("match hit, after chunked inserts", page, length, subjects, repeats,
                          lambda s, r, chunked=chunked: s.tokens(chunked), lambda s, t: s.match(t), expect=length)
        finally:
            close_all(subjects)

        # eviction of 1M tokens (the index alone has no eviction)
        for seq in (2 * K, 768):
            count = -(-1_000_000 // seq) + 1
            subjects = build(evictors, page, count * seq + 8 * K)
            try:
                sequences = [rng.integers(0, VOCAB, seq) for _ in range(count)]

                def fill(s, r, sequences=sequences, seq=seq, page=page):
                    s.evict_all()
                    for tokens in sequences:
                        s.insert(s.tokens(tokens), s.pages(seq // page))

                rows.time(f"evict 1M tokens of {count} sequences of {seq}", page, 1_000_000, subjects,
                          max(1, repeats // 2), fill, lambda s, state: s.evict(1_000_000))
            finally:
                close_all(subjects)
    return rows.rows


def keys(page_sizes, repeats, with_sglang: bool, console) -> list[dict]:
    """Page keys of a 128k-token prompt: kvtier's ``page_keys`` beside SGLang's own page hashes (``get_hash_str``,
    its native SHA-256 chain, from the same tokens in its requests' ``array("q")``)."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, VOCAB, 128 * K)
    rows = []
    for page in page_sizes:
        g = KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=page)
        ns = Namespace("bench", g, "bfloat16")
        row = {"case": "page keys of a prompt", "page": page, "tokens": len(prompt),
               "ms": {"kvtier page_keys": median_ms(lambda ns=ns: page_keys(ns, prompt), repeats)}}
        if with_sglang:
            from array import array

            from sglang.srt.mem_cache.utils import get_hash_str

            ids = array("q", prompt.tolist())
            get_hash_str(ids[:page], None, page)              # its first call builds or loads the extension
            row["ms"]["SGLang get_hash_str (native)"] = median_ms(lambda ids=ids, page=page:
                                                                  get_hash_str(ids, None, page), repeats)
        rows.append(row)
        console.log(row)
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


RUST = "SGLang UnifiedRadixCache (Rust)"


def render(console, rows, key_rows, data) -> None:
    if rows:
        names = list(rows[0]["cpu_ms"])
        table = Table(title="control plane (CPU ms per call, median; same process, interleaved)")
        for c in ["case", "page", "tokens", *names] + (["kvtier / Rust"] if RUST in names else []):
            table.add_column(c, justify="right")
        for r in rows:
            cells = [f"{r['cpu_ms'][n]:.3f}" if n in r["cpu_ms"] else "" for n in names]
            ratio = [f"{r['cpu_ms']['kvtier KVCache'] / r['cpu_ms'][RUST]:.2f}"] if RUST in r["cpu_ms"] else []
            table.add_row(r["case"], str(r["page"]), str(r["tokens"]), *cells, *ratio)
        console.print(table)
    if key_rows:
        table = Table(title="page keys of a 128k-token prompt (ms, median)")
        names = list(key_rows[0]["ms"])
        for c in ["page", *names]:
            table.add_column(c, justify="right")
        for r in key_rows:
            table.add_row(str(r["page"]), *[f"{r['ms'][n]:.2f}" for n in names])
        console.print(table)
    if data:
        table = Table(title=f"data plane: {data['tokens']} tokens of Llama-3-8B ({data['bytes'] / 2**30:.2f} GiB)")
        for c in ("load", "backup", "load_ms", "queue_ms", "first_layer_ms", "load_gbps", "load_pct", "both_gbps",
                  "both_pct", "verified"):
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
    parser.add_argument("--no-sglang", action="store_true",
                        help="leave SGLang's RadixCache and UnifiedRadixCache out of the control-plane rows (they run "
                             "by default, and a run without them fails unless this is given)")
    parser.add_argument("--data", action="store_true", help="data-plane rows (on the runtime; meant for CUDA)")
    parser.add_argument("--data-tokens", type=int, default=32 * K,
                        help="prefix length of the data-plane rows in tokens (default: %(default)s)")
    parser.add_argument("--pairs", default="kernel/kernel,staged/staged,kernel/staged",
                        type=name_list([f"{a}/{b}" for a in IO_BACKENDS for b in IO_BACKENDS], "LOAD/BACKUP pair"),
                        help="LOAD/BACKUP backend pairs of the data-plane rows, comma-separated "
                             "(default: %(default)s)")
    parser.add_argument("--json", help="write rows here")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)
    rows, key_rows, data = [], [], None
    if not args.no_control:
        missing = None if args.no_sglang else sglang_missing()
        if missing:
            parser.error(f"{missing}; or give --no-sglang")
        page_sizes = [int(x) for x in args.page_sizes.split(",")]
        rows = control(subjects(not args.no_sglang), page_sizes, [int(x) for x in args.lengths.split(",")],
                       args.conversations, args.repeats, console)
        key_rows = keys(page_sizes, args.repeats, not args.no_sglang, console)
    if args.data:
        runtime = get_runtime(args.runtime)
        pairs = [tuple(p.split("/")) for p in args.pairs]
        data = data_plane(runtime, args.data_tokens, pairs, max(1, args.repeats // 2), console)
    render(console, rows, key_rows, data)
    if args.json:
        Path(args.json).write_text(json.dumps({"control": rows, "keys": key_rows, "data": data}, indent=1))


if __name__ == "__main__":
    main()
