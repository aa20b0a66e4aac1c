"""End-to-end time to first token (TTFT) of a transformers model whose prompt prefix was seen before, kvtier beside
the alternatives, all in one run.

Model: Llama-3-8B-shaped (32 layers, 32 heads, 8 KV heads, head dim 128, bf16) with random weights (weights do not
change the timing; nothing is downloaded). For each prefix length and suffix length, TTFT of:

- ``recompute``: the whole prompt through the model.
- ``torch device hit``: the prefix's KV already on the device in a ``DynamicCache``; only the suffix is computed.
- ``torch copy, then compute``: each layer's contiguous K/V copied from pinned memory, then the suffix computed.
- ``DynamicCache(offloading=True)``: transformers' own offloaded cache (prefetches the next layer on a side stream).
- ``kvtier device hit``: the prefix in kvtier's device pool (gathered per layer into the model's layout).
- ``kvtier host, overlap`` / ``no overlap``: the prefix only in kvtier's host tier; loaded back with one event per
  layer, attention of layer i waiting on the GPU for layer i (or for the whole load first).
- ``kvtier file store``: the prefix only in a file store (read back through the host tier; the page cache is warm).
- ``torch layer-wise overlap (peer)``: what kvtier's host tier is held against, in plain torch: each layer's K/V copied
  from pinned memory on a side stream, an event per layer, layer i's attention waiting on the GPU for event i only.
  ``vs peer`` is a row's TTFT over this one's.

``bound`` = max(prefix KV bytes / contiguous pinned H2D ceiling measured in the same run, torch device-hit TTFT): the
time of the link or of the compute, whichever is longer; ``x bound`` is a row's TTFT over it. TTFT is measured from
the request to the first token's id on the CPU, median of ``--repeats`` after one warm-up; every row computes only the
last position's logits. Every timed run's first token must be the device hit's (the run fails otherwise; on
transformers' offloaded cache, another library's row, a different token is shown on the row instead); before
each host-tier or storage request every device page of kvtier's pool is poisoned, and the peer's device K/V too, so a
load that did not land changes the token.

``--turns`` adds the multi-turn run: users × turns of ``--turn-tokens`` new tokens each (and ``--decode`` generated
tokens), round-robin over users, with a device pool too small for all conversations; kvtier with the host tier
against the same device pool without one (a radix cache that recomputes what it evicted).

Usage: python3 bench/e2e.py [--lengths 1k,4k,16k,32k,64k] [--suffixes 64,2k] [--turns 20x8] [--json PATH]
On a machine without a GPU: python bench/e2e.py --tiny --runtime emulated:unified (a smoke run, not a speed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", help="kvtier runtime (default: cuda when present, else emulated:unified)")
    parser.add_argument("--lengths", default="1k,4k,16k,32k,64k",
                        help="prefix lengths in tokens, comma-separated (default: %(default)s)")
    parser.add_argument("--suffixes", default="64,2k",
                        help="new tokens after the prefix, comma-separated (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed repeats after one warm-up, median reported (default: %(default)s)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    parser.add_argument("--load-backend", default="direct", choices=["direct", "kernel", "staged", "batch"],
                        help="kvtier's load backend (default: %(default)s)")
    parser.add_argument("--host-layout", default="layer_first",
                        choices=["layer_first", "page_first", "page_first_direct", "page_head"],
                        help="kvtier's host pool layout (default: %(default)s)")
    parser.add_argument("--load-blocks", type=int, help="SMs for kvtier's kernel loads (default: 2)")
    parser.add_argument("--no-storage", action="store_true", help="skip the file store row")
    parser.add_argument("--logits", default="4k",
                        help="prefix length of the logits check, '' to skip (default: %(default)s)")
    parser.add_argument("--turns", default="",
                        help="multi-turn run USERSxTURNS, e.g. 20x8 (default: '', no multi-turn run)")
    parser.add_argument("--turn-tokens", default="2k",
                        help="new prompt tokens per turn in the multi-turn run (default: %(default)s)")
    parser.add_argument("--decode", type=int, default=8,
                        help="tokens generated per turn in the multi-turn run (default: %(default)s)")
    parser.add_argument("--turn-device-tokens", default="48k",
                        help="device pool of the multi-turn run in tokens (default: %(default)s)")
    parser.add_argument("--trace", default="", help="PREFIX+SUFFIX[,…], e.g. 32k+64: a per-layer timeline of "
                                                     "one host-tier request, GPU only (default: '', none)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer toy model (smoke run without a GPU)")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help and bad arguments answer before torch and transformers load (tens of seconds)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _verify import kv_device, poison, same_answers  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

from kvtier.cache import CacheSettings  # noqa: E402
from kvtier.integrations.transformers import KVTierGeneration, cache_keyword  # noqa: E402

console = Console(width=150)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                 rope_theta=500000.0)
TINY = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=8192)


def tokens(text: str) -> int:
    return int(float(text[:-1]) * 1024) if text.lower().endswith("k") else int(text)


def make_model(shape: dict, device: str) -> Any:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM._from_config(LlamaConfig(**shape), dtype=dtype)
    return model.eval()


class Clock:
    """Wall time of one request, from the call to the first token's id on the CPU."""

    def __init__(self, device: str) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time(self, fn: Any, repeats: int, before: Any = None) -> float:
        """Median ms over ``repeats`` timed runs after one warm-up; ``before()`` (untimed) sets each run up."""
        return self.answered(fn, repeats, before)[0]

    def answered(self, fn: Any, repeats: int, before: Any = None) -> tuple[float, list[Any]]:
        """``time``, and what each timed run returned (a request's first token id)."""
        samples, answers = [], []
        for i in range(repeats + 1):
            state = before() if before else None
            self.sync()
            start = time.perf_counter()
            answer = fn(state)
            elapsed = (time.perf_counter() - start) * 1e3
            if i:
                samples.append(elapsed)
                answers.append(answer)
        return statistics.median(samples), answers


