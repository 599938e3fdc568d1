"""vLLM with images on CUDA: the rollout engine takes a vision-language model's prompts as the batch holds them
(already expanded, with the processor's pixels) and samples what the model says about those images.

* engine: the embedded tiny Qwen2.5-VL in bf16, prompts with one and with two images of different sizes; vLLM
  expands each prompt to the batch's tokens exactly (the engine checks it), and the log-probs of what it sampled
  equal transformers' fp32 scoring with the same pixels within bf16 noise (measured on CPU: mean 0.0013, max 0.004
  at log-probs around -5), while scoring against mirrored pictures is ~0.1 off on average: a picture lost, swapped
  or misplaced on the way to vLLM fails the first bound;
* trainer: grpo_vl_tiny with the vLLM rollout in process, three steps, the rollout's log-probs within bf16 noise of
  the Megatron actor's.

Skipped without CUDA or vLLM; vLLM's Qwen2.5-VL needs torchvision and blake3 (carried: docs/device_runs.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.paths import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [[(56, 84)], [(84, 56), (112, 112)], [(56, 56)], [(140, 84)]]  # (height, width) per image, per prompt


def _prompts(tokens, rng):
    from PIL import Image

    from megarl.data.vision_inputs import expand_image_pads, pixel_inputs

    prompts, inputs, pictures = [], [], []
    for index, sizes in enumerate(SIZES):
        images = [Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8)) for h, w in sizes]
        pixels = pixel_inputs(images, tokens)
        ids = [10 + index, 11]
        for _ in images:
            ids += [tokens.vision_start_id, tokens.image_pad_id, tokens.vision_end_id, 12]
        prompts.append(expand_image_pads(ids, pixels["image_grid_thw"].tolist(), tokens, f"prompt {index}"))
        inputs.append(pixels)
        pictures.append(images)
    return prompts, inputs, pictures


@torch.no_grad()
def _score(model, prompt, response, pixels):
    ids = torch.tensor([list(prompt) + list(response)], device="cuda")
    logits = model(input_ids=ids, pixel_values=pixels["pixel_values"].cuda(),
                   image_grid_thw=pixels["image_grid_thw"].cuda()).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response, device="cuda")[:, None])[:, 0].cpu()


def test_vllm_samples_from_the_batchs_images(tmp_path):
    pytest.importorskip("vllm")
    from PIL import Image
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megarl.data.vision_inputs import VisionTokens, pixel_inputs
    from megarl.engines.rollout.base import SamplingConfig
    from megarl.engines.rollout.vllm_engine import VLLMRolloutEngine
    from megarl.models.embedded import resolve_model_path

    model_path = str(resolve_model_path("embedded:tiny-qwen2-vl"))
    tokens = VisionTokens.of_model(model_path)
    prompts, inputs, pictures = _prompts(tokens, np.random.RandomState(0))
    engine = VLLMRolloutEngine(model_path, dtype="bfloat16", in_process=True, enforce_eager=True, max_model_len=512,
                               kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.2, seed=0,
                               enable_prefix_caching=False)
    try:
        outputs = engine.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_tokens=16, logprobs=True,
                                                          ignore_eos=True, seed=0), multi_modal_inputs=inputs)
    finally:
        engine.shutdown()
    assert len(outputs) == 4 * len(prompts)
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32).cuda().eval()
    mirrored = [pixel_inputs([p.transpose(Image.FLIP_LEFT_RIGHT) for p in images], tokens) for images in pictures]
    gaps, wrong = [], []
    for out in outputs:
        if tokens.image_pad_id in out.token_ids:
            continue  # transformers would take a sampled image token for a picture (megarl's engines: text)
        sampled = torch.tensor(out.log_probs)
        gaps.append((sampled - _score(reference, prompts[out.prompt_index], out.token_ids, inputs[out.prompt_index])).abs())
        wrong.append((sampled - _score(reference, prompts[out.prompt_index], out.token_ids,
                                       mirrored[out.prompt_index])).abs())
    assert len(gaps) >= len(outputs) // 2, f"only {len(gaps)} of {len(outputs)} samples without an image token"
    gap, off = torch.cat(gaps), torch.cat(wrong)
    print(f"vLLM bf16 vs transformers fp32: mean {gap.mean():.4f} max {gap.max():.4f}; "
          f"against mirrored pictures: mean {off.mean():.4f}")
    assert gap.max() < 0.03, (gap.mean(), gap.max())
    assert off.mean() > 10 * gap.mean(), (off.mean(), gap.mean())


def test_vision_language_grpo_with_the_vllm_rollout(tmp_path):
    """In a process of its own: vLLM's sleep-mode allocator takes one engine per process, and other GPU tests of
    the session have had theirs."""
    pytest.importorskip("vllm")
    import json
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "megarl.trainer.main", "--config", str(REPO / "configs" / "grpo_vl_tiny.yaml"),
                    f"trainer.default_local_dir={tmp_path}", "trainer.backend=inprocess", "trainer.device=cuda",
                    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=bfloat16",
                    "actor_rollout_ref.rollout.enforce_eager=true",
                    "actor_rollout_ref.rollout.gpu_memory_utilization=0.2", "trainer.total_training_steps=3",
                    "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
                    "trainer.progress_bar=false"], check=True, cwd=REPO, timeout=300)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    history = [row for row in rows if "rollout/log_prob_diff_max" in row]  # the training steps' rows
    assert [h["step"] for h in history] == [1, 2, 3]
    for h in history:
        # bf16 rollout, fp32 actor: the engine test's bound; a lost picture is ~0.3 off at the maximum
        assert h["rollout/log_prob_diff_max"] < 0.03, (h["step"], h["rollout/log_prob_diff_max"])
        assert h["prompt_length/mean"] == 84 + 6
