"""vLLM's real scheduler driving kvtier's connector, and a model-runner stand-in that calls the connector's worker
side the way vLLM's GPU model runner does (``vllm/v1/worker/gpu/kv_connector.py``, the attention layers'
``maybe_transfer_kv_layer``), over KV tensors on kvtier's emulated runtime.

What is vLLM's own: ``VllmConfig`` (from a local model config: no network), the ``Scheduler`` with its KV cache
manager, block pool and prefix cache, ``KVConnectorFactory`` building the connector in both roles, ``Request`` and
its sampling params, ``SchedulerOutput`` and ``ModelRunnerOutput``. What stands in: the model. Each step it writes,
for every scheduled token, KV that is a function of the token's whole prefix and the layer (so two requests with one
prefix write equal KV, and a block loaded from anywhere else is caught), and it checks, before writing, that every
block the request already counts as computed holds exactly the KV of its tokens, whether vLLM's prefix cache or
kvtier put it there. Blocks a load job fills are poisoned first.

Here a missing vLLM is a skip, unless ``KVTIER_REQUIRE_VLLM=1`` (CI) makes it a failure.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
         "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
         "torch_dtype": "bfloat16"}
"""A Llama-shaped config vLLM reads from a local directory (no weights are loaded: the model is the stand-in)."""

EOS = 2


def need_vllm(*, module: bool = False) -> None:
    """Skip (``module``: the whole test module, called at its top) without vLLM, or fail where CI requires it."""
    try:
        import vllm.distributed.kv_transfer.kv_connector.factory  # noqa: F401
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except ImportError as error:
        if os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(f"vLLM is not installed ({error}): pip install --no-deps vllm==0.34.0 plus the vllm-interface "
                    "extra", allow_module_level=module)


def model_dir(root: Path, **overrides: Any) -> Path:
    path = root / "model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**MODEL, **overrides}))
    return path


def vllm_config(model: Path, extra: dict[str, Any], *, block_size: int = 16, batched_tokens: int = 512,
                max_seqs: int = 16, model_name: str | None = None) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    model_config = ModelConfig(model=str(model), dtype="bfloat16", seed=0, skip_tokenizer_init=True,
                               served_model_name=model_name)
    scheduler = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=batched_tokens, max_model_len=8192,
                                enable_chunked_prefill=True, is_encoder_decoder=False)
    cache = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=True)
    transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra,
                                kv_load_failure_policy="recompute")
    return VllmConfig(scheduler_config=scheduler, model_config=model_config, cache_config=cache,
                      kv_transfer_config=transfer, device_config=DeviceConfig("cpu"))


def kv_cache_config(config: Any, blocks: int, *, mla: bool = False) -> Any:
    """One group of full-attention layers as vLLM's FlashAttention backend sizes it for the model config (``mla``:
    DeepSeek's latent cache instead, 512 + 64 values a token)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    hf = config.model_config.hf_config
    block = config.cache_config.block_size
    spec = (MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=576, dtype=torch.bfloat16) if mla else
            FullAttentionSpec(block_size=block, num_kv_heads=hf.num_key_value_heads, head_size=hf.head_dim,
                              dtype=torch.bfloat16))
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
    result = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    config.cache_config.num_gpu_blocks = blocks
    return result


_ids = itertools.count(1)


def request(tokens: list[int], *, max_tokens: int = 4, salt: str | None = None, lora: str | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS)
    adapter = LoRARequest(lora, next(_ids), f"/adapters/{lora}") if lora else None
    return Request(request_id=f"req-{next(_ids)}", prompt_token_ids=list(tokens), sampling_params=params,
                   pooling_params=None, mm_features=None, lora_request=adapter, cache_salt=salt,
                   block_hasher=get_request_block_hasher(16, sha256))


def tokens_of(seed: int, length: int, prefix: list[int] | None = None) -> list[int]:
    rng = np.random.default_rng(seed)
    head = list(prefix or [])
    return head + rng.integers(3, 30000, length - len(head)).tolist()