def first_token(model: Any, ids: Any, past: Any) -> int:
    with torch.no_grad():
        logits = model(ids, **{cache_keyword(model): past}, logits_to_keep=1).logits
    return int(logits[0, -1].argmax().item())


def cache_of(kv: list[tuple[Any, Any]], model: Any, *, offloading: bool = False) -> Any:
    """A ``DynamicCache`` holding ``kv`` as it stands (no copy), as transformers leaves one between steps; with
    ``offloading`` the tensors are expected on the CPU, where transformers' offloaded cache keeps them."""
    past = DynamicCache(config=model.config, offloading=offloading)
    device = next(model.parameters()).device
    for layer, (k, v) in zip(past.layers, kv, strict=True):
        layer.lazy_initialization(k.new_empty(0, device=device), v.new_empty(0, device=device))
        layer.keys, layer.values = k, v
    return past


class WaitingLayer(DynamicLayer):
    """The peer's cache layer: K/V whose copy may still be running on a side stream; the layer's first ``update``
    (its attention) makes the compute stream wait for that layer's event, and only that one."""

    def __init__(self, keys: Any, values: Any, landed: Any) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.landed = keys, values, landed

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if self.landed is not None:
            torch.cuda.current_stream().wait_event(self.landed)
            self.landed = None
        return super().update(key_states, value_states, *args, **kwargs)


