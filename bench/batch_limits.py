"""Does ``cudaMemcpyBatchAsync`` survive many scattered copies on this driver? Each case runs in a child process.

The staged backend once died with SIGSEGV while queuing 131k scattered 1 KiB copies per batch through the runtime's
batched memcpy (``memcpy_runs_async(..., batched=True)``, calls of 8192) on driver 580.159.04; vllm#49276 reports
the same driver crashing or hanging on large or repeated scatter batches. This probe repeats that shape at growing
sizes, checks the bytes, and prints one line per case: ok, wrong bytes, or the signal that killed the child.

Run on a GPU machine: ``python bench/batch_limits.py``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

CASES = [(8192, 1), (8192, 8), (32768, 4), (131072, 1), (131072, 8)]  # (copies per submission, submissions)


def child(copies: int, rounds: int, piece: int = 1024) -> None:
    import numpy as np

    from kvtier.memory import DeviceBuffer, HostBuffer, HostKind
    from kvtier.runtime import get

    runtime = get()
    rng = np.random.default_rng()
    slots = 2 * copies
    with HostBuffer.allocate(slots * piece, HostKind.PINNED, runtime=runtime) as host, \
            DeviceBuffer(copies * piece, 0, runtime=runtime) as device:
        view = host.as_tensor().numpy()
        view[:] = rng.integers(1, 256, view.size, dtype=np.uint8)
        stream = runtime.create_stream(0)
        for _ in range(rounds):
            chosen = rng.choice(slots, copies, replace=False)
            src_offsets, dst_offsets = chosen * piece, np.arange(copies) * piece
            device.upload(np.full(copies * piece, 0xEE, np.uint8))
            runtime.memcpy_runs_async(device.address, dst_offsets, host.cpu_address, src_offsets,
                                      np.full(copies, piece), stream=stream, batched=True)
            stream.synchronize()
            got = np.frombuffer(device.download(), np.uint8).reshape(copies, piece)
            if not np.array_equal(got, view.reshape(slots, piece)[chosen]):
                print("wrong bytes")
                sys.exit(3)
        stream.close()
        del view
    print("ok")


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="The runtime is kvtier's choice ($KVTIER_RUNTIME, else cuda when a GPU is usable, "
                                   "else emulated:split).").parse_args(argv)
    for copies, rounds in CASES:
        here = str(Path(__file__).resolve().parent)
        code = f"import sys; sys.path.insert(0, {here!r}); import batch_limits; batch_limits.child({copies}, {rounds})"
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            outcome = done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()[-200:]]
            result = outcome[0] if done.returncode >= 0 else f"killed by signal {-done.returncode}"
        except subprocess.TimeoutExpired:
            result = "hung (no result in 120 s)"
        print(f"{copies:>7} copies x {rounds} submissions of 1 KiB: {result}", flush=True)


if __name__ == "__main__":
    main()
