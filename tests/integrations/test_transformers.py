"""transformers with kvtier behind it: greedy generation gives exactly the tokens of generation without it, over
several turns of several users, with device hits and host-tier load-backs on turns 2+ (a device pool too small for
every conversation)."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers.models import (  # noqa: E402
    GREEDY,
    emulated,
    forward,
    host_only,
    reference,
    run_prefill,
    tiny_llama,
)
from transformers import DynamicCache  # noqa: E402

from kvtier.integrations.transformers import KVTierGeneration  # noqa: E402


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


def test_a_sequence_longer_than_the_device_pool_still_returns_its_output():
    """Regression: the new pages did not fit and generate raised OutOfPages after generating."""
    model = tiny_llama()
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
    model = tiny_llama()
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
    model = tiny_llama()
    generation = KVTierGeneration.build(model, device_tokens=128, host_tokens=256, runtime="emulated:split")
    try:
        ids = torch.randint(0, 1000, (1, 50))
        full = DynamicCache(config=model.config)
        forward(generation, ids, full)
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


# Regressions from an adversarial review: each failed before its fix.
@pytest.mark.parametrize("seed", [15, 37])
def test_beam_search_caches_only_the_prompt_so_the_next_turn_is_right(seed):
    """Beam 0 of the final cache is not the returned hypothesis when a finished beam wins: its KV was inserted under
    the returned tokens, and the next turn was served another beam's KV."""
    model = tiny_llama()
    torch.manual_seed(seed)
    prompt = torch.randint(0, 1000, (1, 16))
    beams = reference(model, prompt, max_new_tokens=40, num_beams=4, num_return_sequences=4, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    beam = dict(max_new_tokens=40, num_beams=4, do_sample=False, eos_token_id=int(beams[1, 36]), pad_token_id=0)
    with contextlib.closing(emulated(model)) as generation:
        output = generation.generate(prompt, **beam)
        assert torch.equal(output, reference(model, prompt, **beam))
        follow_up = torch.cat([output, torch.randint(0, 1000, (1, 1))], dim=1)
        assert torch.equal(generation.generate(follow_up, **GREEDY), reference(model, follow_up, **GREEDY))
        generation.cache.check()


def test_generate_returns_dicts_and_several_sequences_and_caches_the_prompt():
    """return_dict_in_generate=True and num_return_sequences=2 generated, then raised from finish (output lost)."""
    model = tiny_llama()
    ids = torch.randint(0, 1000, (1, 40))
    with contextlib.closing(emulated(model)) as generation:
        output = generation.generate(ids, return_dict_in_generate=True, output_scores=True, **GREEDY)
        assert torch.equal(output.sequences, reference(model, ids, **GREEDY))
        torch.manual_seed(5)
        several = generation.generate(ids, max_new_tokens=4, do_sample=True, num_return_sequences=2)
        torch.manual_seed(5)
        assert torch.equal(several, reference(model, ids, max_new_tokens=4, do_sample=True, num_return_sequences=2))
        longer = torch.cat([ids, torch.randint(0, 1000, (1, 30))], dim=1)
        assert torch.equal(generation.generate(longer, **GREEDY), reference(model, longer, **GREEDY))
        generation.cache.check()


def test_two_models_of_one_name_with_other_weights_never_share_stored_pages(tmp_path):
    """The namespace was the config's name or model type only: a second Llama with other weights was served the
    first one's stored KV."""
    first, second = tiny_llama(), tiny_llama()
    torch.manual_seed(999)
    for parameter in second.parameters():
        parameter.data.normal_(0, 0.02)
    ids = torch.randint(0, 1000, (1, 70))
    generation = emulated(first, storage=f"file:{tmp_path}")
    generation.generate(ids, **GREEDY)
    generation.cache.drain()
    generation.close()
    for model, hits in ((second, 0), (first, 64)):
        generation = emulated(model, storage=f"file:{tmp_path}")
        try:
            assert torch.equal(generation.generate(ids, **GREEDY), reference(model, ids, **GREEDY))
            assert generation.turns[-1].host_tokens == hits
        finally:
            generation.close()


def test_finish_refuses_what_the_cache_does_not_hold_and_inserts_nothing():
    """finish(other tokens) and a forward of the whole prompt on a hit inserted KV under the wrong tokens."""
    from kvtier.errors import InvalidArgument

    model = tiny_llama()
    a, b = torch.randint(0, 1000, (1, 40)), torch.randint(0, 1000, (1, 40))
    with contextlib.closing(emulated(model)) as generation:
        with generation.request(a) as request:
            forward(generation, a, request.cache)
            with pytest.raises(InvalidArgument, match="does not extend"):
                request.finish(b)
        longer = torch.cat([a, b], dim=1)
        with generation.request(longer) as request:
            assert request.cached_tokens == 0
        run_prefill(generation, a)
        with generation.request(longer) as request:
            forward(generation, longer, request.cache)     # forgot [:, request.cached_tokens:]
            with pytest.raises(InvalidArgument, match="holds 112 tokens"):
                request.finish()
        for ids in (b, longer):
            assert torch.equal(generation.generate(ids, **GREEDY), reference(model, ids, **GREEDY))
        generation.cache.check()


def test_a_batch_on_an_unread_cache_is_refused_and_an_expanded_one_is_right():
    """A batch-2 forward on a request's cache copied only row 0's new K/V (silently wrong logits)."""
    from kvtier.errors import InvalidArgument

    model = tiny_llama()
    prompt, suffix = torch.randint(0, 1000, (1, 40)), torch.randint(0, 1000, (2, 5))
    with contextlib.closing(emulated(model)) as generation:
        run_prefill(generation, prompt)
        ids = torch.cat([prompt[:, 32:].repeat(2, 1), suffix], dim=1)
        with generation.request(torch.cat([prompt, suffix[:1]], dim=1)) as request, torch.no_grad():
            with pytest.raises(InvalidArgument, match="holds 1 row but the forward has 2"):
                forward(generation, ids, request.cache)
        with generation.request(torch.cat([prompt, suffix[:1]], dim=1)) as request, torch.no_grad():
            request.cache.batch_repeat_interleave(2)
            logits = forward(generation, ids, request.cache).logits[:, -1]
            expected = model(torch.cat([prompt.repeat(2, 1), suffix], dim=1)).logits[:, -1]
        assert (logits - expected).abs().max() < 1e-4


def test_models_whose_kv_cannot_be_paged_are_refused_at_build():
    """Falcon multi-query (1 KV head under another name) was read as 4 heads and DeepSeek-V3 MLA as 16-wide heads:
    build accepted them and generate failed after the work."""
    from kvtier.errors import InvalidArgument

    torch.manual_seed(1)
    falcon = transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, multi_query=True)).eval()
    generation = emulated(falcon)                               # MQA: one KV head, paged
    try:
        ids = torch.randint(0, 1000, (1, 45))
        for _ in range(2):
            assert torch.equal(generation.generate(ids, max_new_tokens=4, do_sample=False),
                               reference(falcon, ids, max_new_tokens=4, do_sample=False))
        assert generation.turns[-1].device_tokens == 32
    finally:
        generation.close()
    mla = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=24, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64)).eval()
    with pytest.raises(InvalidArgument, match="latent attention"):
        emulated(mla)


