"""Platform runtimes behind one interface, and the choice between them.

``get()`` picks CUDA when an NVIDIA GPU is usable, HIP when an AMD GPU is, and the emulator otherwise;
``KVTIER_RUNTIME`` (or the CLI's ``--runtime``) overrides with ``cuda``, ``hip`` or
``emulated:<mode>[:<devices>][:<schedule>]`` (mode ``split`` or
``unified``, devices 1-64, schedule ``eager`` or ``lazy``), e.g. ``emulated:split``, ``emulated:unified:4:lazy``.
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
    HostKind,
    HostRegisterFlags,
    MemoryType,
    PointerAttributes,
    Runtime,
    Stream,
)
from kvtier.runtime.program import KernelArg, Program, ProgramSpec, Scalar, i32, i64

__all__ = ["DeviceAttributes", "Event", "Graph", "HostKind", "HostRegisterFlags", "KernelArg", "MemoryType",
           "PointerAttributes", "Program", "ProgramSpec", "Runtime", "Scalar", "Stream", "i32", "i64", "get", "create",
           "ENV_VAR", "SPEC_HELP"]

ENV_VAR = "KVTIER_RUNTIME"
SPEC_HELP = "'cuda', 'hip' or 'emulated:<split|unified>[:<devices 1-64>][:<eager|lazy>]'"


def create(spec: str) -> Runtime:
    """A new runtime for ``spec``; most code wants the shared one from :func:`get`."""
    name, _, rest = spec.strip().lower().partition(":")
    if name == "cuda" and not rest:
        from kvtier.runtime.cuda import CudaRuntime

        return CudaRuntime()
    if name == "hip" and not rest:
        from kvtier.runtime.hip import HipRuntime

        return HipRuntime()
    if name == "emulated":
        return _emulated(spec, rest)
    raise RuntimeUnavailable(f"unknown runtime {spec!r}: use {SPEC_HELP}")


def _emulated(spec: str, rest: str) -> Runtime:
    from kvtier.runtime.emulated import MODES, EmulatedRuntime
    from kvtier.runtime.emulated_scheduler import SCHEDULES

    mode, *fields = rest.split(":") if rest else ["split"]
    options: dict = {}
    for text in fields:
        if text.isdigit() and "devices" not in options:
            options["devices"] = int(text)
        elif text in SCHEDULES and "schedule" not in options:
            options["schedule"] = text
        else:
            raise RuntimeUnavailable(f"bad runtime spec {spec!r}: {text!r} is neither a device count nor a schedule "
                                     f"({', '.join(SCHEDULES)}); use {SPEC_HELP}")
    if mode not in MODES:
        raise RuntimeUnavailable(f"bad runtime spec {spec!r}: mode {mode!r} is not one of {', '.join(MODES)}; "
                                 f"use {SPEC_HELP}")
    try:
        return EmulatedRuntime(mode, **options)
    except ValueError as exc:
        raise RuntimeUnavailable(f"bad runtime spec {spec!r}: {exc}") from exc


_unavailable: set[str] = set()


@functools.cache
def _shared(spec: str) -> Runtime:
    return create(spec)


def get(spec: str | None = None) -> Runtime:
    """The process's runtime: ``spec``, else ``$KVTIER_RUNTIME``, else CUDA if a GPU is usable, else the emulator."""
    spec = (spec or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if spec != "auto":
        return _shared(spec)
    for spec in ("cuda", "hip"):
        if spec in _unavailable:
            continue
        try:
            return _shared(spec)
        except RuntimeUnavailable:
            _unavailable.add(spec)  # probing HIP without a GPU costs ~300 µs: once per process is enough
    return _shared("emulated:split")
