"""Hugging Face transformers with kvtier's cache behind it: the KV of prompts seen before is served from the device
tier, or loaded back from host memory (or storage), instead of being recomputed.

``KVTierGeneration`` wraps a causal LM and a ``KVCache`` whose geometry matches the model. For each prompt (a row of
the batch, after its left padding) it matches the prefix and queues the load-back of its host-tier part (one event
per layer), and it hands the model a ``KVTierCache``: a transformers ``Cache`` whose layers hold no tensors yet, only
the pages each row reads (``request.py``, ``cache_layers.py``). The attention of layer i calls ``update(…, i)``;
only then does the layer make the compute stream wait, *on the GPU*, for layer i's load, and gather its pages into
the ``[batch, heads, seq, dim]`` tensor attention reads. So layer 0 computes while layers 1… are still crossing the
link, and the time to first token approaches the larger of the two, not their sum.
After the request, each prompt's new whole pages are inserted so the next turn hits. The output is the model's own:
greedy, sampled and beam-search generation give the same tokens with or without kvtier. Arguments are checked before
any cache work (``arguments.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.cache import CacheRequest, CacheSettings, KVCache, Namespace, OutOfPages
from kvtier.errors import InvalidArgument
from kvtier.integrations.arguments import UNSERVED_GENERATE, Prompt, cache_keyword, checked_generate, prompts_of
from kvtier.integrations.cache_layers import KVTierCache, KVTierLayer
from kvtier.integrations.paged import PagedKV, itemsize
from kvtier.integrations.request import PromptUse, Request, Turn
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.runtime import Runtime
from kvtier.runtime import get as get_runtime
from kvtier.storage import open_store

__all__ = ["KVTierCache", "KVTierGeneration", "KVTierLayer", "Request", "Turn", "UNSERVED_GENERATE", "cache_keyword",
           "checked_geometry", "geometry_of", "model_fingerprint", "namespace_of"]


def geometry_of(config: Any, page_size: int, dtype: Any) -> KVGeometry:
    """The KV geometry of a transformers decoder config (MHA / GQA / MQA, every layer full attention) kept in
    ``dtype``. Latent-attention (MLA) models and K and V of different head sizes are refused: a kvtier MHA page holds
    K and V of one shape. ``KVTierGeneration.build`` takes the geometry from the model's own cache instead."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise InvalidArgument(f"kvtier serves full-attention layers only; this model has layer types {sorted(kinds)}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if getattr(config, "kv_lora_rank", None) or getattr(config, "v_head_dim", head_dim) != head_dim:
        raise InvalidArgument(f"{config.model_type}: latent attention (MLA) or K and V of different head sizes; "
                              "kvtier's transformers integration serves MHA / GQA / MQA KV only")
    multi_query = getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False)
    heads = 1 if multi_query else (getattr(config, "num_key_value_heads", None)
                                   or getattr(config, "num_kv_heads", None) or config.num_attention_heads)
    return KVGeometry.mha(layers=config.num_hidden_layers, kv_heads=heads, head_dim=head_dim,
                          itemsize=itemsize(dtype), page_size=page_size)


