"""The connector's jobs and reports as vLLM's metadata types (what vLLM's scheduler and model runner pass around)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier.integrations.vllm.jobs import JobReports, StepJobs


@dataclass
class KVTierMetadata(StepJobs, KVConnectorMetadata):
    """One step's jobs, scheduler to workers."""


@dataclass
class KVTierWorkerMeta(JobReports, KVConnectorWorkerMetadata):
    """One worker's finished jobs, summed over the workers by vLLM (``aggregate``) before the scheduler reads them."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMeta:  # type: ignore[override]
        assert isinstance(other, JobReports), f"cannot aggregate kvtier's job reports with {type(other).__name__}"
        merged = JobReports.aggregate(self, other)
        return KVTierWorkerMeta(merged.done, merged.unreadable)
