"""End-to-end GRPO throughput: megarl's trainer (Ray workers, Megatron actor, vLLM rollout, colocated) on a
random-init Qwen2.5-shaped (or Qwen3-MoE-shaped) model, with fixed-length responses, and each stage against the same
stage alone.

What it does, in one process (the driver):

1. writes the model (HF safetensors, bf16, random init of ``bench.shapes.model_config(--shape, layers=--layers)``), a word-level
   tokenizer covering the whole vocabulary (``w<id>`` words, so any sampled id decodes) and a parquet file
   of ``--prompt-len``-token prompts (``data.apply_chat_template=false``);
2. runs ``megarl.trainer.main.run`` for ``--steps`` steps: ``--prompts`` prompts x ``rollout.n`` responses of
   exactly ``--response-len`` tokens (``rollout.ignore_eos=true``), packed micro-batches, one optimizer step
   per step (``ppo_mini_batch_size = --prompts``), no reference/KL (plain GRPO), vLLM with CUDA graphs and
   sleep mode; the first step is warm-up and left out of the means;
3. ``--gen-alone``: after the run (Ray and its GPU memory gone), the same prompts and sampling through a
   plain ``vllm.LLM`` (its own engine-core process, CUDA graphs): vLLM's generation alone. ``--gen-only`` runs
   this step and nothing else, ``--quantization fp8`` has vLLM quantize the weights at load (FP8 beside bf16),
   ``--kv-cache-dtype fp8`` keeps its KV cache in FP8.

Reported (JSON to ``--out`` and a table on stdout): per-stage seconds (mean of the steady steps), tokens/s/GPU
in verl's definition (``perf/throughput``: prompt + response tokens of the step / step seconds / GPUs),
weight-sync GB/s, the rollout-vs-trainer log-prob gap, per-phase peak memory, and gen / gen-alone.
``--shape tiny --device cpu`` is the dry run (HF rollout on CPU) that checks the script itself. ``--random-init``
writes no weights (config.json and the tokenizer only): Megatron initialises the model, vLLM starts with dummy
weights and the first weight sync fills them, so shapes up to what the GPU holds run on a small disk.
A vision-language shape (``--shape vl-3b|vl-7b``, Qwen2.5-VL, ``--random-init`` only) puts one random-noise picture
of ``--image-size`` pixels a side at the start of each prompt (verl's multimodal layout; 448: 256 of the
``--prompt-len`` tokens), which megarl's dataset turns into pixels for the actor and vLLM.
Left out: the reference model and KL loss (add ``--kl`` to include them), critic/PPO, multi-GPU layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Optional

from bench.measure import H200_SPEC_BF16_DENSE_TFLOPS
from bench.shapes import SHAPES, is_vision_language, model_config, train_flops_for_lengths

STAGES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "weight_sync", "step")


def write_word_tokenizer(out: Path, vocab_size: int, eos_id: int, special: Optional[dict[str, int]] = None) -> None:
    """A whitespace word tokenizer whose ids are the model's whole vocabulary: ``w<id>``, with <pad>=0 and the
    model's eos id named <eos>; ``special`` names more ids (a vision-language model's image tokens), matched
    before the whitespace split."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = special or {}
    vocab = {f"w{i}": i for i in range(vocab_size)}
    vocab["<pad>"] = 0
    vocab["<eos>"] = eos_id
    del vocab["w0"], vocab[f"w{eos_id}"]
    for name, token_id in special.items():
        del vocab[f"w{token_id}"]
        vocab[name] = token_id
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in special])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>").save_pretrained(out)


def vision_tokens_of(hf_cfg: dict) -> dict[str, int]:
    """A Qwen2.5-VL config's image tokens by name (what its processor and megarl's dataset look up)."""
    from megarl.data.tokenizer import VISION_TOKENS  # start, end, image pad, video pad

    ids = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return {name: hf_cfg[key] for name, key in zip(VISION_TOKENS, ids, strict=True)}


