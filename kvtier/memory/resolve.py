"""``get_device_accessible_ptr``: the one way to turn a buffer into an address a kernel on a device may use.

Rules (DESIGN.md): the result is valid on the *target* device; resolving never changes the caller's current device;
memory of another device and pageable host memory are refused by name, never passed through.
"""

from __future__ import annotations

from typing import Any

from kvtier.errors import AddressDomainError, KvtierError, NotDeviceAccessible, WrongDeviceError
from kvtier.memory.address import CpuAddress, DeviceAddress
from kvtier.memory.alias import span_alias
from kvtier.memory.device_buffer import DeviceBuffer
from kvtier.memory.host_buffer import HostBuffer, HostRegion
from kvtier.runtime import MemoryType, Runtime
from kvtier.runtime import get as get_runtime


def device_index(device: Any) -> int:
    """Accept 1, ``"cuda:1"`` or ``torch.device("cuda", 1)``."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    text = str(device)
    kind, _, index = text.partition(":")
    if kind in ("cuda", "hip") and index.isdigit():
        return int(index)
    raise KvtierError(f"expected a device index or 'cuda:N', got {device!r}")


def get_device_accessible_ptr(obj: Any, device: Any, *, runtime: Runtime | None = None) -> DeviceAddress:
    """The address of ``obj`` that kernels on ``device`` may dereference.

    ``obj`` is a HostBuffer, HostRegion, DeviceBuffer, CpuAddress, DeviceAddress, or a torch tensor (CPU over
    registered/pinned memory, or on a device). Interior addresses keep their offset.
    """
    target = device_index(device)
    if isinstance(obj, (HostBuffer, HostRegion)):
        owner = obj if isinstance(obj, HostBuffer) else obj.buffer
        _same_runtime(owner.runtime, runtime)
        return obj.device_address(target) if isinstance(obj, HostRegion) else obj.device_address(target, 0, obj.nbytes)
    if isinstance(obj, DeviceBuffer):
        _same_runtime(obj.runtime, runtime)
        obj.runtime.check_device(target)
        return _on_device(obj.address, target)
    runtime = runtime or get_runtime()
    runtime.check_device(target)
    if isinstance(obj, DeviceAddress):
        return _on_device(obj, target)
    if isinstance(obj, CpuAddress):
        return _host_alias(runtime, obj.value, 1, target)
    if isinstance(obj, int):
        raise AddressDomainError(
            f"raw integer 0x{obj:x} is not a buffer operand: pass a HostBuffer, tensor, CpuAddress or DeviceAddress")
    if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        return _tensor(runtime, obj, target)
    raise TypeError(f"cannot resolve a device address for {type(obj).__name__}")


def _same_runtime(owner: Runtime, runtime: Runtime | None) -> None:
    if runtime is not None and runtime is not owner:
        raise KvtierError(f"buffer belongs to {owner!r}, not {runtime!r}")


def _on_device(address: DeviceAddress, target: int) -> DeviceAddress:
    if address.device != target:
        raise WrongDeviceError(f"{address} is memory of device {address.device}, not of device {target}")
    return address


def _tensor(runtime: Runtime, tensor: Any, target: int) -> DeviceAddress:
    nbytes = max(tensor.numel() * tensor.element_size(), 1)
    if tensor.device.type == "cpu":
        return _host_alias(runtime, tensor.data_ptr(), nbytes, target)
    if tensor.device.type != "cuda" or runtime.name != "cuda":
        raise WrongDeviceError(f"a {tensor.device} tensor cannot be used on device {target} of {runtime.name}")
    return _on_device(DeviceAddress(tensor.data_ptr(), tensor.device.index), target)


def _host_alias(runtime: Runtime, address: int, nbytes: int, target: int) -> DeviceAddress:
    if runtime.host_range(address) is not None:
        return DeviceAddress(span_alias(runtime, address, nbytes, target), target)
    attrs = runtime.pointer_attributes(address)
    if attrs.type is MemoryType.DEVICE:
        return _on_device(DeviceAddress(address, attrs.device or 0), target)
    if attrs.type in (MemoryType.HOST, MemoryType.MANAGED):
        return DeviceAddress(runtime.host_get_device_pointer(address, target), target)
    if runtime.device_attributes(target).pageable_memory_access:
        return DeviceAddress(address, target)
    raise NotDeviceAccessible(
        f"0x{address:x} is pageable host memory: device {target} of {runtime.name} cannot access it. Use a "
        f"HostBuffer of kind 'registered', 'pinned' or 'shm' (or a pinned tensor) for kernel operands")
