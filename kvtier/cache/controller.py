"""The cache's background threads: one submits backups off the caller's thread, one per direction handles
completions the moment they happen.

Transfers of one direction run on one stream of one engine, so they complete in the order they were queued: a waiter
blocks on the oldest transfer of its direction (cuda-bindings releases the GIL while it waits) and completes it at
once, never behind a scan or a transfer of the other direction. Completion needs the cache's lock; nothing here waits
while holding it.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

from kvtier.cache.operation import BACKUP, LOAD, Operation
from kvtier.locks import named_condition


class Controller:
    def __init__(self, submit_backup: Callable[[list[Any], Any], Operation | None],
                 complete: Callable[[Operation], None], on_depth: Callable[[str, int], None],
                 enter: Callable[[], None] = lambda: None) -> None:
        """``enter`` runs first on each thread (the cache makes its pools' device current there). The threads start
        with :meth:`start`, once what they call into is built."""
        self._submit_backup, self._complete, self._on_depth, self._enter = submit_backup, complete, on_depth, enter
        self._cond = named_condition("cache.controller")
        self._requests: deque[tuple[list[Any], Any]] = deque()
        self._inflight: dict[str, deque[Operation]] = {LOAD: deque(), BACKUP: deque()}
        self._submitting = False
        self._stopping = False
        self._threads = [threading.Thread(target=self._submitter, name="kvtier-cache-backups", daemon=True)]
        self._threads += [threading.Thread(target=self._waiter, args=(kind,), name=f"kvtier-cache-{kind}s",
                                           daemon=True) for kind in (LOAD, BACKUP)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    # -- called by the cache --------------------------------------------------------------------------------------
    def request_backup(self, nodes: list[Any], after: Any) -> None:
        with self._cond:
            if self._stopping:
                return
            self._requests.append((nodes, after))
            self._depths()
            self._cond.notify_all()

    def track(self, op: Operation) -> None:
        with self._cond:
            self._inflight[op.kind].append(op)
            self._depths()
            self._cond.notify_all()

    def inflight(self, kind: str) -> list[Operation]:
        with self._cond:
            return list(self._inflight[kind])

    def idle(self) -> bool:
        with self._cond:
            return not (self._requests or self._submitting or any(self._inflight.values()))

    def drain(self) -> None:
        """Wait until every requested backup is submitted and every transfer is complete."""
        with self._cond:
            self._cond.wait_for(lambda: not (self._requests or self._submitting or any(self._inflight.values())))

    def close(self, *, cancel: bool) -> int:
        """Stop: drop backups not yet submitted when ``cancel`` (returns how many nodes they named), wait for
        transfers in flight, join the threads. Idempotent."""
        with self._cond:
            dropped = sum(len(nodes) for nodes, _ in self._requests) if cancel else 0
            if cancel:
                self._requests.clear()
            self._cond.wait_for(lambda: not (self._requests or self._submitting))
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread.ident is not None and thread is not threading.current_thread():
                thread.join()
        return dropped

    # -- threads ----------------------------------------------------------------------------------------------------
    def _depths(self) -> None:
        self._on_depth("backup_requests", len(self._requests))
        for kind, queue in self._inflight.items():
            self._on_depth(f"{kind}s_in_flight", len(queue))

    def _submitter(self) -> None:
        self._enter()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._requests or self._stopping)
                if not self._requests:
                    return
                nodes, after = self._requests.popleft()
                self._submitting = True
            try:
                op = self._submit_backup(nodes, after)
                if op is not None:
                    self.track(op)
            finally:
                with self._cond:
                    self._submitting = False
                    self._depths()
                    self._cond.notify_all()

    def _waiter(self, kind: str) -> None:
        self._enter()
        queue = self._inflight[kind]
        while True:
            with self._cond:
                self._cond.wait_for(lambda: queue or self._stopping)
                if not queue:
                    return
                op = queue[0]
            try:
                op.wait()
            except BaseException as exc:  # noqa: BLE001 - a failed transfer is completed as failed, never lost
                op.error = exc
            self._complete(op)
            with self._cond:
                queue.popleft()
                self._depths()
                self._cond.notify_all()
