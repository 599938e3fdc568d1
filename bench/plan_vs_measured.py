"""The memory planner's per-GPU peak estimate next to measured peaks of real megatron actor updates.

GPU rows: the recorded ``torch.cuda.max_memory_allocated`` of ``ActorEngine.update_policy`` from
``bench/train_throughput.py`` (docs/benchmarks.md, "Actor update throughput", H200, 2026-12-02: bf16 params,
fp32 main grads + master params + Adam, local spec with materialised attention, no recompute, TP=PP=DP=1).
The planner is given the same shapes with ``KernelSpec.megatron_local(rmsnorm="fused")`` (torch 2.11's CUDA
RMSNorm is the fused kernel: checked on the device, it saves only its input) and no framework overhead,
since the allocator's peak counts tensors only (no CUDA context, no cached-but-free blocks).

CPU row, measured here: a child process (glibc told to ``mmap`` every block >= 64 KiB, so freed tensors
leave the resident set as they leave the CUDA allocator's count) first runs a throw-away tiny update so
torch's and megatron's one-off lazy state is resident, records VmRSS, builds the real fp32 model, runs one
update (Adam states now exist, as in every step after the first), resets VmHWM (``/proc/self/clear_refs``)
and runs a second update. Measured = VmHWM - the recorded VmRSS. fp32 on CPU maps to the planner as
``param_bytes=4`` (activations fp32, no master copy: megatron's FP32Optimizer steps the params themselves)
with ``KernelSpec.megatron_local(rmsnorm="composite")`` (torch's CPU RMSNorm is the composite decomposition).

    python -m bench.plan_vs_measured            # table of both
    python -m bench.plan_vs_measured --no-cpu   # GPU rows only
Left out: remeasuring the GPU rows (that is bench/train_throughput.py on the device).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

from bench.shapes import qwen2_config
from megarl.plan import KernelSpec, plan_actor_update
from megarl.plan.memory import GIB


@dataclass(frozen=True)
class MeasuredUpdate:
    """One measured actor update: the shapes it ran and its peak."""

    label: str
    hf_config: dict
    rows: int
    micro_batch_size: int
    prompt_len: int
    response_len: int
    param_bytes: int
    kernels: KernelSpec
    measured_gib: float
    source: str


_GPU_SOURCE = "docs/benchmarks.md, train_throughput, H200, 2026-12-02 14:01-14:06 UTC (max_memory_allocated)"
# recorded before f5ac0c1 put the chunked TP = 1 log-prob path in the engine (the planner's default now)
GPU_KERNELS = KernelSpec.megatron_local(rmsnorm="fused", log_prob="fp32_buffers")
CPU_KERNELS = KernelSpec.megatron_local(rmsnorm="composite")

GPU_MEASUREMENTS = (
    MeasuredUpdate("Qwen2.5-0.5B shape, 8 x 4096, mbs 1", qwen2_config("0.5b"), 8, 1, 1024, 3072, 2, GPU_KERNELS,
                   53.6, _GPU_SOURCE),
    MeasuredUpdate("Qwen2.5-1.5B shape, 8 x 4096, mbs 1", qwen2_config("1.5b"), 8, 1, 1024, 3072, 2, GPU_KERNELS,
                   78.7, _GPU_SOURCE),
    MeasuredUpdate("Qwen2.5-0.5B shape, 16 x 2048, mbs 4", qwen2_config("0.5b"), 16, 4, 512, 1536, 2, GPU_KERNELS,
                   68.5, _GPU_SOURCE),
)

# ~31M parameters, GQA 8/2 with q/k/v biases and tied embeddings like Qwen2; 512 tokens, micro-batch 2.
CPU_MODEL = qwen2_config("tiny", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=16384, torch_dtype="float32")
# 4 x 256 tokens: activations still ~40% of the peak (the state the rest), in 23 s on the 2-core CI machine
CPU_SHAPE = dict(rows=4, micro_batch_size=2, prompt_len=64, response_len=192)


def estimate_gib(run: MeasuredUpdate) -> float:
    phase = plan_actor_update(run.hf_config, rows=run.rows, micro_batch_size=run.micro_batch_size,
                              prompt_len=run.prompt_len, response_len=run.response_len,
                              param_bytes=run.param_bytes, kernels=run.kernels)
    return phase.total / GIB


def _run_child(hf_cfg: dict, shape: dict) -> dict:
    """In the child process: the measurement the module docstring describes; returns bytes."""
    import gc

    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from bench.measure import bring_up_single_rank
    from megarl.checkpoint_io.memory import current_rss_bytes, peak_rss_bytes
    from megarl.batch import TrainBatch
    from megarl.engines.megatron.actor import ActorEngine
    from megarl.models.cpu_compat import enable_cpu_compat
    from megarl.engines.megatron.parallel import ParallelLayout
    from megarl.models.bridge import ModelBridge

    torch.set_num_threads(1)
    enable_cpu_compat()
    bring_up_single_rank()

    def build(cfg):
        try:  # megatron's materialising DotProductAttention, as in the recorded GPU runs
            bridge = ModelBridge.from_hf_config(cfg, spec="local", core_attention="local")
        except TypeError:  # a bridge from before the SDPA option: local attention is all it has
            bridge = ModelBridge.from_hf_config(cfg, spec="local")
        config = bridge.transformer_config(layout=ParallelLayout(), params_dtype=torch.float32)

        def provider(pre_process, post_process, vp_stage=None):
            return bridge.build_model(config=config, pre_process=pre_process, post_process=post_process,
                                      vp_stage=vp_stage)

        optimizer = OptimizerConfig(optimizer="adam", lr=1e-6, weight_decay=0.0, clip_grad=1.0, bf16=False,
                                    params_dtype=torch.float32, use_distributed_optimizer=False)
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False)
        return ActorEngine(model_provider=provider, config=config, optimizer_config=optimizer, ddp_config=ddp,
                           micro_batch_size=shape["micro_batch_size"])

    def batch_for(cfg, rows, prompt_len, response_len):
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, cfg["vocab_size"], (rows, prompt_len), generator=g)
        response = torch.randint(0, cfg["vocab_size"], (rows, response_len), generator=g)
        batch = TrainBatch(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), response_ids=response,
                           response_mask=torch.ones_like(response), group_ids=[str(i // 2) for i in range(rows)])
        batch.advantages = torch.randn(rows, 1, generator=g).expand(rows, response_len).contiguous()
        return batch

    def update(actor, batch):
        batch.old_log_probs, _ = actor.compute_log_probs(batch)
        return actor.update_policy(batch, mini_batch_size=len(batch), policy_loss_name="ppo_clip")

    # One-off lazy state (op registrations, megatron buffers, gloo) on a throw-away tiny model.
    tiny = qwen2_config("tiny", torch_dtype="float32")
    update(build(tiny), batch_for(tiny, 2, 8, 8))
    gc.collect()
    baseline = current_rss_bytes()

    actor = build(hf_cfg)
    batch = batch_for(hf_cfg, shape["rows"], shape["prompt_len"], shape["response_len"])
    after_build = current_rss_bytes()
    update(actor, batch)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset VmHWM to the current RSS
    before_step = current_rss_bytes()
    metrics = update(actor, batch)
    peak = peak_rss_bytes()
    num_params = sum(p.numel() for chunk in actor.model for p in chunk.parameters())
    return {"baseline_rss": baseline, "model_built_over_baseline": after_build - baseline,
            "state_over_baseline": before_step - baseline, "peak_over_baseline": peak - baseline,
            "num_params": num_params, "grad_norm": metrics["grad_norm"]}


def measure_cpu_update(hf_cfg: dict = CPU_MODEL, shape: dict = CPU_SHAPE, timeout: float = 300) -> dict:
    """Run the CPU measurement in a fresh process and return its result dict (bytes)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    payload = json.dumps({"hf_config": hf_cfg, "shape": shape})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "bench.plan_vs_measured", "--child", payload], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"CPU measurement failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def cpu_run(measured: dict, hf_cfg: dict = CPU_MODEL, shape: dict = CPU_SHAPE) -> MeasuredUpdate:
    tokens = shape["prompt_len"] + shape["response_len"]
    return MeasuredUpdate(f"CPU Qwen2-shaped ~31M, fp32, {shape['rows']} x {tokens}, mbs {shape['micro_batch_size']}",
                          hf_cfg, shape["rows"],
                          shape["micro_batch_size"], shape["prompt_len"], shape["response_len"], 4, CPU_KERNELS,
                          measured["peak_over_baseline"] / GIB, "measured now: VmHWM - VmRSS baseline")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU measurement")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print("RESULT " + json.dumps(_run_child(spec["hf_config"], spec["shape"])), flush=True)
        return []
    runs = list(GPU_MEASUREMENTS)
    if not args.no_cpu:
        measured = measure_cpu_update()
        print(f"CPU measurement: {json.dumps(measured)}")
        runs.append(cpu_run(measured))
    rows = []
    print(f"{'run':<44} {'estimate GiB':>12} {'measured GiB':>12} {'est/meas':>9}")
    for run in runs:
        est = estimate_gib(run)
        rows.append({"run": run.label, "estimate_gib": est, "measured_gib": run.measured_gib,
                     "ratio": est / run.measured_gib, "source": run.source})
        print(f"{run.label:<44} {est:12.3f} {run.measured_gib:12.3f} {est / run.measured_gib:9.3f}")
    return rows


if __name__ == "__main__":
    main()
