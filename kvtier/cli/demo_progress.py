"""What ``kvtier demo`` says while it runs, and how it stops: everything here goes to stderr, so stdout holds only
the results (a table, or JSON).

- Progress: a bar on a terminal; elsewhere (a log, a pipe, a supervising process) a line when serving starts and
  one every few seconds after, so a long run is never silent. Nothing with ``--json``.
- Notes: one line each (a flag the demo had to adjust, the storage tier going down or coming back), never wrapped.
- Ctrl-C: the first one asks the run to stop after the request in hand, so the cache's threads shut down cleanly
  and the totals so far are shown; a second one interrupts at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

PLAIN_EVERY = 5.0
"""Seconds between progress lines when stderr is not a terminal."""


class Reporter:
    def __init__(self, *, quiet: bool, console: Console | None = None) -> None:
        """``quiet`` (``--json``): notes only, no progress."""
        self.console = console or Console(stderr=True, highlight=False)
        self.quiet = quiet
        self._bar: Progress | None = None
        self._task: Any = None
        self._total = 0
        self._done = 0
        self._started = self._said = 0.0

    def note(self, text: str) -> None:
        """One line on stderr, above the bar when there is one."""
        console = self._bar.console if self._bar is not None else self.console
        console.print(f"kvtier demo: {text}", soft_wrap=True, markup=False, highlight=False)

    def start(self, total: int, what: str) -> None:
        self._total, self._done = total, 0
        self._started = self._said = time.monotonic()
        if self.quiet:
            return
        if self.console.is_terminal:
            self._bar = Progress(TextColumn("[bold]kvtier demo"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.description}"), console=self.console,
                                 transient=True)
            self._bar.start()
            self._task = self._bar.add_task("", total=total)
        else:
            self.note(f"serving {what}")

    def advance(self, description: str) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=description)
        elif not self.quiet and time.monotonic() - self._said >= PLAIN_EVERY:
            self._said = time.monotonic()
            self.note(f"{self._done:,} of {self._total:,} requests, {self._said - self._started:.0f} s; {description}")

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class StorageWatch:
    """Says once when the storage tier stops answering and once when it is back, each time. The store keeps its
    own up/down state (it retries every ``retry_interval``); the demo looks at it between requests."""

    def __init__(self, store: Any, spec: str, reporter: Reporter) -> None:
        self.store, self.spec, self.reporter = store, spec, reporter
        self.up = True

    def check(self) -> None:
        up = self.store.up
        if up == self.up:
            return
        self.up = up
        if up:
            self.reporter.note(f"storage {self.spec}: back")
        else:
            error = " ".join(str(self.store.last_error).split())[:200] or "an error"
            self.reporter.note(f"storage {self.spec}: unavailable ({error}); serving from the device and host tiers, "
                               f"retrying every {self.store.retry_interval:g} s")


@contextlib.contextmanager
def stop_on_interrupt() -> Iterator[threading.Event]:
    """An event the first SIGINT sets (the run stops after the request in hand); a second SIGINT raises
    KeyboardInterrupt as usual. Outside the main thread signals cannot be caught: the event then never fires."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def first(signum: int, frame: Any) -> None:
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
