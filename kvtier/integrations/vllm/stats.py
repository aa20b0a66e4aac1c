"""The connector's counters as vLLM's ``KVConnectorStats``: the scheduler's (host and storage hit tokens, tokens
declined as slower than recompute, pages saved, saves skipped for want of free host pages, blocks failed) and the
workers', summed over the workers and the interval by vLLM's logger."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVTierConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())
