"""What ``KVTierGeneration.generate`` and ``request`` accept, checked before any cache work: a refused call leaves no
match, lock or load-back behind, and the model has not run.

Prompts are token ids ``[rows, tokens]``, optionally left-padded under an attention mask: each row's prompt is its
tokens after the padding (generate numbers positions from the mask, so their KV is the prompt's own). ``generate``
arguments go through transformers' own preparation and validation (the ones ``generate`` runs first), then kvtier
refuses what a pre-filled cache cannot serve exactly.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import InvalidArgument

CACHE_ARGUMENTS = ("past_key_values", "cache", "cache_params")
"""The keywords transformers takes a cache by (``cache`` since it renamed ``past_key_values``): kvtier passes its
own."""

INPUT_ARGUMENTS = ("inputs", "input_ids", "inputs_embeds")

UNSERVED_GENERATE = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
"""generate arguments whose decoding loop re-runs positions a pre-filled cache already holds (transformers gives
other tokens with a pre-filled ``DynamicCache`` too)."""

SERVED_MODES = ("greedy_search", "sample", "beam_search", "beam_sample")


@dataclass(frozen=True)
class Prompt:
    """One row of ``input_ids``: its tokens after the left padding, and the padding's length."""

    tokens: np.ndarray
    pad: int


def cache_keyword(model: Any) -> str:
    """The keyword the model's forward (and so ``generate``) takes its cache by: ``cache`` where transformers renamed
    ``past_key_values`` (which then warns that it is deprecated), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prompts_of(model: Any, input_ids: Any, attention_mask: Any = None) -> list[Prompt]:
    """The prompts of ``input_ids`` (``[rows, tokens]`` integer ids on the model's device, within its vocabulary),
    under a left-padding ``attention_mask`` of the same shape (or none)."""
    import torch

    if not isinstance(input_ids, torch.Tensor):
        raise InvalidArgument(f"input_ids must be a torch tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise InvalidArgument(f"input_ids have dtype {input_ids.dtype}: token ids are integers (torch.long)")
    if input_ids.dim() != 2 or input_ids.shape[0] < 1:
        raise InvalidArgument(f"input_ids have shape {tuple(input_ids.shape)}: expected [rows, tokens] with a row or "
                              "more")
    if input_ids.shape[1] < 1:
        raise InvalidArgument("the prompt is empty (input_ids have no tokens)")
    embeddings = model.get_input_embeddings()
    device = embeddings.weight.device
    if not _same_device(input_ids.device, device):
        raise InvalidArgument(f"input_ids are on device {input_ids.device} but the model's embeddings on {device}")
    ids = input_ids.detach().cpu().numpy().astype(np.int64)
    vocabulary = int(embeddings.num_embeddings)
    if ids.min() < 0 or ids.max() >= vocabulary:
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise InvalidArgument(f"input_ids hold token id {bad}, outside the model's vocabulary [0, {vocabulary})")
    pads = _left_padding(attention_mask, input_ids) if attention_mask is not None else [0] * len(ids)
    return [Prompt(row[pad:], pad) for row, pad in zip(ids, pads, strict=True)]


def _same_device(a: Any, b: Any) -> bool:
    """One device, where ``cuda`` (no index) is the same as any ``cuda:N``."""
    return bool(a.type == b.type and (a.index is None or b.index is None or a.index == b.index))


def _left_padding(mask: Any, input_ids: Any) -> list[int]:
    import torch

    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(input_ids.shape):
        raise InvalidArgument(f"attention_mask must be a tensor shaped like input_ids {tuple(input_ids.shape)}, got "
                              f"{tuple(getattr(mask, 'shape', ())) or type(mask).__name__}")
    if mask.device != input_ids.device:
        raise InvalidArgument(f"attention_mask is on {mask.device} but input_ids on {input_ids.device}")
    values = mask.detach().cpu().numpy()
    if not np.isin(values, (0, 1)).all():
        raise InvalidArgument("attention_mask holds values other than 0 and 1")
    pads = []
    for row, keep in enumerate(values.astype(np.int8)):
        pad = int(len(keep) - keep.sum())
        if pad == len(keep) or keep[:pad].any():
            raise InvalidArgument(f"attention_mask row {row} is not left padding (zeros, then at least one 1): kvtier "
                                  "lays a row out as its padding, then its prompt (decoder-only generate wants left "
                                  "padding too)")
        pads.append(pad)
    return pads


def checked_generate(model: Any, input_ids: Any, kwargs: dict[str, Any]) -> tuple[list[Prompt], int]:
    """Refuse what kvtier's ``generate`` cannot serve exactly, as transformers' ``generate`` would refuse it or with
    kvtier's reason; return the prompts and the cache rows each one is widened to (beams or samples)."""
    for name in CACHE_ARGUMENTS:
        if name in kwargs:
            raise InvalidArgument(f"generate({name}=...): kvtier gives the model its own cache (a KVTierCache over the "
                                  "cached prefix); call model.generate directly to use another")
    for name in INPUT_ARGUMENTS:
        if name in kwargs:
            raise InvalidArgument(f"generate({name}=...): kvtier keys KV by token ids; pass them once, as input_ids")
    prompts = prompts_of(model, input_ids, kwargs.get("attention_mask"))
    config = _generation_config(model, kwargs)
    for name in UNSERVED_GENERATE:
        if kwargs.get(name) is not None or getattr(config, name, None) is not None:
            raise InvalidArgument(f"generate({name}=...): assisted and prompt-lookup decoding do not give the model's "
                                  "own tokens with a pre-filled cache; call model.generate without kvtier for it")
    if config.use_cache is False:
        raise InvalidArgument("generate(use_cache=False) computes without a cache; call model.generate directly")
    mode = str(getattr(config.get_generation_mode(), "value", config.get_generation_mode()))
    if mode not in SERVED_MODES:
        raise InvalidArgument(f"generate: {mode} decoding is not served with a pre-filled cache (greedy, sampling "
                              "and beam search are)")
    for name in ("cache_implementation", "prefill_chunk_size"):
        if getattr(config, name, None) is not None:
            raise InvalidArgument(f"generate({name}={getattr(config, name)!r}) (set here or in the model's "
                                  f"generation config): transformers would make or fill its own cache; pass "
                                  f"{name}=None")
    if config.max_new_tokens is None and input_ids.shape[1] >= config.max_length:
        raise InvalidArgument(f"generate: the prompt has {input_ids.shape[1]} tokens but max_length is "
                              f"{config.max_length}; set max_new_tokens (or a larger max_length)")
    return prompts, max(int(config.num_beams or 1), int(config.num_return_sequences or 1))


def _generation_config(model: Any, kwargs: dict[str, Any]) -> Any:
    """The generation config ``model.generate(**kwargs)`` would run with, after the checks it makes before any
    work (unknown or misspelt arguments, contradictory settings); their ValueError becomes InvalidArgument."""
    own = set(inspect.signature(type(model).generate).parameters) - {"self", "kwargs"}
    named = {name: kwargs[name] for name in own if name in kwargs}
    if named.get("custom_generate") is not None:
        raise InvalidArgument("generate(custom_generate=...): kvtier cannot tell what a custom decoding loop does "
                              "with a pre-filled cache; call model.generate directly")
    rest = {name: value for name, value in kwargs.items() if name not in own and name != "trust_remote_code"}
    try:
        mode_kwargs = model._extract_generation_mode_kwargs(None, rest, named.get("synced_gpus"),
                                                            named.get("assistant_model"), named.get("streamer"))
        config, model_kwargs = model._prepare_generation_config(named.get("generation_config"), **rest)
        model._validate_model_kwargs(model_kwargs.copy())
        model._validate_generation_mode(config.get_generation_mode(named.get("assistant_model")), config,
                                        mode_kwargs)
    except (ValueError, TypeError) as error:
        raise InvalidArgument(f"generate: {error}") from error
    return config
