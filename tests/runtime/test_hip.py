"""The HIP runtime without an AMD GPU: what its ctypes layer computes (memory-type numbering per ROCm release, gfx
target names from the KFD topology, launch argument packing, error names, aliases of registered memory that differ
from the CPU address as on MI355X), driven through a fake ``libamdhip64``; the clear error on a machine without an
AMD GPU, also when KVTIER_HIP_LIBRARY names a library that is not HIP's; closed streams and graphs never handed to
HIP, null streams used with their own device current, ROCm torch tensors resolved; and the kernel source compiled
for AMD targets with the installed hipcc / hiprtc (skipped without them)."""

from __future__ import annotations

import ctypes
import shutil
import struct

import pytest
from helpers.hip_fakes import NON_HIP_LIBRARY, TARGETS, fake_library, needs_non_hip_library

from kvtier.address import CpuAddress, DeviceAddress
from kvtier.errors import KvtierError, RuntimeCallError, RuntimeUnavailable
from kvtier.runtime import MemoryType, create, i32, i64
from kvtier.runtime.hip import (
    INVALID_VALUE,
    NO_DEVICE,
    SUCCESS,
    HipLibrary,
    HipProgram,
    HipRuntime,
    HipStream,
    gfx_name,
    kfd_targets,
    memory_types,
    pci_location,
)

# device 0 sits at PCI 0000:c1:00.0, device 1 at 0001:05:00.0 (FakeLib.hipDeviceGetPCIBusId)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr("kvtier.runtime.hip.kfd_targets", lambda: TARGETS)
    return HipRuntime(fake_library())


def test_memory_type_numbering_follows_the_rocm_release():
    rocm5, rocm6 = memory_types(50_221_153), memory_types(60_300_000)
    assert (rocm5[0], rocm5[1]) == (MemoryType.HOST, MemoryType.DEVICE)
    assert (rocm6[0], rocm6[1], rocm6[2], rocm6[3]) == (MemoryType.UNREGISTERED, MemoryType.HOST, MemoryType.DEVICE,
                                                        MemoryType.MANAGED)


@pytest.mark.parametrize("version, name", [(90010, "gfx90a"), (90402, "gfx942"), (90500, "gfx950"),
                                           (90008, "gfx908"), (110000, "gfx1100"), (120001, "gfx1201")])
def test_gfx_target_names_from_kfd_versions(version, name):
    assert gfx_name(version) == name


def test_device_targets_come_from_the_kfd_topology_by_pci_address(tmp_path):
    nodes = [("0", 0, 0, 0), ("2", 90010, 0, 0x8300), ("10", 90500, 1, 0x0508), ("1", 90402, 0, 0xC100)]
    for node, version, domain, location in nodes:
        (tmp_path / node).mkdir()
        (tmp_path / node / "properties").write_text(f"cpu_cores_count 0\ngfx_target_version {version}\n"
                                                    f"domain {domain}\nlocation_id {location}\n")
    (tmp_path / "7").mkdir()  # a node without properties is skipped
    assert kfd_targets(tmp_path) == {(0, 0x8300): "gfx90a", (1, 0x0508): "gfx950", (0, 0xC100): "gfx942"}
    assert kfd_targets(tmp_path / "missing") == {}


@pytest.mark.parametrize("bus_id, location", [("0000:c1:00.0", (0, 0xC100)), ("0001:05:01.2", (1, 0x050A)),
                                              ("0000:83:00.0\n", (0, 0x8300))])
def test_pci_bus_ids_as_kfd_locations(bus_id, location):
    assert pci_location(bus_id) == location


def test_devices_hidden_from_hip_still_get_their_own_target(monkeypatch):
    """HIP_VISIBLE_DEVICES renumbers devices; KFD lists every GPU: the target follows the PCI address, not order."""
    monkeypatch.setattr("kvtier.runtime.hip.kfd_targets", lambda: {(0, 0x0100): "gfx90a", **TARGETS})
    runtime = HipRuntime(fake_library())
    assert [runtime.device_attributes(d).arch for d in range(2)] == ["gfx950", "gfx942"]


def test_device_attributes_parse_the_alias_attribute_and_the_target(fake):
    attrs = fake.device_attributes(1)
    assert attrs.name == "AMD Instinct MI355X #1" and attrs.arch == "gfx942"
    assert attrs.compute_capability == (9, 4) and attrs.multiprocessors == 256 and attrs.total_memory == 288 << 30
    assert attrs.can_use_host_pointer_for_registered_mem is False  # the MI355X fact kvtier exists for
    assert fake.supports_wait_value(0)


