"""kvtier inside SGLang: :class:`KVTierStorage`, a HiCache L3 storage backend SGLang loads itself.

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KVTierStorage",
          "interface_v1": 1, "store": "file:/var/cache/kvtier"}'

Importing this package imports SGLang (``sglang.srt.mem_cache.hicache_storage``); docs/sglang.md has the options.
"""

from kvtier.integrations.sglang.settings import OPTIONS, Deployment, Settings
from kvtier.integrations.sglang.storage import KVTierStorage, page_key

__all__ = ["OPTIONS", "Deployment", "KVTierStorage", "Settings", "page_key"]
