"""Which compiled image of the transfer kernels to load: AOT when a matching fatbin exists, else JIT.

``KVTIER_KERNELS=aot`` or ``jit`` forces one; a forced AOT with no fatbin, or a fatbin built from another version of
the source, is an error that says how to build it — never a silent fall back to stale code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvtier.errors import KernelBuildError
from kvtier.kernels.source import SHIPPED, Specialization, source_hash

MODES = ("auto", "aot", "jit")


def prebuilt(folder: Path, manifest: str, arch: str, image: Path, command: str) -> tuple[bytes | None, str]:
    """(image, origin) of a prebuilt build for ``arch`` when its manifest says it was built from this source for that
    target, else (None, why not) naming ``command`` to build it."""
    path = folder / manifest
    if not path.exists() or not image.exists():
        return None, f"no prebuilt kernels for {arch} in {folder} (build them with `{command}`)"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        info = exc
    if not isinstance(info, dict):
        return None, f"the manifest {path} is unreadable ({info!r:.80}): rebuild with `{command}`"
    if info.get("source_hash") != source_hash():
        return None, (f"prebuilt kernels in {folder} were built from source {info.get('source_hash')}, not the "
                      f"current {source_hash()}: rebuild with `{command}`")
    if arch not in info.get("archs", []):
        reason = info.get("skipped", {}).get(arch)
        return None, f"prebuilt kernels cover {info.get('archs')}, not {arch}" + (f" ({reason})" if reason else "")
    return image.read_bytes(), f"aot:{image}"


def _aot_image(arch: str) -> tuple[bytes | None, str]:
    from kvtier.kernels.build import FATBIN_NAME, MANIFEST_NAME, prebuilt_dir

    folder = prebuilt_dir()
    return prebuilt(folder, MANIFEST_NAME, arch, folder / FATBIN_NAME, "python -m kvtier.kernels.build")


def _aot_code_object(arch: str) -> tuple[bytes | None, str]:
    from kvtier.kernels.build import prebuilt_dir
    from kvtier.kernels.hip_build import aot_code_object

    return aot_code_object(prebuilt_dir(), arch)


def kernel_image(arch: str, mode: str | None = None, spec: Specialization = SHIPPED) -> tuple[bytes, str]:
    """(image, origin) for a device of ``arch`` (``sm_90``, or ``gfx942`` for an AMD GPU)."""
    mode = (mode or os.environ.get("KVTIER_KERNELS") or "auto").lower()
    if mode not in MODES:
        raise KernelBuildError(f"KVTIER_KERNELS must be one of {MODES}, got {mode!r}")
    hip = arch.startswith("gfx")
    if mode != "jit" and spec.prebuilt:
        image, origin = (_aot_code_object if hip else _aot_image)(arch)
        if image is not None:
            return image, origin
        if mode == "aot":
            raise KernelBuildError(f"KVTIER_KERNELS=aot: {origin}")
    elif mode == "aot":
        raise KernelBuildError(f"KVTIER_KERNELS=aot: prebuilt kernels are not specialized ({spec}): only JIT builds "
                               f"those")
    from kvtier.kernels.build import compile_jit
    from kvtier.kernels.hip_build import compile_jit_hip

    return (compile_jit_hip if hip else compile_jit)(arch, spec), f"jit:{arch}:{spec.label()}"