def test_registered_memory_gets_the_alias_hip_returns_not_the_cpu_address(fake):
    buffer = ctypes.create_string_buffer(8192)
    address = ctypes.addressof(buffer)
    fake.host_register(address, 8192)
    alias = fake.host_get_device_pointer(address + 100, 1)
    assert alias == address + 0x7F00_0000_0000 + 100 != address + 100
    assert fake.host_get_device_pointer(address, 1) == address + 0x7F00_0000_0000  # cached per device
    names = [name for name, _ in fake._hip.lib.calls]
    assert names.count("hipHostRegister") == 1
    fake.host_unregister(address)


def test_pointer_attributes_on_rocm5_and_rocm6(monkeypatch):
    monkeypatch.setattr("kvtier.runtime.hip.kfd_targets", lambda: {})
    old = HipRuntime(fake_library(version=50_221_153))
    old._hip.lib.pointer_status = INVALID_VALUE  # ROCm 5: memory HIP does not know is an error
    assert old.pointer_attributes(0x1234).type is MemoryType.UNREGISTERED
    assert "hipGetLastError" in [name for name, _ in old._hip.lib.calls]  # the sticky error is cleared
    old._hip.lib.pointer_status, old._hip.lib.pointer_type = SUCCESS, 0
    assert old.pointer_attributes(0x1234).type is MemoryType.HOST
    new = HipRuntime(fake_library(version=60_300_000))
    new._hip.lib.pointer_type = 2
    attrs = new.pointer_attributes(0x1234)
    assert (attrs.type, attrs.device, attrs.device_pointer, attrs.host_pointer) == (MemoryType.DEVICE, 1, 0x1000,
                                                                                    0x2000)
    new._hip.lib.pointer_type = 0
    assert new.pointer_attributes(0x1234).type is MemoryType.UNREGISTERED
    old._hip.lib.managed = 1  # ROCm 5 has no managed memory type: the isManaged flag says it
    assert old.pointer_attributes(0x1234).type is MemoryType.MANAGED


def test_errors_carry_hips_name_and_text(fake):
    fake._hip.lib.fail["hipMemcpy"] = 700
    from kvtier.address import CpuAddress
    with pytest.raises(RuntimeCallError, match="hipMemcpy.*hipErrorIllegalAddress.*illegal memory access"):
        fake.memcpy(CpuAddress(0x1000), CpuAddress(0x2000), 16)


def test_a_launch_packs_each_argument_in_c_layout(fake):
    program = HipProgram(None, 0, "test", 0xABC, {"kernel": 0xDEF})
    stream = HipStream(fake._hip, 0, 0x55, owned=False)
    seen = {}

    def launch(function, gx, gy, gz, bx, by, bz, shared, native, params, extra):
        seen.update(function=function.value, grid=(gx, gy, gz), block=(bx, by, bz), shared=shared,
                    stream=native.value, extra=extra,
                    values=[struct.unpack(fmt, ctypes.string_at(params[i], size))[0]
                            for i, (fmt, size) in enumerate([("<i", 4), ("<q", 8), ("<i", 4)])])
        return SUCCESS

    fake._hip.lib.hipModuleLaunchKernel = launch
    fake._launch(program, "kernel", 3, 256, [i32(-7), i64(1 << 40), i32(5)], stream, shared_bytes=1024)
    assert seen == {"function": 0xDEF, "grid": (3, 1, 1), "block": (256, 1, 1), "shared": 1024, "stream": 0x55,
                    "extra": None, "values": [-7, 1 << 40, 5]}


def test_no_device_gives_a_clear_error():
    with pytest.raises(RuntimeUnavailable, match="no AMD GPU"):
        HipRuntime(fake_library(devices=0))


def test_hip_on_this_machine_fails_clearly_or_runs():
    """CI has libamdhip64 and no AMD GPU: 'no AMD GPU'. Without ROCm: 'no AMD GPU runtime: no HIP library'."""
    try:
        runtime = create("hip")
    except RuntimeUnavailable as exc:
        assert "no AMD GPU" in str(exc)
    else:
        assert runtime.device_count() >= 1


def test_a_missing_library_names_the_variable(monkeypatch):
    monkeypatch.setenv("KVTIER_HIP_LIBRARY", "/nonexistent/libamdhip64.so")
    with pytest.raises(RuntimeUnavailable, match="no AMD GPU runtime.*KVTIER_HIP_LIBRARY"):
        HipLibrary()



@needs_non_hip_library
def test_a_non_hip_library_in_kvtier_hip_library_is_runtime_unavailable(monkeypatch):
    """KVTIER_HIP_LIBRARY naming a shared object that is not libamdhip64 (here libz) made HipLibrary() raise a bare
    ``AttributeError: ... undefined symbol: hipGetErrorName`` (the error functions were looked up with a plain
    getattr). It raises RuntimeUnavailable naming the variable, like a missing or garbage file does.
    (Found adversarially, issue #14.)"""
    monkeypatch.setenv("KVTIER_HIP_LIBRARY", NON_HIP_LIBRARY)
    with pytest.raises(RuntimeUnavailable, match="KVTIER_HIP_LIBRARY"):
        HipLibrary()


