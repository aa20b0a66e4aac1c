"""Disaggregation benchmark: one request's KV from a prefill process to a decode process on this host, through
``kvtier.disagg`` (``KVSender`` → ``KVReceiver`` over Mooncake's transfer engine), beside Mooncake's own Python
``batch_transfer_sync_write`` of the same bytes between the same two processes with no kvtier around it.

The request: ``--tokens`` tokens of Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB a token, 4 GiB
for the default 32k) in pages of ``--page-size`` tokens. This process is the prefill side (a host pool of the source
layout, or a device pool staged through host memory); it starts the decode side as a child process (a host pool of
the destination layout, registered once). Rows: one per ``--pairs`` SRC/DST.

- kvtier: ``sender.send`` of the request's pages, timed from the call to its return (the receiver asked for the
  pages before the clock starts; the return comes after the last byte was acknowledged and ``done`` was sent).
  After every timed run the decode side hashes each received page in a layout-free order and compares it with the
  prefill side's hashes: a run that delivered a wrong byte fails the benchmark.
- ceiling: a Mooncake engine of its own in this process writes the same number of bytes from the source pool into
  the decode side's registered pool, as 16 MiB entries in batches of 64 MiB (kvtier's batch limits), one
  synchronous batch at a time, as kvtier's sender does: the best that the transport makes of the same bytes.

Runs alternate (ceiling, kvtier, ceiling, ...) so drift in the machine hits both; the median of ``--repeats`` is
reported, with the machine (cores, load average before and after). Loopback TCP is CPU-bound: on a small machine
both sides and Mooncake's threads share the cores.

Usage: python bench/disagg.py [--tokens 32768] [--pairs page_first/page_first,page_first/layer_first] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _options import name_list  # noqa: E402

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
PAIRS = [f"{a}/{b}" for a in LAYOUTS + ["device"] for b in LAYOUTS + ["device"]]
ENTRY, BATCH = 16 << 20, 64 << 20


def geometry(page_size: int):
    from kvtier.pools import KVGeometry

    return KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=page_size)


def canonical_hashes(pool, pages) -> list[str]:
    """xxh3-64 of each page's bytes in [tensor, layer, slot, head, byte] order, whatever the pool's layout."""
    import ctypes

    import numpy as np
    import xxhash

    g, s = pool.geometry, pool.strides
    memory = np.ctypeslib.as_array((ctypes.c_uint8 * pool.buffer.nbytes).from_address(pool.buffer.cpu_address.value))
    views = [np.lib.stride_tricks.as_strided(memory[pool.tensor_offset(t):],
                                             (pool.pages, g.layers, g.page_size, g.heads, g.head_bytes),
                                             (s.page, s.layer, s.slot, s.head, 1)) for t in range(g.tensors)]
    out = []
    for page in pages:
        digest = xxhash.xxh3_64()
        for view in views:
            digest.update(np.ascontiguousarray(view[page]).data)
        out.append(digest.hexdigest())
    return out


def fill(pool, seed: int) -> None:
    """Random bytes, never zero, different in every page (a random block, shifted per block)."""
    import ctypes

    import numpy as np

    memory = np.ctypeslib.as_array((ctypes.c_uint8 * pool.buffer.nbytes).from_address(pool.buffer.cpu_address.value))
    block = np.random.default_rng(seed).integers(1, 255, min(len(memory), 64 << 20), dtype=np.uint8)
    for i, start in enumerate(range(0, len(memory), len(block))):
        chunk = memory[start:start + len(block)]
        np.add(block[:len(chunk)], i % 200, out=chunk, casting="unsafe")
        np.maximum(chunk, 1, out=chunk)


def decode_main(spec: dict) -> None:
    """The child: a host pool of the destination layout behind a KVReceiver; commands on stdin, answers on stdout."""
    from kvtier.disagg import KVReceiver
    from kvtier.pools import HostPool

    g = geometry(spec["page_size"])
    pool = HostPool.allocate(g, spec["layout"], pages=spec["pages"])
    receiver = KVReceiver(pool, dtype="bfloat16")
    say = lambda **fields: print(json.dumps(fields), flush=True)  # noqa: E731
    say(address=receiver.address, session=receiver.wire.session, base=pool.buffer.cpu_address.value,
        nbytes=pool.buffer.nbytes)
    link = receiver.accept(120)
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "expect":
            landing = link.expect(command["id"], command["pages"])
            say(expecting=command["id"])
            landing.wait(600)
            say(landed=command["id"])
        elif command["cmd"] == "verify":
            got = canonical_hashes(pool, command["pages"])
            say(bad=sum(a != b for a, b in zip(got, command["hashes"], strict=True)))
        else:
            break
    receiver.close()
    pool.close()


class Child:
    def __init__(self, spec: dict) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "GLOG_minloglevel": os.environ.get("GLOG_minloglevel", "2")}  # noqa: SIM112 (glog's own name)
        self.process = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, **command) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the decode process ended (exit {self.process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.ask(cmd="quit")
            self.process.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()


def ceiling_runs(src_base: int, dst_base: int, nbytes: int) -> list[tuple[list, list, list]]:
    batches, offset = [], 0
    while offset < nbytes:
        local, remote, lengths, size = [], [], [], 0
        while offset < nbytes and size < BATCH:
            n = min(ENTRY, nbytes - offset)
            local.append(src_base + offset)
            remote.append(dst_base + offset)
            lengths.append(n)
            offset += n
            size += n
        batches.append((local, remote, lengths))
    return batches


def measure(pair: str, args) -> dict:
    import numpy as np
    from mooncake.engine import TransferEngine

    from kvtier.disagg import KVSender
    from kvtier.pools import DevicePool, HostPool
    from kvtier.runtime import get as get_runtime
    from kvtier.transfer import TransferEngine as Engine

    src_layout, dst_layout = pair.split("/")
    if dst_layout == "device":
        raise SystemExit("--pairs: a device destination needs a second runtime in the child; use a host layout")
    g = geometry(args.page_size)
    pages = -(-args.tokens // g.page_size)
    runtime = get_runtime(args.runtime) if args.runtime else get_runtime()
    host = HostPool.allocate(g, src_layout if src_layout != "device" else "layer_first", pages=pages,
                             runtime=runtime)
    fill(host, 1)
    order = np.arange(pages)
    hashes = canonical_hashes(host, order.tolist())
    source = host
    device = None
    if src_layout == "device":
        device = DevicePool.allocate(g, pages, 0, runtime=runtime)
        with Engine(device, host, backend="direct") as engine:
            engine.load(order, order, per_layer=False).wait()
        source = device
    child = Child({"layout": dst_layout, "pages": pages, "page_size": g.page_size})
    hello = child.answer()
    sender = KVSender(hello["address"], source, dtype="bfloat16")
    raw = TransferEngine()
    if raw.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("Mooncake TransferEngine.initialize failed")
    base = host.buffer.cpu_address.value
    if raw.register_memory(base, host.buffer.nbytes) != 0:
        raise SystemExit("Mooncake register_memory failed")
    nbytes = pages * g.bytes_per_page
    plan = ceiling_runs(base, hello["base"], nbytes)
    times: dict[str, list[float]] = {"kvtier": [], "mooncake": []}
    try:
        for repeat in range(args.repeats):
            start = time.perf_counter()
            for batch in plan:
                code = raw.batch_transfer_sync_write(hello["session"], *batch)
                if code != 0:
                    raise SystemExit(f"Mooncake batch_transfer_sync_write returned {code}")
            times["mooncake"].append(time.perf_counter() - start)
            rid = f"r{repeat}"
            child.ask(cmd="expect", id=rid, pages=order.tolist())
            assert child.answer() == {"expecting": rid}
            start = time.perf_counter()
            written = sender.send(rid, order)
            times["kvtier"].append(time.perf_counter() - start)
            assert child.answer() == {"landed": rid} and written == nbytes
            child.ask(cmd="verify", pages=order.tolist(), hashes=hashes)
            bad = child.answer()["bad"]
            if bad:
                raise SystemExit(f"{pair}: {bad} of {pages} pages arrived wrong in run {repeat}")
    finally:
        raw.unregister_memory(base)
        converts = sender.converts
        sender.close()
        child.close()
        if device is not None:
            device.close()
        host.close()
    kv, mc = statistics.median(times["kvtier"]), statistics.median(times["mooncake"])
    return {"pair": pair, "tokens": args.tokens, "page_size": g.page_size, "gbytes": nbytes / 1e9,
            "kvtier_gbps": nbytes / kv / 1e9, "mooncake_gbps": nbytes / mc / 1e9, "ratio": mc / kv,
            "converts": converts, "runs": args.repeats, "verified_pages": pages * args.repeats}


def _has_gpu() -> bool:
    from kvtier.runtime import get as get_runtime

    return not get_runtime().name.startswith("emulated")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        decode_main(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens in the request (default: %(default)s)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default: %(default)s)")
    parser.add_argument("--pairs", type=name_list(PAIRS, "pair"), default=["page_first/page_first",
                                                                           "page_first/layer_first"],
                        help="SRC/DST layouts (SRC may be 'device': a device pool staged through host memory) "
                             "(default: page_first/page_first,page_first/layer_first)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row, median kept (default: %(default)s)")
    parser.add_argument("--runtime", help="kvtier runtime of the prefill side (KVTIER_RUNTIME or the best there is)")
    parser.add_argument("--json", help="also write the rows and the machine to this file")
    args = parser.parse_args()
    os.environ.setdefault("GLOG_minloglevel", "2")
    load_before = os.getloadavg()
    rows = [measure(pair, args) for pair in args.pairs]
    machine = {"cores": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
               "runtime": args.runtime or os.environ.get("KVTIER_RUNTIME", "default")}
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"prefill → decode, {args.tokens} tokens of Llama-3-8B (bf16), loopback TCP, "
                       f"{machine['cores']} cores, load {load_before[0]:.2f} → {machine['load_after'][0]:.2f}")
    for column in ("src → dst", "GB", "kvtier GB/s", "Mooncake GB/s", "kvtier / Mooncake", "converts", "verified"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["pair"].replace("/", " → "), f"{r['gbytes']:.2f}", f"{r['kvtier_gbps']:.2f}",
                      f"{r['mooncake_gbps']:.2f}", f"{r['ratio']:.0%}", "yes" if r["converts"] else "no",
                      f"{r['verified_pages']} pages")
    Console(width=max(120, Console().width)).print(table)
    if machine["runtime"].startswith("emulated") or (not args.runtime and not _has_gpu()):
        print("on the emulator, a device source's copies to host memory run Python reference code: those rows are "
              "not speeds")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "machine": machine}, indent=2))


if __name__ == "__main__":
    main()
