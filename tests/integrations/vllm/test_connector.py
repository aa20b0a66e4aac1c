"""kvtier's connector inside vLLM's real scheduler: prefixes saved to the host tier or to storage come back into new
blocks, byte for byte (the model stand-in checks every computed block), once vLLM's own prefix cache has dropped them;
namespaces keep salts, adapters and models apart; failed loads are recomputed; aborted loads leave nothing pinned."""

from __future__ import annotations

import os

import pytest
from helpers import vllm_engine as ve


def test_the_factory_builds_the_connector_from_its_module_path(engines) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvtier.integrations.vllm import KVTierConnector

    engine = engines()
    assert KVConnectorFactory.get_connector_class(engine.config.kv_transfer_config) is KVTierConnector
    assert isinstance(engine.connector, KVTierConnector) and isinstance(engine.worker, KVTierConnector)


def test_a_prefix_saved_to_host_is_loaded_layer_by_layer_into_new_blocks(engines) -> None:
    engine = engines()
    engine.add(ve.request(ve.tokens_of(1, 200)))
    engine.run()
    assert engine.connector.scheduler.index.entries, "the first request's blocks were not saved"
    assert engine.scheduler.reset_prefix_cache()
    second = engine.add(ve.request(ve.tokens_of(1, 200)[:160] + ve.tokens_of(2, 60)))
    engine.run()
    (load,) = engine.loads(second)
    assert len(load.blocks) == 10 and load.host == 10 and not load.asynchronous
    assert engine.checked_blocks > 0
    engine.assert_settled()


def test_a_prompt_that_shares_no_whole_block_loads_nothing(engines) -> None:
    engine = engines()
    engine.add(ve.request(ve.tokens_of(1, 100)))
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    other = engine.add(ve.request(ve.tokens_of(1, 100)[:15] + ve.tokens_of(3, 85)))
    engine.run()
    assert not engine.loads(other)


def test_vllms_own_prefix_cache_hit_is_not_loaded_again(engines) -> None:
    engine = engines()
    engine.add(ve.request(ve.tokens_of(1, 160)))
    engine.run()
    again = engine.add(ve.request(ve.tokens_of(1, 160)))
    engine.run()
    assert not engine.loads(again)


@pytest.mark.parametrize("change", ["salt", "adapter", "model"])
def test_salts_adapters_and_models_never_share_pages(engines, tmp_path, change) -> None:
    store = f"file:{tmp_path / 'store'}"
    first = engines({"store": store})
    tokens = ve.tokens_of(4, 130)
    first.add(ve.request(tokens, salt="a", lora="x"))
    first.run()
    config = {"model": "another-model"} if change == "model" else {}
    second = engines({"store": store}, **config)
    salt, lora = ("b" if change == "salt" else "a"), ("y" if change == "adapter" else "x")
    req = second.add(ve.request(tokens, salt=salt, lora=lora))
    second.run()
    assert not second.loads(req)
    same = second.add(ve.request(tokens, salt="a", lora="x")) if change != "model" else None
    if same is not None:
        second.run()
        assert second.loads(same), "the same salt and adapter should have found the stored pages"


def test_a_prefix_in_storage_loads_asynchronously_into_another_instance(engines, written, tmp_path) -> None:
    store = f"file:{tmp_path / 'store'}"
    tokens = ve.tokens_of(5, 300)
    written(store, tokens)
    reader = engines({"store": store})
    req = reader.add(ve.request(tokens[:288] + ve.tokens_of(6, 40)))
    reader.run()
    (load,) = reader.loads(req)
    assert load.asynchronous and load.host == 0 and len(load.pages) == 18
    assert reader.checked_blocks >= 18 * 4
    reader.assert_settled()
    again = reader.add(ve.request(tokens[:288] + ve.tokens_of(7, 40)))   # now in this instance's host tier
    assert reader.scheduler.reset_prefix_cache()
    reader.run()
    (host,) = reader.loads(again)
    assert host.host == 18 and not host.asynchronous


def test_a_stored_page_that_fails_its_check_is_recomputed_not_used(engines, tmp_path) -> None:
    root = tmp_path / "store"
    writer = engines({"store": f"file:{root}"})
    tokens = ve.tokens_of(8, 200)
    writer.add(ve.request(tokens))
    writer.run()
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.stat().st_size > 4096)
    assert files
    for path in files:                       # flip a payload byte of every stored page
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    reader = engines({"store": f"file:{root}"})
    req = reader.add(ve.request(tokens[:192] + ve.tokens_of(9, 30)))
    reader.run()
    loads = reader.loads(req)
    assert loads and all(job.asynchronous for job in loads)
    assert reader.connector.scheduler.index.entries            # recomputed blocks were saved again
    assert len(reader.connector.scheduler.unreadable) == 1     # the first bad page, never offered again
    reader.assert_settled()


def test_a_request_aborted_mid_load_leaves_no_pin_behind(engines, written, tmp_path) -> None:
    from vllm.v1.request import RequestStatus

    store = f"file:{tmp_path / 'store'}"
    tokens = ve.tokens_of(10, 400)
    written(store, tokens)
    reader = engines({"store": store})
    req = reader.add(ve.request(tokens))
    reader.step()                                               # the load is queued and starts
    assert reader.loads(req)
    reader.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    reader.run()
    reader.assert_settled()


def test_write_back_saves_a_request_when_it_finishes(engines) -> None:
    engine = engines({"write_policy": "write_back"})
    req = engine.add(ve.request(ve.tokens_of(11, 120), max_tokens=3))
    engine.step()
    assert not engine.connector.scheduler.index.entries        # nothing saved while it runs
    engine.run()
    assert len(engine.connector.scheduler.index.entries) == (120 + 3 - 1) // 16
    assert engine.scheduler.reset_prefix_cache()
    again = engine.add(ve.request(ve.tokens_of(11, 120)))
    engine.run()
    assert engine.loads(again)
    del req


