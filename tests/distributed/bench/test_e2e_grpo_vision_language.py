"""bench/e2e_grpo.py's vision-language shapes, what the GPU run reads: the model folder vLLM builds its processor from
(config, image processor settings, a tokenizer that knows the image tokens) and prompts of exactly --prompt-len
tokens once megarl's dataset has expanded each picture."""

from __future__ import annotations

import json

import pytest

from bench.e2e_grpo import main
from bench.shapes import model_config, total_params


def test_the_vision_language_shapes_language_models_are_the_published_sizes():
    # Qwen2.5-VL-7B / 3B: 8.29B / 3.75B in all, of which the vision tower (shared by both) is 0.67B
    assert total_params(model_config("vl-7b")) == pytest.approx(8.29e9 - 0.6766e9, rel=2e-3)
    assert total_params(model_config("vl-3b")) == pytest.approx(3.75e9 - 0.6693e9, rel=2e-3)


def test_prepared_prompts_hold_one_picture_and_prompt_len_tokens(tmp_path):
    from transformers import AutoTokenizer

    from megarl.data.dataset import RLDataset, collate_prompts
    from megarl.data.vision_inputs import VisionTokens

    main(["--shape", "vl-tiny", "--random-init", "--device", "cpu", "--prompts", "3", "--steps", "1",
          "--prompt-len", "80", "--image-size", "112", "--work", str(tmp_path), "--prepare-only"])
    work = tmp_path / "vl-tiny_random"
    config = json.loads((work / "model" / "config.json").read_text())
    vision = VisionTokens.of_model(work / "model")
    tokenizer = AutoTokenizer.from_pretrained(work / "model")  # vLLM's processor reads the model's folder
    names = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    assert tokenizer.convert_tokens_to_ids(list(names)) == [
        config["vision_start_token_id"], config["vision_end_token_id"], config["image_token_id"],
        config["video_token_id"]]
    dataset = RLDataset(work / "prompts.parquet", AutoTokenizer.from_pretrained(work / "tok"), max_prompt_length=80,
                        apply_chat_template=False, vision=vision)
    batch = collate_prompts([dataset[i] for i in range(len(dataset))], vision)
    assert [len(ids) for ids in batch.prompt_ids] == [80] * 3
    assert [ids.count(vision.image_pad_id) for ids in batch.prompt_ids] == [16] * 3  # (112 / 28) ** 2
    assert [inputs["image_grid_thw"].tolist() for inputs in batch.multi_modal_inputs] == [[[1, 8, 8]]] * 3
    assert vision.max_pixels == 112 * 112  # vLLM sizes its image budget by the largest picture allowed
    with pytest.raises(SystemExit):  # a vision-language shape has no weights to write
        main(["--shape", "vl-tiny", "--device", "cpu", "--work", str(tmp_path), "--prepare-only"])
