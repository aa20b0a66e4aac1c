"""vLLM with kvtier's host and storage tiers behind it: ``KVTierConnector``, loaded by vLLM's KV connector factory
from ``kv_connector_module_path="kvtier.integrations.vllm"`` (``docs/vllm.md``)."""

from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
