"""SGLang's own classes built on the CPU, without pytest: its storage config, its backend factory and its real host
pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``, ``MambaPoolHost``), and the bytes of their pages. The
tests use them through ``helpers.sglang`` (which turns a missing SGLang into a skip); ``bench/sglang_storage.py``
imports this module directly.

sglang 0.5.23 installs here with ``pip install --no-deps sglang==0.5.23`` plus the small packages its modules import
(``.ci/run`` lists them). Where it does not import, every function here that needs it raises ``SGLangMissing``.

Two stand-ins, both outside what the callers exercise:

- **The device pool.** A host pool is built from a description of the device KV buffers (``MHABufferInfo`` and kin):
  here those buffers are CPU tensors. The storage path never touches them (it reads and writes the host pool's own
  tensors, through ``get_page_buffer_meta``), only the device ↔ host copies would, and those are not under test.
- **torchvision.** SGLang's host-pool modules import every model config, one of which imports
  ``torchvision.transforms`` at module level. PyPI's torchvision is a CUDA build that fails to import beside the CPU
  build of torch this project uses, so where torchvision is not installed a placeholder package stands in for the
  import alone (``helpers/placeholders/torchvision``: nothing in a host pool calls it). ``place_torchvision`` puts it
  on ``sys.path``; call it before anything imports transformers, which decides once whether torchvision is there
  (the test session does it at start, the bench before it imports SGLang).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import torch

STORAGE = "sglang.srt.mem_cache.hicache_storage"
FACTORY = "sglang.srt.mem_cache.storage.backend_factory"
PLACEHOLDERS = Path(__file__).parent / "placeholders"


class SGLangMissing(ImportError):
    """SGLang (or the part of it a caller needs) does not import here."""


def place_torchvision() -> None:
    """Put the torchvision placeholder (``helpers/placeholders``) on ``sys.path`` where SGLang is installed and
    torchvision is not. Call it before anything imports transformers, which decides once whether torchvision is
    there."""
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("torchvision") is not None:
        return
    if str(PLACEHOLDERS) not in sys.path:
        sys.path.append(str(PLACEHOLDERS))


def import_storage() -> None:
    """Import SGLang's HiCache storage interface and its backend factory; SGLangMissing says why they do not."""
    try:
        importlib.import_module(STORAGE)
        importlib.import_module(FACTORY)
    except Exception as exc:                       # noqa: BLE001 (any import failure means: not usable here)
        raise SGLangMissing(f"sglang does not import: {exc}") from exc


def import_host_pools() -> types.SimpleNamespace:
    """SGLang's host-pool classes and their buffer descriptions (SGLangMissing without SGLang)."""
    import_storage()
    try:
        info = importlib.import_module("sglang.srt.mem_cache.device_pool_info")
        mha = importlib.import_module("sglang.srt.mem_cache.pool_host.mha")
        mla = importlib.import_module("sglang.srt.mem_cache.pool_host.mla")
        mamba = importlib.import_module("sglang.srt.mem_cache.pool_host.mamba")
        base = importlib.import_module("sglang.srt.mem_cache.pool_host.base")
    except Exception as exc:                        # noqa: BLE001
        raise SGLangMissing(f"SGLang's host pools do not import here: {exc}") from exc
    return types.SimpleNamespace(info=info, MHA=mha.MHATokenToKVPoolHost, MLA=mla.MLATokenToKVPoolHost,
                                 Mamba=mamba.MambaPoolHost, budget=base.host_memory_budget_scope)


POOL_BUDGET = 8 << 30
"""What SGLang's host-memory check books the pools built here against (its own ``host_memory_budget_scope``): the
tests' pools are a few MB, and the check otherwise wants 10 GB free beyond them, which a loaded machine may not have.
A caller that builds a larger pool passes its own ``budget``."""


