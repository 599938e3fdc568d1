"""Actor-update throughput (tokens/s, MFU) of the Megatron ActorEngine vs a plain HF transformers step.

For each Qwen2-shaped model (random weights) it builds :class:`megarl.engines.megatron.actor.ActorEngine`
(local layer spec with the SDPA core attention, or megatron's own materialising ``DotProductAttention``
with ``--core-attention local``; bf16 params with fp32 main params and fp32 grads, Adam, grad clip 1.0, TP=PP=1),
computes the old log-probs (forward only, timed) and times ``update_policy`` on a GRPO-style batch: rows
of ``prompt_len + response_len`` tokens, every token real (no padding: the engine pads each micro-batch
to the batch's P + R and has no sequence packing, so full rows keep padding out of the count), groups of
``group_size`` rows sharing a normalised advantage, PPO-clip loss, one optimizer step per call.

The baseline is the same work in plain HF transformers: ``AutoModelForCausalLM.from_config`` (fp32 master
weights, bf16 autocast), the same micro-batching, the same log-prob function and policy loss, grad-norm
clip and ``torch.optim.AdamW(fused=True)``; once with SDPA attention (flash kernels, HF's default) and once
with eager attention (materialised scores, like megatron's local spec).

MFU = tokens/s * train_flops_per_token / peak (formula in :mod:`bench.shapes`), against the H200 dense
bf16 datasheet peak (989 TFLOP/s) and against an 8192^3 bf16 matmul measured in the same process.
``--device cpu --models tiny`` is the dry run that checks the script itself.
Left out: TP/PP > 1, sequence packing, the TE spec (Transformer Engine is not installed on the GPU box).
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from bench.measure import (
    H200_SPEC_BF16_DENSE_TFLOPS, bring_up_single_rank, environment, measure_matmul_tflops, peak_memory_gib,
    pick_device, reset_peak_memory, summarize, time_region, write_json,
)
from bench.shapes import forward_flops_per_token, matmul_params, qwen2_config, total_params, train_flops_per_token

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def make_grpo_batch(*, rows: int, prompt_len: int, response_len: int, vocab: int, group_size: int, seed: int):
    """Full-length rows (no padding) with GRPO advantages: one normalised scalar per row, constant in a group."""
    from megarl.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, vocab, (rows, prompt_len), generator=g)
    response_ids = torch.randint(0, vocab, (rows, response_len), generator=g)
    scores = torch.rand(rows, generator=g).view(-1, group_size)
    adv = ((scores - scores.mean(-1, keepdim=True)) / (scores.std(-1, keepdim=True) + 1e-6)).view(rows, 1)
    batch = TrainBatch(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids),
                       response_ids=response_ids, response_mask=torch.ones_like(response_ids),
                       group_ids=[str(i // group_size) for i in range(rows)])
    batch.advantages = adv.expand(rows, response_len).contiguous()
    return batch


def build_actor(hf_cfg: dict, *, dtype: torch.dtype, micro_batch_size: int, lr: float, core_attention: str = "sdpa"):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.parallel import ParallelLayout
    from megarl.models.bridge import ModelBridge

    bridge = ModelBridge.from_hf_config(hf_cfg, spec="local", core_attention=core_attention)
    config = bridge.transformer_config(layout=ParallelLayout(), params_dtype=dtype)

    def provider(pre_process, post_process, vp_stage=None):
        return bridge.build_model(config=config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

    optimizer = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=1.0,
                                bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=False)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                        use_distributed_optimizer=False)
    return ActorEngine(model_provider=provider, config=config, optimizer_config=optimizer, ddp_config=ddp,
                       micro_batch_size=micro_batch_size)


def rates(tokens: int, seconds: float, flops_per_token: float, matmul_tflops: float) -> dict[str, float]:
    achieved = tokens * flops_per_token / seconds / 1e12
    return {"tokens_per_s": tokens / seconds, "achieved_tflops": achieved,
            "mfu_vs_spec": achieved / H200_SPEC_BF16_DENSE_TFLOPS, "mfu_vs_measured_matmul": achieved / matmul_tflops}


def bench_megatron(hf_cfg, batch, args, device, matmul_tflops, core_attention: str = "sdpa") -> dict:
    reset_peak_memory(device)
    actor = build_actor(hf_cfg, dtype=_DTYPES[args.dtype], micro_batch_size=args.micro_batch_size, lr=1e-6,
                        core_attention=core_attention)
    seq = batch.input_ids.shape[1]
    tokens = batch.input_ids.numel()

    def forward():
        batch.old_log_probs, _ = actor.compute_log_probs(batch)

    fwd = time_region(forward, device=device, warmup=1, iters=args.iters)
    metrics = {}

    def update():
        metrics.update(actor.update_policy(batch, mini_batch_size=len(batch), policy_loss_name="ppo_clip"))

    upd = time_region(update, device=device, warmup=args.warmup, iters=args.iters)
    profile = profile_gpu_busy(update, device) if args.profile and device.type == "cuda" else None
    out = {
        "profile": profile,
        "log_prob_forward": {**summarize(fwd), **rates(tokens, statistics.median(fwd),
                                                       forward_flops_per_token(hf_cfg, seq), matmul_tflops)},
        "update_policy": {**summarize(upd), **rates(tokens, statistics.median(upd),
                                                    train_flops_per_token(hf_cfg, seq), matmul_tflops)},
        "core_attention": core_attention,
        "peak_memory_gib": peak_memory_gib(device),
        "last_metrics": {k: float(v) for k, v in metrics.items()},
    }
    del actor
    gc.collect()
    return out


def profile_gpu_busy(fn, device) -> dict:
    """One more call under torch.profiler: GPU kernel time vs wall time (a low ratio means the GPU waits on
    the host: launch/Python overhead), and the kernels that take the most GPU time."""
    import time

    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            wall = time.perf_counter() - start
        kernels = []
        for event in prof.key_averages():
            # Kernels only: CPU-side ops (aten::*) carry their kernels' device time too and would count twice.
            if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            device_us = getattr(event, "self_device_time_total", None)
            if device_us is None:
                device_us = getattr(event, "self_cuda_time_total", 0)
            if device_us > 0:
                kernels.append((event.key, device_us / 1e6, event.count))
        kernels.sort(key=lambda k: -k[1])
        busy = sum(k[1] for k in kernels)
        return {"wall_s": wall, "gpu_kernel_s": busy, "gpu_busy_fraction": busy / wall,
                "top_kernels": [{"name": n[:120], "seconds": t, "calls": c} for n, t, c in kernels[:12]]}
    except Exception as exc:  # the profiler is a diagnostic; the benchmark numbers stand without it
        return {"error": repr(exc)[:300]}


def bench_hf(hf_cfg, batch, args, device, matmul_tflops, attn_implementation: str) -> dict:
    import transformers

    from megarl.algorithms import get_policy_loss
    from megarl.engines.megatron.logprob import compute_vocab_parallel_log_probs
    from megarl.models.hf_config import load_hf_config

    reset_peak_memory(device)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        load_hf_config(hf_cfg), dtype=torch.float32, attn_implementation=attn_implementation).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=device.type == "cuda")
    policy_loss = get_policy_loss("ppo_clip")
    prompt_len = batch.prompt_ids.shape[1]
    rows, mbs = len(batch), args.micro_batch_size
    input_ids = batch.input_ids.to(device)
    response_ids = batch.response_ids.to(device)
    mask = batch.response_mask.to(device).float()
    advantages = batch.advantages.to(device)
    old = batch.old_log_probs.to(device)
    counts = dict(global_num_tokens=float(mask.sum()), global_num_seqs=float(rows), norm_length=mask.shape[1])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def step():
        for start in range(0, rows, mbs):
            sl = slice(start, start + mbs)
            with autocast:
                logits = model(input_ids=input_ids[sl], use_cache=False).logits
            log_probs, _ = compute_vocab_parallel_log_probs(logits[:, prompt_len - 1:-1], response_ids[sl])
            loss, _ = policy_loss(log_probs=log_probs, old_log_probs=old[sl], advantages=advantages[sl],
                                  response_mask=mask[sl], clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None,
                                  loss_agg_mode="token-mean", **counts)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = time_region(step, device=device, warmup=args.warmup, iters=args.iters)
    seq = input_ids.shape[1]
    out = {**summarize(seconds), **rates(input_ids.numel(), statistics.median(seconds),
                                         train_flops_per_token(hf_cfg, seq), matmul_tflops),
           "peak_memory_gib": peak_memory_gib(device)}
    del model, optimizer
    gc.collect()
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="0.5b,1.5b")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=3072)
    parser.add_argument("--rows", type=int, default=8, help="rows per optimizer step (GRPO: prompts x n)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    parser.add_argument("--hf-attn", default="sdpa,eager", help="HF baselines to run ('' for none)")
    parser.add_argument("--core-attention", default="sdpa",
                        help="megatron core attentions to run, comma-separated (sdpa, local); the first is "
                             "'megatron' in the JSON, the others 'megatron_<name>'")
    parser.add_argument("--profile", action="store_true", help="profile one extra megatron update (GPU only)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    if args.rows % args.group_size or args.rows % args.micro_batch_size:
        raise SystemExit(f"--rows {args.rows} must be a multiple of --group-size and --micro-batch-size")

    device = pick_device(args.device)
    bring_up_single_rank()
    matmul_tflops = measure_matmul_tflops(device) if device.type == "cuda" else float("nan")
    results = {"benchmark": "train_throughput", "environment": environment(device), "args": vars(args),
               "peak_spec_tflops": H200_SPEC_BF16_DENSE_TFLOPS, "measured_matmul_tflops": matmul_tflops,
               "flops_formula": "train = 3 * (2 * matmul_params + 2 * layers * seq * heads * head_dim)",
               "models": {}}
    for name in [m for m in args.models.split(",") if m]:
        hf_cfg = qwen2_config(name, torch_dtype=args.dtype)
        batch = make_grpo_batch(rows=args.rows, prompt_len=args.prompt_len, response_len=args.response_len,
                                vocab=hf_cfg["vocab_size"], group_size=args.group_size, seed=0)
        seq = args.prompt_len + args.response_len
        entry = {"total_params": total_params(hf_cfg), "matmul_params": matmul_params(hf_cfg),
                 "train_flops_per_token": train_flops_per_token(hf_cfg, seq), "seq_len": seq,
                 "tokens_per_step": batch.input_ids.numel()}
        cores = [c for c in args.core_attention.split(",") if c]
        try:
            entry["megatron"] = bench_megatron(hf_cfg, batch, args, device, matmul_tflops, cores[0])
        except torch.cuda.OutOfMemoryError as exc:
            entry["megatron"] = {"error": f"OOM: {exc}"[:300]}
            results["models"][name] = entry
            gc.collect()
            torch.cuda.empty_cache()
            continue
        for core in cores[1:]:
            try:
                entry[f"megatron_{core}"] = bench_megatron(hf_cfg, batch, args, device, matmul_tflops, core)
                entry[f"ratio_megatron_over_megatron_{core}"] = (
                    entry["megatron"]["update_policy"]["tokens_per_s"]
                    / entry[f"megatron_{core}"]["update_policy"]["tokens_per_s"])
            except torch.cuda.OutOfMemoryError as exc:
                entry[f"megatron_{core}"] = {"error": f"OOM: {exc}"[:300]}
                gc.collect()
                torch.cuda.empty_cache()
        for impl in [a for a in args.hf_attn.split(",") if a]:
            try:
                entry[f"hf_{impl}"] = bench_hf(hf_cfg, batch, args, device, matmul_tflops, impl)
                entry[f"ratio_megatron_over_hf_{impl}"] = (entry["megatron"]["update_policy"]["tokens_per_s"]
                                                           / entry[f"hf_{impl}"]["tokens_per_s"])
            except torch.cuda.OutOfMemoryError as exc:  # report and continue with the other baselines
                entry[f"hf_{impl}"] = {"error": f"OOM: {exc}"[:300]}
                gc.collect()
                torch.cuda.empty_cache()
        results["models"][name] = entry
        write_json(args.out, results)  # after every model, so a later failure keeps what was measured
        print(f"[train_throughput] {name}: megatron {entry['megatron']['update_policy']['tokens_per_s']:.0f} tok/s "
              f"MFU(spec) {entry['megatron']['update_policy']['mfu_vs_spec']:.3f}", flush=True)
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
