"""A tiny Llama, transformers' own ``generate`` as the reference, and kvtier generations over it on the emulated
runtime: what every transformers integration test builds on. Import after ``pytest.importorskip("transformers")``."""

from __future__ import annotations

import torch
import transformers

from kvtier.integrations.transformers import KVTierGeneration

GREEDY = dict(max_new_tokens=8, do_sample=False)


def tiny_llama(device: str = "cpu"):
    torch.manual_seed(1234)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(config).eval().to(device)


def reference(model, ids, **kwargs):
    """The model's own ``generate``, no kvtier."""
    with torch.no_grad():
        return model.generate(ids, **kwargs)


def emulated(model, **kwargs) -> KVTierGeneration:
    kwargs.setdefault("device_tokens", 512)
    kwargs.setdefault("host_tokens", 2048)
    kwargs.setdefault("runtime", "emulated:split")
    return KVTierGeneration.build(model, **kwargs)


def forward(generation: KVTierGeneration, ids, cache):
    """The model's forward of ``ids`` on ``cache``, passed under the keyword this transformers takes."""
    with torch.no_grad():
        return generation.model(ids, **{generation.cache_keyword: cache})


def run_prefill(generation: KVTierGeneration, ids, *, overlap=True, keep=True):
    """One request through a forward of the uncached tokens: (last-token logits, the turn, tokens inserted);
    ``keep=False`` releases the request without inserting."""
    with generation.request(ids, overlap=overlap) as request:
        assert request.cache.get_seq_length() == request.cached_tokens      # known before any byte is read
        logits = forward(generation, ids[:, request.cached_tokens:], request.cache).logits[0, -1]
        inserted = request.finish() if keep else 0
    return logits.float(), request.turn, inserted


def host_only(generation: KVTierGeneration) -> None:
    """Drop every device copy the host tier also has (after the backups land), so the next match is a host hit."""
    generation.cache.drain()
    generation.cache.evict(device_pages=generation.cache.device.pages)


def held_locks(generation: KVTierGeneration) -> int:
    """Locks held on the cache's nodes (requests not finished or released)."""
    return sum(node.lock for node in generation.cache.index.all_nodes())


def left_padded(rows, pad: int = 0):
    """``rows`` (``[1, n]`` each) as one left-padded batch: (input_ids, attention_mask), on the rows' device."""
    width = max(row.shape[1] for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long, device=rows[0].device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=rows[0].device)
    for i, row in enumerate(rows):
        ids[i, width - row.shape[1]:] = row[0]
        mask[i, width - row.shape[1]:] = 1
    return ids, mask