def test_a_full_host_pool_evicts_the_least_recent_prefix(engines) -> None:
    engine = engines({"host_tokens": 16 * 20})
    for seed in (12, 13, 14):
        engine.add(ve.request(ve.tokens_of(seed, 160)))
        engine.run()
    side = engine.connector.scheduler
    assert side.index.allocator.used_pages <= 20
    side.index.check()
    assert engine.scheduler.reset_prefix_cache()
    newest = engine.add(ve.request(ve.tokens_of(14, 160)))
    engine.run()
    assert engine.loads(newest)


@pytest.mark.skipif(os.cpu_count() is None, reason="never")
def test_many_requests_with_shared_prefixes_are_served_in_one_batch(engines) -> None:
    engine = engines(blocks=256, batched_tokens=256)
    system = ve.tokens_of(15, 64)
    for seed in range(6):
        engine.add(ve.request(ve.tokens_of(100 + seed, 150, system)))
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    for seed in range(6):
        engine.add(ve.request(ve.tokens_of(100 + seed, 150, system)[:144] + ve.tokens_of(200 + seed, 20)))
    engine.run()
    assert engine.checked_blocks > 0
    engine.assert_settled()


def test_an_mla_latent_cache_is_saved_and_loaded(engines) -> None:
    engine = engines(mla=True)
    assert engine.connector.scheduler.deployment.is_mla
    engine.add(ve.request(ve.tokens_of(16, 100)))
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    again = engine.add(ve.request(ve.tokens_of(16, 100)[:96] + ve.tokens_of(17, 10)))
    engine.run()
    (load,) = engine.loads(again)
    assert len(load.blocks) == 6
    engine.assert_settled()


def test_hits_reach_vllms_counters_split_by_tier(engines, written, tmp_path) -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    store = f"file:{tmp_path / 'store'}"
    tokens = ve.tokens_of(18, 200)
    writer = written(store, tokens)
    assert writer.connector_stats["saved_pages"] == 12 and writer.external_hits == 0
    reader = engines({"store": store})
    req = reader.add(ve.request(tokens))
    reader.step()
    assert reader.connector.get_external_cache_hit_sources(req, 192) == {CacheHitSource.DISK: 192}
    reader.run()
    assert reader.connector_stats["storage_hit_tokens"] == 192 and reader.connector_stats["host_hit_tokens"] == 0
    assert reader.connector_stats.get("loaded_pages") == 12 and reader.external_hits == 192, reader.connector_stats


def test_a_store_that_cannot_be_opened_is_a_miss_not_a_crash(engines, tmp_path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the store's directory should be")
    engine = engines({"store": f"file:{blocker}"})
    req = engine.add(ve.request(ve.tokens_of(19, 100)))
    engine.run()
    assert not engine.loads(req) and engine.connector_stats.get("store_errors", 0) >= 1
    assert engine.connector.scheduler.index.entries              # the host tier still serves


def test_the_timeout_prefetch_policy_recomputes_what_it_did_not_read_in_time(engines, written, tmp_path,
                                                                             monkeypatch) -> None:
    import kvtier.integrations.vllm.worker as worker_module

    store = f"file:{tmp_path / 'store'}"
    tokens = ve.tokens_of(20, 200)
    written(store, tokens)
    monkeypatch.setattr(worker_module, "READ_CHUNK_PAGES", 2)
    reader = engines({"store": store, "prefetch_policy": "timeout", "prefetch_timeout_s": 1e-9})
    req = reader.add(ve.request(tokens))
    reader.run()
    (load,) = reader.loads(req)
    assert load.asynchronous and reader.connector_stats.get("storage_read_pages") == 2
    assert reader.connector_stats.get("load_error_blocks") == len(load.blocks) - 2
    assert not reader.connector.scheduler.unreadable        # slow is not bad: the pages stay on offer
    reader.assert_settled()


def test_the_kv_a_step_computes_over_a_failed_load_is_never_kept(engines, monkeypatch) -> None:
    engine = engines()
    tokens = ve.tokens_of(21, 200)
    engine.add(ve.request(tokens))
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    worker = engine.worker.worker
    real, calls = worker.engine.load, []

    def failing_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("injected: the copy could not be queued")
        return real(*args, **kwargs)

    monkeypatch.setattr(worker.engine, "load", failing_once)
    reports, built = [], worker.worker_meta
    monkeypatch.setattr(worker, "worker_meta", lambda: reports.append(built()) or reports[-1])
    req = engine.add(ve.request(tokens[:160] + ve.tokens_of(22, 100)))
    engine.run()
    failing = next(o.kv_connector_metadata for o in engine.outputs
                   if any(job.request == req.request_id for job in o.kv_connector_metadata.loads))
    saves = [job.job for job in failing.saves if job.request == req.request_id]
    assert saves, "the step that loaded should also have saved the suffix's whole blocks"
    settled = {job: ok for report in reports if report is not None for job, (_, ok) in report.done.items()}
    assert all(settled[job] == 0 for job in saves)
    assert engine.reported_invalid                  # the forward read unfilled blocks, reported in that step
    assert engine.scheduler.reset_prefix_cache()
    again = engine.add(ve.request(tokens[:160] + ve.tokens_of(22, 100)))
    engine.run()
    (load,) = engine.loads(again)
    assert len(load.blocks) == 16                   # the recomputed blocks were saved once computed again
    engine.assert_settled()
