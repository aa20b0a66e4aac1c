"""SGLang's own HiCache kernels, as a peer in bench/sglang_compat.py.

SGLang 0.5.23 moves KV between its device pool and a ``layer_first`` or ``page_first`` host pool with JIT kernels
that ship as CUDA sources in the ``sglang`` wheel (``sglang.kernels.ops.kvcache.hicache``, built by nvcc through
tvm-ffi and ninja on first use), not with the ``sgl_kernel`` functions that ``kvtier.compat.sglang.kvcacheio``
stands in for. This module imports that kernel module as SGLang calls it, and nothing of SGLang is copied here.

``sglang/__init__.py`` starts SGLang's front end (its language API, transformers patches, an HTTP client stack), which
the kernel module does not need and a GPU machine without network cannot install; the package is therefore entered
as a bare namespace so only the kernel module and what it imports are loaded. Where the import fails, ``load``
returns the reason and the benchmark runs without this side.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any, Callable


def load() -> Any:
    """SGLang's ``hicache`` kernel module, or a one-line reason it is not available."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "SGLang's HiCache kernels need a CUDA GPU"
    try:
        spec = importlib.util.find_spec("sglang")
    except ValueError:
        spec = None
    if spec is None or spec.submodule_search_locations is None:
        return "sglang is not installed (scripts/device_wheels.sh --sglang brings its wheel to a GPU machine)"
    if "sglang" not in sys.modules:
        package = types.ModuleType("sglang")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["sglang"] = package
    try:
        return importlib.import_module("sglang.kernels.ops.kvcache.hicache")
    except Exception as error:  # noqa: BLE001 - any import failure means "this side is not run", with its reason
        return f"SGLang's hicache module did not import: {type(error).__name__}: {error}"


def kernel_name(hicache: Any, element_size: int, quota: int | None, page_size: int) -> str:
    """Which of SGLang's kernels a transfer of these rows takes (its TMA kernel on sm90+, else the register one)."""
    tma_quota = quota or hicache.TMA_BLOCK_QUOTA
    if hicache.use_hicache_tma_kernel(element_size=element_size, block_quota=tma_quota, page_size=page_size):
        return f"tma:{tma_quota}"
    return f"register:{quota or hicache.DEFAULT_BLOCK_QUOTA}"


def cases(hicache: Any, mem: Any, layout: str, hosts: list, indices: Any, quota: int | None) -> dict[str, Callable]:
    """{compat function name: the SGLang call that HiCache makes for the same move}, for the host layouts SGLang's
    JIT kernels serve. ``hosts`` are the host pool's per-tensor views as the compat cases made them, ``quota`` the
    block budget (None: SGLang's default). Per-layer loads are a call per layer, as SGLang's load-back makes them;
    a ``page_first`` backup uses the all-layer kernel with the host's page-first row stride (SGLang's path when it
    does not stage the write-back)."""
    g = mem.g
    L, item, ps = g.layers, g.row_bytes, g.page_size
    mla = g.tensors == 1
    K = mem.layers[0]
    V = None if mla else mem.layers[1]
    common = {"block_quota": quota, "page_size": ps}
    out: dict[str, Callable] = {}
    if layout == "page_first":
        per_layer = [[h[:, layer] for layer in range(L)] for h in hosts]
        host_tables = [mem.table(views) for views in per_layer]
        host_stride = L * item
        names = ("transfer_kv_all_layer_mla_lf_pf", "transfer_kv_per_layer_mla_pf_lf") if mla else \
            ("transfer_kv_all_layer_lf_pf", "transfer_kv_per_layer_pf_lf")
    elif layout == "layer_first":
        per_layer = [[h[layer] for layer in range(L)] for h in hosts]
        host_tables = [mem.table(views) for views in per_layer]
        host_stride = item
        names = ("transfer_kv_all_layer_mla", "transfer_kv_per_layer_mla") if mla else \
            ("transfer_kv_all_layer", "transfer_kv_per_layer")
    else:
        return out
    dev_tables = [mem.table(row) for row in mem.layers]
    backup, load = names
    if mla:
        out[backup] = lambda: hicache.transfer_hicache_all_layer_mla(
            host_tables[0], indices.di, dev_tables[0], indices.si, cache_src_stride_bytes=item,
            cache_dst_stride_bytes=host_stride, element_size=item, **common)
        out[load] = lambda: [hicache.transfer_hicache_one_layer_mla(
            K[layer], indices.dd, per_layer[0][layer], indices.hi, element_dim=item, **common) for layer in range(L)]
    else:
        out[backup] = lambda: hicache.transfer_hicache_all_layer(
            host_tables[0], host_tables[1], indices.di, dev_tables[0], dev_tables[1], indices.si,
            kv_cache_src_stride_bytes=item, kv_cache_dst_stride_bytes=host_stride, element_size=item, **common)
        out[load] = lambda: [hicache.transfer_hicache_one_layer(
            K[layer], V[layer], indices.dd, per_layer[0][layer], per_layer[1][layer], indices.hi, element_dim=item,
            **common) for layer in range(L)]
    return out
