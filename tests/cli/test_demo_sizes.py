"""``kvtier demo`` works out every size it needs from its flags before it allocates anything: a run too big for
the machine is refused at once, naming the flag and the size, and a device pool the demo has to enlarge is said so."""

from __future__ import annotations

import pytest
from helpers.cli import SMALL_DEMO, kvtier


@pytest.mark.parametrize("flags, named", [
    (["--users", "100000"], "--users 100000 needs"),
    (["--device-tokens", "100000000000"], "--device-tokens 100000000000 needs"),
    (["--hicache-size", "100000"], "--hicache-size 100000.0 needs"),
])
def test_a_run_too_big_for_the_machine_is_refused_before_any_allocation(flags, named):
    done = kvtier("--runtime", "emulated:split", "demo", *flags, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith(f"kvtier demo: {named} ") and " GiB of memory" in lines[0], lines[0]
    assert "available" in lines[0] and done.stdout == ""


def test_a_device_pool_raised_above_the_flag_is_said_with_the_flag_and_why():
    done = kvtier("--runtime", "emulated:split", "demo", "--device-tokens", "1", *SMALL_DEMO)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if "--device-tokens" in line]
    assert said == ["kvtier demo: --device-tokens 1 raised to 336: the device pool must hold the longest "
                    "conversation (320 tokens) and one page more"], done.stderr
    assert "336 / " in done.stdout                    # the table shows the pool it ran with


def test_negative_sizes_are_refused_by_name():
    done = kvtier("--runtime", "emulated:split", "demo", "--device-tokens", "-5", timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "kvtier demo: --device-tokens must be >= 0 (0: a third of the workload), got -5"], done.stderr
