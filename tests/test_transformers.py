"""transformers with kvtier behind it: greedy generation gives exactly the tokens of generation without it, over
several turns of several users, with device hits and host-tier load-backs on turns 2+ (a device pool too small for
every conversation)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvtier.integrations.transformers import KVTierGeneration  # noqa: E402


def tiny_llama(device: str):
    torch.manual_seed(1234)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(config).eval().to(device)


def test_greedy_tokens_are_the_models_own_and_later_turns_hit(runtime):
    device = "cuda" if runtime.name == "cuda" else "cpu"
    model = tiny_llama(device)
    generation = KVTierGeneration.build(model, device_tokens=320, host_tokens=4096, page_size=16, runtime=runtime)
    try:
        histories = [torch.randint(0, 1000, (1, 90 + 7 * user), device=device) for user in range(3)]
        for turn in range(3):
            for user, history in enumerate(histories):
                with torch.no_grad():
                    expected = model.generate(history, max_new_tokens=8, do_sample=False)
                output = generation.generate(history, max_new_tokens=8, do_sample=False)
                assert torch.equal(output, expected), f"turn {turn}, user {user}: tokens differ"
                histories[user] = torch.cat([output, torch.randint(0, 1000, (1, 24), device=device)], dim=1)
        later = generation.turns[3:]
        assert all(t.device_tokens + t.host_tokens > 0 for t in later), generation.turns
        assert sum(t.host_tokens for t in later) > 0, "the device pool is too small for three users: host hits"
        generation.cache.check()
    finally:
        generation.close()


def test_one_sequence_at_a_time():
    model = tiny_llama("cpu")
    generation = KVTierGeneration.build(model, device_tokens=64, host_tokens=128, runtime="emulated:split")
    try:
        from kvtier.errors import InvalidArgument

        with pytest.raises(InvalidArgument, match="one sequence"):
            generation.generate(torch.zeros((2, 8), dtype=torch.long))
    finally:
        generation.close()


def test_a_sequence_longer_than_the_device_pool_still_returns_its_output():
    """Regression: the new pages did not fit and generate raised OutOfPages after generating."""
    model = tiny_llama("cpu")
    generation = KVTierGeneration.build(model, device_tokens=64, host_tokens=256, runtime="emulated:split")
    try:
        for length in (1, 15, 16, 33, 200, 200):
            ids = torch.randint(0, 1000, (1, length))
            with torch.no_grad():
                expected = model.generate(ids, max_new_tokens=5, do_sample=False)
            assert torch.equal(generation.generate(ids, max_new_tokens=5, do_sample=False), expected)
        generation.cache.check()
    finally:
        generation.close()


def run_prefill(generation, ids, *, overlap=True, keep=True):
    """One request through a forward of the uncached tokens: (last-token logits, the turn, tokens inserted);
    ``keep=False`` releases the request without inserting."""
    with generation.request(ids, overlap=overlap) as request:
        assert request.cache.get_seq_length() == request.cached_tokens      # known before any byte is read
        with torch.no_grad():
            logits = generation.model(ids[:, request.cached_tokens:], past_key_values=request.cache).logits[0, -1]
        inserted = request.finish() if keep else 0
    return logits.float(), request.turn, inserted


def host_only(generation):
    """Drop every device copy the host tier also has (after the backups land), so the next match is a host hit."""
    generation.cache.drain()
    generation.cache.evict(device_pages=generation.cache.device.pages)


@pytest.mark.parametrize("overlap", [True, False])
def test_logits_of_a_host_hit_equal_those_of_a_device_hit(runtime, overlap):
    device = "cuda" if runtime.name == "cuda" else "cpu"
    model = tiny_llama(device)
    generation = KVTierGeneration.build(model, device_tokens=512, host_tokens=1024, runtime=runtime)
    try:
        prompt = torch.randint(0, 1000, (1, 200), device=device)
        ids = torch.cat([prompt, torch.randint(0, 1000, (1, 37), device=device)], dim=1)
        first, turn, inserted = run_prefill(generation, prompt)
        assert turn.computed_tokens == 200 and inserted == 192
        on_device, turn, _ = run_prefill(generation, ids, keep=False)
        assert (turn.device_tokens, turn.host_tokens) == (192, 0)
        host_only(generation)
        from_host, turn, _ = run_prefill(generation, ids, overlap=overlap)
        assert (turn.device_tokens, turn.host_tokens) == (0, 192)
        assert torch.equal(from_host, on_device), "the same KV bytes must give the same logits"
        with torch.no_grad():
            recomputed = model(ids).logits[0, -1].float()
        assert (recomputed - from_host).abs().max() < 1e-3
        assert set(recomputed.topk(5).indices.tolist()) == set(from_host.topk(5).indices.tolist())
        generation.cache.check()
    finally:
        generation.close()


def test_a_released_request_inserts_nothing_and_unlocks():
    model = tiny_llama("cpu")
    generation = KVTierGeneration.build(model, device_tokens=128, host_tokens=256, runtime="emulated:split")
    try:
        ids = torch.randint(0, 1000, (1, 70))
        with generation.request(ids) as request:
            assert request.cached_tokens == 0
        request.release()                                   # idempotent
        assert generation.request(ids).finish() == 0        # no forward ran: the cache holds no KV to insert
        _, turn, inserted = run_prefill(generation, ids)
        assert turn.computed_tokens == 70
        assert inserted == 64                               # nothing was cached by the released ones
        _, turn, inserted = run_prefill(generation, ids)
        assert turn.device_tokens == 64 and inserted == 0
        generation.cache.evict(device_pages=8)              # nothing is left locked
        generation.cache.check()
    finally:
        generation.close()


def test_pending_layers_read_their_pages_when_anything_needs_the_tensors():
    model = tiny_llama("cpu")
    generation = KVTierGeneration.build(model, device_tokens=128, host_tokens=256, runtime="emulated:split")
    try:
        ids = torch.randint(0, 1000, (1, 50))
        with torch.no_grad():
            full = DynamicCache(config=model.config)
            model(ids, past_key_values=full)
        run_prefill(generation, ids)
        request = generation.request(ids)
        layer = request.cache.layers[1]
        assert layer.pending and layer.get_seq_length() == 48
        request.cache.crop(-8)                              # a crop reads the pages first, then drops 8 tokens
        assert not layer.pending and layer.keys.shape == (1, 2, 40, 32)
        assert torch.equal(layer.keys, full.layers[1].keys[:, :, :40])
        assert torch.equal(request.cache.layers[0].values, full.layers[0].values[:, :, :40])
        request.release()
    finally:
        generation.close()


def test_sliding_window_models_are_refused_by_name():
    from kvtier.errors import InvalidArgument
    from kvtier.integrations.transformers import geometry_of

    config = transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=64,
                                      max_window_layers=1, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2)
    assert "sliding_attention" in config.layer_types
    with pytest.raises(InvalidArgument, match="full-attention layers only"):
        geometry_of(config, 16, torch.bfloat16)


@pytest.mark.gpu
def test_a_larger_bf16_model_on_the_gpu(cuda, capsys):
    """8 layers of a Llama-3-like shape in bf16: a host-tier hit gives bitwise the logits of a device hit; against
    recompute (other kernels for other shapes, bf16) the difference is reported and the top tokens agree."""
    torch.manual_seed(99)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                                      num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                      max_position_embeddings=16384)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    generation = KVTierGeneration.build(model, device_tokens=8192, host_tokens=8192, runtime=cuda)
    try:
        prompt = torch.randint(0, 32000, (1, 3000), device="cuda")
        ids = torch.cat([prompt, torch.randint(0, 32000, (1, 100), device="cuda")], dim=1)
        run_prefill(generation, prompt)
        on_device, turn, _ = run_prefill(generation, ids, keep=False)
        assert turn.device_tokens == 2992
        for overlap in (True, False):
            host_only(generation)
            from_host, turn, _ = run_prefill(generation, ids, overlap=overlap, keep=False)
            assert turn.host_tokens == 2992
            assert torch.equal(from_host, on_device), f"overlap={overlap}: the same KV bytes, other logits"
        with torch.no_grad():
            recomputed = model(ids).logits[0, -1].float()
        top = set(recomputed.topk(5).indices.tolist()) & set(from_host.topk(5).indices.tolist())
        with capsys.disabled():
            print(f"\nbf16 8-layer model, 2,992 cached tokens: max |logit diff| vs recompute "
                  f"{(recomputed - from_host).abs().max():.4g}, top-5 agreement {len(top)}/5")
        assert int(recomputed.argmax()) in from_host.topk(5).indices.tolist()
        generation.cache.check()
    finally:
        generation.close()