def write_vision_language_model(out: Path, hf_cfg: dict, image_size: int) -> None:
    """config.json in the published (flat) layout and the image processor's settings (Qwen2-VL's published ones, but
    at most ``image_size`` squared pixels: vLLM sizes its multimodal budget by the largest image the processor
    allows, which must fit the benchmark's short max_model_len); no weights: --random-init only."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=1))
    vision = hf_cfg["vision_config"]
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "do_convert_rgb": True, "do_normalize": True,
        "do_rescale": True, "do_resize": True, "rescale_factor": 1 / 255, "resample": 3,
        "image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD),
        "patch_size": vision["patch_size"], "merge_size": vision["spatial_merge_size"],
        "temporal_patch_size": vision["temporal_patch_size"], "min_pixels": 56 * 56, "max_pixels": image_size ** 2,
        "size": {"shortest_edge": 56 * 56, "longest_edge": image_size ** 2}}, indent=1))


def write_model(out: Path, hf_cfg: dict, device: str, *, weights: bool = True) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**hf_cfg)
    if not weights:  # --random-init: megatron initialises, vLLM starts with dummy weights, the sync fills them
        config.save_pretrained(out)
        return
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def write_prompts(path: Path, *, rows: int, prompt_len: int, vocab_size: int, image_size: int = 0,
                  image_tokens: int = 0) -> None:
    """``rows`` prompts of ``prompt_len`` tokens of random words; with ``image_size``, each starts with one
    random-noise picture of that many pixels a side (``image_tokens`` of the prompt's tokens, its vision start and
    end tokens two more) in verl's multimodal layout."""
    import io
    import random

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = random.Random(0)
    pixels = np.random.RandomState(0)
    words = prompt_len - (image_tokens + 2 if image_size else 0)
    if words < 1:
        raise ValueError(f"--prompt-len {prompt_len} leaves no room for text beside a {image_tokens}-token image")
    table = []
    for _ in range(rows):
        row = {"prompt": " ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(words)),
               "reward_model": {"ground_truth": "7"}, "data_source": "openai/gsm8k"}
        if image_size:
            png = io.BytesIO()
            Image.fromarray(pixels.randint(0, 256, (image_size, image_size, 3), dtype=np.uint8)).save(png, "PNG")
            row["prompt"] = "<image> " + row["prompt"]
            row["images"] = [{"bytes": png.getvalue(), "path": None}]
        table.append(row)
    pq.write_table(pa.Table.from_pylist(table), path)


def trainer_overrides(args, work: Path) -> list[str]:
    budget = max(args.token_budget, args.prompt_len + args.response_len)
    overrides = [
        f"actor_rollout_ref.model.path={work / 'model'}", f"actor_rollout_ref.model.tokenizer_path={work / 'tok'}",
        f"data.train_files=['{work / 'prompts.parquet'}']", f"data.val_files=['{work / 'prompts.parquet'}']",
        "data.apply_chat_template=false", f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.response_len}", f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.rollout.n={args.n}", "actor_rollout_ref.rollout.ignore_eos=true",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.model.use_sequence_packing=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={2 * budget}",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={2 * budget}",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.megatron.params_dtype=bfloat16",
        f"actor_rollout_ref.actor.use_kl_loss={'true' if args.kl else 'false'}",
        f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.save_freq=-1", "trainer.progress_bar=false", f"trainer.default_local_dir={work / 'run'}",
        "trainer.resume_mode=disable", f"trainer.device={args.device}",
    ]
    if args.random_init:
        overrides += ["actor_rollout_ref.actor.load_weight=false", "actor_rollout_ref.rollout.load_format=dummy"]
    if args.device == "cuda":
        overrides += ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=bfloat16",
                      f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}"]
    else:
        overrides += ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.dtype=float32",
                      "actor_rollout_ref.actor.megatron.params_dtype=float32"]
    return overrides + list(args.override)


def steady_means(history: list[dict]) -> dict[str, float]:
    steady = history[1:] or history
    keys = sorted({k for row in steady for k in row})
    return {k: statistics.fmean(row[k] for row in steady if k in row) for k in keys
            if all(isinstance(row.get(k, 0.0), (int, float)) for row in steady)}