class VllmHarness:
    """A scheduler, its connector, one worker's connector over emulated KV tensors, and the model stand-in."""

    def __init__(self, config: Any, blocks: int = 96, *, mla: bool = False) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from kvtier.compat.device_array import DeviceArray
        from kvtier.runtime import get as get_runtime

        self.config, self.kv_config = config, kv_cache_config(config, blocks, mla=mla)
        self.block_size = config.cache_config.block_size
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=self.kv_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(config),
                                   block_size=self.block_size)
        self.connector = self.scheduler.connector
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kv_config)
        self.runtime = get_runtime()
        group = self.kv_config.kv_cache_groups[0]
        self.layers = list(group.layer_names)
        self.page_bytes = group.kv_cache_spec.page_size_bytes
        self.row_bytes = self.page_bytes // self.block_size
        import torch

        shape = (blocks, self.block_size, self.row_bytes // 2)     # a block's bytes, in vLLM's physical order
        self.kv = {name: DeviceArray.empty(shape, torch.bfloat16, runtime=self.runtime) for name in self.layers}
        for array in self.kv.values():
            array.buffer.upload(np.full(array.nbytes, 0x5A, np.uint8), 0)
        self.worker.register_kv_caches(self.kv)
        self.requests: dict[str, Any] = {}
        self.checked_blocks = 0
        self.loaded_jobs: list[Any] = []
        self.outputs: list[Any] = []
        self.connector_stats: dict[str, int] = {}
        self.wrong: list[str] = []
        self.reported_invalid: set[int] = set()
        """Blocks a forward read with the wrong KV, each reported by the connector as a load error in that step."""
        self.external_hits = 0

    # -- the model stand-in -----------------------------------------------------------------------------------------
    def expected(self, tokens: list[int], start: int, end: int, layer: int) -> np.ndarray:
        """KV rows of positions [start, end): each a function of its whole prefix and the layer."""
        h = np.uint64(1469598103934665603)
        hashes = []
        for i, token in enumerate(tokens[:end]):
            h = np.uint64((int(h) * 1099511628211 + int(token) + 1) % (1 << 63))
            if i >= start:
                hashes.append(int(h))
        hv = np.array(hashes, dtype=np.uint64)[:, None]
        lanes = np.arange(self.row_bytes, dtype=np.uint64)[None, :]
        rows = (lanes * ((hv % np.uint64(65521)) + np.uint64(1)) + np.uint64(layer * 7919) +
                (hv >> np.uint64(17)) % np.uint64(251)) % np.uint64(251)
        return rows.astype(np.uint8)

    def _slot(self, blocks: list[int], position: int) -> int:
        return blocks[position // self.block_size] * self.page_bytes + (position % self.block_size) * self.row_bytes

    def _write(self, req: Any, blocks: list[int], start: int, end: int) -> None:
        tokens = list(req.all_token_ids)
        for layer, name in enumerate(self.layers):
            rows = self.expected(tokens, start, end, layer)
            for position in range(start, end):
                self.kv[name].buffer.upload(rows[position - start], self._slot(blocks, position))

    def check(self, req: Any, blocks: list[int], computed: int) -> set[int]:
        """The vLLM blocks among the request's computed ones whose KV is not its tokens' (whoever filled them: vLLM's
        prefix cache or kvtier). The step fails unless the connector reports every one as a load error."""
        wrong: set[int] = set()
        if not computed:
            return wrong
        self.runtime.synchronize(0)
        tokens = list(req.all_token_ids)
        for layer, name in enumerate(self.layers):
            rows = self.expected(tokens, 0, computed, layer)
            for block in range(-(-computed // self.block_size)):
                first, last = block * self.block_size, min(computed, (block + 1) * self.block_size)
                got = np.frombuffer(bytes(self.kv[name].buffer.download(self._slot(blocks, first),
                                                                        (last - first) * self.row_bytes)), np.uint8)
                want = rows[first:last].reshape(-1)
                if not np.array_equal(got, want):
                    wrong.add(blocks[block])
                    self.wrong.append(f"{req.request_id}: layer {layer} block {block} (vLLM block {blocks[block]}) "
                                      f"holds the wrong KV for positions {first}-{last}")
                self.checked_blocks += 1
        return wrong

    def poison(self, blocks: list[int]) -> None:
        junk = np.full(self.page_bytes, 0xA7, np.uint8)
        for name in self.layers:
            for block in blocks:
                self.kv[name].buffer.upload(junk, block * self.page_bytes)

    # -- one step, as vLLM's engine core and GPU model runner run it ----------------------------------------------
    def add(self, req: Any) -> Any:
        self.requests[req.request_id] = req
        self.scheduler.add_request(req)
        return req

    def step(self) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        worker = self.worker
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        for job in meta.loads:
            self.poison(job.blocks)
            self.loaded_jobs.append(job)
        if output.has_sync_kv_loads:
            worker.start_load_kv(None)
        scheduled = self._scheduled(output)
        wrong: set[int] = set()
        for req_id, blocks, computed, count in scheduled:     # the forward: each layer waits for its load first
            req = self.requests[req_id]
            for name in self.layers:
                worker.wait_for_layer_load(name)
            wrong |= self.check(req, blocks, computed)
            self._write(req, blocks, computed, computed + count)
            for name in self.layers:
                worker.save_kv_layer(name, self.kv[name], None)
        if not output.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        sending, recving = worker.get_finished(output.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        if wrong - invalid:
            raise AssertionError("; ".join(self.wrong[-3:]) + f" (blocks {sorted(wrong - invalid)} not reported "
                                 "as load errors)")
        self.reported_invalid |= wrong
        connector_output = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                             invalid_block_ids=invalid,
                                             kv_connector_stats=worker.get_kv_connector_stats(),
                                             kv_connector_worker_meta=worker.build_connector_worker_meta())
        worker.clear_connector_metadata()
        ids = [req_id for req_id, *_ in scheduled]
        sampled = [[self._next_token(self.requests[req_id])] if self._sampling(req_id, output) else []
                   for req_id in ids]
        runner = ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, kv_connector_output=connector_output)
        result = self.scheduler.update_from_output(output, runner)
        self.outputs.append(output)
        for outputs in result.values():                 # what vLLM's stats logger would receive
            stats = getattr(outputs, "scheduler_stats", None)
            for name, value in ((getattr(stats, "kv_connector_stats", None) or {}).items()):
                self.connector_stats[name] = self.connector_stats.get(name, 0) + value
            prefix = getattr(stats, "connector_prefix_cache_stats", None)
            if prefix is not None:
                self.external_hits += prefix.hits
        return result

    def _scheduled(self, output: Any) -> list[tuple[str, list[int], int, int]]:
        rows = []
        for new in output.scheduled_new_reqs:
            rows.append((new.req_id, list(new.block_ids[0]), new.num_computed_tokens,
                         output.num_scheduled_tokens[new.req_id]))
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
            rows.append((req_id, blocks, cached.num_computed_tokens[i], output.num_scheduled_tokens[req_id]))
        return rows

    def _sampling(self, req_id: str, output: Any) -> bool:
        req = self.requests[req_id]
        return req.num_computed_tokens + output.num_scheduled_tokens[req_id] >= req.num_tokens

    @staticmethod
    def _next_token(req: Any) -> int:
        return 100 + (len(req.all_token_ids) * 7) % 1000

    def run(self, seconds: float = 60.0) -> None:
        """Step until every request has finished and every transfer is settled, as vLLM's engine loop keeps
        stepping (idle steps included) while transfers are in flight."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            idle = not self.scheduler.has_requests() and not self.worker.worker.busy()
            self.step()
            if idle:
                return
            if not self.outputs[-1].total_num_scheduled_tokens:
                time.sleep(0.001)
        raise AssertionError("the requests did not finish")

    def loads(self, req: Any) -> list[Any]:
        """The load jobs the connector sent for ``req``."""
        return [job for job in self.loaded_jobs if job.request == req.request_id]

    def assert_settled(self) -> None:
        """Nothing pinned, nothing in flight, the host index consistent, vLLM's scheduler empty."""
        side = self.connector.scheduler
        side.index.check()
        assert all(entry.pins == 0 for entry in side.index.entries.values())
        assert not side.jobs and not self.worker.worker.busy()
        assert not self.scheduler.requests

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()
        for array in self.kv.values():
            array.close()