def checked_geometry(model: Any, page_size: int, dtype: Any) -> KVGeometry:
    """The geometry of the K and V the model's own cache holds after a one-token forward (configs name their KV
    heads in several ways; the cache does not), after ``geometry_of`` has refused what kvtier cannot page."""
    import torch
    from transformers import DynamicCache

    geometry_of(model.config, page_size, dtype)
    probe = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.zeros((1, 1), dtype=torch.long, device=next(model.parameters()).device),
              **{cache_keyword(model): probe})
    shapes = [(tuple(keys.shape), tuple(values.shape)) for keys, values in
              ((getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in probe.layers)
              if keys is not None and values is not None]
    kinds = set(shapes)
    if len(kinds) != 1 or len(shapes) != len(probe.layers) or shapes[0][0] != shapes[0][1] or \
            len(shapes[0][0]) != 4:
        raise InvalidArgument(f"{model.config.model_type}: the model's own cache holds K/V shaped "
                              f"{sorted(kinds)[:3]} over {len(shapes)} of {len(probe.layers)} layers; kvtier pages "
                              "one K and V shape for every layer")
    _, heads, _, head_dim = shapes[0][0]
    return KVGeometry.mha(layers=len(shapes), kv_heads=heads, head_dim=head_dim, itemsize=itemsize(dtype),
                          page_size=page_size)


def namespace_of(model: Any, geometry: KVGeometry | int = 16, model_id: str | None = None) -> Namespace:
    """The namespace ``KVTierGeneration.build`` keys this model's pages by (open a storage backend with it to pass
    one in): ``model_id`` (default: the config's ``_name_or_path``, else its model type) plus a hash of a sample of
    the weights, the KV geometry (or its page size, the rest read from the model) and the dtype."""
    dtype = next(model.parameters()).dtype
    if not isinstance(geometry, KVGeometry):
        geometry = checked_geometry(model, geometry, dtype)
    name = model_id or getattr(model.config, "_name_or_path", "") or model.config.model_type
    return Namespace(f"{name}@{model_fingerprint(model)}", geometry, str(dtype).replace("torch.", ""))


def model_fingerprint(model: Any) -> str:
    """A short hash of a sample of the weights (the first 4,096 elements of up to 8 tensors spread over the
    model), so two models of one name or type with other weights never share stored pages."""
    import xxhash

    parameters = list(model.parameters())
    digest = xxhash.xxh3_64()
    for tensor in parameters[::max(1, len(parameters) // 8)][:8]:
        sample = tensor.detach().reshape(-1)[:4096].float().cpu().numpy()
        digest.update(sample.tobytes())
    return digest.hexdigest()


class KVTierGeneration:
    """``generate`` for a transformers causal LM with a kvtier cache behind it. Build with :meth:`build` (it makes the
    pools and the cache for the model) or pass a ``KVCache`` whose geometry matches the model."""

    def __init__(self, model: Any, cache: KVCache, paged: PagedKV, owned: tuple[Any, ...] = ()) -> None:
        """``owned``: pools this object made (``build``) and closes after the cache."""
        if cache.geometry != paged.pool.geometry:
            raise InvalidArgument("the cache and the paged view must share one device pool geometry")
        self.model, self.cache, self.paged = model, cache, paged
        self.cache_keyword = cache_keyword(model)
        """The keyword the model takes a cache by (``cache``, or ``past_key_values`` before transformers renamed it):
        ``model(ids, **{generation.cache_keyword: request.cache})``."""
        self.turns: list[Turn] = []
        self.skipped_inserts = 0
        """Prompts whose new pages could not be had (locked or in flight): their output stands, uncached."""
        self._owned = owned

    @classmethod
    def build(cls, model: Any, *, device_tokens: int, host_tokens: int, page_size: int = 16,
              runtime: Runtime | str | None = None, settings: CacheSettings | None = None, storage: Any = None,
              model_id: str | None = None, host_layout: str = "layer_first") -> KVTierGeneration:
        """Pools for ``device_tokens`` on the model's device and ``host_tokens`` of pinned host memory, in the model's
        dtype, and a cache over them. The host pool is ``layer_first`` and loads use the copy engines (``direct``):
        a layer of a run of host pages is one contiguous piece, so a load-back is one copy per layer and tensor at the
        link's rate, an event after each (``host_layout="page_first_direct"`` makes them strided copies instead).
        ``settings`` default: that, and load back whatever is cached (no recompute estimate). ``storage``: a spec
        (``file:PATH``, ``redis://…``; opened for this model's namespace and closed with this object) or a backend
        opened for ``namespace_of(model, page_size, model_id)`` and ``layout=host_layout``: ``model_id`` (default:
        the config's ``_name_or_path``, else its model type) plus a hash of a sample of the weights, so other weights
        never read these pages."""
        import torch

        runtime = get_runtime(runtime) if not isinstance(runtime, Runtime) else runtime
        parameter = next(model.parameters())
        device, dtype = parameter.device, parameter.dtype
        geometry = checked_geometry(model, page_size, dtype)
        pages = -(-device_tokens // page_size)
        if runtime.torch_device is not None:
            if device.type != runtime.torch_device:
                raise InvalidArgument(f"the model is on {device}; the {runtime.name} runtime needs it on a GPU "
                                      f"({runtime.torch_device}) device")
            tensors = [[torch.empty((pages * page_size, geometry.heads, geometry.head_bytes // itemsize(dtype)),
                                    dtype=dtype, device=device) for _ in range(geometry.layers)] for _ in range(2)]
            pool = DevicePool.from_tensors(geometry, tensors, runtime=runtime)
        else:
            tensors = None
            pool = DevicePool.allocate(geometry, pages, 0, runtime=runtime)
        try:
            host = HostPool.allocate(geometry, host_layout, tokens=host_tokens, kind="pinned", runtime=runtime)
        except BaseException:
            pool.close()
            raise
        namespace = namespace_of(model, geometry, model_id)
        settings = settings or CacheSettings(calibrate=False, load_back_min_tokens=0, load_backend="direct")
        owned: tuple[Any, ...] = (pool, host)
        try:
            if isinstance(storage, str):
                storage = open_store(storage, namespace, layout=host_layout)
                owned += (storage,)
            cache = KVCache(pool, host, namespace, settings, storage=storage)
        except BaseException:
            for resource in reversed(owned):
                resource.close()
            raise
        return cls(model, cache, PagedKV(pool, dtype, device, tensors), owned=owned)

    def request(self, input_ids: Any, *, attention_mask: Any = None, overlap: bool = True) -> Request:
        """Match each row of ``input_ids`` (``[rows, tokens]``; left padding under ``attention_mask``) in the cache,
        queue the load-backs of the host parts the rows read, and return the request whose ``cache`` serves the
        prefixes to the model. ``overlap=False`` makes the model wait for the whole load before its first layer
        (copy, then compute). At least each prompt's last token is left to compute."""
        return self._request(prompts_of(self.model, input_ids, attention_mask), overlap)

    def _request(self, prompts: list[Prompt], overlap: bool) -> Request:
        uses: list[PromptUse] = []
        try:
            for prompt in prompts:                      # every prompt's storage prefetch starts here
                uses.append(PromptUse(prompt.tokens, prompt.pad,
                                      self.cache.request(prompt.tokens[:-1], load_back=False)))
            for use in uses:                            # and lands before any prompt matches
                if use.cached.prefetch is not None:
                    use.cached.prefetch.settle()
            for use in uses:
                use.cached.open()
            request = Request(self, uses, overlap)
        except BaseException:
            for use in uses:
                use.cached.close()
            raise
        self.turns.extend(request.turns)
        return request

    def generate(self, input_ids: Any, *, overlap: bool = True, **kwargs: Any) -> Any:
        """``model.generate`` with each prompt's cached prefix served by kvtier and its new whole pages inserted
        afterwards (only the prompt's when it comes back as several sequences: beams, samples). ``input_ids``:
        ``[rows, tokens]``, left-padded under ``attention_mask`` when the prompts differ in length; each row is its
        own request to the cache. ``kwargs`` go to ``model.generate``; every one is checked before any cache work,
        and those a pre-filled cache cannot serve exactly are refused: another cache, a mask other than left
        padding, ``use_cache=False``, assisted / prompt-lookup decoding, chunked prefill."""
        import torch

        prompts, rows = checked_generate(self.model, input_ids, kwargs)
        with self._request(prompts, overlap) as request:
            if rows > 1:                                # generate widens the prompts, not a cache it is given
                request.cache.batch_repeat_interleave(rows)
            with torch.no_grad():
                output = self.model.generate(input_ids, **{self.cache_keyword: request.cache}, **kwargs)
            request.finish(output)
        return output

    def _insert(self, sequence: np.ndarray, cached: CacheRequest, pad: int, past: KVTierCache, row: int) -> int:
        """Insert the whole pages of ``sequence`` past the prompt's cached prefix, whose KV is row ``row`` of
        ``past`` from position ``pad`` on. A write that raises leaves the pages to ``cached``, which gives them back
        when the request is released."""
        page = self.cache.page_size
        prefix = cached.prefix_pages
        stored = past.get_seq_length() - pad
        whole = min(stored, len(sequence)) // page
        whole = min(whole, self.cache.device.pages)        # a sequence longer than the pool keeps what fits
        if whole <= len(prefix):
            return 0
        past.settle()
        try:
            new = cached.allocate(whole - len(prefix))
        except OutOfPages:                                  # the output stands; this prompt is just not cached
            self.skipped_inserts += 1
            return 0
        start, end = pad + len(prefix) * page, pad + whole * page
        index = self.paged.index(new)
        for layer, states in enumerate(past.kvtier_layers):
            assert states.keys is not None and states.values is not None
            self.paged.write(layer, index, states.keys[row:row + 1, :, start:end],
                             states.values[row:row + 1, :, start:end])
        cached.insert(sequence[:whole * page])
        return (whole - len(prefix)) * page

    def close(self) -> None:
        """Close the cache, then what ``build`` made (idempotent)."""
        self.cache.close()
        for resource in reversed(self._owned):
            resource.close()
