"""Building the transfer kernels: ahead of time with nvcc (a fatbin per source version) or at first use with NVRTC;
for AMD GPUs (``--hip``) see :mod:`kvtier.kernels.hip_build`.

AOT: ``python -m kvtier.kernels.build`` writes ``transfer.fatbin`` and ``transfer.json`` (source hash, archs) into
the package's ``prebuilt`` folder (or ``--out``/``$KVTIER_KERNEL_DIR``). JIT: NVRTC through cuda-bindings, cached on
disk under ``$KVTIER_CACHE_DIR`` (default ``~/.cache/kvtier``) keyed by source hash, arch, options and NVRTC version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtier.errors import KernelBuildError
from kvtier.kernels.source import DEFAULT_UNROLL, SHIPPED, SOURCE_PATH, Specialization, source_hash, source_text

AOT_ARCHS = ("sm_80", "sm_90", "sm_100")
FATBIN_NAME, MANIFEST_NAME = "transfer.fatbin", "transfer.json"


def prebuilt_dir() -> Path:
    return Path(os.environ.get("KVTIER_KERNEL_DIR") or Path(__file__).with_name("prebuilt"))


def cache_dir() -> Path:
    return Path(os.environ.get("KVTIER_CACHE_DIR") or Path.home() / ".cache" / "kvtier") / "kernels"


def nvcc_command(out: Path, archs: tuple[str, ...], nvcc: str = "nvcc", fmt: str = "fatbin") -> list[str]:
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    newest = max(archs, key=lambda a: int(a[3:]))
    if fmt == "fatbin":
        gencode.append(f"-gencode=arch=compute_{newest[3:]},code=compute_{newest[3:]}")
    return [nvcc, f"-{fmt}", "-O3", "-std=c++17", *SHIPPED.defines(), *gencode, "-o", str(out),
            str(SOURCE_PATH)]


def build_aot(out_dir: Path | None = None, archs: tuple[str, ...] = AOT_ARCHS, nvcc: str = "nvcc") -> Path:
    """Compile the fatbin; returns its path. Raises KernelBuildError with nvcc's output on failure."""
    bad = [arch for arch in archs if not re.fullmatch(r"sm_\d{2,3}[af]?", arch)]
    if bad or not archs:
        raise KernelBuildError(f"not CUDA targets: {bad or 'none given'} (use names like sm_90; --hip for AMD)")
    if shutil.which(nvcc) is None:
        raise KernelBuildError(f"AOT build needs {nvcc!r} on PATH (the CUDA toolkit); JIT needs only NVRTC")
    out_dir = out_dir or prebuilt_dir()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelBuildError(f"cannot write the build into {out_dir}: {exc}") from exc
    fatbin = out_dir / FATBIN_NAME
    command = nvcc_command(fatbin, archs, nvcc)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise KernelBuildError(f"nvcc failed ({' '.join(command)}):\n{done.stderr}{done.stdout}")
    manifest = {"source_hash": source_hash(), "archs": list(archs), "unroll": DEFAULT_UNROLL}
    (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    return fatbin


def compile_jit(arch: str, spec: Specialization = SHIPPED) -> bytes:
    """A cubin for ``arch`` (e.g. ``sm_90``) from NVRTC, through the on-disk cache."""
    from kvtier.kernels.hip_build import cached_image
    from kvtier.runtime.cuda import nvrtc_compile, nvrtc_version

    options = [f"--gpu-architecture={arch}", "-std=c++17", *spec.defines()]
    key = hashlib.sha256(repr((source_hash(), options, nvrtc_version())).encode()).hexdigest()[:24]
    cached = cache_dir() / f"transfer-{arch}-{key}.cubin"
    image = cached_image(cached, (b"\x7fELF",))
    if image is not None:
        return image
    cubin = nvrtc_compile(source_text(), "transfer.cu", options)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cached.parent, delete=False) as tmp:
        tmp.write(cubin)
    os.replace(tmp.name, cached)
    return cubin


def main(argv: list[str] | None = None) -> int:
    from kvtier.kernels.hip_build import HIP_ARCHS, build_hip_aot

    parser = argparse.ArgumentParser(prog="python -m kvtier.kernels.build", description=__doc__)
    parser.add_argument("--out", type=Path, help=f"output folder (default {prebuilt_dir()})")
    parser.add_argument("--arch", action="append", help=f"sm_XX to build (default {' '.join(AOT_ARCHS)}; with "
                                                        f"--hip, gfxXXX, default {' '.join(HIP_ARCHS)})")
    parser.add_argument("--nvcc", default="nvcc")
    parser.add_argument("--hip", action="store_true", help="build code objects for AMD GPUs with hipcc instead")
    parser.add_argument("--hipcc", default="hipcc")
    args = parser.parse_args(argv)
    if args.hip:
        archs = tuple(args.arch or HIP_ARCHS)
        print(f"building {SOURCE_PATH.name} (source {source_hash()}) for {', '.join(archs)} with {args.hipcc} ...",
              flush=True)
        try:
            manifest = build_hip_aot(args.out or prebuilt_dir(), archs, args.hipcc)
        except KernelBuildError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"built {', '.join(manifest['archs'])} ({manifest['hipcc']}) into {args.out or prebuilt_dir()}")
        for arch, reason in manifest["skipped"].items():
            print(f"skipped {arch}: {reason}")
        return 0
    archs = tuple(args.arch or AOT_ARCHS)
    print(f"building {SOURCE_PATH.name} (source {source_hash()}) for {', '.join(archs)} ...", flush=True)
    try:
        path = build_aot(args.out, archs, args.nvcc)
    except KernelBuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
