"""Log-prob (+ entropy) throughput and peak memory: the fused vocab-parallel path vs the naive full softmax.

Inputs are bf16 logits ``[batch, seq, vocab]`` (default 8 x 2048 x 151936, Qwen2's vocabulary) and random
targets, at TP=1 on one device (``tp_group=None``: the fused path then has nothing to all-reduce; its
point at TP=1 is memory and passes over the logits). Four cases, each timed forward-only and
forward+backward:

* ``fused_logprob``: :func:`megarl.engines.megatron.logprob.compute_vocab_parallel_log_probs`, loss on the
  log-probs only (the entropy output unused, so its backward term is skipped);
* ``naive_logprob``: ``logits.float().log_softmax(-1).gather(target)``;
* ``parallel_kernel_logprob[_entropy]``: the TP > 1 autograd function run on one rank (no group), i.e.
  the algorithm every TP=1 call used before the dedicated TP=1 path existed;
* ``fused_logprob_entropy`` / ``naive_logprob_entropy``: loss on log-probs plus entropy (naive entropy is
  ``-(softmax * log_softmax).sum(-1)``).

Peak memory is the allocator's peak above what was allocated before the call (the logits themselves are
not counted). The two paths are also checked against each other (max abs difference of log-probs,
entropy and the logits gradient) so a fast wrong kernel cannot pass.
Left out: TP > 1 (needs several GPUs), sequence parallelism.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.measure import environment, pick_device, summarize, synchronize, time_region, write_json


def fused(logits, target, with_entropy: bool):
    from megarl.engines.megatron.logprob import compute_vocab_parallel_log_probs

    log_probs, entropy = compute_vocab_parallel_log_probs(logits, target)
    return log_probs, (entropy if with_entropy else None)


def parallel_kernel(logits, target, with_entropy: bool):
    from megarl.engines.megatron.logprob import _VocabParallelLogProbEntropy

    flat = logits.reshape(-1, logits.shape[-1])
    log_probs, entropy = _VocabParallelLogProbEntropy.apply(flat, target.reshape(-1), 0, 1.0, None)
    return log_probs.view(target.shape), (entropy.view(target.shape) if with_entropy else None)


def naive(logits, target, with_entropy: bool):
    log_softmax = logits.float().log_softmax(dim=-1)
    log_probs = log_softmax.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) if with_entropy else None
    return log_probs, entropy


def loss_of(log_probs, entropy, weights):
    loss = (log_probs * weights).sum()
    if entropy is not None:
        loss = loss + 0.01 * (entropy * weights).sum()
    return loss


def measure_case(fn, logits, target, weights, *, with_entropy: bool, backward: bool, device, warmup, iters):
    def run():
        if backward:
            logits.grad = None
            log_probs, entropy = fn(logits, target, with_entropy)
            loss_of(log_probs, entropy, weights).backward()
        else:
            with torch.no_grad():
                fn(logits, target, with_entropy)

    seconds = time_region(run, device=device, warmup=warmup, iters=iters)
    peak = float("nan")
    if device.type == "cuda":
        logits.grad = None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    tokens = target.numel()
    return {**summarize(seconds), "tokens_per_s": tokens / statistics.median(seconds), "peak_extra_gib": peak}


def check_agreement(logits, target, weights) -> dict[str, float]:
    out = {}
    grads = {}
    for name, fn in (("fused", fused), ("naive", naive), ("parallel_kernel", parallel_kernel)):
        logits.grad = None
        log_probs, entropy = fn(logits, target, True)
        loss_of(log_probs, entropy, weights).backward()
        out[name] = (log_probs.detach(), entropy.detach())
        grads[name] = logits.grad.float()
    logits.grad = None
    return {
        "max_abs_diff_log_probs": float((out["fused"][0] - out["naive"][0]).abs().max()),
        "max_abs_diff_entropy": float((out["fused"][1] - out["naive"][1]).abs().max()),
        "max_abs_diff_grad": float((grads["fused"] - grads["naive"]).abs().max()),
        "max_abs_grad": float(grads["naive"].abs().max()),
        "max_abs_diff_log_probs_parallel_kernel": float((out["parallel_kernel"][0] - out["naive"][0]).abs().max()),
        "max_abs_diff_grad_parallel_kernel": float((grads["parallel_kernel"] - grads["naive"]).abs().max()),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    # Logit scale of a real LM head (std ~2-4): softmax neither uniform nor one-hot.
    logits = (3.0 * torch.randn(args.batch, args.seq, args.vocab, device=device, generator=g)).to(dtype)
    logits.requires_grad_(True)
    target = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=g)
    weights = torch.randn(args.batch, args.seq, device=device, generator=g)

    results = {"benchmark": "logprob", "environment": environment(device), "args": vars(args),
               "logits_gib": logits.numel() * logits.element_size() / 2**30,
               "agreement": check_agreement(logits, target, weights), "cases": {}}
    for name, fn, with_entropy in (("fused_logprob", fused, False), ("naive_logprob", naive, False),
                                   ("parallel_kernel_logprob", parallel_kernel, False),
                                   ("fused_logprob_entropy", fused, True), ("naive_logprob_entropy", naive, True),
                                   ("parallel_kernel_logprob_entropy", parallel_kernel, True)):
        for backward in (False, True):
            key = f"{name}_{'fwd_bwd' if backward else 'fwd'}"
            results["cases"][key] = measure_case(fn, logits, target, weights, with_entropy=with_entropy,
                                                 backward=backward, device=device, warmup=args.warmup,
                                                 iters=args.iters)
            print(f"[logprob] {key}: {results['cases'][key]['median_s'] * 1e3:.2f} ms, "
                  f"peak extra {results['cases'][key]['peak_extra_gib']:.2f} GiB", flush=True)
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
