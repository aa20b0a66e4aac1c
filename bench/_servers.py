"""Private servers the storage benchmarks start when not given one (not a script itself): a redis-server on a free
loopback port, and a Mooncake Store (master + a segment holder) through scripts/mooncake_servers.sh."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MOONCAKE_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mooncake_servers.sh"


def start_redis() -> tuple[str, subprocess.Popen[bytes], str] | None:
    """(its URL, the process, its working directory) of a private redis-server (or valkey-server), or None where
    neither is installed. Stop it with ``stop_redis``."""
    server = shutil.which("redis-server") or shutil.which("valkey-server")
    if server is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-redis-")
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return f"redis://127.0.0.1:{port}/0", process, workdir
        except OSError:
            time.sleep(0.05)
    process.kill()
    return None


def stop_redis(started: tuple[str, subprocess.Popen[bytes], str]) -> None:
    started[1].kill()
    started[1].wait()
    shutil.rmtree(started[2], ignore_errors=True)


def start_mooncake(directory: Path, segment: str | None = None) -> str | None:
    """The spec of a private Mooncake Store (master + a segment holder lending ``segment``, default
    ``KVTIER_BENCH_MOONCAKE_SEGMENT`` or 12 GB) through scripts/mooncake_servers.sh, or None without the wheel.
    Stop it with ``stop_mooncake(directory)``."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return None
    segment = segment or os.environ.get("KVTIER_BENCH_MOONCAKE_SEGMENT", "12 GB")
    done = subprocess.run(["bash", str(MOONCAKE_SCRIPT), "start", str(directory), segment], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable}, check=True)
    return done.stdout.strip().split("=", 1)[1].strip("'")


def stop_mooncake(directory: Path) -> None:
    subprocess.run(["bash", str(MOONCAKE_SCRIPT), "stop", str(directory)], check=False)