def test_a_failed_insert_gives_its_pages_back():
    """A write that raised (a CUDA out-of-memory in index_copy_) left the pages held by the caller for good."""
    model = tiny_llama()
    with contextlib.closing(emulated(model, device_tokens=128)) as generation:
        free = generation.cache.stats()["device_free_pages"]
        write = generation.paged.write
        generation.paged.write = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of memory (simulated)"))
        with pytest.raises(RuntimeError, match="simulated"):
            generation.generate(torch.randint(0, 1000, (1, 70)), max_new_tokens=1)
        generation.paged.write = write
        generation.cache.check()
        assert generation.cache.stats()["device_free_pages"] == free


def test_a_storage_backend_opened_for_namespace_of_the_model_is_taken(tmp_path):
    from kvtier.errors import InvalidArgument
    from kvtier.integrations.transformers import namespace_of
    from kvtier.storage import open_store

    model = tiny_llama()
    ids = torch.randint(0, 1000, (1, 50))
    with contextlib.closing(open_store(f"file:{tmp_path}", namespace_of(model, 16), layout="layer_first")) as store:
        with contextlib.closing(emulated(model, storage=store)) as generation:
            generation.generate(ids, **GREEDY)
            generation.cache.drain()
    with contextlib.closing(emulated(model, storage=f"file:{tmp_path}")) as generation:
        assert torch.equal(generation.generate(ids, **GREEDY), reference(model, ids, **GREEDY))
        assert generation.turns[-1].host_tokens == 48                 # what the first one stored
    other = namespace_of(model, 16, "other")
    with contextlib.closing(open_store(f"file:{tmp_path}", other, layout="layer_first")) as store:
        with pytest.raises(InvalidArgument, match="namespace"):
            emulated(model, storage=store)


def test_stored_pages_of_another_host_layout_are_never_served(tmp_path):
    """A page_first generation's stored pages were loaded by a layer_first one over the same store: the bytes come in
    another order, and the output differed from the model's own."""
    from kvtier.errors import InvalidArgument
    from kvtier.integrations.transformers import namespace_of
    from kvtier.storage import open_store

    model = tiny_llama()
    ids = torch.randint(0, 1000, (1, 70))
    with contextlib.closing(emulated(model, storage=f"file:{tmp_path}", host_layout="page_first")) as generation:
        generation.generate(ids, **GREEDY)
        generation.cache.drain()
    for layout, hits in (("layer_first", 0), ("page_first", 64)):
        with contextlib.closing(emulated(model, storage=f"file:{tmp_path}", host_layout=layout)) as generation:
            assert torch.equal(generation.generate(ids, **GREEDY), reference(model, ids, **GREEDY))
            assert generation.turns[-1].host_tokens == hits
    with contextlib.closing(open_store(f"file:{tmp_path}", namespace_of(model, 16))) as store:   # page_first
        with pytest.raises(InvalidArgument, match="layout='layer_first'"):
            emulated(model, storage=store)