def layer_wise(pinned: list[tuple[Any, Any]], targets: list[tuple[Any, Any]], stream: Any) -> Any:
    """The plain-torch layer-wise overlap: each layer's K/V copied from pinned memory into ``targets`` on ``stream``
    (after the compute stream's earlier work), an event recorded after each layer; a cache whose layer i waits for
    event i. Returns at once: the copies run while the model computes."""
    stream.wait_stream(torch.cuda.current_stream())
    layers = []
    with torch.cuda.stream(stream):
        for (k, v), (k_dev, v_dev) in zip(pinned, targets, strict=True):
            k_dev.copy_(k, non_blocking=True)
            v_dev.copy_(v, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(stream)
            layers.append(WaitingLayer(k_dev, v_dev, landed))
    return Cache(layers=layers)


PEER = "torch layer-wise overlap (peer)"
REFERENCE = "torch device hit"
OTHERS = ("DynamicCache(offloading=True)",)
"""Rows of another library: a first token unlike the device hit's is reported on the row (``wrong first token``) and
the row leaves the comparison, instead of failing the run; every row of kvtier's and of this script's own must agree."""


def h2d_ceiling(device: str) -> float:
    """GB/s of a contiguous 1 GiB pinned → device copy (median of 5), the link's ceiling in this run."""
    if device != "cuda":
        return float("nan")
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(6):
        start.record()
        target.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return (1 << 30) / statistics.median(times[1:]) / 1e9


class Prefix:
    """One prefix, cached every way the rows need it: in kvtier (device, host and storage tiers, by insertion), as
    device tensors, and as pinned host tensors."""

    def __init__(self, model: Any, generation: KVTierGeneration, clock: Clock, length: int) -> None:
        self.model, self.generation, self.clock, self.length = model, generation, clock, length
        self.tokens = torch.randint(0, model.config.vocab_size, (1, length), device=clock.device)
        with generation.request(torch.cat([self.tokens, self.tokens[:, :1]], dim=1)) as request:
            assert request.cached_tokens == 0
            first_token(model, self.tokens, request.cache)
            self.kv = [(layer.keys.clone(), layer.values.clone()) for layer in request.cache.kvtier_layers]
            request.finish(self.tokens)
        generation.cache.drain()
        self.kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in self.kv)
        self.pinned = [(k.to("cpu").pin_memory(), v.to("cpu").pin_memory()) for k, v in self.kv] \
            if clock.device == "cuda" else []

    def cases(self, ids: Any, with_storage: bool) -> list[tuple[str, Any, Any]]:
        """(row, timed call, untimed set-up) for a prompt of this prefix and a suffix."""
        model, tail = self.model, ids[:, self.length:]
        cases: list[tuple[str, Any, Any]] = [
            ("recompute", lambda _: first_token(model, ids, DynamicCache(config=model.config)), None),
            ("torch device hit", lambda past: first_token(model, tail, past), lambda: cache_of(self.kv, model)),
            ("kvtier device hit", *self.kvtier(ids)),
        ]
        if self.pinned:
            side = torch.cuda.Stream()
            cases += [
                ("torch copy, then compute", lambda _: first_token(model, tail, cache_of(
                    [(k.to("cuda", non_blocking=True), v.to("cuda", non_blocking=True)) for k, v in self.pinned],
                    model)), None),
                ("DynamicCache(offloading=True)", lambda past: (past.prefetch(0), first_token(model, tail, past))[1],
                 lambda: cache_of(self.pinned, model, offloading=True)),
                (PEER, lambda targets: first_token(model, tail, layer_wise(self.pinned, targets, side)),
                 lambda: [(torch.full_like(k, 7.0, device="cuda"), torch.full_like(v, 7.0, device="cuda"))
                          for k, v in self.pinned]),           # poisoned: a copy that did not land shows
            ]
        cases += [("kvtier host, overlap", *self.kvtier(ids, where="host")),
                  ("kvtier host, no overlap", *self.kvtier(ids, overlap=False, where="host"))]
        if with_storage:
            cases.append(("kvtier file store", *self.kvtier(ids, where="storage")))
        return cases

    def kvtier(self, ids: Any, *, overlap: bool = True, where: str = "device") -> tuple[Any, Any]:
        """A request through kvtier with the prefix only on the device, in the host tier, or in storage."""
        generation, cache = self.generation, self.generation.cache

        def before() -> None:
            if where != "device":
                cache.drain()
                cache.evict(device_pages=cache.device.pages, host_pages=cache.host.pages if where == "storage" else 0)
                free = np.flatnonzero(~cache.device.used_mask())
                poison(kv_device(cache.device_pool), free)        # the load-back lands in free pages

        def run(_: Any) -> int:
            with generation.request(ids, overlap=overlap) as request:
                assert request.cached_tokens == self.length, (where, request.turn)
                return first_token(self.model, ids[:, self.length:], request.cache)
        return run, before


