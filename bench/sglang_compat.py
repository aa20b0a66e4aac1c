"""Each ``kvtier.compat.sglang.kvcacheio`` function against the equivalent kvtier engine call, same memory, same run.

For each geometry and host layout the script allocates one device pool and one host pool, moves N random pages (1 GiB
by default) with a ``TransferEngine`` (kernel backend at ``--blocks`` SMs, or the DMA backend the compat function
corresponds to), then the same pages with the compat function over the very same memory (token indices, tables of
``data_ptr()``s, ``block_quota`` = ``--blocks``), and reports both rates against the same run's contiguous ceiling.
Per-layer rows call the compat function once per layer, as SGLang's load-back does (a launch per layer); the engine row
is one per-layer load (one launch, each layer signalled from the device), and a second engine column gives the same
load as a launch per layer (``layer_signals=False``; for the DMA rows, one engine call per layer): the API's own cost
apart from the compat layer's. ``page_head`` is
compared with kvtier's own head-major layout, which orders a head's tokens and layers the other way round (same
256-byte pieces). ``--stream side`` runs the compat calls on a torch stream of their own, as SGLang's HiCache does.
Each repeat gives the compat calls new index tensors (same values), as each SGLang request brings its own;
``--same-indices`` reuses one set.

Where SGLang is installed and a CUDA GPU is present, a third side runs SGLang 0.5.23's own HiCache JIT kernels (what
its host pool calls for ``layer_first`` and ``page_first`` on CUDA, built from the sources in the ``sglang`` wheel;
bench/_sglang_kernels.py) on the same memory and indices: once at ``--blocks`` and once at SGLang's default block
quota. Every side's destination is poisoned before its last repeat and checked after it.

Run on a GPU machine: ``python bench/sglang_compat.py [--json out.json]``; ``--runtime emulated:split`` is a smoke test
on the CPU emulator (the numbers are not speeds).
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

sys.path.insert(0, str(Path(__file__).parent))
import _sglang_kernels  # noqa: E402
from _verify import described, kv_device, kv_host, merged, poison, verify  # noqa: E402
from _verify import fill as fill_units  # noqa: E402
from transfer import GEOMETRIES, bench_runtime, fill  # noqa: E402

from kvtier.cli.doctor_probe import probe_bandwidth  # noqa: E402
from kvtier.memory import HostBuffer, HostKind  # noqa: E402
from kvtier.pools import DevicePool, HostPool  # noqa: E402
from kvtier.pools.geometry import Strides  # noqa: E402
from kvtier.transfer import TransferEngine  # noqa: E402

EMULATED_NOTE = "note: {name} runs Python reference kernels on the CPU, so these numbers are not speeds"
ENGINE, COMPAT, LAYERED, SGLANG, SGLANG_DEFAULT = ("engine", "compat", "engine, a launch (call) per layer",
                                                  "SGLang's kernel", "SGLang's kernel at its default quota")
"""The sides of a row (the third for per-layer functions only, the SGLang ones where its kernels load)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", help="cuda, emulated:split or emulated:unified (default: kvtier's choice)")
    parser.add_argument("--geometry", action="append", choices=["llama3-8b-p16", "dsv3-mla-p16"],
                        help="repeatable (default: both)")
    parser.add_argument("--blocks", type=int, default=2, help="SM budget of both sides (default: 2)")
    parser.add_argument("--gib", type=float, help="GiB per transfer (default: 1; 1/256 on an emulated runtime)")
    parser.add_argument("--repeats", type=int, help="timed repeats after one warm-up (default: 3; 1 emulated)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--stream", choices=["default", "side"], default="default",
                        help="torch stream of the compat calls: the default (legacy) stream, or a stream of their own "
                             "(SGLang's HiCache loads and backups run on side streams) (default: %(default)s)")
    parser.add_argument("--same-indices", action="store_true",
                        help="give every repeat the same index tensors (default: new ones each repeat, as each "
                             "SGLang request brings its own)")
    parser.add_argument("--no-sglang", action="store_true", help="leave out SGLang's own kernels")
    parser.add_argument("--profile", metavar="FUNCTION", action="append", default=[],
                        help="also print where the host time of this compat function goes (cProfile); repeatable")
    args = parser.parse_args(argv)
    if args.blocks < 1 or (args.gib is not None and args.gib <= 0):
        parser.error("--blocks must be >= 1 and --gib positive")
    return args


class Memory:
    """Device layers as the compat functions take them (CUDA tensors, or DeviceArrays on the emulator) over one
    pool, and host views of one host pool, all as uint8 rows."""

    def __init__(self, runtime, name: str, g, pages: int, seed: HostBuffer, stream: str = "default") -> None:
        import torch

        from kvtier.compat import DeviceArray

        self.runtime, self.name, self.g, self.cuda = runtime, name, g, runtime.name == "cuda"
        self.stream = torch.cuda.Stream() if self.cuda and stream == "side" else None
        tokens = pages * g.page_size
        if self.cuda:
            self.layers = [[torch.empty((tokens, g.row_bytes), dtype=torch.uint8, device="cuda")
                            for _ in range(g.layers)] for _ in range(g.tensors)]
            self.pool = DevicePool.from_tensors(g, self.layers, runtime=runtime)
        else:
            self.pool = DevicePool.allocate(g, pages, 0, runtime=runtime)
            self.layers = [[DeviceArray(op, (tokens, g.row_bytes), torch.uint8) for op in row]
                           for row in self.pool.layers]
        fill(runtime, self.pool, seed)

    def tensor(self, x):
        import torch

        from kvtier.compat import DeviceArray

        return torch.as_tensor(np.ascontiguousarray(x, dtype=np.int64), device="cuda") if self.cuda else \
            DeviceArray.from_tensor(torch.as_tensor(np.ascontiguousarray(x, dtype=np.int64)), runtime=self.runtime)

    def table(self, operands):
        import torch

        from kvtier.compat import DeviceArray

        raw = torch.tensor([x.data_ptr() for x in operands], dtype=torch.uint64)
        return raw.to("cuda") if self.cuda else DeviceArray.from_tensor(raw, runtime=self.runtime)

    def on_stream(self, call):
        """``call`` on the chosen torch stream (``--stream``)."""
        if self.stream is None:
            return call

        def on_side():
            import torch

            with torch.cuda.stream(self.stream):
                call()
        return on_side

    def done(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.current_stream().synchronize()
            if self.stream is not None:
                self.stream.synchronize()
        else:
            self.runtime.synchronize(0)


def host_views(host: HostPool, tensors: int, shape) -> list:
    """Each tensor's region of the host buffer as a uint8 tensor of ``shape``."""
    flat = host.buffer.as_tensor()
    size = int(np.prod(shape))
    return [flat[host.tensor_offset(t):host.tensor_offset(t) + size].view(shape) for t in range(tensors)]


def timed(op, finish, setup=None) -> tuple[float, float]:
    """Seconds until ``op`` returned (host time to queue) and until its work finished, from an idle device;
    ``setup`` runs first, untimed."""
    if setup is not None:
        setup()
    finish()
    start = time.perf_counter()
    op()
    returned = time.perf_counter()
    finish()
    return returned - start, time.perf_counter() - start


def interleaved(sides, repeats: int, guard=None) -> tuple[list[tuple[float, float]], list[dict]]:
    """Per side ``(op, finish[, setup])``: the median (queued, done) seconds, the sides taken in turn each repeat
    after one warm-up round. Host-bound DMA rates drift 2-3x over a minute on the H200 host; alternating keeps the
    compat and engine figures of one row under the same drift.

    ``guard`` (``poison()``, ``verify(side)``): every side writes the same destination, so in the last round each
    side's destination is poisoned (untimed) before its op and checked right after it, each side on its own bytes;
    the checks are returned too."""
    samples: list[list[tuple[float, float]]] = [[] for _ in sides]
    checks = []
    for i in range(repeats + 1):
        for side, (op, finish, *setup) in enumerate(sides):
            last = guard is not None and i == repeats
            if last:
                guard[0]()
            result = timed(op, finish, *setup)
            if last:
                checks.append(guard[1](side))
            if i:
                samples[side].append(result)
    return [(statistics.median(q for q, _ in s), statistics.median(d for _, d in s)) for s in samples], checks


def profile(name: str, call, finish, calls: int, console, setup=None, rounds: int = 5) -> None:
    """Where a compat call's host time goes: ``rounds`` runs of ``call`` under cProfile (each after ``setup``, untimed,
    as in the measurement), the top functions by cumulative time (per compat call: divide by ``calls``)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    for _ in range(rounds):
        if setup is not None:
            setup()
        finish()
        profiler.enable()
        call()
        profiler.disable()
    finish()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
    console.print(f"profile of {name}: {rounds} rounds of {calls} compat call(s)\n{text.getvalue()}", markup=False,
                  highlight=False)


class Indices:
    """The index tensors of the compat calls: device ones for the kernel functions, CPU ones for ``*_direct``
    (SGLang's controller reads those on the host). ``fresh()`` makes new tensors of the same values, as each SGLang
    request brings its own (the old ones stay alive while the new are made, so no object or address is reused)."""

    def __init__(self, mem: Memory, tokens_dev, tokens_host) -> None:
        self.mem, self.tokens = mem, (tokens_dev, tokens_host)
        self.fresh()

    def fresh(self) -> None:
        import torch

        mem, (dev, host) = self.mem, self.tokens
        made = {"si": mem.tensor(dev), "di": mem.tensor(host), "hi": mem.tensor(host), "dd": mem.tensor(dev)}
        made.update({name: torch.as_tensor(np.ascontiguousarray(x, dtype=np.int64)) for name, x in
                     (("si_cpu", dev), ("di_cpu", host), ("hi_cpu", host), ("dd_cpu", dev))})
        self.__dict__.update(made)


def compat_cases(mem: Memory, host: HostPool, layout: str, tokens_dev, tokens_host, pages_dev, pages_host, blocks,
                 engine: TransferEngine):
    """((name, direction, call) of the compat functions that move these pages on this host layout, and their index
    tensors (``fresh()`` makes new ones)). Each call has the block shape of ``engine`` (the kernel engine it is
    compared with): SGLang's default of 32 warps a block against the engine's 512-thread backup blocks would measure
    the block shape, not the compat layer."""
    from kvtier.compat.sglang import kvcacheio

    g, L, item, ps = mem.g, mem.g.layers, mem.g.row_bytes, mem.g.page_size
    mla = g.tensors == 1
    ix = Indices(mem, tokens_dev, tokens_host)
    quota = {"block_quota": blocks, "num_warps_per_block": engine.threads // 32}
    backup = {"block_quota": blocks, "num_warps_per_block": engine.backup_threads // 32}
    K = mem.layers[0]
    V = mem.layers[1] if not mla else None
    host_tokens = host.pages * ps
    cases = []
    if layout == "page_first":
        hk = host_views(host, g.tensors, (host_tokens, L, item))
        tables = [mem.table(row) for row in mem.layers]
        if mla:
            cases.append(("transfer_kv_all_layer_mla_lf_pf", "backup",
                          lambda: kvcacheio.transfer_kv_all_layer_mla_lf_pf(tables[0], hk[0], ix.si, ix.di, item,
                                                                            L * item, L, **backup)))
            cases.append(("transfer_kv_per_layer_mla_pf_lf", "load",
                          lambda: [kvcacheio.transfer_kv_per_layer_mla_pf_lf(hk[0], K[layer], ix.hi, ix.dd, layer, item,
                                                                             L * item, **quota)
                                   for layer in range(L)]))
        else:
            cases.append(("transfer_kv_all_layer_lf_pf", "backup", lambda: kvcacheio.transfer_kv_all_layer_lf_pf(
                tables[0], hk[0], tables[1], hk[1], ix.si, ix.di, item, L * item, L, **backup)))
            cases.append(("transfer_kv_per_layer_pf_lf", "load", lambda: [kvcacheio.transfer_kv_per_layer_pf_lf(
                hk[0], K[layer], hk[1], V[layer], ix.hi, ix.dd, layer, item, L * item, **quota) for layer in range(L)]))
    elif layout == "layer_first":
        hl = host_views(host, g.tensors, (L, host_tokens, item))
        dev_tables = [mem.table(row) for row in mem.layers]
        host_tables = [mem.table([h[layer] for layer in range(L)]) for h in hl]
        if mla:
            cases.append(("transfer_kv_all_layer_mla", "backup", lambda: kvcacheio.transfer_kv_all_layer_mla(
                dev_tables[0], host_tables[0], ix.si, ix.di, item, L, **backup)))
            cases.append(("transfer_kv_per_layer_mla", "load", lambda: [kvcacheio.transfer_kv_per_layer_mla(
                hl[0][layer], K[layer], ix.hi, ix.dd, item, **quota) for layer in range(L)]))
        else:
            cases.append(("transfer_kv_all_layer", "backup", lambda: kvcacheio.transfer_kv_all_layer(
                dev_tables[0], host_tables[0], dev_tables[1], host_tables[1], ix.si, ix.di, item, L, **backup)))
            cases.append(("transfer_kv_per_layer", "load", lambda: [kvcacheio.transfer_kv_per_layer(
                hl[0][layer], K[layer], hl[1][layer], V[layer], ix.hi, ix.dd, item, **quota) for layer in range(L)]))
        flat = [h[layer] for h in hl for layer in range(L)]
        device_flat = [x for row in mem.layers for x in row]
        cases.append(("transfer_kv_direct", "load-dma", lambda: kvcacheio.transfer_kv_direct(
            flat, device_flat, ix.hi_cpu, ix.dd_cpu, ps)))
    elif layout == "page_head" and not mla:
        heads = g.heads
        hh = host_views(host, g.tensors, (host.pages, heads, ps, L, item // heads))
        tables = [mem.table(row) for row in mem.layers]
        cases.append(("transfer_kv_all_layer_lf_ph", "backup", lambda: kvcacheio.transfer_kv_all_layer_lf_ph(
            tables[0], hh[0], tables[1], hh[1], ix.si, ix.di, item, L * item, L, ps, heads, **backup)))
        cases.append(("transfer_kv_per_layer_ph_lf", "load", lambda: [kvcacheio.transfer_kv_per_layer_ph_lf(
            hh[0], K[layer], hh[1], V[layer], ix.hi, ix.dd, layer, item, L * item, ps, heads, **quota)
            for layer in range(L)]))
    elif layout == "page_first_direct":
        hd = host_views(host, g.tensors, (host.pages, L, ps, item))
        device_flat = [x for row in mem.layers for x in row]
        cases.append(("transfer_kv_all_layer_direct_lf_pf", "backup-dma", lambda: (
            kvcacheio.transfer_kv_all_layer_direct_lf_pf(device_flat, hd, ix.si_cpu, ix.di_cpu, ps))))
        cases.append(("transfer_kv_per_layer_direct_pf_lf", "load-dma", lambda: [
            kvcacheio.transfer_kv_per_layer_direct_pf_lf(hd, [row[layer] for row in mem.layers], ix.hi_cpu, ix.dd_cpu,
                                                         layer, ps)
            for layer in range(L)]))
    return cases, ix


def sglang_sides(hicache, mem: Memory, host: HostPool, layout: str, ix: Indices, blocks: int) -> dict:
    """{compat function: [(side name, SGLang's call, its kernel)]}: SGLang's own kernel for the same move at
    ``blocks`` and at SGLang's default quota (when that differs), on ``mem``'s stream."""
    if isinstance(hicache, str):
        return {}
    g = mem.g
    shape = (host.pages * g.page_size, g.layers, g.row_bytes) if layout == "page_first" else \
        (g.layers, host.pages * g.page_size, g.row_bytes)
    hosts = host_views(host, g.tensors, shape)
    sides: dict[str, list] = {}
    kernels = {name: _sglang_kernels.kernel_name(hicache, g.row_bytes, quota, g.page_size)
               for name, quota in ((SGLANG, blocks), (SGLANG_DEFAULT, None))}
    for name, quota in ((SGLANG, blocks), (SGLANG_DEFAULT, None)):
        if name == SGLANG_DEFAULT and kernels[name] == kernels[SGLANG]:
            continue   # SGLang's default quota is --blocks: one side says it
        kernel = kernels[name]
        for function, call in _sglang_kernels.cases(hicache, mem, layout, hosts, ix, quota).items():
            sides.setdefault(function, []).append((name, mem.on_stream(call), kernel))
    return sides


def checked_copy(pool: DevicePool, host: HostPool, side: str, op: str, pages_dev, pages_host) -> tuple:
    """(destination side, its pages, source side, its pages) of one side's copy, as ``verify`` takes them. The compat
    calls read and write a ``page_head`` host pool in SGLang's order (page, head, token, layer), not kvtier's (page,
    head, layer, token): their host pages are read that way."""
    g = pool.geometry
    strides = None
    if side == COMPAT and host.layout.value == "page_head":
        head_bytes = g.head_bytes
        strides = Strides(layer=head_bytes, page=g.heads * g.page_size * g.layers * head_bytes,
                          slot=g.layers * head_bytes, head=g.page_size * g.layers * head_bytes)
    device_pages, host_pages = kv_device(pool), kv_host(host, strides=strides)
    if op.startswith("backup"):
        return host_pages, pages_host, device_pages, pages_dev
    return device_pages, pages_dev, host_pages, pages_host


def measure(mem, host, layout, tokens, pages_dev, pages_host, engines, ops, ceiling, args, console,
            hicache) -> list[dict]:
    """Every side of every compat function of this layout (in a function of its own, so the host views the calls
    hold are gone before the host pool closes)."""
    rows = []
    g, name = mem.g, mem.name
    cases, ix = compat_cases(mem, host, layout, *tokens, pages_dev, pages_host, args.blocks, engines["kernel"])
    theirs = sglang_sides(hicache, mem, host, layout, ix, args.blocks)
    fresh = () if args.same_indices else (ix.fresh,)
    for function, op, call in cases:
        backend, engine_op = ops[op]
        engine = engines[backend]
        sides = {ENGINE: (lambda e=engine, f=engine_op: f(e).wait(), engine.synchronize),
                 COMPAT: (mem.on_stream(call), mem.done, *fresh)}
        per_layer = function.startswith("transfer_kv_per_layer")
        if per_layer and backend == "kernel":   # SGLang's per-layer API is a launch per layer; the engine's is one
            layered = engines["kernel-layers"]
            sides[LAYERED] = (lambda e=layered, f=engine_op: f(e).wait(), layered.synchronize)
        elif per_layer:   # a DMA load as SGLang asks for it: one engine call per layer
            sides[LAYERED] = (lambda e=engine: [e.load(pages_host, pages_dev, layers=[layer])
                                                for layer in range(g.layers)][-1].wait(), engine.synchronize)
        kernels = {}
        for side, their_call, kernel in theirs.get(function, []):
            sides[side] = (their_call, mem.done, *fresh)
            kernels[side] = kernel
        names = list(sides)
        copies = [checked_copy(mem.pool, host, side, op, pages_dev, pages_host) for side in names]
        what = f"{name} {layout} {function}"
        guard = (lambda copy=copies[0]: poison(copy[0], copy[1]),
                 lambda side, copies=copies, what=what, names=names: verify(f"{what}, {names[side]} side",
                                                                             *copies[side]))
        timing_list, checks = interleaved(list(sides.values()), args.repeats, guard)
        timings = dict(zip(names, timing_list, strict=True))
        (q_engine, t_engine), (q_compat, t_compat) = timings[ENGINE], timings[COMPAT]
        calls = g.layers if function.startswith("transfer_kv_per_layer") else 1
        if function in args.profile:
            profile(function, *sides[COMPAT][:2], calls, console, *sides[COMPAT][2:])
        key = "d2h_gbps" if op.startswith("backup") else "h2d_gbps"
        nbytes = len(pages_dev) * g.bytes_per_page
        threads = engine.backup_threads if op == "backup" else engine.threads
        row = {"geometry": name, "layout": layout, "function": function, "direction": op,
               "engine": f"{backend}:{args.blocks}x{threads}" if backend == "kernel" else "batch",
               "engine_gbps": nbytes / t_engine / 1e9, "compat_gbps": nbytes / t_compat / 1e9,
               "compat_queued_ms": 1e3 * q_compat, "engine_queued_ms": 1e3 * q_engine, "calls": calls,
               "compat_call_us": 1e6 * q_compat / calls, "verified": merged(*checks)}
        row["engine_pct"] = 100 * row["engine_gbps"] / ceiling[key]
        row["compat_pct"] = 100 * row["compat_gbps"] / ceiling[key]
        row["compat_vs_engine_pct"] = 100 * t_engine / t_compat
        if per_layer:
            row["engine_layer_launches_gbps"] = nbytes / timings[LAYERED][1] / 1e9
            row["compat_vs_layer_launches_pct"] = 100 * timings[LAYERED][1] / t_compat
        for side, field in ((SGLANG, "sglang"), (SGLANG_DEFAULT, "sglang_default")):
            if side in timings:
                row[f"{field}_kernel"] = kernels[side]
                row[f"{field}_gbps"] = nbytes / timings[side][1] / 1e9
                row[f"{field}_pct"] = 100 * row[f"{field}_gbps"] / ceiling[key]
                row[f"{field}_vs_engine_pct"] = 100 * t_engine / timings[side][1]
        rows.append(row)
        theirs_text = "".join(f", SGLang's kernel {row[f + '_kernel']} {row[f + '_gbps']:.1f} ({row[f + '_pct']:.0f}%)"
                              for f in ("sglang", "sglang_default") if f + "_gbps" in row)
        console.log(f"{name} {layout} {function}: compat {row['compat_gbps']:.1f} GB/s "
                    f"({row['compat_pct']:.0f}%), engine {row['engine_gbps']:.1f} ({row['engine_pct']:.0f}%)"
                    f"{theirs_text}, verified {described(row['verified'])}")
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console(width=240)
    runtime, emulated = bench_runtime(args, console, EMULATED_NOTE, emulated_gib=1 / 256)
    size = int(args.gib * (1 << 30))
    ceiling = probe_bandwidth(runtime, min(1 << 30, max(1 << 20, size)))
    console.log(f"ceiling: H2D {ceiling['h2d_gbps']:.1f}, D2H {ceiling['d2h_gbps']:.1f} GB/s")
    seed = HostBuffer.allocate(min(256 << 20, max(1 << 20, size)), HostKind.PINNED, runtime=runtime)
    seed.as_tensor().numpy()[:] = np.random.default_rng().integers(0, 256, seed.nbytes, dtype=np.uint8)
    hicache = "left out (--no-sglang)" if args.no_sglang else _sglang_kernels.load()
    theirs = hicache if isinstance(hicache, str) else "sglang.kernels.ops.kvcache.hicache"
    console.log(f"SGLang's own kernels: {theirs}")
    rows = []
    rng = np.random.default_rng(0)
    for name in args.geometry or ["llama3-8b-p16", "dsv3-mla-p16"]:
        g = GEOMETRIES[name]
        pages = max(1, size // g.bytes_per_page)
        mem = Memory(runtime, name, g, 2 * pages, seed, args.stream)
        for layout in ("page_first", "layer_first", "page_head", "page_first_direct"):
            if layout == "page_head" and g.tensors == 1:
                continue
            host = HostPool.allocate(g, layout, pages=2 * pages, runtime=runtime)
            fill_units(kv_host(host), np.arange(host.pages))    # the loads' sources
            pages_dev = rng.choice(mem.pool.pages, pages, replace=False)
            pages_host = rng.choice(host.pages, pages, replace=False)
            tokens = [(p[:, None] * g.page_size + np.arange(g.page_size)).reshape(-1) for p in (pages_dev, pages_host)]
            engines = {"kernel": TransferEngine(mem.pool, host, backend="kernel", max_blocks=args.blocks),
                       "kernel-layers": TransferEngine(mem.pool, host, backend="kernel", max_blocks=args.blocks,
                                                       layer_signals=False),
                       "dma": TransferEngine(mem.pool, host, backend="batch")}
            ops = {"backup": ("kernel", lambda e, d=pages_dev, h=pages_host: e.backup(d, h)),
                   "load": ("kernel", lambda e, d=pages_dev, h=pages_host: e.load(h, d)),
                   "backup-dma": ("dma", lambda e, d=pages_dev, h=pages_host: e.backup(d, h)),
                   "load-dma": ("dma", lambda e, d=pages_dev, h=pages_host: e.load(h, d))}
            rows += measure(mem, host, layout, tokens, pages_dev, pages_host, engines, ops, ceiling, args, console,
                            hicache)
            for engine in engines.values():
                engine.close()
            host.close()
        mem.pool.close()
    seed.close()
    table = Table(title=f"kvtier.compat.sglang.kvcacheio against the engine ({runtime.device_attributes(0).name}; "
                        f"compat calls on the {args.stream} stream; "
                        f"ceiling H2D {ceiling['h2d_gbps']:.1f}, D2H {ceiling['d2h_gbps']:.1f} GB/s)")
    for column in ("geometry", "host layout", "compat function", "engine call", "compat GB/s (%)",
                   "engine GB/s (%)", "compat / engine %", "engine, a launch (call) per layer: GB/s", "compat / it %",
                   "queued ms: compat", "engine", "µs / compat call", "SGLang's kernel GB/s (%)",
                   "at its default quota", "verified"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["geometry"], r["layout"], r["function"], f"{r['engine']} {r['direction'].split('-')[0]}",
                      f"{r['compat_gbps']:.1f} ({r['compat_pct']:.0f}%)",
                      f"{r['engine_gbps']:.1f} ({r['engine_pct']:.0f}%)", f"{r['compat_vs_engine_pct']:.0f}",
                      f"{r['engine_layer_launches_gbps']:.1f}" if "engine_layer_launches_gbps" in r else "",
                      f"{r['compat_vs_layer_launches_pct']:.0f}" if "compat_vs_layer_launches_pct" in r else "",
                      f"{r['compat_queued_ms']:.2f}", f"{r['engine_queued_ms']:.2f}", f"{r['compat_call_us']:.0f}",
                      *(f"{r[f + '_gbps']:.1f} ({r[f + '_pct']:.0f}%) {r[f + '_kernel']}" if f + "_gbps" in r else ""
                        for f in ("sglang", "sglang_default")),
                      described(r["verified"]))
    console.print(table)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"runtime": runtime.name, "ceiling": ceiling, "blocks": args.blocks, "stream": args.stream,
                       "same_indices": args.same_indices,
                       "sglang_kernels": theirs,
                       "rows": rows}, out, indent=1)
    if emulated:
        console.print(EMULATED_NOTE.format(name=runtime.name))


if __name__ == "__main__":
    main()
