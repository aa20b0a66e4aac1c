"""What a vLLM deployment tells kvtier: the connector's options (``kv_connector_extra_config``) and the identity its
pages are keyed under (the model, its KV cache spec, the tensor-parallel shard, and per request the LoRA adapter and
``cache_salt``).

Two vLLM instances share a page only if they would compute the same bytes for it. The namespace holds the model and
its revision and quantization, the KV cache layout vLLM chose (``LBNHC`` and ``LBHNC`` put a block's bytes in other
orders), the per-layer block geometry and dtype, and the tensor-parallel size; each request adds its adapter and its
salt (with the deployment's tenant). MLA's latent cache is the same on every rank, so MLA pages are keyed as rank 0
of 1 and written by rank 0 only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.cache import WritePolicy
from kvtier.cache.settings import IO_BACKENDS
from kvtier.errors import InvalidArgument
from kvtier.keys import Namespace
from kvtier.memory import HostKind
from kvtier.pools import KVGeometry
from kvtier.pools.geometry import HostLayout, PoolKind

OPTIONS = {
    "host_gb": "host memory per worker for KV pages, in GB (default 4; or give host_tokens)",
    "host_tokens": "host memory per worker, as tokens of KV (instead of host_gb)",
    "host_kind": "how the host pool is allocated: registered (default), pinned, shm, hugetlb or pageable",
    "host_layout": "the host pool's layout: layer_first (default) or page_first_direct",
    "store": "a kvtier store spec behind the host pool: file:PATH, redis://…, mooncake://… (default: none)",
    "store_options": "options for the store, as open_store takes them: {\"max_bytes\": …, \"ttl\": …}",
    "write_policy": "write_through (default: back up each full block as soon as it is computed) or write_back (back "
                    "up a request's blocks when it finishes)",
    "io_backend": "the transfer engine's backend: kernel (default), staged, direct or batch",
    "prefetch_policy": "storage hits: wait_complete (default: the request waits until every page is read) or timeout "
                       "(after prefetch_timeout_s, pages not read yet are recomputed)",
    "prefetch_timeout_s": "the timeout of the timeout prefetch policy (default 1.0 s)",
    "prefill_tokens_per_s": "the model's prefill rate: prefixes slower to load than to recompute are left to vLLM "
                            "(default: none, every hit is loaded)",
    "load_gbps": "the host-to-device rate the load estimate uses (default 50)",
    "storage_gbps": "the store's read rate to judge by until it has measured its own",
    "model": "the model's name in the namespace (default: vLLM's model name or path)",
    "tenant": "a salt that keeps this deployment's pages apart from every other's (default: none)",
    "min_load_tokens": "hits shorter than this are recomputed rather than loaded (default 0)",
}


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's options, checked once when vLLM builds it (in the scheduler and in every worker)."""

    host_gb: float | None = 4.0
    host_tokens: int | None = None
    host_kind: HostKind = HostKind.REGISTERED
    host_layout: HostLayout = HostLayout.LAYER_FIRST
    store: str | None = None
    store_options: dict[str, Any] = field(default_factory=dict)
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    io_backend: str = "kernel"
    prefetch_policy: str = "wait_complete"
    prefetch_timeout_s: float = 1.0
    prefill_tokens_per_s: float | None = None
    load_gbps: float = 50.0
    storage_gbps: float | None = None
    model: str | None = None
    tenant: str | None = None
    min_load_tokens: int | None = None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """The options in ``kv_connector_extra_config``; an unknown option or one of the wrong type is an
        InvalidArgument naming it."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(OPTIONS))
        if unknown:
            raise InvalidArgument(f"kv_connector_extra_config has unknown option {unknown[0]!r}; kvtier's connector "
                                  f"takes {', '.join(sorted(OPTIONS))}")
        values: dict[str, Any] = {}
        if "host_gb" in extra and "host_tokens" in extra:
            raise InvalidArgument("kv_connector_extra_config: give host_gb or host_tokens, not both")
        if "host_tokens" in extra:
            values["host_tokens"] = _count(extra, "host_tokens")
            values["host_gb"] = None
        if "host_gb" in extra:
            values["host_gb"] = _positive(extra, "host_gb")
        if "min_load_tokens" in extra:
            values["min_load_tokens"] = _count(extra, "min_load_tokens", low=0)
        for name in ("prefill_tokens_per_s", "load_gbps", "storage_gbps", "prefetch_timeout_s"):
            if extra.get(name) is not None:
                values[name] = _positive(extra, name)
        for name in ("store", "model", "tenant"):
            if extra.get(name) is not None:
                if not isinstance(extra[name], str) or not extra[name]:
                    raise InvalidArgument(f"kv_connector_extra_config {name!r}={extra[name]!r}: a non-empty string "
                                          f"({OPTIONS[name]})")
                values[name] = extra[name]
        options = extra.get("store_options") or {}
        if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
            raise InvalidArgument(f"kv_connector_extra_config 'store_options'={options!r:.80}: an object of option "
                                  "names to values")
        values["store_options"] = dict(options)
        if "host_kind" in extra:
            values["host_kind"] = HostKind(extra["host_kind"])
        if "host_layout" in extra:
            values["host_layout"] = HostLayout.of(extra["host_layout"], (HostLayout.LAYER_FIRST,
                                                                         HostLayout.PAGE_FIRST_DIRECT), "host_layout")
        if "write_policy" in extra:
            policy = WritePolicy(extra["write_policy"])
            if policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
                raise InvalidArgument("write_policy 'write_through_selective' is not served by the vLLM connector: "
                                      "choose 'write_through' or 'write_back'")
            values["write_policy"] = policy
        if "io_backend" in extra:
            if extra["io_backend"] not in IO_BACKENDS:
                raise InvalidArgument(f"io_backend={extra['io_backend']!r}: choose one of {', '.join(IO_BACKENDS)}")
            values["io_backend"] = extra["io_backend"]
        if "prefetch_policy" in extra:
            if extra["prefetch_policy"] not in ("wait_complete", "timeout"):
                raise InvalidArgument(f"prefetch_policy={extra['prefetch_policy']!r}: choose 'wait_complete' or "
                                      "'timeout'")
            values["prefetch_policy"] = extra["prefetch_policy"]
        return cls(**values)

    def host_pages(self, page_bytes: int, page_size: int) -> int:
        """Pages of the host pool, each ``page_bytes`` (every layer of a block) holding ``page_size`` tokens: the
        same count in the scheduler and every worker, so a page number means one slot everywhere."""
        pages = (self.host_tokens // page_size if self.host_tokens is not None
                 else int((self.host_gb or 0) * 1e9) // page_bytes)
        if pages < 1:
            raise InvalidArgument(f"the host pool holds no page: a page takes {page_bytes} bytes; raise host_gb or "
                                  "host_tokens")
        return pages


def _count(extra: dict[str, Any], name: str, *, low: int = 1) -> int:
    value = extra[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgument(f"kv_connector_extra_config {name!r}={value!r}: an integer >= {low} ({OPTIONS[name]})")
    return value


def _positive(extra: dict[str, Any], name: str) -> float:
    value = extra[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgument(f"kv_connector_extra_config {name!r}={value!r}: a positive number ({OPTIONS[name]})")
    return float(value)


@dataclass(frozen=True)
class Deployment:
    """Which pages are whose: the model's identity, the geometry of one worker's KV (every layer of one block per
    page), the KV dtype, and the tensor-parallel shard. ``namespace(adapter, salt)`` is a request's namespace."""

    model: str
    geometry: KVGeometry
    dtype: str
    layout: str
    tp_rank: int
    tp_size: int
    is_mla: bool
    tenant: str | None = None

    @property
    def writer(self) -> bool:
        """Whether this rank writes pages to storage (MLA: rank 0 only; its pages are the same on every rank)."""
        return not self.is_mla or self.tp_rank == 0

    def on_rank(self, rank: int) -> Deployment:
        return replace(self, tp_rank=rank)

    def namespace(self, adapter: str | None = None, salt: str | None = None) -> Namespace:
        """The namespace of this rank's pages for requests of ``adapter`` (a LoRA name) and ``salt`` (vLLM's
        ``cache_salt``). The model part is JSON of the model and the layout, so no name can spell another's."""
        rank, size = (0, 1) if self.is_mla else (self.tp_rank, self.tp_size)
        identity = json.dumps({"vllm": self.model, "layout": self.layout}, sort_keys=True, separators=(",", ":"))
        tenant = self.tenant if salt is None else json.dumps([self.tenant, salt], separators=(",", ":"))
        return Namespace(identity, self.geometry, self.dtype, tp_rank=rank, tp_size=size, adapter=adapter,
                         tenant=tenant)