def measure_length(model: Any, generation: KVTierGeneration, clock: Clock, length: int, suffixes: list[int],
                   repeats: int, ceiling: float, with_storage: bool) -> list[dict]:
    prefix = Prefix(model, generation, clock, length)
    rows = []
    for suffix in suffixes:
        ids = torch.cat([prefix.tokens, torch.randint(0, model.config.vocab_size, (1, suffix), device=clock.device)],
                        dim=1)
        results, answers = {}, {}
        for name, fn, before in prefix.cases(ids, with_storage):
            results[name], answers[name] = clock.answered(fn, repeats, before)
        theirs = {name: answers.pop(name) for name in OTHERS if name in answers}
        same_answers(f"{length:,}-token prefix + {suffix:,}: first token", answers, REFERENCE)
        answers.update(theirs)
        link = prefix.kv_bytes / ceiling / 1e6 if ceiling == ceiling else 0.0
        bound = max(link, results[REFERENCE])
        for name, ms in results.items():
            rows.append({"prefix": length, "suffix": suffix, "row": name, "ttft_ms": ms, "bound_ms": bound,
                         "link_ms": link, "kv_bytes": prefix.kv_bytes, "x_bound": ms / bound,
                         "speedup": results["recompute"] / ms,
                         "vs_peer": ms / results[PEER] if PEER in results else None,
                         "verified": {"first_token": answers[name][0], "runs": len(answers[name]),
                                      "equals": REFERENCE if set(answers[name]) == {answers[REFERENCE][0]}
                                      else None}})
    rows.append(gather_cost(generation, prefix.tokens, clock))
    return rows


def gather_cost(generation: KVTierGeneration, prefix: Any, clock: Clock) -> dict:
    """Time of the per-layer gather from kvtier's device pages into ``[1, heads, tokens, dim]`` for every layer (the
    work a kvtier hit adds over a contiguous cache), and its rate in bytes read + written."""
    paged, cache = generation.paged, generation.cache
    match = cache.match_prefix(prefix[0].cpu().numpy(), lock=True)
    try:
        index = paged.index(match.device_pages)
        empty = torch.empty((1, paged.heads, 0, paged.head_dim), dtype=paged.dtype, device=paged.device)
        layers = cache.geometry.layers
        ms = clock.time(lambda _: ([paged.gather(i, index, empty, empty) for i in range(layers)], clock.sync()), 3)
    finally:
        cache.unlock(match)
    moved = 2 * len(match.device_pages) * cache.geometry.bytes_per_page      # read + written
    return {"prefix": prefix.shape[1], "row": "gather", "ms": ms, "gbps": moved / ms / 1e6,
            "pages": len(match.device_pages)}


