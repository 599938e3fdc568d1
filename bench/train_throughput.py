"""Actor-update throughput (tokens/s, MFU) of the Megatron ActorEngine vs a plain HF transformers step.

For each Qwen2-shaped model (random weights) it builds :class:`megarl.engines.megatron.actor.ActorEngine`
(local layer spec with the SDPA core attention, or megatron's own materialising ``DotProductAttention``
with ``--core-attention local``; bf16 params with fp32 main params and fp32 grads, Adam, grad clip 1.0,
TP=PP=1), computes the old log-probs (forward only, timed) and times ``update_policy`` on a GRPO-style
batch: ``--rows`` rows, groups of ``--group-size`` rows sharing a normalised advantage, PPO-clip loss, one
optimizer step per call.

Data (``--response-len-dist``):

* ``full`` (default): every row is ``prompt_len + response_len`` real tokens, no padding anywhere;
* ``uniform``: what a rollout hands the trainer. Each row's real prompt length is drawn uniformly from
  ``[prompt_len // 2, prompt_len]`` and its response length from ``[response_len // 8, response_len]``
  (seeded, per row); prompts are left-padded to ``prompt_len`` and responses right-padded to
  ``response_len``, as ``megarl.trainer.rollout_assembly`` pads to the configured maxima.

Micro-batches (``--max-tokens-per-micro-batch``, a comma list; each entry is its own megatron measurement
in the same process): an integer budget runs the engine with sequence packing
(``MicroBatching(sequence_packing=True, max_tokens_per_micro_batch=N)``: each micro-batch is one ``thd``
stream of its rows' real tokens, rows grouped into balanced bins under the budget); ``padded`` (or no
flag at all) runs today's padded micro-batches of ``--micro-batch-size`` rows, each ``P + R`` wide.

Baselines, the same work in plain HF transformers: ``AutoModelForCausalLM.from_config`` (fp32 master
weights, bf16 autocast), the same log-prob function and PPO-clip loss, grad-norm clip and
``torch.optim.AdamW(fused=True)``, on the same batch in the same process:

* padded (``--hf-attn`` implementations x ``--hf-micro-batch-size`` row counts): consecutive rows, each
  micro-batch trimmed to its own longest row (the padding columns common to all its rows are dropped,
  as a reasonable HF loop would), ``attention_mask`` and ``position_ids`` passed when padding is left;
* packed (``--hf-packed``, ``--hf-packed-attn`` implementations x every integer budget): the engine's
  own token-budget plan (:func:`megarl.engines.megatron.packing.plan_token_budget`), each micro-batch
  one ``[1, T]`` row of real tokens with ``position_ids`` restarting at 0 per sequence and no
  ``attention_mask``: transformers (>= 4.54) detects the packing from the positions and builds a
  block-diagonal causal mask (with SDPA a ``[T, T]`` boolean mask, so the memory-efficient kernel computes
  all ``T^2`` scores: HF has no varlen kernel here without flash-attn). Log-probs are taken over the whole
  stream and the response positions kept, as the engine does.

Counted: tokens/s are *real* tokens (``attention_mask`` sum); FLOPs are the useful work of each sequence
(:func:`bench.shapes.train_flops_for_lengths`: matmuls per real token plus causal attention per row), so
padding and cross-row attention are overhead that lowers MFU. MFU is against the H200 dense bf16
datasheet peak (989 TFLOP/s) and an 8192^3 bf16 matmul measured in the same process. Each measurement
also reports its micro-batch count and padding fraction (pad tokens / computed tokens). JSON keys: the
first megatron measurement (first core attention, first budget) is ``megatron``, others
``megatron[_<core>][_padded|_tok<N>]``; HF ``hf_<impl>[_mbs<M>]`` and ``hf_packed_<impl>_tok<N>``;
``ratio_<a>_over_<b>`` (tokens/s) for every megatron measurement over every HF one, and for ``megatron``
over the other megatron ones. The results file is rewritten after every measurement, so a run stopped at
a time limit keeps what it finished.
``--device cpu --models tiny`` is the dry run that checks the script itself.
Left out: TP/PP > 1, the TE spec (Transformer Engine is not installed on the GPU box), packing with
``--core-attention local`` (megatron's ``DotProductAttention`` has no ``thd`` path).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
from typing import Optional

import torch

from bench.measure import (
    H200_SPEC_BF16_DENSE_TFLOPS, allocator_retries, bring_up_single_rank, environment, measure_matmul_tflops, peak_memory_gib,
    pick_device, reset_peak_memory, summarize, time_region, write_json,
)
from bench.shapes import (
    forward_flops_for_lengths, matmul_params, qwen2_config, total_params, train_flops_for_lengths,
    train_flops_per_token,
)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_PAD_ID = 0
PADDED = None  # the budget entry meaning "padded micro-batches of --micro-batch-size rows"


def make_grpo_batch(*, rows: int, prompt_len: int, response_len: int, vocab: int, group_size: int, seed: int,
                    length_dist: str = "full"):
    """GRPO rows (module docstring, "Data") with advantages: one normalised scalar per row, constant in a group."""
    from megarl.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, vocab, (rows, prompt_len), generator=g)
    response_ids = torch.randint(0, vocab, (rows, response_len), generator=g)
    if length_dist == "full":
        prompt_real = torch.full((rows,), prompt_len)
        response_real = torch.full((rows,), response_len)
    elif length_dist == "uniform":
        prompt_real = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (rows,), generator=g)
        response_real = torch.randint(max(1, response_len // 8), response_len + 1, (rows,), generator=g)
    else:
        raise ValueError(f"unknown length distribution {length_dist!r} (full, uniform)")
    prompt_mask = (torch.arange(prompt_len)[None] >= prompt_len - prompt_real[:, None]).long()  # left-padded
    response_mask = (torch.arange(response_len)[None] < response_real[:, None]).long()  # right-padded
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, _PAD_ID)
    response_ids = response_ids.masked_fill(response_mask == 0, _PAD_ID)
    scores = torch.rand(rows, generator=g).view(-1, group_size)
    adv = ((scores - scores.mean(-1, keepdim=True)) / (scores.std(-1, keepdim=True) + 1e-6)).view(rows, 1)
    batch = TrainBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                       response_mask=response_mask, group_ids=[str(i // group_size) for i in range(rows)])
    batch.advantages = adv.expand(rows, response_len).contiguous()
    return batch


def row_lengths(batch) -> list[int]:
    """Real tokens (prompt + response) of each row."""
    return batch.attention_mask.sum(dim=1).tolist()


# ModelBridge.transformer_config(fused_kernels=...): megatron's torch.compile'd SwiGLU and bias-dropout-add
# (the engine's default on CUDA); "on-megatron-rope": the same with megatron's own per-sequence RoPE for packed
# micro-batches instead of megarl's whole-stream one (megarl.models.packed_rope, the default);
# "on-eager-norm-rope": megarl's RMSNorm and whole-stream RoPE run eager instead of compiled (megarl.models.compiled).
FUSIONS = {"off": False, "on": True, "on-megatron-rope": True, "on-eager-norm-rope": True}


def _fusion_scope(fusions: str):
    from megarl.models import compiled
    from megarl.models.fused_norm import rms_norm
    from megarl.models.packed_rope import rotate_stream

    return compiled.eager_only(rms_norm, rotate_stream) if fusions == "on-eager-norm-rope" else contextlib.nullcontext()


def build_actor(hf_cfg: dict, *, dtype: torch.dtype, micro_batch_size: int, lr: float, core_attention: str = "sdpa",
                max_tokens_per_micro_batch: Optional[int] = None, fusions: str = "on"):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.micro_batches import MicroBatching
    from megarl.engines.megatron.parallel import ParallelLayout
    from megarl.models.bridge import ModelBridge

    bridge = ModelBridge.from_hf_config(hf_cfg, spec="local", core_attention=core_attention)
    config = bridge.transformer_config(layout=ParallelLayout(), params_dtype=dtype, fused_kernels=FUSIONS[fusions])

    def provider(pre_process, post_process, vp_stage=None):
        from megarl.models import packed_rope

        model = bridge.build_model(config=config, pre_process=pre_process, post_process=post_process,
                                   vp_stage=vp_stage)
        packed_rope.use(fusions != "on-megatron-rope")  # process-wide: set for each engine built
        return model

    optimizer = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=1.0,
                                bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=False)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                        use_distributed_optimizer=False)
    packed = max_tokens_per_micro_batch is not None
    return ActorEngine(model_provider=provider, config=config, optimizer_config=optimizer, ddp_config=ddp,
                       micro_batch_size=micro_batch_size,
                       micro_batching=MicroBatching(sequence_packing=packed,
                                                    max_tokens_per_micro_batch=max_tokens_per_micro_batch))


def rates(tokens: int, seconds: float, flops: float, matmul_tflops: float) -> dict[str, float]:
    """``tokens`` real tokens and ``flops`` useful FLOPs done in ``seconds``."""
    achieved = flops / seconds / 1e12
    return {"tokens_per_s": tokens / seconds, "achieved_tflops": achieved,
            "mfu_vs_spec": achieved / H200_SPEC_BF16_DENSE_TFLOPS, "mfu_vs_measured_matmul": achieved / matmul_tflops}


def layout_stats(computed_tokens: list[int], real_tokens: list[int]) -> dict:
    """Per-step micro-batch shape: computed tokens are what the model runs (padding included)."""
    computed, real = sum(computed_tokens), sum(real_tokens)
    return {"num_micro_batches": len(computed_tokens), "computed_tokens": computed, "real_tokens": real,
            "padding_fraction": (computed - real) / computed,
            "micro_batch_real_tokens": real_tokens, "micro_batch_computed_tokens": computed_tokens}


def bench_megatron(hf_cfg, batch, args, device, matmul_tflops, core_attention: str = "sdpa",
                   max_tokens: Optional[int] = PADDED, fusions: str = "on") -> dict:
    reset_peak_memory(device)
    actor = build_actor(hf_cfg, dtype=_DTYPES[args.dtype], micro_batch_size=args.micro_batch_size, lr=1e-6,
                        core_attention=core_attention, max_tokens_per_micro_batch=max_tokens, fusions=fusions)
    lengths = row_lengths(batch)
    tokens = sum(lengths)
    # The engine's own plan and layout (what update_policy will run), for the padding and micro-batch counts.
    planned = actor.make_micro_batches(batch)
    layout = layout_stats([mb["input_ids"].numel() for mb in planned],
                          [sum(lengths[r] for r in mb["rows"]) for mb in planned])
    del planned

    def forward():
        batch.old_log_probs, _ = actor.compute_log_probs(batch)

    metrics = {}

    def update():
        metrics.update(actor.update_policy(batch, mini_batch_size=len(batch), policy_loss_name="ppo_clip"))

    with _fusion_scope(fusions):
        fwd = time_region(forward, device=device, warmup=1, iters=args.iters)
        upd = time_region(update, device=device, warmup=args.warmup, iters=args.iters)
        trace = os.path.join(args.trace_dir, f"trace_{fusions}_{max_tokens}.json.gz") if args.trace_dir else None
        profile = profile_gpu_busy(update, device, trace) if args.profile and device.type == "cuda" else None
    out = {
        "layout": "padded" if max_tokens is PADDED else "packed",
        "core_attention": core_attention,
        "fusions": fusions,
        "micro_batch_size": args.micro_batch_size if max_tokens is PADDED else None,
        "max_tokens_per_micro_batch": max_tokens,
        **layout,
        "profile": profile,
        "log_prob_forward": {**summarize(fwd), **rates(tokens, statistics.median(fwd),
                                                       forward_flops_for_lengths(hf_cfg, lengths), matmul_tflops)},
        "update_policy": {**summarize(upd), **rates(tokens, statistics.median(upd),
                                                    train_flops_for_lengths(hf_cfg, lengths), matmul_tflops)},
        "peak_memory_gib": peak_memory_gib(device),
        "allocator_retries": allocator_retries(device),
        "last_metrics": {k: float(v) for k, v in metrics.items()},
    }
    del actor
    gc.collect()
    return out


def profile_gpu_busy(fn, device, trace_path: Optional[str] = None) -> dict:
    """One more call under torch.profiler: GPU kernel time vs wall time (a low ratio means the GPU waits on
    the host: launch/Python overhead), and the kernels that take the most GPU time. With ``trace_path`` the
    trace (Python stacks included) is written there, gzipped, and its idle gaps are charged to the host code
    that caused them (:mod:`bench.trace_gaps`)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=bool(trace_path)) as prof:
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
        out = {"wall_s": wall, "gpu_kernel_s": busy, "gpu_busy_fraction": busy / wall,
               "top_kernels": [{"name": n[:120], "seconds": t, "calls": c} for n, t, c in kernels[:12]]}
        if trace_path:
            out["gaps"] = _trace_and_gaps(prof, trace_path)
        return out
    except Exception as exc:  # the profiler is a diagnostic; the benchmark numbers stand without it
        return {"error": repr(exc)[:300]}


