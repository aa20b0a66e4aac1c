"""Ctrl-C in ``kvtier demo``: one line, the totals of what ran, exit code 130, and the cache's threads shut down
(the process ends)."""

from __future__ import annotations

import signal

import pytest
from helpers.cli import LONG_DEMO, Running

pytestmark = pytest.mark.slow   # whole-program or stateful runs: `-m 'not slow'` skips them


def test_ctrl_c_stops_with_one_line_and_the_totals_so_far():
    demo = Running("--runtime", "emulated:split", "demo", *LONG_DEMO)
    try:
        demo.wait_for("serving")                          # the demo is running: its requests have begun
        demo.process.send_signal(signal.SIGINT)
        code, out, err = demo.finish()
    finally:
        demo.kill()
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    said = [line for line in err.splitlines() if "interrupted" in line]
    assert len(said) == 1 and said[0].startswith("kvtier demo: interrupted after"), err
    assert "of 256 requests" in said[0]
    assert "(interrupted)" in out and "hit rate" in out and "byte for byte" in out, out


def test_a_second_ctrl_c_while_stopping_still_ends_without_a_traceback():
    demo = Running("--runtime", "emulated:split", "demo", *LONG_DEMO)
    try:
        demo.wait_for("serving")
        demo.process.send_signal(signal.SIGINT)
        demo.process.send_signal(signal.SIGINT)           # wherever it lands: in a request, the wind-down, the exit
        code, _, err = demo.finish()
    finally:
        demo.kill()
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert 1 <= len(err.splitlines()) <= 3 and "interrupted" in err.splitlines()[-1], err
