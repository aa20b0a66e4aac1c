"""``get_device_accessible_ptr``: the one place kvtier turns memory into an address a kernel on a device may use.

Rules (docs/design.md): the result is valid on the *target* device; resolving never changes the caller's current
device; memory of another device and pageable host memory are refused by name, never passed through; and the whole
extent an operand covers (a strided tensor's lowest to highest byte, a region's every byte) must lie in one span
that has a single alias on the target device — else a kernel reading its far end would fault or read another buffer.
Pointer tables, the launch boundary and the doctor all come here; nothing else asks the runtime for an alias.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from kvtier.address import CpuAddress, DeviceAddress
from kvtier.errors import (
    AddressDomainError,
    InvalidArgument,
    KvtierError,
    NotDeviceAccessible,
    RegistrationError,
    WrongDeviceError,
    WrongRuntime,
)
from kvtier.memory.alias import span_alias
from kvtier.memory.device_buffer import DeviceBuffer, DeviceRegion
from kvtier.memory.host_buffer import HostBuffer, HostRegion
from kvtier.pause_points import reached
from kvtier.runtime import HostKind, MemoryType, Runtime
from kvtier.runtime import get as get_runtime


def device_index(device: Any) -> int:
    """Accept 1 (or a numpy integer), ``"cuda:1"`` or ``torch.device("cuda", 1)``."""
    if type(device) is int:
        return device
    if isinstance(device, numbers.Integral) and not isinstance(device, (bool, np.bool_)):
        return int(device)
    text = str(device)
    kind, _, index = text.partition(":")
    if kind in ("cuda", "hip") and index.isdigit():
        return int(index)
    raise KvtierError(f"expected a device index or 'cuda:N', got {device!r}")


def get_device_accessible_ptr(obj: Any, device: Any, *, runtime: Runtime | None = None) -> DeviceAddress:
    """The address of ``obj`` that kernels on ``device`` may dereference.

    ``obj`` is a HostBuffer, HostRegion, DeviceBuffer, DeviceRegion, CpuAddress, DeviceAddress, or a torch tensor
    (CPU over registered/pinned memory, or on a device). Interior addresses keep their offset.
    """
    target = device_index(device)
    if isinstance(obj, (HostBuffer, HostRegion)):
        host, offset, nbytes = (obj, 0, obj.nbytes) if isinstance(obj, HostBuffer) else (
            obj.buffer, obj.offset, obj.nbytes)
        _same_runtime(host.runtime, runtime)
        return _host_buffer(host, offset, nbytes, target)
    if isinstance(obj, (DeviceBuffer, DeviceRegion)):
        device, offset, nbytes = (obj, 0, obj.nbytes) if isinstance(obj, DeviceBuffer) else (
            obj.buffer, obj.offset, obj.nbytes)
        _same_runtime(device.runtime, runtime)
        device.runtime.check_device(target)
        device.check_span(offset, nbytes, "device region")
        return _on_device(device.address + offset, target)
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
    raise AddressDomainError(f"cannot resolve a device address for {type(obj).__name__}")


def resolve_foreign_address(value: int, device: Any, *, runtime: Runtime | None = None) -> DeviceAddress:
    """The address kernels on ``device`` use for ``value``, a raw address kvtier did not hand out (a ``data_ptr()``
    someone wrote into a pointer table): host memory registered or pinned by anyone resolves to its alias for the
    device, memory of that device passes as it is. Pageable host memory is refused even where the device could
    read it (slowly, through page faults), and so is memory of another device: either means the table was built
    from the wrong tensor."""
    target = device_index(device)
    runtime = runtime or get_runtime()
    runtime.check_device(target)
    return _host_alias(runtime, int(value), 1, target, pageable=False)


def tensor_extent(tensor: Any) -> tuple[int, int]:
    """(first, end) byte offsets, relative to ``data_ptr()``, of every byte a tensor's elements touch."""
    if tensor.numel() == 0:
        return 0, 0
    item = tensor.element_size()
    low = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if stride < 0)
    high = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if stride > 0)
    return low * item, (high + 1) * item