def _trace_and_gaps(prof, trace_path: str) -> dict:
    import gzip
    import shutil

    from bench.trace_gaps import analyse, load_events

    plain = trace_path.removesuffix(".gz")
    prof.export_chrome_trace(plain)
    with open(plain, "rb") as source, gzip.open(plain + ".gz", "wb", compresslevel=6) as target:
        shutil.copyfileobj(source, target)
    os.remove(plain)
    gaps = analyse(load_events(plain + ".gz"))
    return {**{k: v for k, v in gaps.items() if not isinstance(v, list)},
            "host_late": gaps["host_late"][:15], "host_waits": gaps["host_waits"][:15]}


# ---------------------------------------------------------------------------------------- HF baseline

def _per_row_fields(batch, index: torch.Tensor, columns: slice, device) -> dict:
    out = {"response_mask": batch.response_mask[index, columns].to(device).float()}
    for name in ("response_ids", "old_log_probs", "advantages"):
        value = getattr(batch, name)
        out[name] = None if value is None else value[index, columns].to(device)
    return out


def hf_padded_micro_batches(batch, micro_batch_size: int, device) -> list[dict]:
    """Consecutive rows, each micro-batch cut to its own longest prompt and response (left-padded prompts
    keep their last columns, right-padded responses their first)."""
    prompt_len = batch.prompt_ids.shape[1]
    out = []
    for start in range(0, len(batch), micro_batch_size):
        index = torch.arange(start, min(start + micro_batch_size, len(batch)))
        p_from = prompt_len - int(batch.prompt_mask[index].sum(dim=1).max())
        r_to = max(1, int(batch.response_mask[index].sum(dim=1).max()))
        attention_mask = torch.cat([batch.prompt_mask[index, p_from:], batch.response_mask[index, :r_to]], dim=1)
        padded = not bool(attention_mask.all())
        mb = {
            "layout": "padded",
            "input_ids": torch.cat([batch.prompt_ids[index, p_from:], batch.response_ids[index, :r_to]],
                                   dim=1).to(device),
            # Without padding, HF's defaults (causal, positions 0..S-1) are exactly right and let SDPA skip the mask.
            "attention_mask": attention_mask.to(device) if padded else None,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0).to(device) if padded else None,
            "prompt_len": prompt_len - p_from,
            "real_tokens": int(attention_mask.sum()),
            **_per_row_fields(batch, index, slice(0, r_to), device),
        }
        out.append(mb)
    return out


