"""Platform runtimes behind one interface, and the choice between them.

``get()`` picks CUDA when a GPU is usable and the emulator otherwise; ``KVTIER_RUNTIME`` (or the CLI's
``--runtime``) overrides with ``cuda``, ``emulated:split``, ``emulated:unified`` or ``emulated:<mode>:<devices>``.
One runtime object exists per spec in a process, because registrations are process-wide facts.
"""

from __future__ import annotations

import functools
import os

from kvtier.errors import RuntimeUnavailable
from kvtier.runtime.base import (
    DeviceAttributes,
    Event,
    Graph,
    HostRegisterFlags,
    MemoryType,
    PointerAttributes,
    Runtime,
    Stream,
)

__all__ = ["DeviceAttributes", "Event", "Graph", "HostRegisterFlags", "MemoryType", "PointerAttributes", "Runtime",
           "Stream", "get", "create", "ENV_VAR"]

ENV_VAR = "KVTIER_RUNTIME"


def create(spec: str) -> Runtime:
    """A new runtime for ``spec``; most code wants the shared one from :func:`get`."""
    name, _, rest = spec.strip().lower().partition(":")
    if name == "cuda" and not rest:
        from kvtier.runtime.cuda import CudaRuntime

        return CudaRuntime()
    if name == "emulated":
        from kvtier.runtime.emulated import EmulatedRuntime

        mode, _, devices = rest.partition(":")
        try:
            return EmulatedRuntime(mode or "split", int(devices) if devices else 2)
        except ValueError as exc:
            raise RuntimeUnavailable(f"bad runtime spec {spec!r}: {exc}") from exc
    raise RuntimeUnavailable(
        f"unknown runtime {spec!r}: use 'cuda', 'emulated:split', 'emulated:unified' or 'emulated:<mode>:<devices>'")


@functools.cache
def _shared(spec: str) -> Runtime:
    return create(spec)


def get(spec: str | None = None) -> Runtime:
    """The process's runtime: ``spec``, else ``$KVTIER_RUNTIME``, else CUDA if a GPU is usable, else the emulator."""
    spec = (spec or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if spec != "auto":
        return _shared(spec)
    try:
        return _shared("cuda")
    except RuntimeUnavailable:
        return _shared("emulated:split")