def trace(model: Any, generation: KVTierGeneration, clock: Clock, length: int, suffix: int) -> list[dict]:
    """One host-tier request with layer-wise overlap, timed per layer: when the CPU reached the layer's attention
    (``fill``), when the layer's load landed and when the compute stream passed its wait (GPU events, from the start
    of the request). Shows where TTFT above the bound goes."""
    from cuda.bindings import runtime as cudart

    prefix = Prefix(model, generation, clock, length)
    ids = torch.cat([prefix.tokens, torch.randint(0, model.config.vocab_size, (1, suffix), device="cuda")], dim=1)
    run, before = prefix.kvtier(ids, where="host")
    run(before())                                       # warm-up
    before()
    paged, marks, start = generation.paged, [], torch.cuda.Event(enable_timing=True)
    gather = paged.gather

    def traced(layer: int, index: Any, keys: Any, values: Any) -> tuple[Any, Any]:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((layer, (time.perf_counter() - begin) * 1e3, event))
        return gather(layer, index, keys, values)
    paged.gather = traced                               # type: ignore[method-assign]
    try:
        clock.sync()
        begin = time.perf_counter()
        start.record()
        with generation.request(ids) as request:
            queued = (time.perf_counter() - begin) * 1e3
            first_token(model, ids[:, length:], request.cache)
            loads = request.load.transfer.layer_events if request.load is not None else {}
        total = (time.perf_counter() - begin) * 1e3
    finally:
        del paged.gather
    rows = []
    for layer, cpu_ms, event in marks:
        landed = loads.get(layer)
        rows.append({"layer": layer, "cpu_ms": cpu_ms, "passed_ms": start.elapsed_time(event),
                     "landed_ms": (cudart.cudaEventElapsedTime(start.cuda_event, landed.native)[1]
                                   if landed is not None else None)})
    console.print(f"trace, {length:,}-token prefix + {suffix}: load queued in {queued:.1f} ms (CPU), TTFT {total:.1f} "
                  "ms", highlight=False)
    for r in rows:
        if r["layer"] % 4 == 0 or r["layer"] == len(rows) - 1:
            console.print(f"  layer {r['layer']:2d}: CPU reached it {r['cpu_ms']:6.1f} ms, load landed "
                          f"{r['landed_ms'] or float('nan'):6.1f} ms, compute passed the wait {r['passed_ms']:6.1f} ms",
                          highlight=False)
    return [{"queued_ms": queued, "ttft_ms": total}, *rows]


def logits_check(model: Any, generation: KVTierGeneration, length: int, device: str) -> dict:
    """Last-token logits with the prefix loaded back from the host tier, with it on the device (the same bytes),
    and recomputed: bitwise equality of the first two, max abs difference and top-5 agreement against the third."""
    cache, vocab = generation.cache, model.config.vocab_size
    prefix = torch.randint(0, vocab, (1, length), device=device)
    ids = torch.cat([prefix, torch.randint(0, vocab, (1, 64), device=device)], dim=1)
    with generation.request(torch.cat([prefix, prefix[:, :1]], dim=1)) as request:
        first_token(model, prefix[:, request.cached_tokens:], request.cache)
        request.finish(prefix)

    def logits() -> Any:
        with generation.request(ids) as request, torch.no_grad():
            return model(ids[:, request.cached_tokens:], **{cache_keyword(model): request.cache},
                         logits_to_keep=1).logits[0, -1].float()
    on_device = logits()
    cache.drain()
    cache.evict(device_pages=cache.device.pages)
    from_host = logits()
    with torch.no_grad():
        recomputed = model(ids, logits_to_keep=1).logits[0, -1].float()
    top = set(recomputed.topk(5).indices.tolist())
    return {"prefix": length, "host_equals_device": bool(torch.equal(from_host, on_device)),
            "max_abs_diff_vs_recompute": float((from_host - recomputed).abs().max()),
            "top5_agreement": len(top & set(from_host.topk(5).indices.tolist())) / 5,
            "argmax_equal": int(from_host.argmax()) == int(recomputed.argmax())}


