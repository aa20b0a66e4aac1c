"""kvtier's vLLM connector, measured two ways: its worker path on a GPU, and its scheduler side's cost per step.

**Worker path (``--worker``, a GPU).** vLLM itself cannot be installed on the GPU machine (no network for its CUDA
wheels), so this harness drives the connector's worker side (``kvtier.integrations.vllm.worker.WorkerSide``, the
object ``KVTierConnector`` routes vLLM's worker calls to) the way vLLM's model runner does: ``start_load_kv`` before
the forward, ``wait_for_layer_load`` at each attention layer, ``wait_for_save`` after. The KV cache is
Llama-3-8B-shaped (32 layers, 8 KV heads, head size 128, bf16, 16-token blocks) in vLLM's default layout (``LBNHC``:
per layer ``[blocks, heads, tokens, 2 * head_size]`` over ``[blocks, tokens, heads, 2 * head_size]`` memory). Each
layer's compute is a Llama-3-8B layer's prefill of ``--suffix`` tokens (its projections and MLP as matmuls, and
attention of the suffix over the whole prefix with torch's SDPA). Rows, all in one run, time from ``start_load_kv``
to the end of the last layer's compute (CUDA events on the compute stream), median of ``--repeats``:

- ``compute alone``: the forward with no load;
- ``load alone``: the load with no forward;
- ``kvtier layer-wise``: layer i's compute waits on the GPU for layer i of the load;
- ``whole load first``: the forward waits for the whole load before layer 0 (what vLLM's own offloading connector
  does: its ``wait_for_layer_load`` does nothing).

``bound`` = max(compute alone, load alone); ``x bound`` = a row over it (goal for layer-wise: <= 1.05). Every timed
load is checked: the loaded blocks (poisoned before each run) equal, byte for byte, the blocks the host pages were
backed up from.

**Scheduler side (``--scheduler``, CPU, needs vLLM).** vLLM's real scheduler with ``--running`` requests (1k-token
prompts sharing a 512-token prefix, decoding), with and without the connector; a stand-in worker reports every job
done at once. Reports the connector's own time per step (its scheduler calls, timed) in µs per running request, and
the scheduler's step time with and without it.

Usage: python bench/vllm_connector.py --worker [--tokens 32k] [--suffixes 512,2k] [--backends kernel,direct]
       python bench/vllm_connector.py --scheduler [--running 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _options import name_list  # noqa: E402

LAYERS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
HIDDEN, HEADS, MLP = 4096, 32, 14336


def tokens_arg(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="the worker path on a GPU")
    parser.add_argument("--scheduler", action="store_true", help="the scheduler side's cost per step (CPU)")
    parser.add_argument("--runtime", help="kvtier runtime (default: cuda)")
    parser.add_argument("--tokens", type=tokens_arg, default=32 * 1024, help="prefix tokens (default: 32k)")
    parser.add_argument("--suffixes", default="512,2k",
                        help="suffix tokens whose prefill each layer computes (default: %(default)s)")
    parser.add_argument("--backends", type=name_list(["kernel", "direct", "staged", "batch"], "io backend"),
                        default=["kernel", "direct"], help="kvtier io backends (default: kernel,direct)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats after one warm-up (default: 5)")
    parser.add_argument("--running", type=int, default=256, help="running requests (--scheduler; default: 256)")
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed (--scheduler; default: 50)")
    parser.add_argument("--blocks", choices=["scattered", "contiguous"], default="scattered",
                        help="the vLLM block ids loaded into: a random permutation, as after churn, or one run "
                             "(default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="a small shape (a smoke run, not a speed)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not args.worker and not args.scheduler:
        parser.error("choose --worker (GPU) and/or --scheduler (CPU)")
    args.suffix_list = [tokens_arg(s) for s in args.suffixes.split(",") if s]
    return args


# -- the worker path --------------------------------------------------------------------------------------------------
class Layer:
    """A Llama-3-8B layer's prefill of ``suffix`` tokens over a ``prefix``-token context, as GPU work."""

    def __init__(self, torch: Any, suffix: int, prefix: int, device: Any, tiny: bool) -> None:
        hidden, mlp, heads = (512, 1024, 4) if tiny else (HIDDEN, MLP, HEADS)
        bf16 = torch.bfloat16
        self.torch = torch
        self.x = torch.randn(suffix, hidden, dtype=bf16, device=device)
        self.qkv = torch.randn(hidden, hidden + 2 * KV_HEADS * HEAD // (8 if tiny else 1), dtype=bf16, device=device)
        self.o = torch.randn(hidden, hidden, dtype=bf16, device=device)
        self.up = torch.randn(hidden, 2 * mlp, dtype=bf16, device=device)
        self.down = torch.randn(mlp, hidden, dtype=bf16, device=device)
        self.q = torch.randn(1, heads, suffix, HEAD, dtype=bf16, device=device)
        self.kv = torch.randn(1, heads, prefix + suffix, HEAD, dtype=bf16, device=device)

    def __call__(self) -> None:
        torch = self.torch
        torch.matmul(self.x, self.qkv)
        torch.nn.functional.scaled_dot_product_attention(self.q, self.kv, self.kv)
        torch.matmul(self.x, self.o)
        torch.matmul(torch.matmul(self.x, self.up)[:, :self.down.shape[0]], self.down)


class Harness:
    """A worker side over vLLM-layout KV tensors whose first ``pages`` blocks were backed up to host pages ``0..``;
    each run loads them into the other ``pages`` blocks (poisoned first) and checks them."""

    def __init__(self, args: argparse.Namespace, backend: str, runtime: Any) -> None:
        import torch

        from kvtier.integrations.vllm.settings import ConnectorSettings, Deployment
        from kvtier.integrations.vllm.worker import WorkerSide
        from kvtier.pools import KVGeometry

        self.torch, self.backend = torch, backend
        layers, heads = (4, 2) if args.tiny else (LAYERS, KV_HEADS)
        self.pages = pages = args.tokens // BLOCK
        self.geometry = KVGeometry("k_only", layers, BLOCK, heads * 2 * HEAD * 2, 1)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        self.physical = [torch.empty((2 * pages, BLOCK, heads, 2 * HEAD), dtype=torch.bfloat16, device="cuda")
                         for _ in self.names]
        for tensor in self.physical:
            tensor[:pages].view(torch.int16).random_(-32768, 32767)
        self.originals = [tensor[:pages].clone() for tensor in self.physical]
        kv = {name: tensor.permute(0, 2, 1, 3) for name, tensor in zip(self.names, self.physical, strict=True)}
        settings = ConnectorSettings(host_tokens=args.tokens, io_backend=backend)
        deployment = Deployment("bench", self.geometry, "bfloat16", "LBNHC", 0, 1, False)
        self.worker = WorkerSide(settings, deployment, self.names, runtime)
        self.worker.register(kv)
        assert self.worker.engine is not None
        self.worker.engine.backup(list(range(pages)), list(range(pages))).wait()
        self.job = 0
        order = np.random.default_rng(0).permutation(pages) if args.blocks == "scattered" else np.arange(pages)
        self.target = (pages + order).tolist()
        self.target_index = torch.tensor(self.target, device="cuda")

    def load(self, layerwise: bool, forward: list[Layer] | None) -> float:
        """ms from ``start_load_kv`` to the end of the forward (or of the load, without one)."""
        from kvtier.integrations.vllm.jobs import LoadJob, StepJobs

        torch, worker, pages = self.torch, self.worker, self.pages
        for tensor in self.physical:
            tensor[pages:].view(torch.uint8).fill_(0xA7)
        torch.cuda.synchronize()
        self.job += 1
        meta = StepJobs(loads=[LoadJob(self.job, "bench", self.target, list(range(pages)), pages, [], [], False)])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        worker.start_load(meta)
        if forward is None:
            worker.wait_step_load()
        for i, name in enumerate(self.names):
            if forward is not None:
                if layerwise:
                    worker.wait_layer(name)
                elif i == 0:
                    worker.wait_step_load()
                forward[i]()
        end.record()
        worker.save(StepJobs())
        torch.cuda.synchronize()
        while worker.busy():
            worker.poll()
        worker.worker_meta()
        for original, tensor in zip(self.originals, self.physical, strict=True):
            if not torch.equal(tensor[self.target_index].view(torch.uint8), original.view(torch.uint8)):
                raise AssertionError(f"{self.backend}: a loaded block differs from what was backed up")
        return float(start.elapsed_time(end))

    def compute(self, forward: list[Layer]) -> float:
        torch = self.torch
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for layer in forward:
            layer()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end))

    def close(self) -> None:
        self.worker.close()


