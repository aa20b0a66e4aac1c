"""KV pool geometries, host layouts, device and host pools, pointer tables, page slots."""

from kvtier.pools.device_pool import DevicePool
from kvtier.pools.geometry import (
    HostLayout,
    KVGeometry,
    PoolKind,
    Strides,
    device_strides,
    host_strides,
    payload_order,
    valid_payload_order,
)
from kvtier.pools.host_pool import HostPool
from kvtier.pools.pointer_table import PointerTable, build_pointer_table

__all__ = ["DevicePool", "HostLayout", "HostPool", "KVGeometry", "PointerTable", "PoolKind",
           "Strides", "build_pointer_table", "device_strides", "host_strides", "payload_order",
           "valid_payload_order"]
