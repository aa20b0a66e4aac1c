"""Which runtimes a test can have: the GPU one when usable, and what kind of aliases an emulated one gives."""

from __future__ import annotations

import os

from kvtier.errors import RuntimeUnavailable
from kvtier.runtime import Runtime, get

EMULATED_MODES = ["split", "unified"]
"""The emulator's alias modes, as ``EmulatedRuntime(mode)`` takes them."""


def cuda_runtime() -> Runtime | None:
    """The GPU runtime (``cuda``, or the one ``KVTIER_GPU_RUNTIME`` names), or None where none is usable."""
    try:
        return get(os.environ.get("KVTIER_GPU_RUNTIME") or "cuda")
    except RuntimeUnavailable:
        return None


def is_split(runtime: Runtime) -> bool:
    """Whether registered host memory has a device alias other than its CPU address on device 0."""
    return not runtime.device_attributes(0).can_use_host_pointer_for_registered_mem
