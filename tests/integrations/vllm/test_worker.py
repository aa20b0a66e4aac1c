"""The connector's worker side without vLLM: vLLM's KV tensors seen as kvtier pages (their strides read, not assumed),
and on a GPU the layer-wise load and the backup over real CUDA tensors in vLLM's layout."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import InvalidArgument
from kvtier.integrations.vllm.jobs import LoadJob, SaveJob, StepJobs
from kvtier.integrations.vllm.kv_tensors import _block_dim
from kvtier.integrations.vllm.settings import ConnectorSettings, Deployment
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.pools import KVGeometry

BLOCKS, BLOCK, HEADS, HEAD = 12, 16, 2, 64
PAGE = BLOCK * HEADS * 2 * HEAD * 2


def _lbnhc(device: str = "cpu") -> torch.Tensor:
    """A layer as vLLM's FlashAttention backend hands it over: [blocks, heads, tokens, 2 * head] over memory in
    [blocks, tokens, heads, 2 * head] order."""
    return torch.empty((BLOCKS, BLOCK, HEADS, 2 * HEAD), dtype=torch.bfloat16, device=device).permute(0, 2, 1, 3)


def test_the_block_dimension_is_found_from_the_strides_of_each_layout() -> None:
    assert _block_dim("l", _lbnhc(), PAGE) == 0
    lbhnc = torch.empty((BLOCKS, HEADS, BLOCK, 2 * HEAD), dtype=torch.bfloat16)
    assert _block_dim("l", lbhnc, PAGE) == 0
    mla = torch.empty((BLOCKS, BLOCK, 576), dtype=torch.bfloat16)
    assert _block_dim("l", mla, BLOCK * 576 * 2) == 0


def test_a_layout_that_interleaves_blocks_with_something_else_is_refused() -> None:
    interleaved = torch.empty((2, BLOCKS, BLOCK, HEADS, HEAD), dtype=torch.bfloat16).permute(1, 0, 2, 3, 4)
    with pytest.raises(InvalidArgument, match="block-contiguous"):
        _block_dim("l", interleaved, PAGE // 2)
    with pytest.raises(InvalidArgument, match="no dimension"):
        _block_dim("l", _lbnhc(), PAGE * 2)


@pytest.mark.gpu
def test_blocks_backed_up_come_back_layer_by_layer_into_other_blocks(cuda) -> None:
    layers = 4
    names = [f"layer.{i}" for i in range(layers)]
    kv = {name: _lbnhc("cuda") for name in names}
    for tensor in kv.values():
        tensor.permute(0, 2, 1, 3).view(torch.int16).random_(-32768, 32767)      # its memory, in order
    geometry = KVGeometry("k_only", layers, BLOCK, PAGE // BLOCK, 1)
    worker = WorkerSide(ConnectorSettings(host_tokens=6 * BLOCK), Deployment("t", geometry, "bfloat16", "LBNHC", 0,
                                                                            1, False), names, cuda)
    try:
        worker.register(kv)
        worker.save(StepJobs(saves=[SaveJob(1, "r", [0, 1, 2, 3, 4, 5], list(range(6)), [b"k" * 32] * 6)]))
        torch.cuda.synchronize()
        expected = {name: kv[name].permute(0, 2, 1, 3)[:6].clone() for name in names}
        for tensor in kv.values():
            tensor.permute(0, 2, 1, 3)[6:].view(torch.uint8).fill_(0xA7)
        worker.start_load(StepJobs(loads=[LoadJob(2, "r", [11, 10, 9, 8, 7, 6], list(range(6)), 6, [], [], False)]))
        for name in names:
            worker.wait_layer(name)
        worker.save(StepJobs())
        torch.cuda.synchronize()
        for name in names:
            got = kv[name].permute(0, 2, 1, 3)
            assert torch.equal(got[[11, 10, 9, 8, 7, 6]].view(torch.uint8), expected[name].view(torch.uint8))
        while worker.busy():
            worker.poll()
        assert worker.worker_meta().done == {1: (1, 6), 2: (1, 6)}
    finally:
        worker.close()