@needs_non_hip_library
def test_auto_selection_falls_back_to_the_emulator_with_a_non_hip_library(monkeypatch):
    """get() with no runtime named must try CUDA, then HIP, then the emulator (docs/hip.md). With KVTIER_HIP_LIBRARY
    pointing at a non-HIP .so the HIP attempt raised AttributeError, which get() did not catch: auto selection
    crashed instead of choosing the emulator. (Found adversarially, issue #14.)"""
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

def _installed_library() -> HipLibrary | None:
    try:
        return HipLibrary()
    except RuntimeUnavailable:
        return None


@pytest.mark.skipif(_installed_library() is None, reason="no libamdhip64 here")
def test_the_installed_library_names_its_errors():
    error = HipLibrary().error(NO_DEVICE, "hipGetDeviceCount")
    assert "hipErrorNoDevice" in str(error)


@pytest.mark.skipif(shutil.which("hipcc") is None, reason="no hipcc here")
def test_hipcc_builds_the_kernel_source_for_the_targets_it_knows(tmp_path):
    from kvtier.kernels.hip_build import HIP_ARCHS, aot_code_object, build_hip_aot
    from kvtier.kernels.source import KERNEL_NAMES

    manifest = build_hip_aot(tmp_path, HIP_ARCHS)
    assert manifest["archs"] and set(manifest["archs"]) | set(manifest["skipped"]) == set(HIP_ARCHS)
    for arch in manifest["archs"]:
        image, origin = aot_code_object(tmp_path, arch)
        # a code object, or the offload bundle around one that hipcc --genco writes (hipModuleLoadData takes both)
        assert image[:4] == b"\x7fELF" or image.startswith(b"__CLANG_OFFLOAD_BUNDLE__")
        assert origin.endswith(f"transfer-{arch}.hsaco")
        assert all(name.encode() in image for name in KERNEL_NAMES)
    for arch in manifest["skipped"]:
        assert aot_code_object(tmp_path, arch)[0] is None


@pytest.mark.skipif(_installed_library() is None, reason="no hiprtc here")
def test_hiprtc_compiles_the_kernel_source(tmp_path):
    from kvtier.kernels.hip_build import compile_jit_hip
    from kvtier.kernels.source import KERNEL_NAMES

    code = compile_jit_hip("gfx90a", cache=tmp_path)
    assert code[:4] == b"\x7fELF" and all(name.encode() in code for name in KERNEL_NAMES)
    assert compile_jit_hip("gfx90a", cache=tmp_path) == code  # from the cache
    assert len(list(tmp_path.glob("*.hsaco"))) == 1


def test_bulk_copies_are_never_chosen_on_hip(fake):
    """The TMA bulk kernels exist only for CUDA sm_90+; a gfx942 reports compute capability 9.4 too."""
    from kvtier.kernels import KernelLauncher

    assert fake.device_attributes(0).compute_capability[0] == 9
    assert not KernelLauncher(fake, bulk=True)._bulk_capable(0)


def test_a_closed_stream_is_never_handed_to_hip(fake):
    """After HipStream.close() (hipStreamDestroy) the stream still passed its destroyed handle to
    hipStreamSynchronize, hipStreamWaitEvent, hipEventRecord and hipMemcpyAsync (a use after free: HIP may crash or
    act on a recycled handle). HipEvent refuses use after close ('this HIP event is closed') and the emulator raises
    cudaErrorInvalidResourceHandle; a closed HipStream raises too, without calling HIP.
    (Found adversarially, issue #14.)"""
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
    """HipGraph.close() destroys the executable graph, but a later launch() still called hipGraphLaunch with the
    destroyed handle; it raises (as a closed event does) without calling HIP. (Found adversarially, issue #14.)"""
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
    memcpy_async on them ran with whatever device was current (device 0 here), so they waited on, recorded on and
    queued to device 0's null stream. _launch and _wait_value make the stream's device current for this reason;
    every call that takes a stream does (the emulator's handle-0 streams are per device).
    (Found adversarially, issue #14.)"""
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
    """get_device_accessible_ptr refused every GPU tensor unless runtime.name == 'cuda' ('a cuda:0 tensor cannot be
    used on device 0 of hip'), so with the hip runtime no torch tensor on an AMD GPU could be a kernel operand or
    back a DevicePool.from_tensors (the transformers integration likewise took its emulator branch for hip).
    HipRuntime accepts torch (ROCm) streams and scripts/amd_check.sh runs the torch tests on hip: a ROCm GPU tensor
    resolves to its own device address, as a CUDA tensor does on the cuda runtime. (Found adversarially, issue #14.)"""
    from kvtier.memory.resolve import get_device_accessible_ptr

    tensor = FakeRocmTensor(0x7F12_0000_0000, 4096, 1)
    assert get_device_accessible_ptr(tensor, 1, runtime=fake) == DeviceAddress(0x7F12_0000_0000, 1)