def _pointer_table(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_host_pool(layout: str, *, layers: int = 3, heads: int = 2, head_dim: int = 64, page_size: int = 4,
                  tokens: int = 256, dtype: torch.dtype = torch.bfloat16, host_tokens: int | None = None,
                  budget: int = POOL_BUDGET) -> Any:
    """SGLang's real ``MHATokenToKVPoolHost``, its device side (``tokens`` slots) described by CPU tensors: about 2 ×
    ``tokens`` host slots, or exactly ``host_tokens`` (a multiple of ``page_size``) when given; booked against
    ``budget`` bytes of host memory."""
    sg = import_host_pools()
    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    buffers = sg.info.KVBuffers(k=k, v=v, k_data_ptrs=_pointer_table(k), v_data_ptrs=_pointer_table(v),
                                layout=sg.info.KVBufferLayout.NHD)
    info = sg.info.MHABufferInfo(buffers=buffers, page_size=page_size, head_num=heads, head_dim=head_dim,
                                 v_head_dim=head_dim, dtype=dtype, device=torch.device("cpu"))
    with sg.budget(budget):
        return sg.MHA(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                      device_capacity_tokens=tokens, start_layer=0, end_layer=layers, host_token_capacity=host_tokens)


def mla_host_pool(layout: str, *, layers: int = 3, lora_rank: int = 64, rope_dim: int = 32, page_size: int = 4,
                  tokens: int = 256, dtype: torch.dtype = torch.bfloat16) -> Any:
    """SGLang's real ``MLATokenToKVPoolHost``."""
    sg = import_host_pools()
    dim = lora_rank + rope_dim
    buffers = tuple(torch.zeros(tokens, 1, dim, dtype=dtype) for _ in range(layers))
    info = sg.info.MLABufferInfo(buffers=buffers, data_ptrs=_pointer_table(buffers), layer_indices=tuple(range(layers)),
                                 device_layer_num=layers, page_size=page_size, kv_lora_rank=lora_rank,
                                 qk_rope_head_dim=rope_dim, kv_cache_dim=dim, dtype=dtype,
                                 device=torch.device("cpu"))
    with sg.budget(POOL_BUDGET):
        return sg.MLA(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                      device_capacity_tokens=tokens, start_layer=0, end_layer=layers, target_layer_num=layers)


def mamba_host_pool(*, layers: int = 2, slots: int = 16, conv_shape: tuple[int, ...] = (64, 3),
                    temporal_shape: tuple[int, ...] = (4, 8, 8), layout: str = "page_first") -> Any:
    """SGLang's real ``MambaPoolHost`` (one slot per page)."""
    sg = import_host_pools()
    temporal = torch.zeros(layers, slots, *temporal_shape, dtype=torch.float32)
    conv = (torch.zeros(layers, slots, *conv_shape, dtype=torch.bfloat16),)
    info = sg.info.MambaStateBufferInfo(temporal=temporal, conv=conv)
    with sg.budget(POOL_BUDGET):
        return sg.Mamba(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout=layout)


def storage_config(**fields: Any) -> Any:
    """SGLang's ``HiCacheStorageConfig`` of one TP rank of a model (fields override)."""
    import_storage()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    values = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                  enable_storage_metrics=True, is_page_first_layout=True, model_name="meta-llama/Llama-3.1-8B")
    values.update(fields)
    return HiCacheStorageConfig(**values)


def extra_config(store: str, **options: Any) -> dict[str, Any]:
    """The ``--hicache-storage-backend-extra-config`` a user writes for kvtier; a fresh ``tenant`` unless given, so
    callers sharing a server never see each other's pages."""
    options.setdefault("tenant", uuid.uuid4().hex)
    return {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", "class_name": "KVTierStorage",
            "interface_v1": 1, "store": store, **options}


def create_backend(store: str, host_pool: Any, *, config: Any = None, **options: Any) -> Any:
    """kvtier's backend as SGLang's controller makes it: its factory's ``dynamic`` path, then
    ``register_mem_pool_host``."""
    config = config or storage_config(is_mla_model=hasattr(host_pool, "kv_cache_dim"))
    config.extra_config = extra_config(store, **options)
    return create_sglang_backend("dynamic", config, host_pool)


def create_sglang_backend(name: str, config: Any, host_pool: Any) -> Any:
    """Any backend (``dynamic``, SGLang's own ``file``, ``mooncake``, …) as SGLang's controller makes it: its
    factory with ``config`` (its ``extra_config`` set), then ``register_mem_pool_host``."""
    import_storage()
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend(name, config, host_pool)
    backend.register_mem_pool_host(host_pool)
    return backend