def worker_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from kvtier.runtime import get as get_runtime

    runtime = get_runtime(args.runtime or "cuda")
    rows: list[dict[str, Any]] = []
    for backend in args.backends:
        harness = Harness(args, backend, runtime)
        try:
            load_alone = timed(lambda h=harness: h.load(True, None), args.repeats)
            for suffix in args.suffix_list:
                shared = [Layer(torch, suffix, args.tokens, "cuda", args.tiny) for _ in range(2)]
                forward = [shared[i % 2] for i in range(len(harness.names))]
                alone = timed(lambda h=harness, f=forward: h.compute(f), args.repeats)
                overlap = timed(lambda h=harness, f=forward: h.load(True, f), args.repeats)
                whole = timed(lambda h=harness, f=forward: h.load(False, f), args.repeats)
                bound = max(alone, load_alone)
                nbytes = harness.pages * harness.geometry.bytes_per_page
                for name, ms in (("compute alone", alone), ("load alone", load_alone),
                                 ("kvtier layer-wise", overlap), ("whole load first", whole)):
                    rows.append({"backend": backend, "blocks": args.blocks, "prefix": args.tokens, "suffix": suffix,
                                 "row": name,
                                 "ms": ms, "bound_ms": bound, "x_bound": ms / bound, "kv_gib": nbytes / 2**30,
                                 "load_gbps": nbytes / (load_alone * 1e6)})
                del shared, forward
        finally:
            harness.close()
    return rows


