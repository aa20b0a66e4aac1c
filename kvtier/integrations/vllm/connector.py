"""``KVTierConnector``: kvtier's host and storage tiers behind vLLM, as a KV connector vLLM loads by module path.

    --kv-transfer-config '{"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"host_gb": 16, "store": "file:/…"}}'

vLLM's factory builds it twice: in the scheduler (``SchedulerSide``: the host index, the load and save decisions) and
in every worker (``WorkerSide``: the transfers). This class only routes vLLM's calls to the side of its role.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, SupportsHMA
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.integrations.vllm.messages import KVTierMetadata, KVTierWorkerMeta
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.settings import ConnectorSettings, deployment_of
from kvtier.integrations.vllm.stats import KVTierConnectorStats
from kvtier.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        """Workers move bytes with the platform's kvtier runtime (``$KVTIER_RUNTIME`` picks another: the emulator's
        in CI)."""
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            deployment, _ = deployment_of(vllm_config, kv_cache_config, self.settings)
            self.scheduler = SchedulerSide(self.settings, deployment,
                                           int(vllm_config.parallel_config.world_size or 1))
        else:
            from kvtier.runtime import get as get_runtime

            deployment, layers = deployment_of(vllm_config, kv_cache_config, self.settings, tensor_parallel_rank())
            self.worker = WorkerSide(self.settings, deployment, layers, get_runtime())

    # -- scheduler side ---------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.allocated(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        assert self.scheduler is not None
        if not num_external_tokens:
            return {}
        host, storage = self.scheduler.hit_sources(request)
        if host + storage != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {source: tokens for source, tokens in ((CacheHitSource.HOST, host), (CacheHitSource.DISK, storage))
                if tokens}

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        assert self.scheduler is not None
        return self.scheduler.build(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.scheduler is not None
        self.scheduler.reported(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.finished(request, block_ids), None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator calls this one; kvtier serves models of one KV cache group (refused otherwise when
        the connector is built), so it is ``request_finished`` of that group."""
        return self.request_finished(request, block_ids[0])

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        side: Any = self.scheduler if self.scheduler is not None else self.worker
        counters = side.take_counters()
        return KVTierConnectorStats(data=counters) if any(counters.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierConnectorStats:
        return KVTierConnectorStats(data=dict(data or {}))

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset() if self.scheduler is not None else None

    # -- worker side ------------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self.worker is not None and self.worker.engine is not None and isinstance(kv_connector_metadata,
                                                                                     KVTierMetadata):
            self.worker.preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: the step's saves go as one backup in ``wait_for_save`` (one engine call instead of one
        per layer, and still off the forward's path)."""

    def wait_for_save(self) -> None:
        assert self.worker is not None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVTierMetadata)
            self.worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        sending, recving = self.worker.poll()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.load_errors()

    def build_connector_worker_meta(self) -> Any:
        assert self.worker is not None
        reports = self.worker.worker_meta()
        return KVTierWorkerMeta(reports.done, reports.unreadable) if reports is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 where vLLM's process groups are not set up: one worker)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

        return int(get_tensor_model_parallel_rank()) if model_parallel_is_initialized() else 0
    except (ImportError, AssertionError):
        return 0
