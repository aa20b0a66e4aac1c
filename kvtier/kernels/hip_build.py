"""Building the transfer kernels for AMD GPUs from the same source: ahead of time with hipcc, or at first use with
hiprtc.

AOT: ``python -m kvtier.kernels.build --hip`` writes one code object per target (``transfer-gfx90a.hsaco``, ...) and
``transfer-hip.json`` (source hash, the targets built, and why any target was skipped: an older ROCm's compiler does
not know gfx942 or gfx950) into the prebuilt folder. JIT: hiprtc through ctypes (``libhiprtc.so`` in ROCm 6+, inside
``libamdhip64`` before), cached on disk like the CUDA builds.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvtier.errors import KernelBuildError
from kvtier.kernels.source import DEFAULT_UNROLL, SHIPPED, SOURCE_PATH, Specialization, source_hash, source_text

HIP_ARCHS = ("gfx90a", "gfx942", "gfx950")
COMGR_LIBRARIES = ("libamd_comgr.so", "libamd_comgr.so.3", "libamd_comgr.so.2")
TARGET_NAME = re.compile(r"gfx[0-9a-f]{3,4}(:[a-z-]+[+-])*")
CODE_MAGIC = (b"\x7fELF", b"__CLANG_OFFLOAD_BUNDLE__")
HIP_MANIFEST = "transfer-hip.json"
HIPRTC_LIBRARIES = ("libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so.5", "libamdhip64.so",
                    "libamdhip64.so.5")


def code_object_name(arch: str) -> str:
    return f"transfer-{arch}.hsaco"


def hipcc_command(out: Path, arch: str, hipcc: str = "hipcc") -> list[str]:
    return [hipcc, "--genco", f"--offload-arch={arch}", "-O3", "-std=c++17", *SHIPPED.defines(),
            "-o", str(out), str(SOURCE_PATH)]


def hip_environment() -> dict[str, str]:
    """hipcc picks NVIDIA when it finds nvcc on PATH: kvtier's HIP builds are for AMD."""
    return {**os.environ, "HIP_PLATFORM": "amd"}


