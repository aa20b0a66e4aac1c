"""What the scheduler tells the workers each step, and what the workers tell it back.

The scheduler sends jobs by page number (``KVTierMetadata``): a load fills vLLM blocks from host pages (after reading
the storage part of them into their pages first, for an asynchronous load); a save backs blocks up into host pages (and
writes them on to storage). Every worker does every job on its own shard and reports each job once it is finished,
with how many of its pages made it (``KVTierWorkerMeta``); vLLM sums the reports of all workers before the scheduler
sees them, and a job is settled when every worker has reported it, by the fewest pages any worker managed.

These are plain classes, so the worker side runs without vLLM (the GPU harness drives it so); ``messages.py`` makes
them vLLM's metadata types.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadJob:
    """Fill ``blocks`` from host ``pages`` (one each). The first ``host`` pages are in the host tier already; the
    others are read from storage by ``keys`` first (``asynchronous``: the request waits outside the batch until the
    job is reported). The last ``failed`` blocks got no page (the host pool was full of pinned pages, or a page went
    between the match and the allocation): they are reported as load errors and vLLM recomputes them."""

    job: int
    request: str
    blocks: list[int]
    pages: list[int]
    host: int
    keys: list[bytes]
    failed_blocks: list[int]
    asynchronous: bool
    adapter: str | None = None
    salt: str | None = None
    start: int = 0
    """The request's block index of ``blocks[0]``."""


@dataclass
class SaveJob:
    """Back up ``blocks`` into host ``pages`` (keys ``keys``, the logical keys: storage writes use them)."""

    job: int
    request: str
    blocks: list[int]
    pages: list[int]
    keys: list[bytes]
    adapter: str | None = None
    salt: str | None = None


@dataclass
class StepJobs:
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    awaiting: set[str] = field(default_factory=set)
    """Finished requests whose blocks vLLM keeps until the workers report their saves done (``finished_sending``)."""
    preempted: set[str] = field(default_factory=set)
    """Requests vLLM preempted this step: their blocks go to others at once, so saves still reading them must land
    before this step's forward writes anything."""


@dataclass
class JobReports:
    done: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Job -> (workers that finished it, the fewest pages any of them completed)."""
    unreadable: set[int] = field(default_factory=set)
    """Loads whose storage read stopped at a page that is missing or fails its checks (not at a timeout): the
    scheduler never offers that page again."""

    def aggregate(self, other: JobReports) -> JobReports:
        merged = dict(self.done)
        for job, (count, ok) in other.done.items():
            have = merged.get(job)
            merged[job] = (count, ok) if have is None else (have[0] + count, min(have[1], ok))
        return type(self)(merged, self.unreadable | other.unreadable)