def fill_pages(host_pool: Any, indices: torch.Tensor, seed: int) -> None:
    """Random bytes (never zeros) in every host buffer slot of ``indices``."""
    generator = torch.Generator().manual_seed(seed)
    for tensor in _buffers(host_pool):
        raw = tensor.view(torch.uint8)
        rows = _rows(host_pool, tensor, indices)
        raw[rows] = torch.randint(1, 256, raw[rows].shape, dtype=torch.uint8, generator=generator)


def poison_pages(host_pool: Any, indices: torch.Tensor, value: int = 0xA5) -> None:
    for tensor in _buffers(host_pool):
        raw = tensor.view(torch.uint8)
        raw[_rows(host_pool, tensor, indices)] = value


def page_slots(host_pool: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    """The bytes of the slots of ``indices``, per buffer, as uint8 tensors (copies: compare them with
    ``torch.equal``)."""
    return [tensor.view(torch.uint8)[_rows(host_pool, tensor, indices)].clone() for tensor in _buffers(host_pool)]


def page_bytes(host_pool: Any, indices: torch.Tensor) -> list[bytes]:
    """Every byte of the slots of ``indices``, per buffer (for exact comparison)."""
    return [slots.numpy().tobytes() for slots in page_slots(host_pool, indices)]


def restore_pages(host_pool: Any, indices: torch.Tensor, data: list[bytes]) -> None:
    """Put back what ``page_bytes`` read from the slots of ``indices``."""
    for tensor, chunk in zip(_buffers(host_pool), data, strict=True):
        raw = tensor.view(torch.uint8)
        rows = _rows(host_pool, tensor, indices)
        raw[rows] = torch.frombuffer(bytearray(chunk), dtype=torch.uint8).reshape(raw[rows].shape)


def _buffers(host_pool: Any) -> list[torch.Tensor]:
    if hasattr(host_pool, "temporal_buffer"):
        return [host_pool.temporal_buffer, *host_pool.conv_buffer]
    return [host_pool.kv_buffer]


def _rows(host_pool: Any, tensor: torch.Tensor, indices: torch.Tensor) -> tuple[Any, ...]:
    """Index of the slots ``indices`` in ``tensor`` of SGLang's host layouts."""
    layout = host_pool.layout
    if hasattr(host_pool, "temporal_buffer"):
        return (indices,)
    mla = hasattr(host_pool, "kv_cache_dim")
    if layout == "layer_first":
        return (slice(None), indices) if mla else (slice(None), slice(None), indices)
    if layout == "page_first":
        return (indices,) if mla else (slice(None), indices)
    pages = torch.unique(indices // host_pool.page_size)
    return (pages,) if mla else (slice(None), pages)


def page_keys(count: int, salt: str = "") -> list[str]:
    """Keys as SGLang makes them: SHA-256 hex, each chained on the one before."""
    keys, last = [], salt
    for i in range(count):
        last = hashlib.sha256(f"{last}|{i}".encode()).hexdigest()
        keys.append(last)
    return keys


def pages_at(host_pool: Any, count: int) -> torch.Tensor:
    """Host indices of ``count`` fresh pages (``page_size`` slots each), as SGLang's allocator hands them out."""
    indices = host_pool.alloc(count * host_pool.page_size)
    assert indices is not None, "host pool full"
    return indices


def store_pages(backend: Any, host_pool: Any, pages: int = 4,
                salt: str = "") -> tuple[list[str], torch.Tensor, list[bytes]]:
    """Fresh random pages stored through ``batch_set_v1``, then poisoned in the pool: (keys, host indices, the bytes
    they held)."""
    keys, indices = page_keys(pages, salt), pages_at(host_pool, pages)
    fill_pages(host_pool, indices, seed=len(salt) * 31 + pages)
    written = page_bytes(host_pool, indices)
    assert backend.batch_set_v1(keys, indices) == [True] * pages
    poison_pages(host_pool, indices)
    assert page_bytes(host_pool, indices) != written
    return keys, indices, written


def reads_back(backend: Any, host_pool: Any, keys: list[str], indices: torch.Tensor, expected: list[bytes]) -> bool:
    """Poison the slots of ``indices``, read ``keys`` into them with ``batch_get_v1``: whether every page was a hit
    and the slots hold ``expected`` byte for byte."""
    poison_pages(host_pool, indices)
    hits = backend.batch_get_v1(keys, indices)
    return hits == [True] * len(keys) and page_bytes(host_pool, indices) == expected