def build_hip_aot(out_dir: Path, archs: tuple[str, ...] = HIP_ARCHS, hipcc: str = "hipcc") -> dict:
    """Compile a code object per target this toolchain knows; returns the manifest written. Raises KernelBuildError
    when hipcc is missing or no target builds."""
    bad = [arch for arch in archs if not TARGET_NAME.fullmatch(arch)]
    if bad or not archs:
        raise KernelBuildError(f"not AMD GPU targets: {bad or 'none given'} (use names like gfx90a, gfx942)")
    if shutil.which(hipcc) is None:
        raise KernelBuildError(f"the HIP build needs {hipcc!r} on PATH (ROCm's hipcc, e.g. apt-get install hipcc)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelBuildError(f"cannot write the HIP build into {out_dir}: {exc}") from exc
    built, skipped = [], {}
    for arch in archs:
        command = hipcc_command(out_dir / code_object_name(arch), arch, hipcc)
        done = subprocess.run(command, capture_output=True, text=True, env=hip_environment())
        if done.returncode == 0:
            built.append(arch)
        else:
            lines = [line for line in (done.stderr + done.stdout).splitlines() if "error" in line.lower()]
            skipped[arch] = (lines[0] if lines else f"hipcc exited {done.returncode}").strip()
    if not built:
        raise KernelBuildError(f"hipcc built none of {', '.join(archs)}: {skipped}")
    manifest = {"source_hash": source_hash(), "archs": built, "skipped": skipped, "unroll": DEFAULT_UNROLL,
                "hipcc": hipcc_version(hipcc)}
    try:
        (out_dir / HIP_MANIFEST).write_text(json.dumps(manifest, indent=2))
    except OSError as exc:
        raise KernelBuildError(f"cannot write the HIP build into {out_dir}: {exc}") from exc
    return manifest


def hipcc_version(hipcc: str = "hipcc") -> str:
    done = subprocess.run([hipcc, "--version"], capture_output=True, text=True, env=hip_environment())
    return next((line.strip() for line in done.stdout.splitlines() if line.startswith("HIP version")), "unknown")


def aot_code_object(folder: Path, arch: str) -> tuple[bytes | None, str]:
    from kvtier.kernels.loader import prebuilt

    return prebuilt(folder, HIP_MANIFEST, arch, folder / code_object_name(arch), "python -m kvtier.kernels.build --hip")


def _resolved(name: str) -> str:
    """A library name as the file the loader opens: the first match on LD_LIBRARY_PATH, ROCm's and the system's
    folders (the name itself when none matches)."""
    if os.path.isabs(name):
        return name
    folders = [f for f in os.environ.get("LD_LIBRARY_PATH", "").split(":") if f]
    for folder in (*folders, "/opt/rocm/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        candidate = os.path.join(folder, name)
        if os.path.exists(candidate):
            return os.path.realpath(candidate)
    return name


def compiler_targets() -> set[str] | None:
    """The gfx targets the installed code-object compiler (comgr, which hiprtc uses) knows; None when comgr cannot be
    asked. hiprtc aborts the process (SIGABRT, no error) when handed a target its ROCm predates (gfx942 on 5.2)."""
    for name in COMGR_LIBRARIES:
        try:
            lib = ctypes.CDLL(name)
            count = ctypes.c_size_t()
            if lib.amd_comgr_get_isa_count(ctypes.byref(count)) != 0:
                return None
            names = set()
            for index in range(count.value):
                isa = ctypes.c_char_p()
                if lib.amd_comgr_get_isa_name(ctypes.c_size_t(index), ctypes.byref(isa)) == 0 and isa.value:
                    names.add(isa.value.decode().rsplit("--", 1)[-1].split(":")[0])
            return names
        except (OSError, AttributeError):
            continue
    return None


def cached_image(path: Path, magic: tuple[bytes, ...]) -> bytes | None:
    """A cached kernel image when the file holds one (it starts with one of ``magic``); a truncated or damaged entry
    is removed so it is built again."""
    try:
        image = path.read_bytes()
    except OSError:
        return None
    if image.startswith(magic) and len(image) > 64:
        return image
    path.unlink(missing_ok=True)
    return None


class Hiprtc:
    """hiprtc's C API, declared once."""

    def __init__(self) -> None:
        errors = []
        for name in HIPRTC_LIBRARIES:
            try:
                lib = ctypes.CDLL(name)
                lib.hiprtcCreateProgram  # noqa: B018 (the library must export hiprtc)
                break
            except (OSError, AttributeError) as exc:
                errors.append(str(exc))
        else:
            raise KernelBuildError(f"JIT builds for AMD GPUs need hiprtc ({'; '.join(errors)})")
        p, size = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
        signatures = {
            "hiprtcCreateProgram": [ctypes.POINTER(p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, p, p],
            "hiprtcCompileProgram": [p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "hiprtcGetCodeSize": [p, size], "hiprtcGetCode": [p, ctypes.c_char_p],
            "hiprtcGetProgramLogSize": [p, size], "hiprtcGetProgramLog": [p, ctypes.c_char_p],
            "hiprtcDestroyProgram": [ctypes.POINTER(p)], "hiprtcVersion": [ctypes.POINTER(ctypes.c_int)] * 2}
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
        lib.hiprtcGetErrorString.argtypes, lib.hiprtcGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
        self.lib = lib

    def identity(self) -> str:
        """What the JIT cache keys on: hiprtcVersion is a fixed 9.0 in every ROCm release, so the library file itself
        (path, size, modification time) tells one ROCm from another."""
        path = _resolved(self.lib._name)
        try:
            info = os.stat(path)
        except OSError:
            return path
        return f"{path}:{info.st_size}:{int(info.st_mtime)}"

    def check(self, status: int, call: str, log: str = "") -> None:
        if status != 0:
            text = (self.lib.hiprtcGetErrorString(status) or b"").decode(errors="replace")
            raise KernelBuildError(f"{call}: {text} ({status})\n{log}")

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(self.lib.hiprtcVersion(ctypes.byref(major), ctypes.byref(minor)), "hiprtcVersion")
        return major.value, minor.value

    def compile(self, source: str, filename: str, options: list[str]) -> bytes:
        program = ctypes.c_void_p()
        self.check(self.lib.hiprtcCreateProgram(ctypes.byref(program), source.encode(), filename.encode(), 0, None,
                                                None), "hiprtcCreateProgram")
        try:
            encoded = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = self.lib.hiprtcCompileProgram(program, len(options), encoded)
            if status != 0:
                size = ctypes.c_size_t()
                self.lib.hiprtcGetProgramLogSize(program, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                self.lib.hiprtcGetProgramLog(program, log)
                self.check(status, "hiprtcCompileProgram", log.value.decode(errors="replace"))
            size = ctypes.c_size_t()
            self.check(self.lib.hiprtcGetCodeSize(program, ctypes.byref(size)), "hiprtcGetCodeSize")
            code = ctypes.create_string_buffer(size.value)
            self.check(self.lib.hiprtcGetCode(program, code), "hiprtcGetCode")
            return code.raw
        finally:
            self.lib.hiprtcDestroyProgram(ctypes.byref(program))


def compile_jit_hip(arch: str, spec: Specialization = SHIPPED, cache: Path | None = None) -> bytes:
    """A code object for ``arch`` (e.g. ``gfx942``) from hiprtc, through the on-disk cache."""
    from kvtier.kernels.build import cache_dir

    known = compiler_targets()
    if known is not None and arch not in known:
        raise KernelBuildError(f"this ROCm's compiler does not know {arch!r} (it knows {', '.join(sorted(known))}): "
                               f"install a ROCm that supports it")
    hiprtc = Hiprtc()
    options = [f"--gpu-architecture={arch}", "-std=c++17", "-O3", *spec.defines()]
    key = hashlib.sha256(repr((source_hash(), options, hiprtc.version(), hiprtc.identity())).encode()).hexdigest()[:24]
    cached = (cache or cache_dir()) / f"transfer-{arch}-{key}.hsaco"
    image = cached_image(cached, CODE_MAGIC)
    if image is not None:
        return image
    code = hiprtc.compile(source_text(), "transfer.cu", options)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cached.parent, delete=False) as tmp:
        tmp.write(code)
    os.replace(tmp.name, cached)
    return code
