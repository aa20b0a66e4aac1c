"""Adversary tests for issue 14 (the AMD / HIP path): each test fails because of a defect and says what should happen.

The HIP runtime is driven through the fake ``libamdhip64`` of tests/test_hip.py where a code path needs a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.hip_fakes import TARGETS, fake_library

from kvtier.address import CpuAddress, DeviceAddress
from kvtier.errors import KernelBuildError, KvtierError, RuntimeUnavailable
from kvtier.runtime.hip import HipLibrary, HipRuntime

ROOT = Path(__file__).resolve().parent.parent
# Children see this checkout first and keep whatever else the parent had on its path (the device carries wheels there).
CHILD_PATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
NON_HIP_LIBRARY = next((p for p in ("/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1",
                                    "/lib64/libz.so.1", "/usr/lib64/libz.so.1") if os.path.exists(p)), None)
needs_non_hip_library = pytest.mark.skipif(NON_HIP_LIBRARY is None, reason="no libz.so.1 to stand in for a non-HIP .so")


def _installed_hiprtc() -> bool:
    from kvtier.kernels.hip_build import Hiprtc

    try:
        Hiprtc()
    except KernelBuildError:
        return False
    return True


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr("kvtier.runtime.hip.kfd_targets", lambda: TARGETS)
    return HipRuntime(fake_library())


# -- runtime selection -------------------------------------------------------------------------------------------


@needs_non_hip_library
def test_a_non_hip_library_in_kvtier_hip_library_is_runtime_unavailable(monkeypatch):
    """KVTIER_HIP_LIBRARY naming a shared object that is not libamdhip64 (here libz) makes HipLibrary() raise a bare
    ``AttributeError: ... undefined symbol: hipGetErrorName`` (HipLibrary.__init__ looks the error functions up with a
    plain getattr). It should raise RuntimeUnavailable naming the variable, like a missing or garbage file does."""
    monkeypatch.setenv("KVTIER_HIP_LIBRARY", NON_HIP_LIBRARY)
    with pytest.raises(RuntimeUnavailable, match="KVTIER_HIP_LIBRARY"):
        HipLibrary()


@needs_non_hip_library
def test_auto_selection_falls_back_to_the_emulator_with_a_non_hip_library(monkeypatch):
    """get() with no runtime named must try CUDA, then HIP, then the emulator (docs/hip.md). With KVTIER_HIP_LIBRARY
    pointing at a non-HIP .so the HIP attempt raises AttributeError, which get() does not catch: auto selection
    crashes instead of choosing the emulator."""
    from kvtier.runtime import get

    monkeypatch.delenv("KVTIER_RUNTIME", raising=False)
    monkeypatch.setenv("KVTIER_HIP_LIBRARY", NON_HIP_LIBRARY)
    try:
        import kvtier.runtime.cuda  # noqa: F401
        get("cuda")
        pytest.skip("a usable CUDA GPU is chosen before HIP here")
    except (RuntimeUnavailable, ImportError):
        pass
    assert get().name.startswith("emulated")


@needs_non_hip_library
def test_cli_runtime_hip_with_a_non_hip_library_exits_2_without_a_traceback():
    """``KVTIER_HIP_LIBRARY=<libz> kvtier --runtime hip doctor`` prints a Python traceback (AttributeError) and exits 1;
    the CLI contract is one 'kvtier doctor: ...' line on stderr and exit code 2."""
    env = {**os.environ, "KVTIER_HIP_LIBRARY": NON_HIP_LIBRARY, "PYTHONPATH": CHILD_PATH}
    done = subprocess.run([sys.executable, "-m", "kvtier", "--runtime", "hip", "doctor"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert "Traceback" not in done.stderr, done.stderr[-500:]
    assert done.returncode == 2


def test_cli_runtime_help_names_hip():
    """docs/hip.md documents ``kvtier --runtime hip doctor``, but ``--runtime``'s help (top level, doctor and demo)
    still says 'cuda | emulated:split | emulated:unified (... else cuda when a GPU is usable, else emulated:split)':
    it should list hip and say auto selection tries HIP before the emulator."""
    from kvtier.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if "--runtime" in a.option_strings)
    assert "hip" in action.help


# -- the build CLI and the kernel images --------------------------------------------------------------------------


def test_build_hip_into_an_unusable_out_folder_is_a_clear_error(tmp_path, capsys):
    """``python -m kvtier.kernels.build --hip --out <a file>`` (or a folder that cannot be created) dies with a
    FileExistsError / FileNotFoundError / PermissionError traceback from mkdir; it should print one error line and
    exit 1, as it does when hipcc is missing or no target builds."""
    from kvtier.kernels.build import main

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    assert main(["--hip", "--hipcc", "/bin/true", "--arch", "gfx90a", "--out", str(blocker)]) == 1


def test_build_hip_refuses_an_empty_target(tmp_path):
    """``--hip --arch ''`` exits 0: hipcc gets ``--offload-arch=`` and builds its default target (gfx803 with
    ROCm 5.2) into ``transfer-.hsaco``, and the manifest lists the target ``""`` as built. An empty target name should
    be refused (exit 1) before anything is compiled."""
    from kvtier.kernels.build import main

    code = main(["--hip", "--hipcc", "/bin/true", "--arch", "", "--out", str(tmp_path)])
    manifest = tmp_path / "transfer-hip.json"
    assert code == 1 and not (manifest.exists() and "" in json.loads(manifest.read_text())["archs"])


def test_a_corrupt_hip_manifest_is_a_kernel_build_error(tmp_path, monkeypatch):
    """A truncated or hand-edited ``transfer-hip.json`` makes kernel_image raise json.JSONDecodeError (in auto mode
    too, so no JIT fall back happens). The loader's contract is a KernelBuildError that says how to rebuild
    (``python -m kvtier.kernels.build --hip``)."""
    from kvtier.kernels.loader import kernel_image

    monkeypatch.setenv("KVTIER_KERNEL_DIR", str(tmp_path))
    (tmp_path / "transfer-gfx90a.hsaco").write_bytes(b"\x7fELF")
    (tmp_path / "transfer-hip.json").write_text('{"source_hash": "')
    with pytest.raises(KernelBuildError, match="kvtier.kernels.build --hip"):
        kernel_image("gfx90a", "aot")


@pytest.mark.skipif(not _installed_hiprtc(), reason="no hiprtc here")
def test_a_truncated_jit_cache_entry_is_compiled_again(tmp_path, monkeypatch):
    """compile_jit_hip returns whatever bytes the cache file holds: an empty (or otherwise damaged) entry is served
    forever as the code object, and every load then fails in hipModuleLoadData until someone deletes
    ~/.cache/kvtier by hand. A cached entry that is not a code object (ELF / offload bundle) should be rebuilt."""
    from kvtier.kernels import hip_build

    image = b"\x7fELF" + bytes(60)
    monkeypatch.setattr(hip_build.Hiprtc, "compile", lambda self, source, name, options: image)
    assert hip_build.compile_jit_hip("gfx90a", cache=tmp_path) == image
    (entry,) = tmp_path.glob("*.hsaco")
    entry.write_bytes(b"")
    assert hip_build.compile_jit_hip("gfx90a", cache=tmp_path) == image


@pytest.mark.skipif(not _installed_hiprtc(), reason="no hiprtc here")
def test_jit_for_a_target_hiprtc_does_not_know_raises_instead_of_aborting(tmp_path):
    """KVTIER_KERNELS=jit (or any JIT build) for a gfx target the installed hiprtc does not know (gfx942/gfx950 on
    ROCm 5.2, or gfx999) aborts the whole Python process inside hiprtcCompileProgram ('munmap_chunk(): invalid
    pointer', SIGABRT): a serving process dies with no exception. The AOT build skips such targets; the JIT path should
    also refuse them with a KernelBuildError (check the target first, or compile out of process)."""
    code = ("from pathlib import Path\n"
            "from kvtier.errors import KernelBuildError\n"
            "from kvtier.kernels.hip_build import compile_jit_hip\n"
            "try:\n"
            f"    compile_jit_hip('gfx999', cache=Path({str(tmp_path)!r}))\n"
            "except KernelBuildError as exc:\n"
            "    print('KernelBuildError', exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": CHILD_PATH})
    assert done.returncode == 0 and "KernelBuildError" in done.stdout, (done.returncode, done.stderr[-300:])


# -- HipRuntime lifecycle and devices (fake libamdhip64) -----------------------------------------------------------


def test_a_closed_stream_is_never_handed_to_hip(fake):
    """After HipStream.close() (hipStreamDestroy) the stream still passes its destroyed handle to hipStreamSynchronize,
    hipStreamWaitEvent, hipEventRecord and hipMemcpyAsync (a use after free: HIP may crash or act on a recycled
    handle). HipEvent refuses use after close ('this HIP event is closed') and the emulator raises
    cudaErrorInvalidResourceHandle; a closed HipStream should raise too, without calling HIP."""
    stream = fake.create_stream(0)
    stream.close()
    fake._hip.lib.calls.clear()
    for use in (stream.synchronize, lambda: fake.create_event(0).record(stream),
                lambda: fake.memcpy_async(CpuAddress(0x1000), CpuAddress(0x2000), 16, stream=stream)):
        with pytest.raises(KvtierError):
            use()
    used = {name for name, _ in fake._hip.lib.calls}
    assert not used & {"hipStreamSynchronize", "hipEventRecord", "hipMemcpyAsync"}, used


def test_a_closed_graph_is_never_launched(fake):
    """HipGraph.close() destroys the executable graph, but a later launch() still calls hipGraphLaunch with the
    destroyed handle; it should raise (as a closed event does) without calling HIP."""
    stream = fake.create_stream(0)
    graph = stream.end_capture()
    graph.close()
    fake._hip.lib.calls.clear()
    with pytest.raises(KvtierError):
        graph.launch(stream)
    assert "hipGraphLaunch" not in [name for name, _ in fake._hip.lib.calls]


def test_the_null_stream_of_another_device_is_used_with_that_device_current(fake):
    """HIP resolves the null stream (handle 0) against the calling thread's current device. legacy_stream(1) /
    current_stream(1) / wrap_stream(0, 1) are HipStreams of device 1, but synchronize(), an event record on them and
    memcpy_async on them run with whatever device is current (device 0 here), so they wait on, record on and queue to
    device 0's null stream. _launch and _wait_value make the stream's device current for this reason; every call that
    takes a stream should (the emulator's handle-0 streams are per device)."""
    lib = fake._hip.lib
    seen: list[tuple[str, int]] = []
    for name in ("hipStreamSynchronize", "hipEventRecord", "hipMemcpyAsync"):
        def recorded(*args, _name=name):
            seen.append((_name, lib.current))
            return 0
        setattr(lib, name, recorded)
    fake.set_device(0)
    stream = fake.legacy_stream(1)
    event = fake.create_event(1)
    stream.synchronize()
    event.record(stream)
    fake.memcpy_async(CpuAddress(0x1000), CpuAddress(0x2000), 16, stream=stream)
    assert seen == [("hipStreamSynchronize", 1), ("hipEventRecord", 1), ("hipMemcpyAsync", 1)]
    assert fake.current_device() == 0


class _Device:
    def __init__(self, kind: str, index: int | None) -> None:
        self.type, self.index = kind, index

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"


class FakeRocmTensor:
    """What a ROCm build of torch hands out for a GPU tensor: device type 'cuda' (ROCm torch keeps CUDA's names)."""

    __module__ = "torch"

    def __init__(self, address: int, nbytes: int, device: int) -> None:
        self._address, self._nbytes, self.device = address, nbytes, _Device("cuda", device)
        self.shape, self._stride = (nbytes,), (1,)

    def numel(self) -> int:
        return self._nbytes

    def element_size(self) -> int:
        return 1

    def stride(self) -> tuple[int, ...]:
        return self._stride

    def data_ptr(self) -> int:
        return self._address

    def is_contiguous(self) -> bool:
        return True


def test_a_rocm_torch_gpu_tensor_resolves_on_the_hip_runtime(fake):
    """get_device_accessible_ptr refuses every GPU tensor unless runtime.name == 'cuda' ('a cuda:0 tensor cannot be
    used on device 0 of hip'), so with the hip runtime no torch tensor on an AMD GPU can be a kernel operand or back
    a DevicePool.from_tensors (the transformers integration likewise takes its emulator branch for hip). HipRuntime
    accepts torch (ROCm) streams and scripts/amd_check.sh runs the torch tests on hip: a ROCm GPU tensor should
    resolve to its own device address, as a CUDA tensor does on the cuda runtime."""
    from kvtier.memory.resolve import get_device_accessible_ptr

    tensor = FakeRocmTensor(0x7F12_0000_0000, 4096, 1)
    assert get_device_accessible_ptr(tensor, 1, runtime=fake) == DeviceAddress(0x7F12_0000_0000, 1)

