"""vLLM with kvtier's host and storage tiers behind it: ``KVTierConnector``, loaded by vLLM's KV connector factory
from ``kv_connector_module_path="kvtier.integrations.vllm"`` (``docs/vllm.md``).

The connector is imported on first use, so the worker side (``worker.py``) also runs where vLLM is not installed
(the GPU harness in ``bench/vllm_connector.py`` drives it as vLLM's model runner does).
"""

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.integrations.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module 'kvtier.integrations.vllm' has no attribute {name!r}")