def timed(run: Any, repeats: int) -> float:
    run()
    return statistics.median(run() for _ in range(repeats))


# -- the scheduler side -----------------------------------------------------------------------------------------------
def scheduler_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-bench-") as root:
        return [_scheduler_row(args, Path(root), connector) for connector in (False, True)]


def _scheduler_row(args: argparse.Namespace, root: Path, connector: bool) -> dict[str, Any]:
    """One scheduler (with kvtier's connector or none) stepping ``args.running`` decoding requests."""
    from helpers import vllm_engine as ve
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.structured_output import StructuredOutputManager

    from kvtier.integrations.vllm.messages import KVTierWorkerMeta

    system = ve.tokens_of(1, 512)
    config = ve.vllm_config(ve.model_dir(root), {"host_tokens": 1 << 20}, batched_tokens=8192,
                            max_seqs=args.running)
    if not connector:
        config.kv_transfer_config = None
    kv_config = ve.kv_cache_config(config, blocks=args.running * 80)
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_config, log_stats=True,
                          structured_output_manager=StructuredOutputManager(config), block_size=16)
    side = scheduler.connector
    spent = [0.0]
    if side is not None:
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                     "update_connector_output", "request_finished", "get_external_cache_hit_sources"):
            setattr(side, name, _clocked(getattr(side, name), spent))
    for i in range(args.running):
        scheduler.add_request(ve.request(ve.tokens_of(10 + i, 1024, system), max_tokens=4000))
    steps, prefill_steps = [], 0
    while True:
        started = time.perf_counter()
        spent[0] = 0.0
        output = scheduler.schedule()
        meta = output.kv_connector_metadata
        done = {job.job: (1, len(job.pages)) for job in (meta.loads + meta.saves)} if meta is not None else {}
        ids = list(output.num_scheduled_tokens)
        sampled = [[7] if scheduler.requests[r].num_computed_tokens + output.num_scheduled_tokens[r]
                   >= scheduler.requests[r].num_tokens else [] for r in ids]
        kv_out = KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMeta(done)) if connector else None
        scheduler.update_from_output(output, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled,
                                                               kv_connector_output=kv_out))
        elapsed = time.perf_counter() - started
        decoding = all(scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_prompt_tokens
                       for r in ids) and len(ids) == args.running
        if not decoding:
            prefill_steps += 1
            continue
        steps.append((elapsed, spent[0]))
        if len(steps) >= args.steps:
            break
    step = statistics.median(s for s, _ in steps)
    own = statistics.median(c for _, c in steps)
    return {"row": "with kvtier" if connector else "no connector", "running": args.running,
            "step_ms": step * 1e3, "connector_us_per_request": own * 1e6 / args.running,
            "prefill_steps": prefill_steps}


def _clocked(method: Any, spent: list[float]) -> Any:
    def call(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*a, **k)
        finally:
            spent[0] += time.perf_counter() - started
    return call


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    console, rows = Console(), []
    if args.worker:
        worker = worker_rows(args)
        rows += worker
        table = Table(title=f"vLLM connector worker path: {args.tokens:,}-token prefix into {args.blocks} blocks, "
                            f"Llama-3-8B-shaped KV ({worker[0]['kv_gib']:.2f} GiB)" if worker else "worker path")
        for column in ("backend", "suffix", "row", "ms", "bound ms", "x bound", "load GB/s"):
            table.add_column(column)
        for r in worker:
            table.add_row(r["backend"], f"{r['suffix']:,}", r["row"], f"{r['ms']:.1f}", f"{r['bound_ms']:.1f}",
                          f"{r['x_bound']:.2f}", f"{r['load_gbps']:.1f}")
        console.print(table)
    if args.scheduler:
        sched = scheduler_rows(args)
        rows += sched
        table = Table(title=f"vLLM scheduler step with {args.running} running requests (decode)")
        for column in ("row", "step ms", "connector µs / request / step"):
            table.add_column(column)
        for r in sched:
            table.add_row(r["row"], f"{r['step_ms']:.2f}", f"{r['connector_us_per_request']:.2f}")
        console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
