"""The cache: a radix index over the device and host tiers (and a hybrid model's state snapshots), write policies,
eviction, layer-wise load-back."""

from kvtier.cache.allocator import PageAllocator
from kvtier.cache.cache import Inserted, KVCache, OutOfPages
from kvtier.cache.index import IndexCorrupted, Match, Node, RadixIndex
from kvtier.cache.metrics import CacheMetrics
from kvtier.cache.operation import LoadBack, Operation
from kvtier.cache.rates import H200_TABLE, PairRate, RateTable, measure_rates
from kvtier.cache.request import CacheRequest
from kvtier.cache.settings import CacheSettings, PrefetchPolicy, WritePolicy
from kvtier.cache.state_tier import StateTier, interleaved_layers
from kvtier.cache.storage_tier import Prefetch
from kvtier.keys import Namespace, page_keys, token_array

__all__ = ["CacheMetrics", "CacheRequest", "CacheSettings", "H200_TABLE", "IndexCorrupted", "Inserted", "KVCache",
           "LoadBack", "Match", "Namespace", "Node", "Operation", "OutOfPages", "PageAllocator", "PairRate", "Prefetch",
           "PrefetchPolicy", "RadixIndex", "RateTable", "StateTier", "WritePolicy", "interleaved_layers",
           "measure_rates", "page_keys", "token_array"]