LAYER_COMPACT_LAYOUTS = ("LBNHC", "LBHNC")
"""vLLM KV cache layouts where each layer's blocks are contiguous runs of one block each: a kvtier device page is a
(layer, block) piece. Block-outermost layouts interleave every layer of a block and are refused."""


def deployment_of(vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings, tp_rank: int = 0
                  ) -> tuple[Deployment, list[str]]:
    """The deployment of one vLLM worker (or its scheduler, as rank 0) and the names of its attention layers in
    the KV cache group's order. Refused, naming why: several KV cache groups (sliding-window, Mamba and other hybrid
    models), a spec other than full attention or MLA, pipeline or decode-context parallelism, a block-outermost
    layout."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise InvalidArgument(f"kvtier's vLLM connector serves models whose KV cache is one group of full-attention "
                              f"(or MLA) layers; this one has {len(groups)} groups ({', '.join(kinds)})")
    spec, layers = groups[0].kv_cache_spec, list(groups[0].layer_names)
    kind = type(spec).__name__
    if kind not in ("FullAttentionSpec", "MLAAttentionSpec") or getattr(spec, "sliding_window", None):
        raise InvalidArgument(f"kvtier's vLLM connector serves full-attention and MLA layers, not {kind}")
    parallel = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(parallel, name, 1) or 1) > 1:
            raise InvalidArgument(f"kvtier's vLLM connector does not serve {name}={getattr(parallel, name)} yet "
                                  "(tensor parallelism is served)")
    layout = str(kv_cache_config.kv_cache_layout or getattr(vllm_config.cache_config, "kv_cache_layout", None)
                 or "LBNHC")
    layout = {"NHD": "LBNHC", "HND": "LBHNC"}.get(layout, layout)
    if layout not in LAYER_COMPACT_LAYOUTS:
        raise InvalidArgument(f"vLLM's KV cache layout {layout} interleaves the layers of a block; kvtier's connector "
                              f"serves {' and '.join(LAYER_COMPACT_LAYOUTS)} (set VLLM_KV_CACHE_LAYOUT=NHD)")
    page_bytes, block = int(spec.page_size_bytes), int(spec.block_size)
    if page_bytes % block or (page_bytes // block) % 16 or page_bytes // block < 64:
        raise InvalidArgument(f"a {kind} block of {block} tokens takes {page_bytes} bytes: kvtier pages rows of a "
                              "multiple of 16 bytes, at least 64")
    pool_kind = PoolKind.MLA if kind == "MLAAttentionSpec" else PoolKind.K_ONLY
    geometry = KVGeometry(pool_kind, len(layers), block, page_bytes // block, 1)
    dtype = str(spec.dtype).replace("torch.", "")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if quant != "NONE":
        dtype = f"{dtype}+{quant.lower()}"
    model_config = vllm_config.model_config
    identity = {"model": settings.model or str(model_config.model),
                "revision": getattr(model_config, "revision", None),
                "quantization": getattr(model_config, "quantization", None)}
    model = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    return (Deployment(model, geometry, dtype, layout, tp_rank, tp_size, pool_kind is PoolKind.MLA, settings.tenant),
            layers)


def rank_keys(keys: list[bytes], logical: Namespace, rank: Namespace) -> list[bytes]:
    """The keys one rank stores its shard of ``keys`` under. The scheduler keys pages once, under the deployment's
    rank-0 namespace (``logical``); another rank's page of the same tokens is a different page, keyed by hashing
    its own namespace's digest with the logical key (one SHA-256 per page, no second chain)."""
    if rank.digest == logical.digest:
        return keys
    sha256, seed = hashlib.sha256, b"kvtier.vllm.rank" + rank.digest
    return [sha256(seed + key).digest() for key in keys]
