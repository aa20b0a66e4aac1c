"""kvtier: a hierarchical KV cache for LLM serving, correct in every pointer domain."""

from kvtier.errors import KvtierError
from kvtier.memory import CpuAddress, DeviceAddress, DeviceBuffer, HostBuffer, HostKind, get_device_accessible_ptr

__version__ = "0.1.0"
__all__ = ["KvtierError", "CpuAddress", "DeviceAddress", "DeviceBuffer", "HostBuffer", "HostKind",
           "get_device_accessible_ptr", "__version__"]