def multi_turn(model: Any, generation: KVTierGeneration, clock: Clock, users: int, turns: int, turn_tokens: int,
               decode: int, label: str) -> dict:
    """Round-robin conversations: each turn appends ``turn_tokens`` new tokens, takes the first token (TTFT) and
    ``decode`` more greedily, and inserts the conversation so far."""
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(7)
    histories = [torch.empty((1, 0), dtype=torch.long) for _ in range(users)]
    ttfts, prompt_tokens, computed = [], 0, 0
    start = time.perf_counter()
    for turn in range(turns):
        console.print(f"  {label}: turn {turn + 1}/{turns}", highlight=False)
        for user in range(users):
            ids = torch.cat([histories[user], torch.randint(0, vocab, (1, turn_tokens), generator=generator)], dim=1)
            ids = ids.to(clock.device)
            clock.sync()
            begin = time.perf_counter()
            with generation.request(ids) as request:
                past = request.cache
                with torch.no_grad():
                    out = model(ids[:, request.cached_tokens:], **{cache_keyword(model): past}, logits_to_keep=1)
                    token = out.logits[:, -1:].argmax(-1)
                    token.item()
                    ttfts.append((time.perf_counter() - begin) * 1e3)
                    generated = [token]
                    for _ in range(decode - 1):
                        token = model(token, **{cache_keyword(model): past}, logits_to_keep=1).logits[:, -1:].argmax(-1)
                        generated.append(token)
                sequence = torch.cat([ids, *generated], dim=1)
                request.finish(sequence)
            prompt_tokens += ids.shape[1]
            computed += request.turn.computed_tokens
            histories[user] = sequence.cpu()
    seconds = time.perf_counter() - start
    ordered = sorted(ttfts)
    return {"run": label, "users": users, "turns": turns, "turn_tokens": turn_tokens, "decode": decode,
            "seconds": seconds, "turns_per_s": users * turns / seconds,
            "tokens_per_s": (prompt_tokens + users * turns * decode) / seconds,
            "ttft_mean_ms": statistics.fmean(ttfts), "ttft_p99_ms": ordered[min(len(ordered) - 1,
                                                                                int(0.99 * len(ordered)))],
            "prompt_tokens": prompt_tokens, "computed_tokens": computed}


def show(rows: list[dict], ceiling: float) -> None:
    table = Table(title=f"TTFT, ms (H2D ceiling {ceiling:.1f} GB/s, same run; every timed run's first token is the "
                        f"{REFERENCE}'s)")
    for column in ("prefix", "suffix", "row", "TTFT ms", "bound ms", "x bound", "vs recompute", "vs peer",
                   "first token"):
        table.add_column(column, justify="left" if column == "row" else "right")
    for r in rows:
        if r["row"] == "gather":
            continue
        table.add_row(f"{r['prefix']:,}", f"{r['suffix']:,}", r["row"], f"{r['ttft_ms']:.1f}", f"{r['bound_ms']:.1f}",
                      f"{r['x_bound']:.2f}", f"{r['speedup']:.1f}x",
                      "" if r.get("vs_peer") is None else f"{r['vs_peer']:.2f}",
                      f"{r['verified']['first_token']} x{r['verified']['runs']}"
                      + ("" if r["verified"]["equals"] else " (wrong first token)"))
    console.print(table)
    for r in rows:
        if r["row"] == "gather":
            console.print(f"gather from pages, all layers, {r['prefix']:,}-token prefix: {r['ms']:.2f} ms "
                          f"({r['gbps']:.0f} GB/s read + written)", highlight=False)


