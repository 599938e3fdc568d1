"""A vision-language prompt's image tokens and pixels (megarl.data.vision_inputs) against transformers' Qwen2-VL
image processor, the one vLLM and transformers use."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from megarl.data.vision_inputs import VisionTokens, expand_image_pads, image_grid, pixel_inputs

TOKENS = VisionTokens(image_pad_id=7, vision_start_id=5, vision_end_id=6)


@pytest.mark.parametrize("width,height", [(100, 60), (28, 28), (20, 900), (3000, 2000), (640, 480), (57, 1130)])
def test_the_grid_from_the_size_alone_is_the_image_processors(width, height):
    image = Image.new("RGB", (width, height))
    grid = TOKENS.image_processor()(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert tuple(grid) == image_grid(height, width, TOKENS)


def test_pixels_come_with_their_grids_and_patch_rows():
    out = pixel_inputs([Image.new("RGB", (100, 60)), Image.new("RGB", (300, 300))], TOKENS)
    assert out["image_grid_thw"].tolist() == [[1, 4, 8], [1, 22, 22]]
    assert tuple(out["pixel_values"].shape) == (4 * 8 + 22 * 22, 3 * 2 * 14 * 14)


def test_each_image_pad_grows_to_its_images_token_count():
    ids = [1, 5, 7, 6, 2, 5, 7, 6, 3]
    assert expand_image_pads(ids, [(1, 4, 8), (1, 2, 2)], TOKENS, "row 0") == [1, 5] + [7] * 8 + [6, 2, 5, 7, 6, 3]
    with pytest.raises(ValueError, match="row 3: 2 image tokens in the tokenized prompt for 1 image"):
        expand_image_pads(ids, [(1, 4, 8)], TOKENS, "row 3")


def test_the_models_tokens_and_pixel_bounds_are_read_from_its_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2_5_vl", "image_token_id": 151655, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_config": {"patch_size": 14, "spatial_merge_size": 2,
                                                         "temporal_patch_size": 2}}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056}))
    assert VisionTokens.of_model(tmp_path) == VisionTokens(151655, 151652, 151653, max_pixels=12845056)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert VisionTokens.of_model(tmp_path) is None


def test_a_vision_language_dataset_writes_each_image_as_its_tokens_and_counts_them(tmp_path):
    from transformers import AutoTokenizer

    from megarl.data.dataset import RLDataset, collate_prompts
    from megarl.data.shapes_task import write_shapes_dataset
    from megarl.data.tokenizer import write_local_tokenizer
    from megarl.data.vision_inputs import IMAGE_PAD, VISION_END, VISION_START

    tokenizer = AutoTokenizer.from_pretrained(write_local_tokenizer(tmp_path / "tok"))
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END]})
    vision = VisionTokens(*tokenizer.convert_tokens_to_ids([IMAGE_PAD, VISION_START, VISION_END]))
    train, _ = write_shapes_dataset(tmp_path, n_train=4, n_val=2, seed=1)
    dataset = RLDataset(train, tokenizer, max_prompt_length=512, vision=vision)
    text = RLDataset(train, tokenizer, max_prompt_length=512, allow_images=True)  # <image> left as text
    batch = collate_prompts(dataset.items)
    assert batch.image_grids == [[(1, 4, 4)]] * 4  # 64 x 64 pictures: 56 x 56 pixels, 4 x 4 patches, 4 tokens
    for ids, plain in zip(batch.prompt_ids, collate_prompts(text.items).prompt_ids):
        start = ids.index(vision.vision_start_id)
        assert ids[start:start + 6] == [vision.vision_start_id] + [vision.image_pad_id] * 4 + [vision.vision_end_id]
        assert len(ids) == len(plain) - len("<image>") + 6  # the character tokenizer spelled <image> out
    tight = len(batch.prompt_ids[0]) - 1  # one token short of the first prompt: its images count
    assert len(RLDataset(train, tokenizer, max_prompt_length=tight, vision=vision).filtered_rows) >= 1