def _same_runtime(owner: Runtime, runtime: Runtime | None) -> None:
    if runtime is not None and runtime is not owner:
        raise WrongRuntime(f"this buffer belongs to another runtime instance ({owner.name} at 0x{id(owner):x}), not "
                           f"the {runtime.name} at 0x{id(runtime):x} it was resolved for")


def _on_device(address: DeviceAddress, target: int) -> DeviceAddress:
    if address.device != target:
        raise WrongDeviceError(f"{address} is memory of device {address.device}, not of device {target}")
    return address


def _host_buffer(buffer: HostBuffer, offset: int, nbytes: int, target: int) -> DeviceAddress:
    offset, nbytes = buffer.check_span(offset, nbytes)
    if nbytes == 0 and offset:
        return _host_buffer(buffer, offset - 1, 1, target) + 1
    runtime = buffer.runtime
    runtime.check_device(target)
    address = buffer.cpu_address.value + offset
    if buffer.kind is HostKind.PAGEABLE:
        if runtime.device_attributes(target).pageable_memory_access:
            return DeviceAddress(address, target)
        raise NotDeviceAccessible(
            f"{buffer!r} is pageable host memory, which device {target} cannot access; allocate kind "
            f"'registered', 'pinned' or 'shm' for anything a kernel reads or writes")
    return DeviceAddress(span_alias(runtime, address, nbytes, target), target)


def _tensor(runtime: Runtime, tensor: Any, target: int) -> DeviceAddress:
    if tensor.numel() == 0:
        raise InvalidArgument(f"an empty tensor (shape {tuple(tensor.shape)}) has no bytes for a kernel to touch, so "
                              f"no device address: pass a non-empty view")
    first, end = tensor_extent(tensor)
    start = tensor.data_ptr()
    if tensor.device.type == "cpu":
        alias = _host_alias(runtime, start + first, max(end - first, 1), target)
        return DeviceAddress(alias.value - first, target)
    if runtime.torch_device is None or tensor.device.type != runtime.torch_device:
        raise WrongDeviceError(f"a {tensor.device} tensor cannot be used on device {target} of {runtime.name}")
    return _on_device(DeviceAddress(start, tensor.device.index), target)


def _host_alias(runtime: Runtime, address: int, nbytes: int, target: int, pageable: bool = True) -> DeviceAddress:
    if runtime.host_range(address) is not None:
        return DeviceAddress(span_alias(runtime, address, nbytes, target), target)
    reached("resolve.host_alias_attributes")
    attrs = runtime.pointer_attributes(address)
    if attrs.type is MemoryType.DEVICE:
        return _on_device(DeviceAddress(address, attrs.device or 0), target)
    if attrs.type in (MemoryType.HOST, MemoryType.MANAGED):
        alias = runtime.host_get_device_pointer(address, target)
        _check_foreign_span(runtime, address, nbytes, alias, target)
        return DeviceAddress(alias, target)
    if not pageable:
        raise NotDeviceAccessible(f"0x{address:x} is pageable (or unmapped) host memory: kernels on device {target} "
                                  f"read only pinned or registered host memory and device memory")
    if runtime.device_attributes(target).pageable_memory_access:
        return DeviceAddress(address, target)
    raise NotDeviceAccessible(
        f"0x{address:x} is pageable host memory: device {target} of {runtime.name} cannot access it. Use a "
        f"HostBuffer of kind 'registered', 'pinned' or 'shm' (or a pinned tensor) for kernel operands")


def _check_foreign_span(runtime: Runtime, address: int, nbytes: int, alias: int, target: int) -> None:
    """Host memory pinned by someone else (torch's pin_memory): its last byte must be pinned too, at the matching
    alias, or the span crosses into memory the kernel cannot read."""
    if nbytes <= 1:
        return
    last = address + nbytes - 1
    attrs = runtime.pointer_attributes(last)
    if attrs.type not in (MemoryType.HOST, MemoryType.MANAGED) or \
            runtime.host_get_device_pointer(last, target) != alias + nbytes - 1:
        raise RegistrationError(f"0x{address:x} (+{nbytes}) runs past the pinned memory it starts in: its end is "
                                f"not device-accessible at a contiguous alias")
