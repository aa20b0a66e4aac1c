"""A fake ``libamdhip64`` behind the HIP runtime's ctypes layer, and the gfx targets it reports."""

from __future__ import annotations

import os

import pytest

from kvtier.runtime.hip import (
    ATTRIBUTES,
    NO_DEVICE,
    SUCCESS,
    HipLibrary,
)


class FakeLib:
    """The few libamdhip64 entry points a test drives, as Python functions on ctypes out-parameters."""

    def __init__(self, devices: int = 2, version: int = 60_300_000, alias_offset: int = 0x7F00_0000_0000) -> None:
        self.devices, self.version, self.alias_offset = devices, version, alias_offset
        self.current, self.calls, self.fail = 0, [], {}
        self.attributes = {ATTRIBUTES["can_use_host_pointer_for_registered_mem"]: 0, ATTRIBUTES["major"]: 9,
                           ATTRIBUTES["minor"]: 4, ATTRIBUTES["multiprocessors"]: 256,
                           ATTRIBUTES["unified_addressing"]: 1, ATTRIBUTES["can_map_host_memory"]: 1,
                           ATTRIBUTES["pageable_memory_access"]: 0, ATTRIBUTES["stream_wait_value"]: 1}
        self.pointer_status, self.pointer_type, self.managed = SUCCESS, 1, 0

    def __getattr__(self, name: str):
        if name.startswith("hip"):
            def recorded(*args):
                self.calls.append((name, args))
                return self.fail.get(name, SUCCESS)
            return recorded
        raise AttributeError(name)

    def _out(self, ref, value) -> int:
        ref._obj.value = value
        return SUCCESS

    def hipGetDeviceCount(self, ref):
        return self._out(ref, self.devices) if self.devices else NO_DEVICE

    def hipRuntimeGetVersion(self, ref):
        return self._out(ref, self.version)

    def hipGetDevice(self, ref):
        return self._out(ref, self.current)

    def hipSetDevice(self, device):
        self.current = device
        return SUCCESS

    def hipDeviceGetAttribute(self, ref, attribute, device):
        return self._out(ref, self.attributes.get(attribute, 0))

    def hipDeviceGetName(self, buffer, size, device):
        buffer.value = f"AMD Instinct MI355X #{device}".encode()
        return SUCCESS

    def hipDeviceTotalMem(self, ref, device):
        return self._out(ref, 288 << 30)

    def hipDeviceGetPCIBusId(self, buffer, size, device):
        buffer.value = ["0000:c1:00.0", "0001:05:00.0"][device].encode()
        return SUCCESS

    def hipHostGetDevicePointer(self, ref, address, flags):
        return self._out(ref, address.value + self.alias_offset)

    def hipPointerGetAttributes(self, ref, address):
        attrs = ref._obj
        attrs.type, attrs.device, attrs.devicePointer, attrs.hostPointer = self.pointer_type, 1, 0x1000, 0x2000
        attrs.isManaged = self.managed
        return self.pointer_status

    def hipGetErrorName(self, status):
        return {700: b"hipErrorIllegalAddress", NO_DEVICE: b"hipErrorNoDevice"}.get(status, b"hipErrorUnknown")

    def hipGetErrorString(self, status):
        return b"an illegal memory access was encountered" if status == 700 else b"unknown error"



def fake_library(**options) -> HipLibrary:
    library = HipLibrary.__new__(HipLibrary)
    library.lib = FakeLib(**options)
    return library



TARGETS = {(0, 0xC1 << 8): "gfx950", (1, 0x05 << 8): "gfx942"}

# A shared object that exists on every Linux host and is not libamdhip64, for KVTIER_HIP_LIBRARY to name.
NON_HIP_LIBRARY = next((p for p in ("/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1",
                                    "/lib64/libz.so.1", "/usr/lib64/libz.so.1") if os.path.exists(p)), None)
needs_non_hip_library = pytest.mark.skipif(NON_HIP_LIBRARY is None, reason="no libz.so.1 to stand in for a non-HIP .so")
