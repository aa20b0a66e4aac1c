"""``kvtier demo --storage``: a store that cannot be reached at the start, or is lost and regained mid-run, is said
in one line each time (the demo goes on serving from the device and host tiers). The store that goes down is a
redis-server of the test's own, never a shared one."""

from __future__ import annotations

import signal
import time

import pytest
from helpers.cli import LONG_DEMO, SMALL_DEMO, Running, kvtier
from helpers.storage import RedisServer, free_port, need_server

pytestmark = pytest.mark.slow   # whole-program or stateful runs: `-m 'not slow'` skips them

RETRY_SECONDS = 1.0
"""The store's retry interval (StorageBackend's default), which the demo's line names."""


def said(err: str, text: str) -> list[str]:
    return [line for line in err.splitlines() if text in line]


def test_a_store_unreachable_at_the_start_is_said_once():
    spec = f"redis://127.0.0.1:{free_port()}/0"              # nothing listens there
    done = kvtier("--runtime", "emulated:split", "demo", *SMALL_DEMO, "--storage", spec)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    down = said(done.stderr, "unavailable")
    assert len(down) == 1, done.stderr
    assert down[0].startswith(f"kvtier demo: storage {spec}: unavailable (") and "Connection" in down[0]
    assert down[0].endswith("serving from the device and host tiers, retrying every 1 s")
    assert not said(done.stderr, ": back")


def test_a_store_lost_and_regained_mid_run_is_said_once_each_time():
    need_server()
    server = RedisServer()
    demo = Running("--runtime", "emulated:split", "demo", *LONG_DEMO, "--storage", server.url)
    try:
        demo.wait_for("serving")
        demo.process.send_signal(signal.SIGSTOP)             # freeze it, so the loss lands between two requests
        server.stop()
        demo.process.send_signal(signal.SIGCONT)
        demo.wait_for(f"storage {server.url}: unavailable")
        demo.process.send_signal(signal.SIGSTOP)
        server.start()
        time.sleep(RETRY_SECONDS + 0.5)                      # frozen past its retry time: its next request retries
        demo.process.send_signal(signal.SIGCONT)
        demo.wait_for(f"storage {server.url}: back")
        code, out, err = demo.finish()
    finally:
        demo.process.send_signal(signal.SIGCONT)
        demo.kill()
        server.close()
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert len(said(err, "unavailable")) == 1 and len(said(err, ": back")) == 1, err
    assert "0 wrong" in out
