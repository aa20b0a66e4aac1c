"""What an SGLang deployment tells kvtier: the backend's options (from SGLang's extra config) and the identity its
pages are stored under (from SGLang's ``HiCacheStorageConfig`` and the host pool's geometry).

Two deployments share a page only if they would compute the same bytes for it: the namespace holds the model, the
KV geometry and dtype, the tensor-parallel rank and size (MLA's latent cache is the same on every TP rank, so MLA
pages are stored once, as rank 0 of 1), the pipeline stage, the context-parallel shard, the adapter and the tenant.
Data-parallel replicas compute the same KV, so ``dp_rank`` is left out: they share pages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.keys import Namespace
from kvtier.pools.geometry import KVGeometry

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""Keys SGLang's factory reads from the same extra config (the backend's own options sit beside them)."""

OPTIONS = {
    "store": "the kvtier store spec: file:PATH, redis://…, redis+cluster://…, mooncake://… (required)",
    "model": "the model's name in the namespace where SGLang gives none (SGLang's own name always wins)",
    "tenant": "a salt that keeps this deployment's pages apart from every other's (default: none)",
    "adapter": "the LoRA adapter every request of this deployment uses (default: none)",
    "store_options": "options for the store, as open_store takes them: {\"max_bytes\": …, \"ttl\": …, …}",
    "skip_existing": "check which pages storage holds before writing and write only the others (default: true)",
    "prefill_tokens_per_s": "the model's prefill rate: stored pages slower to read than to recompute are reported "
                            "as misses (default: none, every stored page is a hit)",
    "storage_gbps": "the store's read rate to judge by until it has measured its own (over 64 MiB read)",
}


@dataclass(frozen=True)
class Settings:
    """The backend's options, checked once when SGLang builds it."""

    store: str
    model: str | None = None
    tenant: str | None = None
    adapter: str | None = None
    store_options: dict[str, Any] = field(default_factory=dict)
    skip_existing: bool = True
    prefill_tokens_per_s: float | None = None
    storage_gbps: float | None = None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> Settings:
        """The options in SGLang's ``--hicache-storage-backend-extra-config`` (keys SGLang's own factory reads are
        left to it). A missing store or an option of the wrong type is an InvalidArgument naming it."""
        extra = dict(extra or {})
        if not isinstance(extra.get("store"), str) or not extra["store"]:
            raise InvalidArgument("kvtier's HiCache backend needs \"store\" in --hicache-storage-backend-extra-config: "
                                  "a kvtier store spec such as \"file:/var/cache/kvtier\", \"redis://host:6379/0\" or "
                                  "\"mooncake://master:50051?metadata=http://master:8080/metadata\"")
        for name in ("model", "tenant", "adapter"):
            if extra.get(name) is not None and (not isinstance(extra[name], str) or not extra[name]):
                raise InvalidArgument(f"extra config {name!r}={extra[name]!r}: a non-empty string ({OPTIONS[name]})")
        options = extra.get("store_options") or {}
        if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
            raise InvalidArgument(f"extra config 'store_options'={options!r:.80}: an object of option names to values")
        skip = extra.get("skip_existing", True)
        if not isinstance(skip, bool):
            raise InvalidArgument(f"extra config 'skip_existing'={skip!r}: true or false")
        rates = {}
        for name in ("prefill_tokens_per_s", "storage_gbps"):
            value = extra.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise InvalidArgument(f"extra config {name!r}={value!r}: a positive number ({OPTIONS[name]})")
            rates[name] = float(value) if value is not None else None
        return cls(extra["store"], extra.get("model"), extra.get("tenant"), extra.get("adapter"), dict(options), skip,
                   **rates)


@dataclass(frozen=True)
class Deployment:
    """The part of SGLang's ``HiCacheStorageConfig`` that decides which pages are whose."""

    model: str
    tp_rank: int
    tp_size: int
    is_mla: bool
    writer: bool
    shard: tuple[tuple[str, int, int], ...]
    """(name, rank, size) of each sharding beyond tensor parallelism that has more than one shard: ``pp``, ``cp``
    (attention context parallel), ``dcp`` (decode context parallel)."""

    @classmethod
    def of(cls, config: Any, settings: Settings) -> Deployment:
        """From SGLang's ``HiCacheStorageConfig`` (read by attribute, so any object with its fields works). The
        model's name is SGLang's; ``settings.model`` only stands in where SGLang gives none."""
        model = getattr(config, "model_name", None) or settings.model
        if not model:
            raise InvalidArgument("kvtier's HiCache backend needs the model's name to keep its pages apart: SGLang "
                                  "gave none, so set \"model\" in --hicache-storage-backend-extra-config")
        is_mla = bool(getattr(config, "is_mla_model", False))
        tp_rank, tp_size = int(getattr(config, "tp_rank", 0)), int(getattr(config, "tp_size", 1))
        writer = getattr(config, "is_storage_writer", None)
        if writer is None:
            writer = not is_mla or tp_rank == 0
        shard = tuple((name, int(rank or 0), int(size or 1)) for name, rank, size in (
            ("pp", getattr(config, "pp_rank", 0), getattr(config, "pp_size", 1)),
            ("cp", getattr(config, "attn_cp_rank", 0), getattr(config, "attn_cp_size", 1)),
            ("dcp", getattr(config, "dcp_rank", 0), getattr(config, "dcp_size", 1))) if int(size or 1) > 1)
        return cls(str(model), tp_rank, tp_size, is_mla, bool(writer), shard)

    def namespace(self, geometry: KVGeometry, dtype: str, settings: Settings, *, row_split: str = "",
                  order: int = 0) -> Namespace:
        """The namespace of this deployment's pages of ``geometry`` and ``dtype``. ``row_split`` names how a row
        divides where its width alone does not say (MLA's latent and rope parts: ``mla512+64``); ``order`` is the
        byte order of the host layout (``kvtier.pools.payload_order``): deployments of one order share pages,
        deployments of two keep a copy each (a page is stored once under its key, so sharing one would leave the
        second deployment with pages it can never read). The model's part of the namespace is JSON of all of it,
        so no model name can spell another deployment's shard."""
        rank, size = (0, 1) if self.is_mla else (self.tp_rank, self.tp_size)
        identity = {"sglang": self.model, "shard": {name: [r, n] for name, r, n in self.shard},
                    "row": row_split, "order": order}
        return Namespace(json.dumps(identity, sort_keys=True, separators=(",", ":")), geometry, dtype, tp_rank=rank,
                         tp_size=size, adapter=settings.adapter, tenant=settings.tenant)
