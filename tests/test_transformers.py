"""transformers with kvtier behind it: greedy generation gives exactly the tokens of generation without it, over
several turns of several users, with device hits and host-tier load-backs on turns 2+ (a device pool too small for
every conversation)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

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