def hf_packed_micro_batches(batch, plan: list[list[int]], device) -> list[dict]:
    """Each micro-batch of ``plan`` as one ``[1, T]`` stream of its rows' real tokens, positions 0..L_i-1
    per row; ``predict_index`` is the stream position of the logit predicting each real response token
    (row-major over ``response_mask``)."""
    out = []
    for rows in plan:
        index = torch.as_tensor(rows, dtype=torch.long)
        real = batch.attention_mask[index].bool()
        lengths = real.sum(dim=1)
        starts = torch.cumsum(lengths, 0) - lengths
        response_mask = batch.response_mask[index].bool()
        prompt_real = batch.prompt_mask[index].sum(dim=1)
        grid = (starts + prompt_real - 1)[:, None] + torch.arange(response_mask.shape[1])[None, :]
        mb = {
            "layout": "packed",
            "input_ids": batch.input_ids[index][real][None].to(device),
            "attention_mask": None,
            "position_ids": torch.cat([torch.arange(int(n)) for n in lengths])[None].to(device),
            "predict_index": grid[response_mask].to(device),
            "real_tokens": int(lengths.sum()),
            **_per_row_fields(batch, index, slice(None), device),
        }
        out.append(mb)
    return out


def hf_response_log_probs(model, mb: dict, autocast) -> torch.Tensor:
    """``[b, R]`` fp32 log-probs of ``mb``'s response tokens (zeros at padding when packed)."""
    from megarl.engines.megatron.logprob import compute_vocab_parallel_log_probs

    with autocast:
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                       position_ids=mb["position_ids"], use_cache=False).logits
    if mb["layout"] == "padded":
        start = mb["prompt_len"] - 1  # the logit at position t predicts token t + 1
        log_probs, _ = compute_vocab_parallel_log_probs(logits[:, start:-1], mb["response_ids"])
        return log_probs
    # As the megatron engine does: score the whole stream's next tokens (a view, no logits-sized copy),
    # then keep the response ones.
    stream = mb["input_ids"][0]
    every, _ = compute_vocab_parallel_log_probs(logits[0, :-1], stream[1:])
    mask = mb["response_mask"].bool()
    return every.new_zeros(mask.shape).masked_scatter(mask, every.index_select(0, mb["predict_index"]))


