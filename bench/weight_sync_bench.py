"""Weight-sync throughput: Megatron actor (TP=1) -> HF rollout engine on the same device, vs plain copies.

For each Qwen2-shaped model (random weights) it builds the megatron model chunks through the bridge
(bf16, local spec) and an :class:`megarl.engines.rollout.hf_engine.HFRolloutEngine` from an HF checkpoint
of a *different* random init, then times :func:`megarl.weight_sync.sync_weights` with
:class:`megarl.weight_sync.ColocatedTransport` at several bucket sizes (device synchronised before and
after each sync, median of ``--iters``). After the first sync every rollout parameter is compared
exactly (``torch.equal``) with the gathered megatron tensor, so the timing is of a sync that worked.

Baselines, same process and same bytes: ``copy_`` of every tensor with the same sizes (a pre-gathered
clone -> a separate buffer, one call per tensor) and one flat ``copy_`` of all bytes. GB/s count the
payload once (bytes written into the rollout engine), as ``SyncStats`` does; read + write traffic is
twice that.

``--rollout vllm`` (vLLM staged as ``../shared/device/README.md`` says; CUDA) syncs into the engine megarl's
workers build (engine core in this process, bf16, sleep mode) instead, in each weight-reload mode (``auto``, which
loads these dense models directly, and vLLM's ``layerwise`` reload), against vLLM's own ``load_weights`` of the
same pre-gathered tensors inside one session of the kind ``auto`` takes (the floor any sync into this engine can
reach). Exactness of both modes is what ``tests/gpu/test_vllm_cuda.py`` checks. Left out: TP/PP > 1 gathers (need
several GPUs).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile

import torch

from bench.measure import bring_up_single_rank, environment, pick_device, summarize, time_region, write_json
from bench.shapes import qwen2_config


def build_megatron_chunks(hf_cfg: dict, dtype: torch.dtype):
    from megarl.models.cpu_compat import cuda_tensors_on_cpu
    from megarl.engines.megatron.model_chunks import build_model_chunks
    from megarl.engines.megatron.parallel import ParallelLayout
    from megarl.models.bridge import ModelBridge

    bridge = ModelBridge.from_hf_config(hf_cfg, spec="local")
    config = bridge.transformer_config(layout=ParallelLayout(), params_dtype=dtype)

    def provider(pre_process, post_process, vp_stage=None):
        return bridge.build_model(config=config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

    with cuda_tensors_on_cpu():
        chunks = build_model_chunks(model_provider=provider, config=config, wrap_with_ddp=False)
    return bridge, chunks


def build_rollout_engine(hf_cfg: dict, dtype: torch.dtype, device: torch.device, directory: str):
    import transformers

    from megarl.engines.rollout.hf_engine import HFRolloutEngine
    from megarl.models.hf_config import load_hf_config

    torch.manual_seed(12345)  # a different init than megatron's, so a sync that does nothing is caught
    model = transformers.AutoModelForCausalLM.from_config(load_hf_config(hf_cfg), dtype=dtype)
    model.save_pretrained(directory)
    del model
    return HFRolloutEngine(directory, dtype=dtype, device=device)


def count_mismatches(chunks, bridge, engine, dtype) -> tuple[int, int]:
    from megarl.weight_sync import iter_hf_tensors

    params = dict(engine.model.named_parameters(remove_duplicate=False))
    checked = mismatched = 0
    with torch.no_grad():
        for name, tensor in iter_hf_tensors(chunks, bridge, dtype=dtype):
            checked += 1
            mismatched += int(not torch.equal(params[name], tensor.to(params[name].device)))
    return checked, mismatched


def bench_model(name: str, args, device: torch.device) -> dict:
    from megarl.weight_sync import ColocatedTransport, iter_hf_tensors, sync_weights

    dtype = getattr(torch, args.dtype)
    hf_cfg = qwen2_config(name, torch_dtype=args.dtype)
    bridge, chunks = build_megatron_chunks(hf_cfg, dtype)
    with tempfile.TemporaryDirectory() as directory:
        engine = build_rollout_engine(hf_cfg, dtype, device, directory)
    transport = ColocatedTransport(engine)
    checked, before = count_mismatches(chunks, bridge, engine, dtype)
    first = sync_weights(chunks, bridge, transport, bucket_bytes=args.bucket_mb[0] * 2**20, dtype=dtype)
    _, after = count_mismatches(chunks, bridge, engine, dtype)
    if before == 0 or after != 0:
        raise RuntimeError(f"{name}: sync check failed ({before} of {checked} tensors differed before the sync, "
                           f"{after} after)")
    out = {"hf_tensors": checked, "payload_bytes": first.total_bytes, "mismatched_before": before,
           "mismatched_after": after, "sync": {}}
    for bucket_mb in args.bucket_mb:
        stats = []

        def sync():
            stats.append(sync_weights(chunks, bridge, transport, bucket_bytes=bucket_mb * 2**20, dtype=dtype))

        seconds = time_region(sync, device=device, warmup=1, iters=args.iters)
        median = statistics.median(seconds)
        out["sync"][str(bucket_mb)] = {**summarize(seconds), "gb_per_s": first.total_bytes / median / 1e9,
                                       "buckets": stats[-1].num_buckets,
                                       "largest_bucket_bytes": stats[-1].largest_bucket_bytes,
                                       "syncstats_gb_per_s": stats[-1].gb_per_s}
    with torch.no_grad():
        sources = [t.clone() for _, t in iter_hf_tensors(chunks, bridge, dtype=dtype)]
    targets = [torch.empty_like(t) for t in sources]

    def per_tensor_copy():
        for dst, src in zip(targets, sources):
            dst.copy_(src)

    seconds = time_region(per_tensor_copy, device=device, warmup=1, iters=args.iters)
    out["copy_per_tensor"] = {**summarize(seconds), "gb_per_s": first.total_bytes / statistics.median(seconds) / 1e9}
    del targets
    flat_src = torch.cat([t.reshape(-1) for t in sources])
    del sources
    flat_dst = torch.empty_like(flat_src)
    seconds = time_region(lambda: flat_dst.copy_(flat_src), device=device, warmup=1, iters=args.iters)
    out["copy_flat"] = {**summarize(seconds), "gb_per_s": first.total_bytes / statistics.median(seconds) / 1e9}
    best = max(v["gb_per_s"] for v in out["sync"].values())
    out["ratio_best_sync_over_copy_per_tensor"] = best / out["copy_per_tensor"]["gb_per_s"]
    out["ratio_best_sync_over_copy_flat"] = best / out["copy_flat"]["gb_per_s"]
    del flat_src, flat_dst, chunks, engine, transport
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def build_vllm_engine(hf_cfg: dict, dtype: torch.dtype, device: torch.device, directory: str):
    import transformers

    from megarl.engines.rollout.vllm_engine import VLLMRolloutEngine
    from megarl.models.hf_config import load_hf_config

    torch.manual_seed(12345)
    transformers.AutoModelForCausalLM.from_config(load_hf_config(hf_cfg), dtype=dtype).save_pretrained(directory)
    # the trainer's engine: in process, sleep mode on CUDA; eager and a small KV cache: only loading is timed
    on_cuda = device.type == "cuda"
    return VLLMRolloutEngine(directory, dtype=str(dtype).removeprefix("torch."), in_process=True,
                             local_device_index=0 if on_cuda else None, enable_sleep_mode=on_cuda,
                             enforce_eager=True, max_model_len=1024, kv_cache_memory_bytes=(2 << 30) if on_cuda
                             else (64 << 20))


def bench_model_vllm(name: str, args, device: torch.device) -> dict:
    from megarl.weight_sync import ColocatedTransport, iter_hf_tensors, sync_weights

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # vLLM on CPU: fp32 (the CPU dry run)
    hf_cfg = qwen2_config(name, torch_dtype=str(dtype).removeprefix("torch."))
    bridge, chunks = build_megatron_chunks(hf_cfg, dtype)
    with tempfile.TemporaryDirectory() as directory:
        engine = build_vllm_engine(hf_cfg, dtype, device, directory)
        transport = ColocatedTransport(engine)
        bucket_bytes = args.bucket_mb[0] * 2**20
        out: dict = {"bucket_mb": args.bucket_mb[0], "sync": {}}
        for mode in ("auto", "layerwise"):
            engine.weight_reload = mode
            stats = []

            def sync():
                stats.append(sync_weights(chunks, bridge, transport, bucket_bytes=bucket_bytes, dtype=dtype))

            seconds = time_region(sync, device=device, warmup=1, iters=args.iters)
            out["payload_bytes"] = stats[-1].total_bytes
            out["sync"][mode] = {"loaded": engine.weight_reload_taken, **summarize(seconds),
                                 "gb_per_s": stats[-1].total_bytes / statistics.median(seconds) / 1e9,
                                 "buckets": stats[-1].num_buckets}
        with torch.no_grad():
            gathered = [(n, t.clone()) for n, t in iter_hf_tensors(chunks, bridge, dtype=dtype)]
        worker_rpc = engine.llm.collective_rpc

        def load_weights_alone():
            worker_rpc("megarl_start_weight_update", args=("auto",))
            worker_rpc("megarl_load_weights", args=(gathered,))
            worker_rpc("megarl_finish_weight_update")

        seconds = time_region(load_weights_alone, device=device, warmup=1, iters=args.iters)
        out["vllm_load_weights_alone"] = {**summarize(seconds), "gb_per_s": out["payload_bytes"]
                                          / statistics.median(seconds) / 1e9}
        auto_s = out["sync"]["auto"]["median_s"]
        out["ratio_auto_sync_over_load_weights_alone"] = auto_s / out["vllm_load_weights_alone"]["median_s"]
        out["ratio_layerwise_over_auto"] = out["sync"]["layerwise"]["median_s"] / auto_s
        del gathered
        engine.shutdown()
    if not torch.distributed.is_initialized():  # vLLM's shutdown took the one-rank world down with it
        from megarl.engines.megatron.parallel import destroy_megatron_parallel

        destroy_megatron_parallel()
        os.environ.pop("MASTER_PORT")  # the old world's store may still hold it
        bring_up_single_rank()
    del chunks, engine, transport
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="0.5b,1.5b")
    parser.add_argument("--bucket-mb", default="64,512,2048", help="comma-separated bucket sizes in MiB")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rollout", default="hf", choices=["hf", "vllm"], help="vllm: CUDA, vLLM installed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.bucket_mb = [int(b) for b in args.bucket_mb.split(",")]
    device = pick_device(args.device)
    bring_up_single_rank()
    results = {"benchmark": "weight_sync", "environment": environment(device),
               "args": {**vars(args)}, "models": {}}
    for name in [m for m in args.models.split(",") if m]:
        if args.rollout == "vllm":
            results["models"][name] = entry = bench_model_vllm(name, args, device)
            print(f"[weight_sync vllm] {name}: {entry['payload_bytes'] / 1e9:.2f} GB, "
                  + ", ".join(f"{mode} ({v['loaded']}) {v['median_s'] * 1e3:.1f} ms"
                              for mode, v in entry["sync"].items())
                  + f", vLLM load_weights alone {entry['vllm_load_weights_alone']['median_s'] * 1e3:.1f} ms",
                  flush=True)
            continue
        results["models"][name] = entry = bench_model(name, args, device)
        best = max(entry["sync"].items(), key=lambda kv: kv[1]["gb_per_s"])
        print(f"[weight_sync] {name}: {entry['payload_bytes'] / 1e9:.2f} GB, best sync {best[1]['gb_per_s']:.1f} GB/s "
              f"(bucket {best[0]} MiB), per-tensor copy {entry['copy_per_tensor']['gb_per_s']:.1f} GB/s", flush=True)
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
