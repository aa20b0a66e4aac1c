"""The device alias of a span of registered host memory, across registration chunks when that is sound.

A span inside one registration has one alias. A span over several (a big buffer registered in chunks) has one only
where the chunks' aliases on that device are laid out like their CPU addresses — always where alias == CPU address,
not necessarily on split-alias platforms. This is the one place that rule is checked.
"""

from __future__ import annotations

from kvtier.errors import NotDeviceAccessible, RegistrationError
from kvtier.runtime import Runtime


def span_alias(runtime: Runtime, address: int, nbytes: int, device: int) -> int:
    first = runtime.host_range(address)
    if first is None:
        raise NotDeviceAccessible(f"0x{address:x} is not registered or pinned host memory")
    alias = runtime.host_get_device_pointer(address, device)
    end, entry = address + max(nbytes, 1), first
    while entry.end < end:
        following = runtime.host_range(entry.end)
        if following is None:
            raise RegistrationError(f"0x{address:x} (+{nbytes}) runs past the registered memory at "
                                    f"0x{first.start:x}: it ends outside any registration")
        expected = alias + (following.start - address)
        actual = runtime.host_get_device_pointer(following.start, device)
        if actual != expected:
            raise RegistrationError(
                f"0x{address:x} (+{nbytes}) spans two registration chunks whose aliases on device {device} are not "
                f"contiguous (0x{actual:x} where 0x{expected:x} would be): resolve each page on its own, or register "
                f"the span as one chunk")
        entry = following
    return alias
