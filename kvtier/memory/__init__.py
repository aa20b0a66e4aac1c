"""Host and device buffers, typed addresses, and resolution of device-accessible addresses."""

from kvtier.address import CpuAddress, DeviceAddress
from kvtier.memory.device_buffer import DeviceBuffer, DeviceRegion
from kvtier.memory.host_buffer import HostBuffer, HostRegion
from kvtier.memory.registration import DEFAULT_REGISTER_CHUNK_BYTES, plan_chunks, register_chunks, unregister_chunks
from kvtier.memory.resolve import device_index, get_device_accessible_ptr, resolve_foreign_address, tensor_extent
from kvtier.memory.shm import sweep_shm
from kvtier.runtime import HostKind

__all__ = ["CpuAddress", "DeviceAddress", "DeviceBuffer", "DeviceRegion", "HostBuffer", "HostKind", "HostRegion",
           "tensor_extent",
           "DEFAULT_REGISTER_CHUNK_BYTES", "plan_chunks", "register_chunks", "unregister_chunks", "device_index",
           "get_device_accessible_ptr", "resolve_foreign_address", "sweep_shm"]
