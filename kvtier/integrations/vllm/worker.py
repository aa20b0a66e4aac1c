"""The connector's worker side: moves the bytes of the scheduler's jobs between vLLM's KV blocks, this worker's host
pool and storage, and reports each job once it is finished.

Loads of host pages run layer by layer on kvtier's load stream, one event per layer, queued before the forward; the
attention of layer i makes the compute stream wait for layer i's event (``wait_for_layer_load``), on the GPU, so
layer 0 computes while the later layers are still crossing the link. Asynchronous loads (a storage part) run on an
I/O thread: read storage into the job's host pages, verified, then copy them up; their blocks are reported with
``finished_recving``, and blocks whose pages could not be read as load errors, so vLLM recomputes them rather than
use bad KV. Saves are one backup per step after the forward, ordered after it on the GPU (the CPU never waits for
the copy), then written on to storage from the I/O thread. Before vLLM hands a preempted request's blocks to others,
the compute stream waits for the backups still reading them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier.integrations.vllm.jobs import JobReports, LoadJob, SaveJob, StepJobs
from kvtier.integrations.vllm.kv_tensors import device_pool_of
from kvtier.integrations.vllm.settings import ConnectorSettings, Deployment, rank_keys
from kvtier.integrations.vllm.stores import OpenStores
from kvtier.keys import Namespace
from kvtier.pools import HostPool
from kvtier.runtime import Runtime
from kvtier.transfer import TransferEngine
from kvtier.transfer.completion import Transfer
from kvtier.transfer.ordering import CURRENT, after_events

log = logging.getLogger("kvtier.vllm")

READ_CHUNK_PAGES = 32
"""Pages read from storage between two checks of the timeout prefetch policy's deadline."""


