"""Host and device buffers, typed addresses, and resolution of device-accessible addresses."""

from kvtier.memory.address import CpuAddress, DeviceAddress
from kvtier.memory.device_buffer import DeviceBuffer
from kvtier.memory.host_buffer import HostBuffer, HostKind, HostRegion
from kvtier.memory.registration import DEFAULT_REGISTER_CHUNK_BYTES, plan_chunks, register_chunks, unregister_chunks
from kvtier.memory.resolve import device_index, get_device_accessible_ptr

__all__ = ["CpuAddress", "DeviceAddress", "DeviceBuffer", "HostBuffer", "HostKind", "HostRegion",
           "DEFAULT_REGISTER_CHUNK_BYTES", "plan_chunks", "register_chunks", "unregister_chunks", "device_index",
           "get_device_accessible_ptr"]
