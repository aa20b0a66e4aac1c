"""The ``kvtier`` command run as a user runs it: a process of its own (``python -m kvtier``), whose exit code, stdout
and stderr are what a test checks. A running one can be watched line by line, so a test waits for what the command
says (with a generous bound) instead of sleeping."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers.paths import ROOT

SMALL_DEMO = ["--users", "3", "--turns", "2", "--system-tokens", "128", "--user-tokens", "64", "--reply-tokens", "32"]
"""A demo workload that still evicts, loads back and saves prefill, in about a second."""
LONG_DEMO = ["--users", "16", "--turns", "16", "--system-tokens", "64", "--user-tokens", "32", "--reply-tokens", "16"]
"""256 short requests: long enough to act on a running demo, whatever the machine's speed."""


def environment() -> dict[str, str]:
    """This checkout's kvtier first on the path, and no runtime chosen by the caller's environment."""
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_RUNTIME"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def kvtier(*args: str, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """The real ``kvtier`` command, as a user starts it, in ``cwd``."""
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True, timeout=timeout,
                          env=environment(), cwd=cwd)


class Running:
    """A ``kvtier`` process whose stderr is read as it comes (a thread queues the lines; another keeps stdout)."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "kvtier", *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=environment(), cwd=ROOT)
        self.lines: list[str] = []
        self._out: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._readers = [threading.Thread(target=self._read_stderr, daemon=True),
                         threading.Thread(target=self._read_stdout, daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._queue.put(line)
        self._queue.put(None)

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        self._out.append(self.process.stdout.read())

    def wait_for(self, text: str, timeout: float = 180) -> str:
        """The first stderr line from now on that holds ``text``; fails if the process ends or the bound passes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line with {text!r} within {timeout} s; stderr so far: {self.lines}") from None
            if line is None:
                raise AssertionError(f"the process ended before saying {text!r}; stderr: {self.lines}")
            self.lines.append(line)
            if text in line:
                return line

    def finish(self, timeout: float = 300) -> tuple[int, str, str]:
        """(exit code, stdout, all of stderr) once the process has ended."""
        code = self.process.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout)
        while (line := self._queue.get_nowait() if not self._queue.empty() else None) is not None:
            self.lines.append(line)
        return code, "".join(self._out), "".join(self.lines)

    def kill(self) -> None:
        """End the process if it still runs (a failed test leaves none behind)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
