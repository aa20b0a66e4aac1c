"""Kernel build, loader choice (one loaded program per device) and the launch boundary's refusals; the reference
kernel takes its access width from the table entries and faults on a misaligned vector access as a GPU does (no GPU
needed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers.cache import TINY
from helpers.cli import environment
from helpers.pools import SMALL_MHA, engine_on, fill_host, launch_names

from kvtier.errors import AddressDomainError, KernelBuildError, KvtierError, MisalignedAddress
from kvtier.kernels import ChunkCopy, ChunkSide, KernelLauncher
from kvtier.kernels.build import FATBIN_NAME, MANIFEST_NAME, build_aot
from kvtier.kernels.loader import kernel_image
from kvtier.kernels.source import Specialization
from kvtier.memory import DeviceBuffer
from kvtier.pools import DevicePool, HostPool, KVGeometry, build_pointer_table
from kvtier.runtime.emulated import EmulatedRuntime
from kvtier.transfer import TransferEngine
from kvtier.transfer.hisparse import HotBuffer

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


@needs_nvcc
def test_aot_build_and_loader(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_KERNEL_DIR", str(tmp_path))
    fatbin = build_aot(tmp_path, ("sm_90",))
    assert fatbin.stat().st_size > 1000
    image, origin = kernel_image("sm_90", "aot")
    assert image == fatbin.read_bytes() and origin.startswith("aot:")
    with pytest.raises(KernelBuildError, match="cover"):
        kernel_image("sm_80", "aot")


def test_forced_aot_without_a_build_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_KERNEL_DIR", str(tmp_path))
    with pytest.raises(KernelBuildError, match="python -m kvtier.kernels.build"):
        kernel_image("sm_90", "aot")


def test_stale_prebuilt_kernels_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_KERNEL_DIR", str(tmp_path))
    (tmp_path / FATBIN_NAME).write_bytes(b"not a fatbin")
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"source_hash": "0" * 16, "archs": ["sm_90"]}))
    with pytest.raises(KernelBuildError, match="rebuild"):
        kernel_image("sm_90", "aot")


def test_unknown_mode_and_specialized_aot_are_refused():
    with pytest.raises(KernelBuildError, match="KVTIER_KERNELS"):
        kernel_image("sm_90", "fast")
    for spec in (Specialization(unroll=4), Specialization(streaming=False), Specialization(skip_absent=False)):
        with pytest.raises(KernelBuildError, match="only JIT"):
            kernel_image("sm_90", "aot", spec)


def _installed_hiprtc() -> bool:
    from kvtier.kernels.hip_build import Hiprtc

    try:
        Hiprtc()
    except KernelBuildError:
        return False
    return True


def test_build_hip_into_an_unusable_out_folder_is_a_clear_error(tmp_path, capsys):
    """``python -m kvtier.kernels.build --hip --out <a file>`` (or a folder that cannot be created) died with a
    FileExistsError / FileNotFoundError / PermissionError traceback from mkdir; it prints one error line and exits 1,
    as it does when hipcc is missing or no target builds. (Found adversarially, issue #14.)"""
    from kvtier.kernels.build import main

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    assert main(["--hip", "--hipcc", "/bin/true", "--arch", "gfx90a", "--out", str(blocker)]) == 1


def test_build_hip_refuses_an_empty_target(tmp_path):
    """``--hip --arch ''`` exited 0: hipcc got ``--offload-arch=`` and built its default target (gfx803 with
    ROCm 5.2) into ``transfer-.hsaco``, and the manifest listed the target ``""`` as built. An empty target name is
    refused (exit 1) before anything is compiled."""
    from kvtier.kernels.build import main

    code = main(["--hip", "--hipcc", "/bin/true", "--arch", "", "--out", str(tmp_path)])
    manifest = tmp_path / "transfer-hip.json"
    assert code == 1 and not (manifest.exists() and "" in json.loads(manifest.read_text())["archs"])


def test_a_corrupt_hip_manifest_is_a_kernel_build_error(tmp_path, monkeypatch):
    """A truncated or hand-edited ``transfer-hip.json`` made kernel_image raise json.JSONDecodeError (in auto mode
    too, so no JIT fall back happened). The loader's contract is a KernelBuildError that says how to rebuild
    (``python -m kvtier.kernels.build --hip``)."""
    monkeypatch.setenv("KVTIER_KERNEL_DIR", str(tmp_path))
    (tmp_path / "transfer-gfx90a.hsaco").write_bytes(b"\x7fELF")
    (tmp_path / "transfer-hip.json").write_text('{"source_hash": "')
    with pytest.raises(KernelBuildError, match="kvtier.kernels.build --hip"):
        kernel_image("gfx90a", "aot")


@pytest.mark.skipif(not _installed_hiprtc(), reason="no hiprtc here")
def test_a_truncated_jit_cache_entry_is_compiled_again(tmp_path, monkeypatch):
    """compile_jit_hip returned whatever bytes the cache file held: an empty (or otherwise damaged) entry was served
    forever as the code object, and every load then failed in hipModuleLoadData until someone deleted
    ~/.cache/kvtier by hand. A cached entry that is not a code object (ELF / offload bundle) is rebuilt."""
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
    ROCm 5.2, or gfx999) aborted the whole Python process inside hiprtcCompileProgram ('munmap_chunk(): invalid
    pointer', SIGABRT): a serving process died with no exception. The AOT build skips such targets; the JIT path
    refuses them with a KernelBuildError."""
    code = ("from pathlib import Path\n"
            "from kvtier.errors import KernelBuildError\n"
            "from kvtier.kernels.hip_build import compile_jit_hip\n"
            "try:\n"
            f"    compile_jit_hip('gfx999', cache=Path({str(tmp_path)!r}))\n"
            "except KernelBuildError as exc:\n"
            "    print('KernelBuildError', exc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=environment())
    assert done.returncode == 0 and "KernelBuildError" in done.stdout, (done.returncode, done.stderr[-300:])


def test_a_specialization_is_named_by_what_it_changes():
    """Each switch reaches the compiler and the cache key: two specializations never share an image."""
    shipped = Specialization()
    assert shipped.prebuilt and "-DKVTIER_SKIP_ABSENT=1" in shipped.defines()
    others = [Specialization(unroll=4), Specialization(max_threads=512), Specialization(streaming=False),
              Specialization(skip_absent=False)]
    assert not any(spec.prebuilt for spec in others)
    labels = {spec.label() for spec in [shipped, *others]}
    assert len(labels) == 5 and "noskip" in Specialization(skip_absent=False).label()
    assert len({tuple(spec.defines()) for spec in [shipped, *others]}) == 5


@pytest.mark.parametrize("max_width", [0, 3, 32])
def test_an_access_width_the_kernels_lack_is_refused(split, max_width):
    with pytest.raises(KvtierError, match=f"max_width={max_width}"):
        KernelLauncher(split, max_width=max_width)


@pytest.mark.parametrize("max_width", [8.0, True], ids=["float", "bool"])
def test_kernel_launcher_refuses_a_max_width_that_is_not_an_int(split, max_width):
    """``KernelLauncher(max_width=...)`` checked ``max_width not in WIDTHS``, which a float (8.0) or a bool (True == 1)
    passes: the launcher was built, and then every copy it launched failed (8.0 with a TypeError from chunk_group,
    True with "program ... has no kernel 'kvtier_copy_chunks_i64_wTrue'"). The constructor refuses such a value up
    front, as it refuses 3 or 32 and as the engine's own settings refuse non-integers; or the launches work.
    (Found adversarially, issue #13.)"""
    try:
        launcher = KernelLauncher(split, max_width=max_width)
    except KvtierError:
        return                      # refused up front: what is expected
    with engine_on(split, TINY, "page_first", launcher=launcher) as (_, host, engine):
        fill_host(host)
        engine.load([0, 1], [2, 3]).wait()


def test_max_width_caps_the_hisparse_swap_in_width_too(split, monkeypatch):
    """``KernelLauncher(max_width=4)`` "caps the access width (bytes per load and store; a launch otherwise takes the
    widest its addresses allow)", and the swap-in kernel exists in 4-byte form (``kvtier_hot_swap_in_w4``). The
    swap-in's width was computed from the rows and tables alone, so a HotBuffer given a launcher capped at 4 bytes
    launched the 16-byte ``kvtier_hot_swap_in``. Every launch of the launcher, the swap-in included, uses at most
    ``max_width`` bytes per access."""
    host_g, dev_g = KVGeometry.mla(2, 80, 4), KVGeometry.mla(2, 80, 1)
    dev = DevicePool.allocate(dev_g, 7, 0, runtime=split)
    host = HostPool.allocate(host_g, "page_first", pages=8, runtime=split)
    hot = HotBuffer(dev, host, requests=1, slots=6, top_k=4, max_tokens=24,
                    launcher=KernelLauncher(split, max_width=4))
    try:
        hot.assign(0, np.arange(24))
        names = launch_names(split, monkeypatch)
        hot.swap_in(0, [0], np.array([[10, 11, 3, 12]], np.int32), [20])
        hot.synchronize()
        assert names == ["kvtier_hot_swap_in_w4"], f"a launcher capped at 4-byte accesses launched {names}"
    finally:
        hot.close()
        host.close()
        dev.close()


def _call(split, **overrides):
    table = DeviceBuffer(16, 0, runtime=split)
    index = DeviceBuffer(64, 0, runtime=split)
    fields = dict(src=ChunkSide(table, 1024, 0), dst=ChunkSide(table, 1024, 0), src_index=index, dst_index=index,
                  index_bytes=8, n_units=1, layer_begin=0, n_layers=1, n_pieces=1, chunk_bytes=1024)
    fields.update(overrides)
    return ChunkCopy(**fields)


def test_launch_boundary_refuses_raw_integers(split):
    launcher = KernelLauncher(split)
    stream = split.create_stream(0)
    with pytest.raises(AddressDomainError, match="raw integer"):
        launcher.copy_chunks(_call(split, src_index=12345), device=0, stream=stream)
    table = DeviceBuffer(16, 0, runtime=split)
    with pytest.raises(AddressDomainError, match="raw integer"):
        launcher.copy_chunks(_call(split, dst=ChunkSide(table.address.value, 1024, 0)), device=0, stream=stream)


@pytest.mark.parametrize("overrides, match", [
    ({"chunk_bytes": 0}, "positive number of bytes"),
    ({"src": None}, None),
    ({"index_bytes": 2}, "int32 or int64"),
    ({"n_pieces": 0}, "bad launch shape"),
    ({"layer_begin": 3, "table_layers": 2}, "exceed"),
    ({"n_units": 1 << 30, "n_pieces": 2}, "31 bits"),
    ({"src": "per_page"}, "31 bits"),
    ({"chunk_bytes": 32 << 30, "n_pieces": 2}, "31 bits"),
])
def test_launch_shapes_are_checked(split, overrides, match):
    launcher = KernelLauncher(split)
    if overrides.get("src", 1) is None:
        overrides["src"] = ChunkSide(DeviceBuffer(16, 0, runtime=split), 1000, 0, units_per_page=0)
        match = "units_per_page"
    if overrides.get("src") == "per_page":
        overrides["src"] = ChunkSide(DeviceBuffer(16, 0, runtime=split), 1024, 0, units_per_page=1 << 31)
    with pytest.raises(KvtierError, match=match):
        launcher.copy_chunks(_call(split, **overrides), device=0, stream=split.create_stream(0))


@pytest.mark.parametrize("layer_group", [1 << 31, 1 << 40])
def test_a_layer_group_beyond_int32_is_refused_by_validate(layer_group):
    """``ChunkCopy.validate`` checked ``layer_group`` is a positive int but not that it fits the kernel's ``int
    layer_group`` parameter: 2**31 passed validation, and the launch then died in argument packing with a bare
    ``struct.error`` ("'i' format requires ...") instead of a KvtierError. (Every layer count in a launch fits int32,
    so such a group means "all layers" and could equally be clamped.) validate() refuses it (KvtierError) or the
    launch clamps it to the launch's layers, as the kernel's ``walk_group`` does. (Found adversarially, issue #13.)"""
    runtime = EmulatedRuntime("split", seed=0)
    memories = [DeviceBuffer(4 * 128, 0, runtime=runtime) for _ in range(2)]
    tables = [build_pointer_table(runtime, 0, [m.address + r * 128 for r in range(4)]) for m in memories]
    index = DeviceBuffer(16, 0, runtime=runtime)
    index.upload(np.array([0, 1], np.int64))
    sides = [ChunkSide(t, 0, 64, 0, 1 << 20) for t in tables]
    stream = runtime.create_stream(0)
    call = ChunkCopy(src=sides[0], dst=sides[1], src_index=index, dst_index=index, index_bytes=8, n_units=2,
                     layer_begin=0, n_layers=4, n_pieces=1, chunk_bytes=64, n_tensors=1, table_layers=4,
                     layer_group=layer_group)
    try:
        try:
            call.validate()
        except KvtierError:
            return                                   # refused up front: fine
        KernelLauncher(runtime).copy_chunks(call, device=0, stream=stream)   # else it must launch
        stream.synchronize()
    except KvtierError:
        pass
    finally:
        stream.close()
        for handle in (index, *tables, *memories):
            handle.close()


def test_launch_on_another_devices_memory_is_refused(split):
    from kvtier.errors import WrongDeviceError

    launcher = KernelLauncher(split)
    other = DeviceBuffer(64, 1, runtime=split)
    with pytest.raises(WrongDeviceError):
        launcher.copy_chunks(_call(split, src_index=other), device=0, stream=split.create_stream(0))


def test_reference_kernel_copies_through_the_device_map(split):
    from kvtier.pools import build_pointer_table

    src, dst = DeviceBuffer(4096, 0, runtime=split), DeviceBuffer(4096, 0, runtime=split)
    data = np.random.default_rng().integers(1, 256, 4096, dtype=np.uint8)
    src.upload(data)
    dst.upload(np.zeros(4096, np.uint8))
    tables = [build_pointer_table(split, 0, [b.address]) for b in (src, dst)]
    index = DeviceBuffer(16, 0, runtime=split)
    index.upload(np.array([3, 1], np.int64))
    stream = split.create_stream(0)
    call = ChunkCopy(src=ChunkSide(tables[0], 1024, 0), dst=ChunkSide(tables[1], 1024, 0), src_index=index,
                     dst_index=index, index_bytes=8, n_units=2, layer_begin=0, n_layers=1, n_pieces=1, chunk_bytes=1024)
    KernelLauncher(split).copy_chunks(call, device=0, stream=stream)
    stream.synchronize()
    out = np.frombuffer(dst.download(), np.uint8).reshape(4, 1024)
    np.testing.assert_array_equal(out[[3, 1]], data.reshape(4, 1024)[[3, 1]])
    assert not out[[0, 2]].any()


# (tensors, table layers, first layer, layers, units, pieces, chunk bytes, src units/page, dst units/page, index bytes)
DECODE_SHAPES = [
    (2, 5, 1, 3, 37, 1, 656, 3, 16, 8),
    (1, 4, 0, 4, 200, 2, 64, 1, 7, 4),
    (2, 3, 2, 1, 90, 3, 48, 64, 5, 8),
    (1, 2, 0, 2, 9, 1, 36864, 1, 1, 4),
]


def _side(runtime, rng, tensors, table_layers, units, pieces, chunk_bytes, per_page, pad):
    """A pool laid out by (page, slot, piece) strides with padding, its table, and a random unit per item."""
    from kvtier.pools import build_pointer_table

    slots = units + int(rng.integers(0, 2 * units))
    piece_stride = chunk_bytes + pad
    unit_stride = pieces * piece_stride + pad
    page_stride = per_page * unit_stride + 2 * pad
    layer_bytes = -(-slots // per_page) * page_stride
    memory = DeviceBuffer(tensors * table_layers * layer_bytes, 0, runtime=runtime)
    table = build_pointer_table(runtime, 0, [memory.address + r * layer_bytes for r in range(tensors * table_layers)])
    chosen = rng.choice(slots, units, replace=False)
    return memory, table, ChunkSide(table, page_stride, unit_stride, piece_stride, per_page), chosen, layer_bytes


@pytest.mark.parametrize("unit_major, layer_group, max_width, bulk, skip_absent, absent", [
    (False, 1, 16, False, True, False), (True, 1, 16, False, True, False), (True, 1, 4, False, True, False),
    (False, 1, 16, True, True, False), (True, 1, 16, True, True, False), (False, 2, 16, False, True, False),
    (False, 3, 8, False, True, False), (False, 2, 16, True, True, False), (False, 1, 16, False, False, False),
    (True, 3, 8, False, False, False), (False, 1, 16, False, True, True), (True, 3, 8, False, True, True),
    (False, 1, 16, True, True, True), (True, 1, 16, True, True, True)],
    ids=["layer_major", "unit_major", "unit_major_w4", "bulk", "bulk_unit_major", "group2", "group3_w8",
         "bulk_group2", "noskip", "noskip_unit_major_group3_w8", "absent", "absent_unit_major_group3_w8",
         "absent_bulk", "absent_bulk_unit_major"])
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=[f"shape{i}" for i in range(len(DECODE_SHAPES))])
def test_kernel_copies_every_chunk_of_odd_shapes(runtime, shape, unit_major, layer_group, max_width, bulk,
                                                 skip_absent, absent):
    """The kernel's chunk decode (units per page, pieces, tensors, a layer window, odd chunk sizes, every walk order:
    layer-major, unit-major, groups of layers with a shorter last group, a capped access width, the bulk-copy kernels
    where sizes allow, the measuring build without the absent-unit test) against numpy. With ``absent``, units
    marked absent (any negative index, on either side: scattered, a run of 40, the first and the last; one pair
    stays) are skipped
    and their destinations keep their poison."""
    if not skip_absent and runtime.name in ("cuda", "hip") and os.environ.get("KVTIER_KERNELS", "").lower() == "aot":
        pytest.skip("prebuilt kernels ship only the default specialization; the JIT run covers the measuring build")
    tensors, table_layers, first, layers, units, pieces, chunk, src_per_page, dst_per_page, index_bytes = shape
    rng = np.random.default_rng()
    src_mem, src_table, src, src_units, src_layer = _side(runtime, rng, tensors, table_layers, units, pieces, chunk,
                                                          src_per_page, 0)
    dst_mem, dst_table, dst, dst_units, dst_layer = _side(runtime, rng, tensors, table_layers, units, pieces, chunk,
                                                          dst_per_page, 16)
    if absent:
        keep = int(rng.integers(1, units - 1)), src_units.copy(), dst_units.copy()
        src_units[rng.random(units) < 0.3] = -1
        dst_units[rng.random(units) < 0.2] = -int(rng.integers(2, 1000))
        src_units[[0, -1]] = -1
        run = int(rng.integers(0, max(units - 40, 0) + 1))
        src_units[run:run + 40] = -7
        src_units[keep[0]], dst_units[keep[0]] = keep[1][keep[0]], keep[2][keep[0]]  # one pair present
    source = rng.integers(1, 256, src_mem.nbytes, dtype=np.uint8)
    poison = rng.integers(1, 256, dst_mem.nbytes, dtype=np.uint8)
    src_mem.upload(source)
    dst_mem.upload(poison)
    dtype = np.int64 if index_bytes == 8 else np.int32
    indices = []
    for chosen in (src_units, dst_units):
        buffer = DeviceBuffer(units * index_bytes, 0, runtime=runtime)
        buffer.upload(chosen.astype(dtype))
        indices.append(buffer)
    call = ChunkCopy(src=src, dst=dst, src_index=indices[0], dst_index=indices[1], index_bytes=index_bytes,
                     n_units=units, layer_begin=first, n_layers=layers, n_pieces=pieces, chunk_bytes=chunk,
                     n_tensors=tensors, table_layers=table_layers, unit_major=unit_major, layer_group=layer_group)
    stream = runtime.create_stream(0)
    launcher = KernelLauncher(runtime, max_width=max_width, bulk=bulk, skip_absent=skip_absent)
    prepared = launcher.copy_chunks(call, device=0, stream=stream)
    assert prepared.name.startswith("kvtier_bulk_copy") == (bulk and chunk % 16 == 0 and src.unit_stride % 16 == 0
                                                           and dst.unit_stride % 16 == 0)
    stream.synchronize()
    expected = poison.copy()
    for row in [t * table_layers + first + layer for t in range(tensors) for layer in range(layers)]:
        for s_unit, d_unit in zip(src_units.tolist(), dst_units.tolist(), strict=True):
            if s_unit < 0 or d_unit < 0:
                continue
            for piece in range(pieces):
                at = []
                for side, unit, layer_bytes in ((src, s_unit, src_layer), (dst, d_unit, dst_layer)):
                    page, slot = divmod(unit, side.units_per_page)
                    at.append(row * layer_bytes + page * side.page_stride + slot * side.unit_stride
                              + piece * side.piece_stride)
                expected[at[1]:at[1] + chunk] = source[at[0]:at[0] + chunk]
    out = np.frombuffer(dst_mem.download(), np.uint8)
    assert (out != poison).any()
    np.testing.assert_array_equal(out, expected)
    stream.close()
    for handle in (*indices, src_table, dst_table, src_mem, dst_mem):
        handle.close()


def test_large_single_piece_chunks_are_cut_into_pieces_of_at_most_4_kib(split):
    table = DeviceBuffer(16, 0, runtime=split)
    call = _call(split, chunk_bytes=18432, src=ChunkSide(table, 18432 * 4, 18432), dst=ChunkSide(table, 18432, 0))
    cut = call.in_pieces()
    assert (cut.n_pieces, cut.chunk_bytes) == (6, 3072)
    assert cut.src.piece_stride == cut.dst.piece_stride == 3072
    assert (cut.src.page_stride, cut.src.unit_stride) == (18432 * 4, 18432)
    assert _call(split, chunk_bytes=4096).in_pieces().n_pieces == 1
    assert _call(split, chunk_bytes=8192, n_pieces=2).in_pieces().n_pieces == 2


def test_the_reference_kernel_faults_on_a_misaligned_vector_access(split):
    """A GPU dies with cudaErrorMisalignedAddress; the emulator must fault too, not copy."""
    from kvtier.kernels import ChunkCopy, ChunkSide, KernelLauncher

    src, dst, table, index = (DeviceBuffer(n, 0, runtime=split) for n in (4096, 4096, 16, 16))
    table.upload(np.array([src.address.value + 8, dst.address.value], np.uint64))
    index.upload(np.zeros(2, np.int64))
    stream = split.create_stream(0)
    call = ChunkCopy(src=ChunkSide(table.region(0, 8), 1024, 0), dst=ChunkSide(table.region(8, 8), 1024, 0),
                     src_index=index, dst_index=index, index_bytes=8, n_units=1, layer_begin=0, n_layers=1, n_pieces=1,
                     chunk_bytes=1024)
    KernelLauncher(split).copy_chunks(call, device=0, stream=stream)
    with pytest.raises(MisalignedAddress, match="misaligned"):
        stream.synchronize()


def test_table_entries_decide_the_access_width_at_the_boundary(split):
    """A base 8 bytes off a 16-byte boundary is copied with 8-byte accesses (a 16-byte access there faults the
    emulated device as it would a GPU), and every byte lands."""
    from kvtier.kernels import ChunkCopy, ChunkSide, KernelLauncher

    with DeviceBuffer(4096, 0, runtime=split) as memory, DeviceBuffer(4096, 0, runtime=split) as out, \
            DeviceBuffer(16, 0, runtime=split) as index:
        data = np.random.default_rng().integers(1, 256, 4096, dtype=np.uint8)
        memory.upload(data)
        out.upload(np.full(4096, 0xEE, np.uint8))
        index.upload(np.array([0, 0], np.int64))
        table = build_pointer_table(split, 0, [memory.region(8, 1024)])
        good = build_pointer_table(split, 0, [out.region(0, 1024)])
        call = ChunkCopy(src=ChunkSide(table, 1024, 0), dst=ChunkSide(good, 1024, 0), src_index=index, dst_index=index,
                         index_bytes=8, n_units=1, layer_begin=0, n_layers=1, n_pieces=1, chunk_bytes=1024)
        stream = split.create_stream(0)
        KernelLauncher(split).copy_chunks(call, device=0, stream=stream)
        stream.synchronize()
        got = np.frombuffer(out.download(), np.uint8)
        np.testing.assert_array_equal(got[:1024], data[8:1032])
        assert (got[1024:] == 0xEE).all()


def test_engines_share_one_loaded_program_per_device(runtime):
    with engine_on(runtime, SMALL_MHA, "page_first", engine=False) as (dev, host, _):
        before = len(runtime._programs)
        engines = [TransferEngine(dev, host) for _ in range(3)]
        for engine in engines:
            engine.backup([0], [1]).wait()
        assert len(runtime._programs) <= before + 1
        for engine in engines:
            engine.close()
