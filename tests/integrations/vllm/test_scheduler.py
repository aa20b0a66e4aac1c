"""The connector's scheduler side alone: jobs settle only when every worker has reported them, by the fewest pages
any worker managed (tensor parallelism: each rank moves its own shard)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from helpers import vllm_engine as ve

ve.need_vllm(module=True)

from kvtier.integrations.vllm.jobs import JobReports  # noqa: E402
from kvtier.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvtier.integrations.vllm.settings import ConnectorSettings, Deployment  # noqa: E402
from kvtier.pools import KVGeometry  # noqa: E402

NOTHING_SCHEDULED = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, scheduled_spec_decode_tokens={},
                                    preempted_req_ids=set(),
                                    scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                          num_computed_tokens=[]))


def _scheduler_side(workers: int) -> SchedulerSide:
    geometry = KVGeometry("k_only", 4, 16, 512, 1)
    return SchedulerSide(ConnectorSettings(host_tokens=16 * 20), Deployment("m", geometry, "bfloat16", "LBNHC", 0,
                                                                            workers, False), workers)


def _request(name: str, length: int) -> SimpleNamespace:
    tokens = np.random.default_rng(int.from_bytes(name.encode(), "little")).integers(0, 30000, length).tolist()
    return SimpleNamespace(request_id=name, all_token_ids=tokens, num_tokens=length, lora_request=None,
                           cache_salt=None, prompt_embeds=None, mm_features=None, num_computed_tokens=length)


def _saved(side: SchedulerSide, name: str, length: int) -> tuple[object, int]:
    request = _request(name, length)
    tracked = side.track(request)
    assert tracked is not None
    tracked.blocks = list(range(length // 16))
    side._save(tracked, length)
    (job,) = side.build(NOTHING_SCHEDULED).saves
    return tracked, job.job


def test_a_save_settles_when_every_worker_reported_it_by_the_fewest_pages() -> None:
    side = _scheduler_side(2)
    tracked, job = _saved(side, "a", 96)
    side.reported(SimpleNamespace(kv_connector_worker_meta=JobReports({job: (1, 6)})))
    assert side.index.match(tracked.keys) == 0 and job in side.jobs          # one of two workers
    side.reported(SimpleNamespace(kv_connector_worker_meta=JobReports({job: (1, 4)})))
    assert side.index.match(tracked.keys) == 4 and job not in side.jobs      # the other saved 4 of 6
    assert len(side.index.entries) == 4
    side.index.check()


def test_reports_summed_by_vllm_settle_at_once() -> None:
    side = _scheduler_side(2)
    tracked, job = _saved(side, "b", 64)
    summed = JobReports({job: (1, 4)}).aggregate(JobReports({job: (1, 4)}))
    side.reported(SimpleNamespace(kv_connector_worker_meta=summed))
    assert side.index.match(tracked.keys) == 4


def test_a_finished_request_with_saves_in_flight_keeps_its_blocks_until_they_settle() -> None:
    side = _scheduler_side(1)
    _, job = _saved(side, "c", 48)
    assert side.finished(_request("c", 48), [0, 1, 2]) is True
    assert side.build(NOTHING_SCHEDULED).awaiting == {"c"}
    side.reported(SimpleNamespace(kv_connector_worker_meta=JobReports({job: (1, 3)})))
    assert not side.jobs and side.finished(_request("d", 48), []) is False