def require_hf_packed_sequence_support() -> None:
    """Packed rows without an attention mask are only correct if transformers builds the block-diagonal
    mask from ``position_ids``; an older version would let rows attend to each other silently."""
    from transformers import masking_utils

    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__} does not detect packed sequences from "
                           f"position_ids; --hf-packed needs transformers >= 4.54")


def build_hf_model(hf_cfg: dict, attn_implementation: str, device):
    import transformers

    from megarl.models.hf_config import load_hf_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        load_hf_config(hf_cfg), dtype=torch.float32, attn_implementation=attn_implementation).to(device)
    return model


def bench_hf(hf_cfg, batch, args, device, matmul_tflops, attn_implementation: str, *,
             micro_batch_size: Optional[int] = None, max_tokens: Optional[int] = None) -> dict:
    """Padded micro-batches of ``micro_batch_size`` rows, or (``max_tokens``) packed token-budget ones."""
    from megarl.algorithms import get_policy_loss
    from megarl.engines.megatron.packing import plan_token_budget

    packed = max_tokens is not None
    if packed:
        require_hf_packed_sequence_support()
    reset_peak_memory(device)
    model = build_hf_model(hf_cfg, attn_implementation, device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=device.type == "cuda")
    policy_loss = get_policy_loss("ppo_clip")
    lengths = row_lengths(batch)
    counts = dict(global_num_tokens=float(batch.response_mask.sum()), global_num_seqs=float(len(batch)),
                  norm_length=batch.response_ids.shape[1])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    plan = plan_token_budget(lengths, max_tokens) if packed else None

    def micro_batches():
        if packed:
            return hf_packed_micro_batches(batch, plan, device)
        return hf_padded_micro_batches(batch, micro_batch_size, device)

    last = {}

    def step():
        total = 0.0
        for mb in micro_batches():  # laid out inside the step, as the engine does in update_policy
            log_probs = hf_response_log_probs(model, mb, autocast)
            loss, _ = policy_loss(log_probs=log_probs, old_log_probs=mb["old_log_probs"],
                                  advantages=mb["advantages"], response_mask=mb["response_mask"],
                                  clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None,
                                  loss_agg_mode="token-mean", **counts)
            loss.backward()
            total = total + loss.detach()  # stays on the device: no host sync inside the timed step
        last.update(pg_loss=total, grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    planned = micro_batches()
    layout = layout_stats([mb["input_ids"].numel() for mb in planned], [mb["real_tokens"] for mb in planned])
    del planned
    seconds = time_region(step, device=device, warmup=args.warmup, iters=args.iters)
    out = {"layout": "packed" if packed else "padded", "attn_implementation": attn_implementation,
           "micro_batch_size": None if packed else micro_batch_size, "max_tokens_per_micro_batch": max_tokens,
           **layout, **summarize(seconds),
           **rates(sum(lengths), statistics.median(seconds), train_flops_for_lengths(hf_cfg, lengths), matmul_tflops),
           "peak_memory_gib": peak_memory_gib(device),
           # the last step's loss and pre-clip grad norm: both must be finite (padding or packing gone wrong
           # shows up here first); not comparable to megatron's, whose random init differs
           "last_metrics": {k: float(v) for k, v in last.items()}}
    del model, optimizer, last
    gc.collect()
    return out


# ---------------------------------------------------------------------------------------------- driver

def parse_budgets(text: str) -> list[Optional[int]]:
    """``"padded,16384"`` -> ``[None, 16384]``; empty -> ``[None]`` (padded only)."""
    budgets: list[Optional[int]] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if item.lower() in ("padded", "none"):
            budgets.append(PADDED)
        else:
            try:
                budgets.append(int(item))
            except ValueError:
                raise SystemExit(f"--max-tokens-per-micro-batch: {item!r} is neither an integer nor 'padded'")
    return budgets or [PADDED]


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"{flag} takes a comma-separated list of integers, got {text!r}")


