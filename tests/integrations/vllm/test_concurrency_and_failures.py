"""The vLLM connector under concurrency and failure: loads and saves of one prefix at once, preemption, aborts, resets,
stores that go away, odd prompt lengths."""

from __future__ import annotations

from helpers import vllm_engine as ve


def test_two_requests_reading_one_stored_prefix_in_one_step_share_the_host_pages(engines, written, tmp_path) -> None:
    store = f"file:{tmp_path / 'store'}"
    tokens = ve.tokens_of(21, 200)
    written(store, tokens)
    reader = engines({"store": store})
    reader.add(ve.request(tokens[:192] + ve.tokens_of(22, 20)))
    reader.add(ve.request(tokens[:192] + ve.tokens_of(23, 20)))
    reader.run()
    reader.assert_settled()


def test_preemption_under_a_tiny_block_pool_serves_right_kv_and_settles(engines) -> None:
    engine = engines(blocks=24, batched_tokens=64)
    system = ve.tokens_of(30, 48)
    for seed in range(4):
        engine.add(ve.request(ve.tokens_of(300 + seed, 120, system), max_tokens=40))
    engine.run()
    assert any(r.num_preemptions for r in engine.requests.values()), "nothing was preempted"
    engine.assert_settled()
    assert engine.scheduler.reset_prefix_cache()
    for seed in range(4):
        engine.add(ve.request(ve.tokens_of(300 + seed, 120, system)[:112] + ve.tokens_of(400 + seed, 8), max_tokens=40))
    engine.run()
    engine.assert_settled()


def test_preemption_with_write_back_serves_right_kv_and_settles(engines) -> None:
    engine = engines({"write_policy": "write_back"}, blocks=20, batched_tokens=64)
    for seed in range(4):
        engine.add(ve.request(ve.tokens_of(310 + seed, 100), max_tokens=80))
    engine.run()
    assert any(r.num_preemptions for r in engine.requests.values()), "nothing was preempted"
    engine.assert_settled()
    assert engine.scheduler.reset_prefix_cache()
    for seed in range(4):
        engine.add(ve.request(ve.tokens_of(310 + seed, 100), max_tokens=80))
    engine.run()
    engine.assert_settled()


def _corrupt(root) -> None:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.stat().st_size > 4096)
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))


def test_blocks_recomputed_after_a_failed_storage_read_are_saved_to_the_host_tier(engines, written, tmp_path) -> None:
    root = tmp_path / "store"
    tokens = ve.tokens_of(24, 200)
    written(f"file:{root}", tokens)
    _corrupt(root)
    reader = engines({"store": f"file:{root}"})
    first = reader.add(ve.request(tokens[:192] + ve.tokens_of(25, 30)))
    reader.run()
    assert reader.loads(first)
    reader.assert_settled()
    assert reader.scheduler.reset_prefix_cache()
    again = reader.add(ve.request(tokens[:192] + ve.tokens_of(26, 30)))
    reader.run()
    loads = reader.loads(again)
    assert loads and loads[0].host == 12, "the recomputed prefix was never backed up to the host tier"
    reader.assert_settled()


def test_pages_left_unread_by_the_prefetch_timeout_are_offered_again(engines, written, tmp_path) -> None:
    store = f"file:{tmp_path / 'store'}"
    tokens = ve.tokens_of(27, 700)
    written(store, tokens)
    reader = engines({"store": store, "prefetch_policy": "timeout", "prefetch_timeout_s": 1e-9}, blocks=128)
    first = reader.add(ve.request(tokens[:640] + ve.tokens_of(28, 10)))
    reader.run()
    (load,) = reader.loads(first)
    assert load.asynchronous and len(load.pages) == 40
    reader.assert_settled()
    assert reader.scheduler.reset_prefix_cache(reset_connector=True)
    assert not reader.connector.scheduler.index.entries
    again = reader.add(ve.request(tokens[:640] + ve.tokens_of(29, 10)))
    reader.run()
    (load,) = reader.loads(again)
    assert len(load.pages) == 40, "a page the timeout left unread is never offered from storage again"
    reader.assert_settled()


def test_more_salts_than_open_stores_at_once_all_load_from_storage(engines, tmp_path, caplog) -> None:
    store = f"file:{tmp_path / 'store'}"
    tokens = ve.tokens_of(31, 200)
    writer = engines({"store": store, "host_tokens": 8192}, blocks=256, batched_tokens=4096)
    for salt in range(12):
        writer.add(ve.request(tokens, salt=f"s{salt}"))
    writer.run()
    reader = engines({"store": store, "host_tokens": 8192}, blocks=256, batched_tokens=4096)
    reqs = [reader.add(ve.request(tokens[:192] + ve.tokens_of(32, 10), salt=f"s{salt}")) for salt in range(12)]
    reader.run()
    for req in reqs:
        (load,) = reader.loads(req)
        assert load.asynchronous and len(load.pages) == 12, f"salt of {req.request_id} missed its stored pages"
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    assert reader.connector.scheduler.counters.failed_load_blocks == 0
    reader.assert_settled()


