"""vLLM's KV cache tensors seen as a kvtier device pool: one operand per layer, a page per (layer, block).

vLLM hands ``register_kv_caches`` one tensor per attention layer, shaped in its logical order (``[blocks, heads,
tokens, 2 * head_size]`` for FlashAttention and FlashInfer, ``[blocks, tokens, latent]`` for MLA) with strides in the
physical order of its layout. In the layer-compact layouts (``LBNHC``, ``LBHNC``) a layer's block is one contiguous run
of ``page_size_bytes``, blocks follow each other, and what a block holds inside is vLLM's business: kvtier copies the
run whole. This module finds the block dimension from the strides, checks that every other dimension stays inside a
block, and wraps the layer as a flat byte view (CUDA) or the region of a ``DeviceArray`` (the emulated runtime).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.pools import DevicePool, KVGeometry
from kvtier.runtime import Runtime


def device_pool_of(kv_caches: Mapping[str, Any], layers: list[str], geometry: KVGeometry, runtime: Runtime
                   ) -> DevicePool:
    """A device pool over vLLM's KV tensors of ``layers`` (the KV cache group's order), each a whole number of
    ``geometry.page_bytes`` blocks."""
    missing = [name for name in layers if name not in kv_caches]
    if missing:
        raise InvalidArgument(f"register_kv_caches: no KV tensor for layer {missing[0]!r} of the KV cache group")
    operands, blocks = [], None
    for name in layers:
        operand, count = _layer_operand(name, kv_caches[name], geometry.page_bytes, runtime)
        if blocks is not None and count != blocks:
            raise InvalidArgument(f"layer {name!r} has {count} blocks, the layers before it {blocks}")
        blocks = count
        operands.append(operand)
    assert blocks is not None
    device = _device_index(kv_caches[layers[0]])
    return DevicePool(geometry, blocks, device, runtime, [operands])


def _layer_operand(name: str, tensor: Any, page_bytes: int, runtime: Runtime) -> tuple[Any, int]:
    from kvtier.compat.device_array import DeviceArray

    if isinstance(tensor, DeviceArray):
        if tensor.nbytes % page_bytes:
            raise InvalidArgument(f"layer {name!r}: {tensor.nbytes} bytes are not whole {page_bytes}-byte blocks")
        return tensor.region, tensor.nbytes // page_bytes
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgument(f"layer {name!r}: expected a torch tensor, got {type(tensor).__name__}")
    if runtime.torch_device is None or tensor.device.type != runtime.torch_device:
        raise InvalidArgument(f"layer {name!r} is on {tensor.device}; the {runtime.name} runtime moves KV of "
                              f"{runtime.torch_device or 'its own'} device memory")
    itemsize = tensor.element_size()
    blocks = _block_dim(name, tensor, page_bytes)
    start = tensor.storage_offset() * itemsize
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    flat.set_(tensor.untyped_storage(), start, (tensor.shape[blocks] * page_bytes,), (1,))
    return flat, tensor.shape[blocks]


def _block_dim(name: str, tensor: Any, page_bytes: int) -> int:
    """The dimension that steps from block to block (stride of one block), every other one inside a block."""
    itemsize = tensor.element_size()
    strides = [s * itemsize for s in tensor.stride()]
    candidates = [d for d, s in enumerate(strides) if s == page_bytes]
    for d in candidates:
        inner = sum((size - 1) * stride for i, (size, stride) in enumerate(zip(tensor.shape, strides, strict=True))
                    if i != d) + itemsize
        if inner <= page_bytes:
            return d
    raise InvalidArgument(f"layer {name!r}: shape {tuple(tensor.shape)} with byte strides {tuple(strides)} has no "
                          f"dimension of {page_bytes}-byte blocks that holds the rest; kvtier needs a layer-compact, "
                          "block-contiguous KV cache layout (LBNHC or LBHNC)")


def _device_index(tensor: Any) -> int:
    device = getattr(tensor, "device_index", None)
    if device is not None:
        return int(device)
    return int(tensor.device.index or 0)