def megatron_key(core_index: int, core: str, budget_index: int, budget: Optional[int],
                 fusion_index: int = 0, fusions: str = "off") -> str:
    key = "megatron" + (f"_{core}" if core_index else "")
    if budget_index:
        key += "_padded" if budget is PADDED else f"_tok{budget}"
    if fusion_index:
        key += f"_fusions_{fusions}"
    return key


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def save_quietly(path: Optional[str], payload: dict) -> None:
    """The results so far, without write_json's echo: a run killed at its time limit keeps what it measured."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(json.dumps(payload, indent=2, default=str) + "\n")


def _update_stats(measurement: dict) -> Optional[dict]:
    """The timed-step numbers of a measurement (megatron: its update_policy), None if it failed."""
    if "error" in measurement:
        return None
    return measurement.get("update_policy", measurement)


def progress(name: str, key: str, measurement: dict) -> None:
    stats = _update_stats(measurement)
    text = measurement["error"][:120] if stats is None else (
        f"{stats['tokens_per_s']:,.0f} real tok/s, MFU(spec) {stats['mfu_vs_spec']:.3f}, "
        f"{measurement['num_micro_batches']} micro-batches, padding {measurement['padding_fraction']:.1%}, "
        f"step {stats['median_s']:.2f} s")
    print(f"[train_throughput] {name} {key}: {text}", flush=True)


def add_ratios(entry: dict, megatron_keys: list[str], hf_keys: list[str]) -> None:
    measured = {k: _update_stats(entry[k]) for k in megatron_keys + hf_keys if k in entry}
    for a in megatron_keys:
        if measured.get(a) is None:
            continue
        others = hf_keys + ([k for k in megatron_keys if k != a] if a == "megatron" else [])
        for b in others:
            if measured.get(b) is not None:
                entry[f"ratio_{a}_over_{b}"] = measured[a]["tokens_per_s"] / measured[b]["tokens_per_s"]


def format_table(name: str, entry: dict, megatron_keys: list[str], hf_keys: list[str]) -> str:
    """Console summary of one model: one line per measurement; the last column compares with the megatron
    measurement of the same token budget for packed HF, else with ``megatron``."""
    header = (f"{'measurement':<28} {'layout':<14} {'mbs':>4} {'pad':>6} {'real tok/s':>11} {'TFLOP/s':>8} "
              f"{'MFU spec':>8} {'MFU mm':>7} {'peak GiB':>8}  megatron/this")
    lines = [f"== {name}: {entry['tokens_per_step']} real tokens/step in {entry['rows']} rows "
             f"(padded width {entry['seq_len']}, {entry['length_dist']} lengths)", header]
    for key in megatron_keys + hf_keys:
        m = entry.get(key)
        if m is None:
            continue
        if "error" in m:
            lines.append(f"{key:<28} {m['error'][:90]}")
            continue
        stats = _update_stats(m)
        layout = m["layout"] + (f" {m['max_tokens_per_micro_batch']}" if m["layout"] == "packed"
                                else f" x{m['micro_batch_size']}")
        versus = "megatron"
        if key.startswith("hf_packed_"):
            versus = f"megatron_tok{m['max_tokens_per_micro_batch']}"
            if versus not in entry and entry.get("megatron", {}).get("max_tokens_per_micro_batch") == \
                    m["max_tokens_per_micro_batch"]:
                versus = "megatron"
        ratio = entry.get(f"ratio_{versus}_over_{key}")
        peak = m.get("peak_memory_gib", float("nan"))
        lines.append(f"{key:<28} {layout:<14} {m['num_micro_batches']:>4} {m['padding_fraction']:>6.1%} "
                     f"{stats['tokens_per_s']:>11,.0f} {stats['achieved_tflops']:>8.1f} {stats['mfu_vs_spec']:>8.1%} "
                     f"{stats['mfu_vs_measured_matmul']:>7.1%} {peak:>8.1f}  "
                     + (f"{ratio:.2f} ({versus})" if ratio is not None else "-"))
        if "log_prob_forward" in m:
            f = m["log_prob_forward"]
            lines.append(f"{key + ' log-prob fwd':<28} {'':<14} {'':>4} {'':>6} {f['tokens_per_s']:>11,.0f} "
                         f"{f['achieved_tflops']:>8.1f} {f['mfu_vs_spec']:>8.1%} {f['mfu_vs_measured_matmul']:>7.1%}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="0.5b,1.5b")
    parser.add_argument("--prompt-len", type=int, default=1024, help="prompt width (the maximum prompt length)")
    parser.add_argument("--response-len", type=int, default=3072, help="response width (the maximum response length)")
    parser.add_argument("--response-len-dist", default="full", choices=["full", "uniform"],
                        help="full: every row P + R real tokens; uniform: prompt lengths U[P/2, P], response "
                             "lengths U[R/8, R], left/right padded (module docstring)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch (tokens, lengths, advantages)")
    parser.add_argument("--rows", type=int, default=8, help="rows per optimizer step (GRPO: prompts x n)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=1, help="rows per padded megatron micro-batch")
    parser.add_argument("--max-tokens-per-micro-batch", default="",
                        help="megatron token budgets, comma-separated, each its own measurement: an integer "
                             "packs sequences under that budget, 'padded' runs --micro-batch-size padded rows "
                             "(the default when the flag is absent)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    parser.add_argument("--hf-attn", default="sdpa,eager", help="padded HF baselines to run ('' for none)")
    parser.add_argument("--hf-micro-batch-size", default=None,
                        help="rows per padded HF micro-batch, comma-separated (default: --micro-batch-size)")
    parser.add_argument("--hf-packed", action="store_true",
                        help="also run HF on the packed token-budget micro-batches of every integer budget")
    parser.add_argument("--hf-packed-attn", default="sdpa", help="attention implementations of the packed HF runs")
    parser.add_argument("--core-attention", default="sdpa",
                        help="megatron core attentions to run, comma-separated (sdpa, local); the first is "
                             "'megatron' in the JSON, the others 'megatron_<name>'")
    parser.add_argument("--fusions", default=None,
                        help="megatron fused-kernel variants to run, comma-separated (on: torch.compile'd SwiGLU "
                             "and bias-dropout-add, the engine's CUDA default; off); the first is the plain key, "
                             "others '_fusions_<v>'. Default: on with CUDA, off on CPU")
    parser.add_argument("--profile", action="store_true", help="profile one extra megatron update (GPU only)")
    parser.add_argument("--trace-dir", default=None,
                        help="with --profile: write each profiled update's trace here and charge its GPU idle gaps "
                             "to host code (bench/trace_gaps.py)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)

    budgets = parse_budgets(args.max_tokens_per_micro_batch)
    packed_budgets = [b for b in budgets if b is not PADDED]
    cores = [c for c in args.core_attention.split(",") if c]
    if args.fusions is None:
        args.fusions = "on" if pick_device(args.device).type == "cuda" else "off"
    fusion_variants = [f for f in args.fusions.split(",") if f]
    if not fusion_variants or any(f not in FUSIONS for f in fusion_variants):
        raise SystemExit(f"--fusions takes a comma list of {sorted(FUSIONS)}, got {args.fusions!r}")
    if any(f != "off" for f in fusion_variants) and pick_device(args.device).type != "cuda":
        raise SystemExit("--fusions on compiles CUDA kernels: GPU only")
    hf_mbs = _ints(args.hf_micro_batch_size or str(args.micro_batch_size), "--hf-micro-batch-size")
    width = args.prompt_len + args.response_len
    if args.rows % args.group_size or any(args.rows % m for m in [args.micro_batch_size, *hf_mbs]):
        raise SystemExit(f"--rows {args.rows} must be a multiple of --group-size and of every micro-batch size")
    if any(b < width for b in packed_budgets):
        raise SystemExit(f"every token budget must hold a full row: >= --prompt-len + --response-len = {width}")
    if packed_budgets and "local" in cores:
        raise SystemExit("--core-attention local has no packed (thd) path; run it with padded micro-batches")
    if args.hf_packed and not packed_budgets:
        raise SystemExit("--hf-packed needs an integer --max-tokens-per-micro-batch")

    device = pick_device(args.device)
    bring_up_single_rank()
    matmul_tflops = measure_matmul_tflops(device) if device.type == "cuda" else float("nan")
    results = {"benchmark": "train_throughput", "environment": environment(device), "args": vars(args),
               "peak_spec_tflops": H200_SPEC_BF16_DENSE_TFLOPS, "measured_matmul_tflops": matmul_tflops,
               "flops_formula": "train = sum over rows of 3 * (2 * matmul_params * L + 2 * layers * L^2 * heads "
                                "* head_dim), L = the row's real tokens (useful work only)",
               "models": {}}
    tables = []
    for name in [m for m in args.models.split(",") if m]:
        hf_cfg = qwen2_config(name, torch_dtype=args.dtype)
        batch = make_grpo_batch(rows=args.rows, prompt_len=args.prompt_len, response_len=args.response_len,
                                vocab=hf_cfg["vocab_size"], group_size=args.group_size, seed=args.seed,
                                length_dist=args.response_len_dist)
        lengths = row_lengths(batch)
        tokens = sum(lengths)
        step_flops = train_flops_for_lengths(hf_cfg, lengths)
        entry = {"total_params": total_params(hf_cfg), "matmul_params": matmul_params(hf_cfg),
                 "length_dist": args.response_len_dist, "rows": len(batch), "seq_len": width,
                 "tokens_per_step": tokens, "padded_tokens_per_step": len(batch) * width,
                 "train_flops_per_step": step_flops, "train_flops_per_token": step_flops / tokens,
                 "train_flops_per_token_full_row": train_flops_per_token(hf_cfg, width),
                 "row_lengths": {"min": min(lengths), "max": max(lengths), "mean": tokens / len(lengths)},
                 "response_lengths": batch.response_mask.sum(dim=1).tolist(),
                 "prompt_lengths": batch.prompt_mask.sum(dim=1).tolist()}
        results["models"][name] = entry
        megatron_keys, hf_keys = [], []
        runs = [(ci, core, bi, budget, fi, fusion) for ci, core in enumerate(cores)
                for bi, budget in enumerate(budgets) for fi, fusion in enumerate(fusion_variants)]
        for ci, core, bi, budget, fi, fusion in runs:
            key = megatron_key(ci, core, bi, budget, fi, fusion)
            megatron_keys.append(key)
            try:
                entry[key] = bench_megatron(hf_cfg, batch, args, device, matmul_tflops, core, budget, fusion)
            except torch.cuda.OutOfMemoryError as exc:
                entry[key] = {"error": f"OOM: {exc}"[:300]}
            if "error" in entry[key]:
                _release_memory()
            progress(name, key, entry[key])
            save_quietly(args.out, results)
        if batch.old_log_probs is None:  # no megatron engine fitted: the baselines would have nothing to match
            write_json(args.out, results)
            continue
        hf_runs = [(f"hf_{impl}" + (f"_mbs{m}" if mi else ""), impl, dict(micro_batch_size=m))
                   for impl in [a for a in args.hf_attn.split(",") if a] for mi, m in enumerate(hf_mbs)]
        if args.hf_packed:
            hf_runs += [(f"hf_packed_{impl}_tok{b}", impl, dict(max_tokens=b))
                        for impl in [a for a in args.hf_packed_attn.split(",") if a] for b in packed_budgets]
        for key, impl, layout in hf_runs:
            hf_keys.append(key)
            try:
                entry[key] = bench_hf(hf_cfg, batch, args, device, matmul_tflops, impl, **layout)
            except torch.cuda.OutOfMemoryError as exc:  # report and continue with the other baselines
                entry[key] = {"error": f"OOM: {exc}"[:300]}
            if "error" in entry[key]:
                _release_memory()
            progress(name, key, entry[key])
            add_ratios(entry, megatron_keys, hf_keys)
            save_quietly(args.out, results)
        add_ratios(entry, megatron_keys, hf_keys)
        write_json(args.out, results)  # after every model, so a later failure keeps what was measured
        tables.append(format_table(name, entry, megatron_keys, hf_keys))
        print(tables[-1], flush=True)
    write_json(args.out, results)
    print("\n\n".join(tables), flush=True)
    return results


if __name__ == "__main__":
    main()
