"""The device alias of a span of registered host memory, across registration chunks when that is sound.

A span inside one registration has one alias. A span over several (a big buffer registered in chunks) has one only
where the chunks' aliases on that device are laid out like their CPU addresses — always where alias == CPU address,
not necessarily on split-alias platforms. This is the one place that rule is checked.
"""

from __future__ import annotations

from kvtier.errors import NotDeviceAccessible, RegistrationError
from kvtier.runtime import Runtime


def span_chunks(runtime: Runtime, address: int, nbytes: int, device: int) -> list[tuple[int, int]]:
    """(CPU start, device alias) of each registration chunk [address, address + nbytes) lies in, in order: what a
    copy engine needs of host memory (every byte registered, for the device), whether or not the aliases are
    contiguous. Copies read such a span by its CPU address, each copy cut where two chunks meet."""
    first = runtime.host_range(address)
    if first is None:
        raise NotDeviceAccessible(f"0x{address:x} is not registered or pinned host memory")
    chunks = [(address, runtime.host_get_device_pointer(address, device))]
    end, entry = address + max(nbytes, 1), first
    while entry.end < end:
        following = runtime.host_range(entry.end)
        if following is None:
            raise RegistrationError(f"0x{address:x} (+{nbytes}) runs past the registered memory at "
                                    f"0x{first.start:x}: it ends outside any registration")
        chunks.append((following.start, runtime.host_get_device_pointer(following.start, device)))
        entry = following
    return chunks


def span_alias(runtime: Runtime, address: int, nbytes: int, device: int) -> int:
    """The one device alias of [address, address + nbytes) on ``device``, for kernels: refused where the span's chunks
    have aliases not laid out like their CPU addresses."""
    chunks = span_chunks(runtime, address, nbytes, device)
    alias = chunks[0][1]
    for start, actual in chunks[1:]:
        expected = alias + (start - address)
        if actual != expected:
            raise RegistrationError(
                f"0x{address:x} (+{nbytes}) spans two registration chunks whose aliases on device {device} are not "
                f"contiguous (0x{actual:x} where 0x{expected:x} would be): resolve each page on its own, or register "
                f"the span as one chunk")
    return alias
