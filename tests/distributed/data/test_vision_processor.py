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


def test_images_recovered_from_the_pixels_give_the_same_pixels_again():
    """What the vLLM engine hands vLLM for a prompt's pixels: the processor's resized images, exactly (vLLM's
    processor then makes the pixels the trainer reads)."""
    import numpy as np
    import torch

    from megarl.data.vision_inputs import images_of_pixels

    rng = np.random.RandomState(0)
    images = [Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8)) for h, w in [(60, 100), (300, 300), (37, 911)]]
    pixels = pixel_inputs(images, TOKENS)
    back = images_of_pixels(pixels["pixel_values"], pixels["image_grid_thw"], TOKENS)
    assert [image.size for image in back] == [(112, 56), (308, 308), (924, 28)]  # the processor's sizes
    again = pixel_inputs(back, TOKENS)
    assert torch.equal(again["image_grid_thw"], pixels["image_grid_thw"])
    assert torch.equal(again["pixel_values"], pixels["pixel_values"])
    with pytest.raises(ValueError, match=r"644 patch rows for grids \[\[1, 4, 8\], \[1, 22, 22\], \[1, 2, 66\]\], which hold 648"):
        images_of_pixels(pixels["pixel_values"][:-4], pixels["image_grid_thw"], TOKENS)


def test_collapsing_image_pads_undoes_the_expansion_and_keeps_sampled_image_tokens_as_text():
    from megarl.data.vision_inputs import collapse_image_pads, expand_image_pads

    pad, grids = TOKENS.image_pad_id, [[1, 4, 8], [1, 2, 2]]  # 8 and 1 tokens
    prompt = [1, 5, pad, 6, 2, 5, pad, 6, 3]
    expanded = expand_image_pads(prompt, grids, TOKENS, "row 0")
    assert expanded.count(pad) == 9
    assert collapse_image_pads(expanded, grids, TOKENS, "row 0") == prompt
    # a later turn: the policy sampled the image token once after the pictures; it is text, not an image
    later = expanded + [4, pad, 4]
    assert collapse_image_pads(later, grids, TOKENS, "row 0") == prompt + [4, pad, 4]
    with pytest.raises(ValueError, match=r"row 3: token 2: image 1 has 7 placeholder tokens, its grid \(1, 4, 8\) merged by 2 needs 8"):
        collapse_image_pads([1, 5] + [pad] * 7 + [6], grids, TOKENS, "row 3")
    with pytest.raises(ValueError, match="row 4: 2 images in image_grid_thw, 1 runs of image tokens"):
        collapse_image_pads([1, 5] + [pad] * 8 + [6], grids, TOKENS, "row 4")
