"""megarl.data.vision_inputs against transformers' Qwen2-VL image processor, the one vLLM and transformers use: the
grid megarl counts a prompt's image tokens with, from the size alone, is the processor's for every size tried."""

from __future__ import annotations

import random

import pytest
from PIL import Image

from megarl.data.vision_inputs import VisionTokens, image_grid, pixel_inputs

TOKENS = VisionTokens(image_pad_id=7, vision_start_id=5, vision_end_id=6)


def test_the_grid_from_the_size_alone_is_the_image_processors():
    rng = random.Random(0)
    sizes = [(100, 60), (28, 28), (20, 900), (3000, 2000), (640, 480), (57, 1130)]
    sizes += [(rng.randint(20, 3000), rng.randint(20, 3000)) for _ in range(30)]
    processor = TOKENS.image_processor()
    for width, height in sizes:
        if max(width, height) / min(width, height) > 200:
            continue
        grid = processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"][0]
        assert tuple(grid.tolist()) == image_grid(height, width, TOKENS), (width, height)


def test_pixels_come_with_their_grids_and_patch_rows():
    out = pixel_inputs([Image.new("RGB", (100, 60)), Image.new("RGB", (300, 300))], TOKENS)
    assert out["image_grid_thw"].tolist() == [[1, 4, 8], [1, 22, 22]]
    assert tuple(out["pixel_values"].shape) == (4 * 8 + 22 * 22, 3 * 2 * 14 * 14)


def test_a_processor_that_resizes_otherwise_is_caught():
    other = VisionTokens(image_pad_id=7, vision_start_id=5, vision_end_id=6, max_pixels=28 * 28 * 4)
    with pytest.raises(ValueError, match="the image processor made grids"):
        pixel_inputs([Image.new("RGB", (300, 300))], TOKENS, processor=other.image_processor())