@dataclass
class InFlight:
    job: LoadJob | SaveJob
    transfer: Transfer | None = None
    future: Future[Any] | None = None
    ok: int = 0
    unreadable: bool = False

    def done(self) -> bool:
        if self.future is not None and not self.future.done():
            return False
        if self.future is not None and self.transfer is None and self.future.exception() is None:
            self.transfer, self.ok, *bad = self.future.result()
            self.unreadable = bool(bad and bad[0])
        return self.transfer is None or self.transfer.done()


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, deployment: Deployment, layers: list[str],
                 runtime: Runtime) -> None:
        self.settings, self.deployment, self.runtime = settings, deployment, runtime
        self.layers = {name: i for i, name in enumerate(layers)}
        self._layer_names = layers
        self.device_pool: Any = None
        self.host_pool: HostPool | None = None
        self.engine: TransferEngine | None = None
        self.stores: OpenStores | None = None
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-vllm-io")
        self._step_load: Transfer | None = None
        self._inflight: list[InFlight] = []
        self._finished: dict[int, int] = {}
        self._errors: set[int] = set()
        self._recving: set[str] = set()
        self._awaiting: set[str] = set()
        self._unreadable: set[int] = set()
        self._unloaded: set[str] = set()
        """Requests whose load in this step failed: the KV the step computes for them is not saved."""
        self.stats: dict[str, int] = {}
        self._closed = False

    # -- setup ------------------------------------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, Any]) -> None:
        """vLLM's ``register_kv_caches``: wrap its tensors once, then make this worker's host pool (the scheduler's
        page count) and the transfer engine between them."""
        geometry = self.deployment.geometry
        self.device_pool = device_pool_of(kv_caches, self._layer_names, geometry, self.runtime)
        pages = self.settings.host_pages(geometry.bytes_per_page, geometry.page_size)
        try:
            self.host_pool = HostPool.allocate(geometry, self.settings.host_layout, pages=pages,
                                               kind=self.settings.host_kind, runtime=self.runtime)
            self.engine = TransferEngine(self.device_pool, self.host_pool, backend=self.settings.io_backend)
            if self.settings.store:
                self.stores = OpenStores(self.settings.store, self.settings.store_options, self.settings.host_layout,
                                         self.host_pool)
        except BaseException:
            self.close()
            raise

    def _namespaces(self, adapter: str | None, salt: str | None) -> tuple[Namespace, Namespace]:
        """The logical namespace a request's keys are made in, and this rank's (its store's)."""
        return self.deployment.on_rank(0).namespace(adapter, salt), self.deployment.namespace(adapter, salt)

    # -- loads ------------------------------------------------------------------------------------------------------
    def start_load(self, meta: StepJobs) -> None:
        """vLLM's ``start_load_kv``: queue this step's host loads as one layer-wise load, and hand the asynchronous
        ones to the I/O thread (ordered after the compute stream's work so far: their blocks may have been another
        request's a moment ago)."""
        assert self.engine is not None
        self._awaiting |= meta.awaiting
        sync = [job for job in meta.loads if not job.asynchronous]
        for job in meta.loads:
            self._errors.update(job.failed_blocks)
        self._unloaded = {job.request for job in sync if job.failed_blocks}
        if sync:
            pages = [p for job in sync for p in job.pages]
            blocks = [b for job in sync for b in job.blocks]
            try:
                transfer = self.engine.load(pages, blocks) if pages else None
            except Exception as error:  # noqa: BLE001 - the blocks are recomputed, the step goes on
                log.warning("kvtier: a host load failed (%s); its blocks are recomputed", error)
                for job in sync:
                    self._errors.update(job.blocks)
                    self._finished[job.job] = 0
                    self._unloaded.add(job.request)
            else:
                self._step_load = transfer
                for job in sync:
                    self._inflight.append(InFlight(job, transfer, ok=len(job.pages)))
        late = [job for job in meta.loads if job.asynchronous]
        if late:
            after = after_events(self.runtime, self.engine.device, CURRENT)
            for job in late:
                self._inflight.append(InFlight(job, future=self._io.submit(self._read_then_load, job, after)))

    def _read_then_load(self, job: LoadJob, after: Any) -> tuple[Transfer | None, int, bool]:
        """I/O thread: read the storage part of ``job`` into its host pages (verified), then copy every page that
        holds its bytes up to its block. Returns the copy, how many leading pages it covers, and whether the read
        stopped at a bad page (not at the timeout)."""
        assert self.engine is not None
        ok, bad = self._read(job) if job.keys else (job.host, False)
        transfer = self.engine.load(job.pages[:ok], job.blocks[:ok], after=after, per_layer=False) if ok else None
        return transfer, ok, bad

    def _read(self, job: LoadJob) -> tuple[int, bool]:
        """Read the storage part of ``job`` into its host pages: the pages of the job that hold their bytes, and
        whether a page was missing or failed its checks."""
        assert self.stores is not None
        ok, bad = job.host, False
        logical, mine = self._namespaces(job.adapter, job.salt)
        keys = rank_keys(job.keys, logical, mine)
        with self.stores.lease(mine) as (store, pages):
            assert pages is not None
            targets = job.pages[job.host:]
            deadline = (time.monotonic() + self.settings.prefetch_timeout_s
                        if self.settings.prefetch_policy == "timeout" else None)
            step = READ_CHUNK_PAGES if deadline is not None else len(keys)
            for start in range(0, len(keys), step):
                with pages.batch(targets[start:start + step]) as io:
                    read = store.get(keys[start:start + step], io.pages)
                ok += read
                if read < len(keys[start:start + step]):
                    bad = True
                    break
                if deadline is not None and time.monotonic() > deadline:
                    break
        return ok, bad

    def wait_layer(self, layer_name: str) -> None:
        """vLLM's ``wait_for_layer_load``: the compute stream waits, on the GPU, for this layer of the step's load."""
        if self._step_load is not None:
            layer = self.layers.get(layer_name)
            if layer is not None:
                self._step_load.stream_wait(layer=layer)

    def wait_step_load(self) -> None:
        """The current stream waits, on the GPU, for the whole of this step's load (what a connector without
        layer-wise waits gives: the forward starts when the last layer has landed)."""
        if self._step_load is not None:
            self._step_load.stream_wait()

    # -- saves ------------------------------------------------------------------------------------------------------
    def save(self, meta: StepJobs) -> None:
        """vLLM's ``wait_for_save``: one backup of every block this step's saves name, ordered after the forward that
        wrote them; the storage writes follow on the I/O thread."""
        assert self.engine is not None
        if self._step_load is not None:             # every later use of the blocks is ordered after the load
            self._step_load.stream_wait()
            self._step_load = None
        self._awaiting |= meta.awaiting
        unloaded, self._unloaded = self._unloaded, set()
        saves = []
        for job in meta.saves:
            if job.request in unloaded:             # computed over blocks its load did not fill: never kept
                self._finished[job.job] = 0
            else:
                saves.append(job)
        if not saves:
            return
        blocks = [b for job in saves for b in job.blocks]
        pages = [p for job in saves for p in job.pages]
        try:
            transfer = self.engine.backup(blocks, pages)
        except Exception as error:  # noqa: BLE001 - the pages are simply not cached
            log.warning("kvtier: a backup failed (%s); those blocks are not cached", error)
            for job in saves:
                self._finished[job.job] = 0
            return
        for job in saves:
            if self.settings.store and self.deployment.writer:
                future = self._io.submit(self._write, job, transfer)
                self._inflight.append(InFlight(job, transfer, future, ok=len(job.pages)))
            else:
                self._inflight.append(InFlight(job, transfer, ok=len(job.pages)))

    def _write(self, job: SaveJob, transfer: Transfer) -> tuple[Transfer, int]:
        """I/O thread: once the backup has landed, write the pages on to storage (a failure leaves them uncached in
        storage only: the host pages hold their bytes either way)."""
        transfer.wait()
        assert self.stores is not None
        logical, mine = self._namespaces(job.adapter, job.salt)
        with self.stores.lease(mine) as (store, pages):
            assert pages is not None
            with pages.batch(job.pages) as io:
                store.set(rank_keys(job.keys, logical, mine), io.pages)
        return transfer, len(job.pages)

    def preempted(self, meta: StepJobs) -> None:
        """vLLM's ``handle_preemptions``: the blocks of requests preempted this step go to others at once, so the
        compute stream waits (on the GPU) for the backups still reading them; other steps wait for nothing."""
        for flight in self._inflight:
            if (isinstance(flight.job, SaveJob) and flight.job.request in meta.preempted
                    and flight.transfer is not None):
                flight.transfer.stream_wait()

    # -- reports ----------------------------------------------------------------------------------------------------
    def poll(self) -> tuple[set[str], set[str]]:
        """vLLM's ``get_finished``: requests whose saves are all done (of those vLLM keeps blocks for) and requests
        whose asynchronous loads are done."""
        still = []
        for flight in self._inflight:
            if not flight.done():
                still.append(flight)
                continue
            ok, job = flight.ok, flight.job
            failure = flight.future.exception() if flight.future is not None else None
            if failure is not None:
                log.warning("kvtier: a %s failed (%s)", "storage read" if isinstance(job, LoadJob) else
                            "storage write", failure)
                ok = 0 if isinstance(job, LoadJob) else len(job.pages)
            if isinstance(job, LoadJob):
                if flight.unreadable:
                    self._unreadable.add(job.job)
                self._errors.update(job.blocks[ok:])
                if job.asynchronous:
                    self._recving.add(job.request)
                self._count("loaded_pages", ok)
                self._count("load_error_blocks", len(job.blocks) - ok)
                self._count("storage_read_pages", max(0, ok - job.host))
            else:
                self._count("backed_up_pages", ok)
            self._finished[job.job] = ok
        self._inflight = still
        busy = {flight.job.request for flight in still if isinstance(flight.job, SaveJob)}
        sending = {req for req in self._awaiting if req not in busy}
        self._awaiting -= sending
        recving, self._recving = self._recving, set()
        return sending, recving

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def worker_meta(self) -> JobReports | None:
        if not self._finished:
            return None
        done = {job: (1, ok) for job, ok in self._finished.items()}
        unreadable, self._finished, self._unreadable = self._unreadable, {}, set()
        return JobReports(done, unreadable)

    def take_counters(self) -> dict[str, int]:
        """This worker's counters since the last call, then zeroed."""
        stats, self.stats = self.stats, {}
        return stats

    def _count(self, name: str, value: int) -> None:
        self.stats[name] = self.stats.get(name, 0) + value

    def busy(self) -> bool:
        return bool(self._inflight)

    # -- lifetime ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the jobs in flight, then close the stores, the engine and the host pool (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._io.shutdown(wait=True)
        for flight in self._inflight:
            if flight.transfer is not None:
                flight.transfer.wait()
        self._inflight = []
        if self.stores is not None:
            self.stores.close()
        for resource in (self.engine, self.host_pool, self.device_pool):
            if resource is not None:
                resource.close()

