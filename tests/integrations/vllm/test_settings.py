"""The connector's options and the deployments it refuses: a clear error naming the problem, when vLLM builds it."""

from __future__ import annotations

import pytest
from helpers import vllm_engine as ve

from kvtier.errors import InvalidArgument
from kvtier.integrations.vllm.host_index import READY, WRITING, HostIndex
from kvtier.integrations.vllm.settings import ConnectorSettings


@pytest.mark.parametrize(("extra", "named"), [
    ({"host_gbs": 4}, "host_gbs"),
    ({"host_gb": 0}, "host_gb"),
    ({"host_gb": 1, "host_tokens": 16}, "not both"),
    ({"host_tokens": 1.5}, "host_tokens"),
    ({"write_policy": "sometimes"}, "write policy"),
    ({"write_policy": "write_through_selective"}, "write_through_selective"),
    ({"io_backend": "warp"}, "io_backend"),
    ({"prefetch_policy": "best_effort"}, "prefetch_policy"),
    ({"host_layout": "page_first"}, "host_layout"),
    ({"store": ""}, "store"),
    ({"store_options": ["ttl"]}, "store_options"),
    ({"prefill_tokens_per_s": -1}, "prefill_tokens_per_s"),
])
def test_a_bad_option_is_refused_by_name(extra, named) -> None:
    with pytest.raises(InvalidArgument, match=named):
        ConnectorSettings.from_extra_config(extra)


def test_the_defaults_serve_without_options() -> None:
    settings = ConnectorSettings.from_extra_config({})
    assert settings.store is None and settings.host_gb == 4.0
    assert settings.host_pages(1 << 20, 16) == 3814


def test_vllm_refuses_to_build_it_with_a_bad_option(tmp_path, vllm) -> None:
    with pytest.raises(InvalidArgument, match="host_gbs"):
        ve.VllmHarness(ve.vllm_config(ve.model_dir(tmp_path), {"host_gbs": 4}))


def test_a_model_with_a_sliding_window_group_is_refused(tmp_path, vllm) -> None:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from kvtier.integrations.vllm import KVTierConnector

    config = ve.vllm_config(ve.model_dir(tmp_path), {})
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128)
    groups = [KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["b"], window)]
    with pytest.raises(InvalidArgument, match="2 groups"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER, KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                                                         kv_cache_groups=groups))


def test_the_host_index_never_evicts_a_pinned_page_or_a_chains_middle() -> None:
    index = HostIndex(4)
    keys = [bytes([i]) * 32 for i in range(6)]
    first = index.reserve(keys[:3], None, WRITING)
    assert first is not None and index.match(keys) == 0      # writing: not a hit yet
    index.commit(keys[:3])
    assert index.match(keys) == 3
    index.pin(keys[:1])
    assert index.reserve(keys[3:5], None, WRITING) is not None    # evicts the chain's leaf (keys[2]), not its middle
    index.check()
    assert index.match(keys) == 2 and index.entries[keys[0]].state == READY
    assert index.reserve(keys[5:6], None, WRITING) is not None   # then keys[1], a leaf now
    assert index.match(keys) == 1
    assert index.reserve([b"x" * 32], None, WRITING) is None     # every page pinned or writing
    index.check()


def test_each_rank_stores_its_shard_under_its_own_keys_and_mla_once() -> None:
    from kvtier.integrations.vllm.settings import Deployment, rank_keys
    from kvtier.pools import KVGeometry

    geometry = KVGeometry("k_only", 4, 16, 512, 1)
    rank0 = Deployment("m", geometry, "bfloat16", "LBNHC", 0, 2, False)
    rank1 = rank0.on_rank(1)
    keys = [bytes([i]) * 32 for i in range(3)]
    assert rank_keys(keys, rank0.namespace(), rank0.namespace()) == keys
    other = rank_keys(keys, rank0.namespace(), rank1.namespace())
    assert len(set(other) | set(keys)) == 6 and rank1.writer
    mla = Deployment("m", KVGeometry("mla", 4, 16, 1152, 1), "bfloat16", "LBNHC", 1, 2, True)
    assert mla.namespace() == mla.on_rank(0).namespace() and not mla.writer and mla.on_rank(0).writer
    assert rank0.namespace("lora-a") != rank0.namespace("lora-b") != rank0.namespace(None, "salt")


def test_a_store_in_use_is_never_closed_to_make_room_for_another(tmp_path) -> None:
    from kvtier.integrations.vllm.settings import Deployment
    from kvtier.integrations.vllm.stores import OPEN_STORES, OpenStores
    from kvtier.pools import KVGeometry

    deployment = Deployment("m", KVGeometry("k_only", 4, 16, 512, 1), "bfloat16", "LBNHC", 0, 1, False)
    stores = OpenStores(f"file:{tmp_path}", {}, "layer_first")
    try:
        with stores.lease(deployment.namespace(None, "held")) as (held, _):
            for salt in range(OPEN_STORES + 3):
                with stores.lease(deployment.namespace(None, str(salt))):
                    pass
            assert not held.closed
            assert len(stores._open) == OPEN_STORES          # the idle ones went, the held one stayed
        with stores.lease(deployment.namespace(None, "one more")):
            pass
        assert held.closed and len(stores._open) == OPEN_STORES
    finally:
        stores.close()


def test_a_save_larger_than_the_free_host_pages_keeps_what_fits() -> None:
    from types import SimpleNamespace

    from kvtier.integrations.vllm.scheduler import SchedulerSide
    from kvtier.integrations.vllm.settings import Deployment
    from kvtier.pools import KVGeometry

    ve.need_vllm()
    side = SchedulerSide(ConnectorSettings(host_tokens=16 * 4), Deployment("m", KVGeometry("k_only", 4, 16, 512, 1),
                                                                            "bfloat16", "LBNHC", 0, 1, False), 1)
    request = SimpleNamespace(request_id="r", all_token_ids=list(range(100, 196)), num_tokens=96, lora_request=None,
                              cache_salt=None, prompt_embeds=None, mm_features=None)
    tracked = side.track(request)
    tracked.blocks = list(range(6))
    side._save(tracked, 96)
    assert len(side._saves[0].pages) == 4 and side.counters.save_skipped_pages == 2
