"""The connector's scheduler side: which external tokens a request can load, and the jobs that load and save them.

For a waiting request vLLM asks how many tokens past its own prefix cache the connector can supply. kvtier keys the
request's whole blocks (``kvtier.keys`` under the request's namespace: model, layout, dtype, TP shard, LoRA adapter,
``cache_salt``), finds the run of them the host tier holds (``HostIndex``), then the run storage holds after that, and
takes each part only when loading it beats recomputing it (``kvtier.cache.rates``). A host-only hit loads layer by
layer inside the step that computes the rest of the prompt; a hit with a storage part is asynchronous: the request
waits while the workers read storage into host pages and copy them up.

Saves follow the write policy: ``write_through`` backs up each block as soon as a step completes it (tokens known,
speculative tokens excluded); ``write_back`` backs up a request's blocks when it finishes, and vLLM keeps the blocks
until the save is done. A block whose key the host tier already has (or is filling) is not saved twice.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.cache import WritePolicy
from kvtier.cache.rates import read_beats_recompute, storage_read_gbps
from kvtier.integrations.vllm.host_index import READING, WRITING, HostIndex
from kvtier.integrations.vllm.jobs import JobReports, LoadJob, SaveJob
from kvtier.integrations.vllm.messages import KVTierMetadata
from kvtier.integrations.vllm.settings import ConnectorSettings, Deployment, rank_keys
from kvtier.integrations.vllm.stores import OpenStores
from kvtier.keys import Namespace, chain_keys

log = logging.getLogger("kvtier.vllm")

UNREADABLE_KEYS = 1 << 16


@dataclass
class Plan:
    """What ``get_num_new_matched_tokens`` found: blocks ``[start, host_end)`` in the host tier, ``[host_end,
    end)`` in storage."""

    start: int
    host_end: int
    end: int


@dataclass
class Tracked:
    """A request the connector knows: its namespace, the logical keys of its whole blocks so far, its block ids,
    and how many leading blocks need no save (saved, being saved, or loaded)."""

    request: Any
    namespace: Namespace
    adapter: str | None
    salt: str | None
    keys: list[bytes] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    saved: int = 0
    plan: Plan | None = None
    stored: tuple[int, int] | None = None
    saves: set[int] = field(default_factory=set)
    sources: tuple[int, int] = (0, 0)
    """(host, storage) tokens of its last load."""

    def keys_upto(self, pages: int, page_size: int) -> list[bytes]:
        """The logical keys of the first ``pages`` blocks (hashed once: later calls extend the chain)."""
        if pages > len(self.keys):
            tokens = np.asarray(self.request.all_token_ids[len(self.keys) * page_size:pages * page_size],
                                dtype=np.uint32)
            parent = self.keys[-1] if self.keys else self.namespace.digest
            self.keys.extend(chain_keys(parent, tokens, page_size))
        return self.keys[:pages]


@dataclass
class Counters:
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    declined_tokens: int = 0
    saved_pages: int = 0
    save_skipped_pages: int = 0
    failed_load_blocks: int = 0
    evicted_pages: int = 0
    store_errors: int = 0


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, deployment: Deployment, world_size: int) -> None:
        self.settings, self.deployment, self.world_size = settings, deployment, world_size
        g = deployment.geometry
        self.page_size = g.page_size
        self.page_bytes = g.bytes_per_page
        self.index = HostIndex(settings.host_pages(self.page_bytes, self.page_size))
        self.tracked: dict[str, Tracked] = {}
        self._ids = itertools.count(1)
        self.jobs: dict[int, tuple[LoadJob | SaveJob, list[bytes]]] = {}
        """Job -> (the job, the host-tier keys a load pinned)."""
        self._reports: dict[int, tuple[int, int]] = {}
        self._loads: list[LoadJob] = []
        self._saves: list[SaveJob] = []
        self._awaiting: set[str] = set()
        self._namespaces: dict[tuple[str | None, str | None], Namespace] = {}
        self.counters = Counters()
        self._warned = 0.0
        self._unreadable_jobs: set[int] = set()
        self.unreadable: OrderedDict[bytes, None] = OrderedDict()
        """Keys whose stored page failed to read (missing or failing its checks): never offered again, so vLLM's
        recompute of them does not loop back into the same failed load."""
        self.stores = (OpenStores(settings.store, settings.store_options, settings.host_layout)
                       if settings.store else None)

    # -- requests ---------------------------------------------------------------------------------------------------
    def namespace(self, adapter: str | None, salt: str | None) -> Namespace:
        key = (adapter, salt)
        if key not in self._namespaces:
            self._namespaces[key] = self.deployment.namespace(adapter, salt)
        return self._namespaces[key]

    def track(self, request: Any) -> Tracked | None:
        """The request's record, made on first sight; None for a request kvtier cannot key (prompt embeddings,
        multimodal inputs: its token ids do not say what its KV is)."""
        tracked = self.tracked.get(request.request_id)
        if tracked is not None:
            return tracked
        if getattr(request, "prompt_embeds", None) is not None or getattr(request, "mm_features", None):
            return None
        lora = getattr(request, "lora_request", None)
        adapter = getattr(lora, "lora_name", None) if lora is not None else None
        salt = getattr(request, "cache_salt", None)
        tracked = Tracked(request, self.namespace(adapter, salt), adapter, salt)
        self.tracked[request.request_id] = tracked
        return tracked

    def matched_tokens(self, request: Any, computed: int) -> tuple[int, bool]:
        """vLLM's ``get_num_new_matched_tokens``: tokens past ``computed`` (block-aligned) the connector loads, and
        whether the load is asynchronous. The last token is always left to compute (it gives the logits)."""
        tracked = self.track(request)
        if tracked is None:
            return 0, False
        tracked.plan = None
        page = self.page_size
        limit = (request.num_tokens - 1) // page
        start = computed // page
        if start >= limit:
            return 0, False
        keys = tracked.keys_upto(limit, page)
        host_end = start + self.index.match(keys, start)
        rate = self.settings.prefill_tokens_per_s
        if host_end > start and not read_beats_recompute((host_end - start) * page, (host_end - start) *
                                                         self.page_bytes, rate, self.settings.load_gbps):
            self.counters.declined_tokens += (host_end - start) * page
            return 0, False
        end = host_end
        if self.stores is not None and host_end < limit:
            try:
                stored = self._stored(tracked, keys, host_end)
            except Exception as error:  # noqa: BLE001 - a store that cannot be reached is a miss, never vLLM's crash
                self._store_failed(error)
                stored = 0
            # a key the host tier already has a page for (being read or written for another request) cannot get a
            # second page: the storage part stops there, and vLLM computes the rest
            stored = next((i for i, key in enumerate(keys[host_end:host_end + stored]) if self.index.known(key)),
                          stored)
            # the storage part is read into host pages beside the pinned host part: never more than the pool holds
            stored = max(0, min(stored, self.index.pages - (host_end - start)))
            if stored and read_beats_recompute(stored * page, stored * self.page_bytes, rate, self._storage_gbps(),
                                               self.settings.load_gbps):
                end += stored
            else:
                self.counters.declined_tokens += stored * page
        tokens = (end - start) * page
        if not tokens or tokens < (self.settings.min_load_tokens or 0):
            return 0, False
        tracked.plan = Plan(start, host_end, end)
        return tokens, end > host_end

    def _stored(self, tracked: Tracked, keys: list[bytes], start: int) -> int:
        """How many blocks from ``start`` every rank has in storage (asked once per request and start)."""
        if tracked.stored is not None and tracked.stored[0] == start:
            return tracked.stored[1]
        assert self.stores is not None
        logical, wanted = tracked.namespace, keys[start:]
        count = len(wanted)
        for rank in range(1 if self.deployment.is_mla else self.deployment.tp_size):
            if not count:
                break
            rank_space = self.deployment.on_rank(rank).namespace(tracked.adapter, tracked.salt)
            with self.stores.lease(rank_space) as (store, _):
                count = min(count, store.exists(rank_keys(wanted[:count], logical, rank_space)))
        count = next((i for i, key in enumerate(wanted[:count]) if key in self.unreadable), count)
        tracked.stored = (start, count)
        return count

    def _storage_gbps(self) -> float | None:
        store = self.stores.first() if self.stores is not None else None
        return storage_read_gbps(store.stats() if store is not None else {}, self.settings.storage_gbps)

    def allocated(self, request: Any, block_ids: list[int], external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc``: the request's blocks, and (when ``external_tokens``) the load of the
        plan into them."""
        tracked = self.tracked.get(request.request_id)
        if tracked is None:
            return
        tracked.blocks = list(block_ids)
        plan, tracked.plan = tracked.plan, None
        if not external_tokens or plan is None:
            return
        page = self.page_size
        end = min(plan.end, plan.start + external_tokens // page)
        keys = tracked.keys[:end]
        host_end = min(plan.host_end, end, plan.start + self.index.match(keys, plan.start))
        host_keys = keys[plan.start:host_end]
        self.index.pin(host_keys)
        pages = self.index.pages_of(host_keys).tolist()
        storage_keys = keys[host_end:end] if plan.end > plan.host_end else []
        storage_keys = storage_keys[:next((i for i, key in enumerate(storage_keys) if self.index.known(key)),
                                          len(storage_keys))]
        if storage_keys:
            parent = keys[host_end - 1] if host_end else None
            reserved = self.index.reserve(storage_keys, parent, READING)
            if reserved is None:                # as many as the pool can free now (pinned pages are not freed)
                storage_keys = storage_keys[:self.index.allocator.free_pages + self.index.evictable_pages]
                reserved = self.index.reserve(storage_keys, parent, READING) if storage_keys else None
            if reserved is None:
                storage_keys = []
                # vLLM recomputes the blocks: not planned from storage again at this start, or the request would
                # park, fail and come back to the same plan for as long as the pool stays full
                tracked.stored = (host_end, 0)
            else:
                pages += reserved.tolist()
        covered = host_end - plan.start + len(storage_keys)
        blocks = tracked.blocks[plan.start:end]
        job = LoadJob(next(self._ids), request.request_id, blocks[:covered], pages, host_end - plan.start,
                      list(storage_keys), blocks[covered:], plan.end > plan.host_end, tracked.adapter, tracked.salt,
                      plan.start)
        self.counters.failed_load_blocks += len(job.failed_blocks)
        self.counters.host_hit_tokens += job.host * page
        self.counters.storage_hit_tokens += len(storage_keys) * page
        self.jobs[job.job] = (job, host_keys)
        self._loads.append(job)
        tracked.sources = (job.host * page, len(storage_keys) * page)
        tracked.saved = max(tracked.saved, plan.start + covered)

    def hit_sources(self, request: Any) -> tuple[int, int]:
        """(host, storage) tokens of the request's last load (vLLM's per-source hit counts)."""
        tracked = self.tracked.get(request.request_id)
        return tracked.sources if tracked is not None else (0, 0)

    # -- steps ------------------------------------------------------------------------------------------------------
    def build(self, output: Any) -> KVTierMetadata:
        """vLLM's ``build_connector_meta``: this step's loads, saves of the blocks it completes, and the finished
        requests whose blocks wait for their saves."""
        if self.settings.write_policy is WritePolicy.WRITE_THROUGH:
            spec, page = output.scheduled_spec_decode_tokens or {}, self.page_size
            for new in output.scheduled_new_reqs:
                tracked = self.tracked.get(new.req_id)
                if tracked is not None:
                    tracked.blocks = list(new.block_ids[0])
                    done = new.num_computed_tokens + output.num_scheduled_tokens.get(new.req_id, 0)
                    if done // page > tracked.saved:
                        self._save(tracked, done - len(spec.get(new.req_id, ())))
            cached = output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                tracked = self.tracked.get(req_id)
                if tracked is None:
                    continue
                if cached.new_block_ids[i] is not None:
                    tracked.blocks.extend(cached.new_block_ids[i][0])
                done = cached.num_computed_tokens[i] + output.num_scheduled_tokens.get(req_id, 0)
                if done // page > tracked.saved:            # most decode steps complete no block
                    self._save(tracked, done - len(spec.get(req_id, ())))
        else:
            for new in output.scheduled_new_reqs:
                if new.req_id in self.tracked:
                    self.tracked[new.req_id].blocks = list(new.block_ids[0])
            cached = output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                if req_id in self.tracked and cached.new_block_ids[i] is not None:
                    self.tracked[req_id].blocks.extend(cached.new_block_ids[i][0])
        meta = KVTierMetadata(self._loads, self._saves, self._awaiting, set(output.preempted_req_ids or ()))
        self._loads, self._saves, self._awaiting = [], [], set()
        return meta

    def _save(self, tracked: Tracked, computed: int) -> None:
        """Queue the save of the request's whole blocks up to ``computed`` tokens that the host tier lacks."""
        page = self.page_size
        count = min(computed, len(tracked.request.all_token_ids), len(tracked.blocks) * page) // page
        if count <= tracked.saved:
            return
        keys = tracked.keys_upto(count, page)
        blocks, pages, saved_keys = [], [], []
        i = tracked.saved
        while i < count:
            if self.index.known(keys[i]):
                i += 1
                continue
            j = i
            while j < count and not self.index.known(keys[j]):
                j += 1
            reserved = self.index.reserve(keys[i:j], keys[i - 1] if i else None, WRITING)
            if reserved is None:                    # as many of the run as the pool can free now
                fit = min(j - i, self.index.allocator.free_pages + self.index.evictable_pages)
                reserved = self.index.reserve(keys[i:i + fit], keys[i - 1] if i else None, WRITING) if fit else None
                self.counters.save_skipped_pages += j - i - (fit if reserved is not None else 0)
                if reserved is not None:
                    blocks += tracked.blocks[i:i + fit]
                    pages += reserved.tolist()
                    saved_keys += keys[i:i + fit]
            else:
                blocks += tracked.blocks[i:j]
                pages += reserved.tolist()
                saved_keys += keys[i:j]
            i = j
        tracked.saved = count
        if blocks:
            job = SaveJob(next(self._ids), tracked.request.request_id, blocks, pages, saved_keys, tracked.adapter,
                          tracked.salt)
            self.jobs[job.job] = (job, [])
            tracked.saves.add(job.job)
            self._saves.append(job)

    def finished(self, request: Any, block_ids: list[int]) -> bool:
        """vLLM's ``request_finished``: whether vLLM must keep the request's blocks until its saves are done."""
        tracked = self.tracked.pop(request.request_id, None)
        if tracked is None:
            return False
        if self.settings.write_policy is WritePolicy.WRITE_BACK:
            tracked.blocks = list(block_ids)
            self._save(tracked, request.num_computed_tokens)
        if tracked.saves:
            self._awaiting.add(request.request_id)
            return True
        return False

    def reported(self, output: Any) -> None:
        """vLLM's ``update_connector_output``: settle the jobs every worker has finished."""
        meta = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(meta, JobReports):
            return
        self._unreadable_jobs |= meta.unreadable
        for job_id, (count, ok) in meta.done.items():
            have = self._reports.get(job_id)
            count, ok = (count, ok) if have is None else (have[0] + count, min(have[1], ok))
            if count < self.world_size:
                self._reports[job_id] = (count, ok)
                continue
            self._reports.pop(job_id, None)
            job, pinned = self.jobs.pop(job_id, (None, []))
            if isinstance(job, LoadJob):
                self.index.unpin(pinned)
                read = max(0, ok - job.host)
                self.index.commit(job.keys[:read])
                self.index.drop(job.keys[read:])
                if job_id in self._unreadable_jobs:
                    self._unreadable_jobs.discard(job_id)
                    if read < len(job.keys):
                        self._unreadable(job.keys[read])
                tracked = self.tracked.get(job.request)
                if read < len(job.keys) and tracked is not None:
                    tracked.stored = None
                if tracked is not None and ok < len(job.blocks):
                    # vLLM recomputes the blocks this load did not fill: they are saved once computed
                    tracked.saved = min(tracked.saved, job.start + max(ok, 0))
            elif isinstance(job, SaveJob):
                self._settle_save(job, ok)

    def _settle_save(self, job: SaveJob, ok: int) -> None:
        self.index.commit(job.keys[:ok])
        self.index.drop(job.keys[ok:])
        self.counters.saved_pages += ok
        tracked = self.tracked.get(job.request)
        if tracked is not None:
            tracked.saves.discard(job.job)

    def _store_failed(self, error: BaseException) -> None:
        self.counters.store_errors += 1
        now = time.monotonic()
        if now - self._warned > 60:
            self._warned = now
            log.warning("kvtier: storage lookups fail (%s); they count as misses", error)

    def _unreadable(self, key: bytes) -> None:
        self.unreadable[key] = None
        while len(self.unreadable) > UNREADABLE_KEYS:
            self.unreadable.popitem(last=False)

    def take_counters(self) -> dict[str, int]:
        """The counters since the last call (vLLM's stats interval), then zeroed."""
        counters, self.counters = self.counters, Counters()
        counters.evicted_pages, self.index.evicted = self.index.evicted, 0
        return dict(counters.__dict__)

    def reset(self) -> bool:
        """vLLM's ``reset_cache``: forget every host page (those jobs use are never matched again, and go when their
        jobs settle)."""
        self.index.clear()
        return True

    def close(self) -> None:
        if self.stores is not None:
            self.stores.close()