def generate_alone(args, work: Path) -> dict:
    """The same prompts and sampling through a plain vllm.LLM (its own engine-core process, CUDA graphs)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(str(work / "tok"))
    import pyarrow.parquet as pq

    texts = pq.read_table(work / "prompts.parquet").column("prompt").to_pylist()[:args.prompts]
    prompts = [TokensPrompt(prompt_token_ids=tokenizer(t)["input_ids"]) for t in texts]
    llm = LLM(model=str(work / "model"), tokenizer=str(work / "tok"), dtype="bfloat16",
              gpu_memory_utilization=args.gpu_memory_utilization,
              max_model_len=args.prompt_len + args.response_len, seed=0, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype,
              load_format="dummy" if args.random_init else "auto")  # --random-init wrote no weights
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.response_len, ignore_eos=True, logprobs=0,
                            detokenize=False)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(2):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    llm.llm_engine.engine_core.shutdown()
    return {"gen_alone_s": min(times), "gen_alone_output_tok_s": tokens / min(times), "gen_alone_tokens": tokens,
            "gen_alone_quantization": args.quantization, "gen_alone_kv_cache_dtype": args.kv_cache_dtype}


def update_mfu(hf_cfg: dict, args, means: dict, *, lora: bool) -> dict:
    """The update's model FLOPs (bench/shapes.py: 6 x matmul parameters x tokens + attention; recompute not
    counted; a vision-language model's language model; a LoRA run's frozen base takes no weight gradients) over
    its seconds, against the card's dense bf16 peak (989 TFLOP/s on an H100 SXM and an H200 alike), with and
    without the host optimizer step it contains."""
    if "timing_s/update_actor" not in means:
        return {}
    flops = train_flops_for_lengths(hf_cfg, [args.prompt_len + args.response_len] * (args.prompts * args.n),
                                    frozen_weights=lora)
    update, host_step = means["timing_s/update_actor"], means.get("actor/optimizer_step_s", 0.0)
    peak = H200_SPEC_BF16_DENSE_TFLOPS * 1e12
    return {"update_tflops": flops / update / 1e12, "update_mfu": flops / update / peak,
            "update_mfu_without_optimizer_step": flops / (update - host_step) / peak if update > host_step else None}


def format_table(result: dict) -> str:
    means = result["steady"]
    lines = [f"e2e GRPO {result['shape']}: {result['prompts']} prompts x n={result['n']}, prompt {result['prompt_len']}"
             f" + response {result['response_len']} tokens, {result['steps']} steps (first = warm-up)", "",
             "| stage | seconds |", "| --- | --- |"]
    lines += [f"| {stage} | {means[f'timing_s/{stage}']:.2f} |" for stage in STAGES if f"timing_s/{stage}" in means]
    if "actor/optimizer_step_s" in means:
        lines.append(f"(update_actor's optimizer steps: {means['actor/optimizer_step_s']:.2f} s)")
    if result.get("update_mfu") is not None:
        without = result["update_mfu_without_optimizer_step"]
        lines.append(f"update: {result['update_tflops']:.0f} TFLOP/s of model FLOPs, MFU {result['update_mfu']:.1%}"
                     + (f" ({without:.1%} without the optimizer step)" if without is not None else ""))
    lines += ["", f"tokens/s/GPU (verl's perf/throughput): {means.get('perf/throughput', float('nan')):,.0f}",
              f"weight sync: {means.get('weight_sync/bytes', 0) / 1e9:.2f} GB at "
              f"{means.get('weight_sync/gb_per_s', float('nan')):.1f} GB/s",
              f"rollout/log_prob_diff_mean {means.get('rollout/log_prob_diff_mean', float('nan')):.4f}, "
              f"max {means.get('rollout/log_prob_diff_max', float('nan')):.4f}"]
    if "routing/rollout_mismatch_frac" in means:
        lines.append(f"routing/rollout_mismatch_frac {means['routing/rollout_mismatch_frac']:.4f}")
    if "gen_alone_s" in result:
        lines.append(f"gen alone (plain vLLM): {result['gen_alone_s']:.2f} s; gen in the trainer / alone: "
                     f"{means['timing_s/gen'] / result['gen_alone_s']:.2f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.5b", choices=SHAPES)
    parser.add_argument("--layers", type=int, help="keep the shape's per-layer sizes, this many layers")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--token-budget", type=int, default=16384, help="actor tokens per packed micro-batch")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--kl", action="store_true", help="reference model + low_var_kl loss")
    parser.add_argument("--gen-alone", action="store_true")
    parser.add_argument("--gen-only", action="store_true", help="plain vLLM's generation only, no trainer")
    parser.add_argument("--quantization", help="plain vLLM's weight quantization (fp8), with --gen-alone/--gen-only")
    parser.add_argument("--kv-cache-dtype", default="auto", help="plain vLLM's KV cache dtype (fp8; the "
                        "trainer's: actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--random-init", action="store_true",
                        help="no weights on disk: config.json only, megatron's random init, vLLM dummy weights")
    parser.add_argument("--work", default="/tmp/megarl_e2e")
    parser.add_argument("--prepare-only", action="store_true", help="write model, tokenizer and prompts, then stop")
    parser.add_argument("--image-size", type=int, default=448,
                        help="a vision-language shape's picture per prompt: pixels a side, a multiple of 28 "
                             "(448: 256 of the prompt's tokens)")
    parser.add_argument("--out")
    parser.add_argument("override", nargs="*", help="extra a.b.c=value trainer overrides")
    args = parser.parse_args(argv)

    from megarl.config.lora import model_lora
    from megarl.run_config import load_config
    from megarl.trainer.main import run

    hf_cfg = model_config(args.shape, layers=args.layers)
    name = args.shape + (f"_{args.layers}l" if args.layers else "")
    work = Path(args.work) / (name + ("_random" if args.random_init else ""))
    vision = is_vision_language(args.shape)
    if vision and (not args.random_init or args.gen_alone or args.gen_only or args.image_size % 28):
        parser.error(f"--shape {args.shape} (vision-language) runs with --random-init, without --gen-alone/--gen-only "
                     f"(text prompts only), and an --image-size that is a multiple of 28")
    if not (work / "model" / "config.json").is_file():
        special = vision_tokens_of(hf_cfg) if vision else None
        if vision:  # vLLM builds the image processor, and with it the tokenizer, from the model's folder
            write_vision_language_model(work / "model", hf_cfg, args.image_size)
            write_word_tokenizer(work / "model", hf_cfg["vocab_size"], hf_cfg["eos_token_id"], special)
        else:
            write_model(work / "model", hf_cfg, args.device, weights=not args.random_init)
        write_word_tokenizer(work / "tok", hf_cfg["vocab_size"], hf_cfg["eos_token_id"], special)
    image_tokens = 0
    if vision:  # as megarl's dataset will count them: the model folder's patch geometry and pixel bounds
        from megarl.data.vision_inputs import VisionTokens, image_grid, tokens_of

        tokens = VisionTokens.of_model(work / "model")
        image_tokens = tokens_of(image_grid(args.image_size, args.image_size, tokens), tokens)
    write_prompts(work / "prompts.parquet", rows=args.prompts * args.steps, prompt_len=args.prompt_len,
                  vocab_size=hf_cfg["vocab_size"], image_size=args.image_size if vision else 0,
                  image_tokens=image_tokens)
    if args.prepare_only:
        return {}
    workload = {"shape": name, "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len,
                "response_len": args.response_len}
    if args.gen_only:
        result = {**workload, **generate_alone(args, work)}
        print(json.dumps(result), flush=True)
    else:
        cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_tiny.yaml"),
                          overrides=trainer_overrides(args, work))
        start = time.perf_counter()
        history = run(cfg)
        result = {**workload, "steps": args.steps, "wall_s": time.perf_counter() - start, "history": history,
                  "steady": steady_means(history)}
        lora = model_lora(cfg.actor_rollout_ref.model) is not None
        result.update(update_mfu(hf_cfg, args, result["steady"], lora=lora))
        if args.gen_alone:
            import ray

            ray.shutdown()
            result.update(generate_alone(args, work))
        print(format_table(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
