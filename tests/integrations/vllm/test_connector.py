"""kvtier's connector inside vLLM's real scheduler: prefixes saved to the host tier come back into new blocks,
byte for byte, once vLLM's own prefix cache has dropped them."""

from __future__ import annotations

from helpers import vllm_engine as ve


def test_a_prefix_saved_to_host_is_loaded_into_new_blocks_byte_for_byte(engines) -> None:
    engine = engines()
    first = engine.add(ve.request(ve.prompt(1, 200)))
    engine.run()
    assert engine.connector.scheduler.index.match(engine.connector.scheduler.tracked.get(first.request_id).keys
                                                  if first.request_id in engine.connector.scheduler.tracked else [],
                                                  0) == 0
    assert engine.scheduler.reset_prefix_cache()
    second = engine.add(ve.request(ve.prompt(1, 200)[:160] + ve.prompt(2, 60)))
    engine.run()
    loads = [job for job in engine.loaded_jobs if job.request == second.request_id]
    assert len(loads) == 1 and len(loads[0].blocks) == 10 and not loads[0].asynchronous
    assert engine.checked_blocks > 0