def test_requests_aborted_while_their_saves_are_in_flight_settle(engines, tmp_path) -> None:
    from vllm.v1.request import RequestStatus

    for policy in ("write_through", "write_back"):
        engine = engines({"store": f"file:{tmp_path / policy}", "write_policy": policy}, batched_tokens=64)
        reqs = [engine.add(ve.request(ve.tokens_of(40 + i, 150), max_tokens=20)) for i in range(3)]
        for _ in range(4):
            engine.step()
        engine.scheduler.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
        engine.run()
        engine.assert_settled()


def test_odd_prompt_lengths_and_one_token_outputs(engines) -> None:
    engine = engines()
    lengths = [1, 5, 15, 16, 17, 32, 48, 64, 65]
    for n in lengths:
        engine.add(ve.request(ve.tokens_of(50 + n, n), max_tokens=1))
    engine.run()
    engine.assert_settled()
    assert engine.scheduler.reset_prefix_cache()
    for n in lengths:
        engine.add(ve.request(ve.tokens_of(50 + n, n), max_tokens=1))
    engine.run()
    engine.assert_settled()


def test_a_reset_while_loads_and_saves_are_in_flight_settles(engines, written, tmp_path) -> None:
    store = f"file:{tmp_path / 'store'}"
    tokens = ve.tokens_of(60, 300)
    written(store, tokens)
    reader = engines({"store": store}, batched_tokens=64)
    reader.add(ve.request(tokens[:288] + ve.tokens_of(61, 20)))
    reader.add(ve.request(ve.tokens_of(62, 200)))
    reader.step()
    assert reader.connector.reset_cache()
    reader.step()
    reader.scheduler.reset_prefix_cache(reset_connector=True)
    reader.run()
    reader.assert_settled()


def test_the_same_request_id_reused_after_finishing(engines) -> None:
    engine = engines()
    first = engine.add(ve.request(ve.tokens_of(70, 100)))
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    again = ve.request(ve.tokens_of(70, 100))
    again.request_id = first.request_id
    engine.add(again)
    engine.run()
    assert engine.loads(again)
    engine.assert_settled()


def test_a_host_pool_smaller_than_one_prefix(engines) -> None:
    engine = engines({"host_tokens": 16 * 3}, batched_tokens=64)
    engine.add(ve.request(ve.tokens_of(80, 200)))
    engine.run()
    engine.assert_settled()
    assert engine.scheduler.reset_prefix_cache()
    engine.add(ve.request(ve.tokens_of(80, 200)))
    engine.run()
    engine.assert_settled()


def test_a_store_deleted_mid_run_gives_recomputes_not_wrong_kv(engines, written, tmp_path) -> None:
    import shutil

    root = tmp_path / "store"
    tokens = ve.tokens_of(90, 400)
    written(f"file:{root}", tokens)
    reader = engines({"store": f"file:{root}"}, batched_tokens=64)
    reader.add(ve.request(tokens[:384] + ve.tokens_of(91, 20)))
    reader.connector.scheduler.matched_tokens  # noqa: B018
    output = reader.scheduler.schedule
    calls = []

    def schedule():
        out = output()
        if not calls and out.kv_connector_metadata.loads:
            shutil.rmtree(root)
            calls.append(1)
        return out

    reader.scheduler.schedule = schedule
    reader.run()
    assert calls
    reader.assert_settled()
    reader.add(ve.request(ve.tokens_of(92, 200)))
    reader.run()
    reader.assert_settled()


def test_a_read_only_store_still_serves_the_host_tier(engines, tmp_path) -> None:
    import os

    root = tmp_path / "store"
    root.mkdir()
    engine = engines({"store": f"file:{root}"})
    os.chmod(root, 0o555)
    try:
        engine.add(ve.request(ve.tokens_of(93, 200)))
        engine.run()
        engine.assert_settled()
        assert engine.scheduler.reset_prefix_cache()
        again = engine.add(ve.request(ve.tokens_of(93, 200)))
        engine.run()
        assert engine.loads(again)
        engine.assert_settled()
    finally:
        os.chmod(root, 0o755)


def test_a_reset_that_reports_success_leaves_no_page_written_before_it(engines) -> None:
    engine = engines()
    tokens = ve.tokens_of(94, 200)
    engine.add(ve.request(tokens))
    schedule, resets = engine.scheduler.schedule, []

    def reset_after_schedule():
        output = schedule()
        if output.kv_connector_metadata.saves and not resets:
            resets.append(engine.connector.reset_cache())         # as vLLM's reset_prefix_cache(reset_connector=True)
        return output

    engine.scheduler.schedule = reset_after_schedule
    engine.run()
    engine.assert_settled()
    assert resets == [True]
    assert engine.scheduler.reset_prefix_cache()
    again = engine.add(ve.request(tokens))
    engine.run()
    assert not engine.loads(again), "a reset reported success, yet pages written before it are loaded"
    engine.assert_settled()


def test_a_stored_prefix_longer_than_the_host_pool_does_not_park_its_request_forever(engines, written,
                                                                                    tmp_path) -> None:
    store = f"file:{tmp_path / 'store'}"
    tokens = ve.tokens_of(95, 300)
    written(store, tokens)
    reader = engines({"store": store, "host_tokens": 16 * 4})
    req = reader.add(ve.request(tokens[:288] + ve.tokens_of(96, 20)))
    reader.run(seconds=10)
    reader.assert_settled()
    assert len(reader.loads(req)) <= 2