def main(args: argparse.Namespace | None = None) -> None:
    args = args or parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    runtime = args.runtime or ("cuda" if device == "cuda" else "emulated:unified")
    lengths = [tokens(x) for x in args.lengths.split(",") if x]
    suffixes = [tokens(x) for x in args.suffixes.split(",") if x]
    model = make_model(TINY if args.tiny else LLAMA3_8B, device)
    clock = Clock(device)
    ceiling = h2d_ceiling(device)
    results: dict[str, Any] = {"runtime": runtime, "device": torch.cuda.get_device_name() if device == "cuda" else
                               "cpu", "h2d_gbps": ceiling, "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}
    traces = [tuple(tokens(x) for x in item.split("+")) for item in args.trace.split(",") if item]
    biggest = max(lengths + [tokens(args.logits) if args.logits else 0] + [length for length, _ in traces]) \
        + max(suffixes + [suffix for _, suffix in traces]) + args.page_size
    settings = CacheSettings(calibrate=False, load_back_min_tokens=0, storage_queue_pages=1 << 20,
                             load_backend=args.load_backend,
                             **({"max_blocks": args.load_blocks} if args.load_blocks else {}))
    with tempfile.TemporaryDirectory() as root, contextlib.ExitStack() as stack:
        generation = KVTierGeneration.build(model, device_tokens=biggest, host_tokens=biggest, runtime=runtime,
                                            page_size=args.page_size, settings=settings, host_layout=args.host_layout,
                                            storage=None if args.no_storage else f"file:{root}")
        stack.callback(generation.close)
        rows: list[dict] = []
        for length in lengths:
            console.print(f"prefix {length:,} tokens …", highlight=False)
            rows += measure_length(model, generation, clock, length, suffixes, args.repeats, ceiling,
                                   not args.no_storage)
        results["rows"] = rows
        save(args.json, results)
        show(rows, ceiling)
        if device == "cuda":
            results["traces"] = [trace(model, generation, clock, length, suffix) for length, suffix in traces]
        save(args.json, results)
        if args.logits:
            check = logits_check(model, generation, tokens(args.logits), device)
            results["logits"] = check
            console.print(f"logits, {check['prefix']:,}-token prefix from the host tier: bitwise equal to the device "
                          f"hit: {check['host_equals_device']}; vs recompute max |diff| "
                          f"{check['max_abs_diff_vs_recompute']:.4g}, top-5 agreement "
                          f"{check['top5_agreement']:.0%}, argmax equal: {check['argmax_equal']}", highlight=False)
    if args.turns:
        users, turns = (int(x) for x in args.turns.lower().split("x"))
        results["multi_turn"] = run_turns(model, clock, runtime, users, turns, tokens(args.turn_tokens), args.decode,
                                          tokens(args.turn_device_tokens), args.page_size, settings,
                                          args.host_layout)
    save(args.json, results)


def save(path: str | None, results: dict) -> None:
    """Write what has been measured so far (a run cut short keeps its finished phases)."""
    if path:
        Path(path).write_text(json.dumps(results, indent=1))


def run_turns(model: Any, clock: Clock, runtime: str, users: int, turns: int, turn_tokens: int, decode: int,
              device_tokens: int, page_size: int, settings: CacheSettings, host_layout: str) -> list[dict]:
    """The multi-turn run with the host tier (large enough for every conversation) and without (one page of it,
    loads declined): the same device pool, the same conversations."""
    total = users * turns * (turn_tokens + decode) + page_size
    runs = []
    for label, host_tokens, loads in (("with host tier", total, settings),
                                      ("device only", page_size, CacheSettings(
                                          calibrate=False, load_back_min_tokens=1 << 40,
                                          load_backend=settings.load_backend))):
        generation = KVTierGeneration.build(model, device_tokens=device_tokens, host_tokens=host_tokens,
                                            runtime=runtime, page_size=page_size, settings=loads,
                                            host_layout=host_layout)
        try:
            runs.append(multi_turn(model, generation, clock, users, turns, turn_tokens, decode, label))
        finally:
            generation.close()
    table = Table(title=f"{users} users x {turns} turns of {turn_tokens:,} tokens (+{decode} generated), device pool "
                        f"{device_tokens:,} tokens")
    for column in ("run", "turns/s", "tokens/s", "TTFT mean ms", "TTFT p99 ms", "computed / prompt tokens"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for r in runs:
        table.add_row(r["run"], f"{r['turns_per_s']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['ttft_mean_ms']:.1f}",
                      f"{r['ttft_p99_ms']:.1f}", f"{r['computed_tokens']:,} / {r['prompt_tokens']:,}")
    console.print(table)
    return runs


if __name__ == "__main__":
    main(ARGS)
