"""What a Qwen2.5-VL-style model needs of a prompt's images: the image tokens in its text, and the pixels.

The model sees an image as a grid of ``patch_size`` pixel patches, after resizing it so that each side is a
multiple of ``patch_size * merge_size`` and its area lies within ``[min_pixels, max_pixels]`` (keeping the aspect
ratio as closely as that allows); each ``merge_size x merge_size`` square of patches becomes one image token of the
language model. In the text an image is ``<|vision_start|>`` + that many ``<|image_pad|>`` + ``<|vision_end|>``.

A dataset's ``<image>`` placeholder becomes ``<|vision_start|><|image_pad|><|vision_end|>`` before the chat
template and the tokenizer run; :func:`expand_image_pads` then repeats each pad as many times as its image has
tokens, which :func:`image_grid` knows from the image's size alone (no pixels: the dataset counts every prompt's
tokens up front). :func:`pixel_inputs` makes the pixels with transformers' own image processor, the one vLLM and
transformers use, so every engine sees the same ``pixel_values``; the grids it reports are checked against
:func:`image_grid`.

Left out: videos; other vision-language families (their token layouts differ).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE_IN_TEXT = VISION_START + IMAGE_PAD + VISION_END  # what a dataset's <image> becomes before tokenizing
# Qwen2-VL's image processor defaults: 56 x 56 to 28 x 28 x 1280 pixels
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 56 * 56, 28 * 28 * 1280


@dataclass(frozen=True)
class VisionTokens:
    """A vision-language model's image tokens and patch geometry (its config.json and preprocessor_config.json)."""

    image_pad_id: int
    vision_start_id: int
    vision_end_id: int
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS

    @classmethod
    def of_model(cls, model_path: str | Path) -> Optional["VisionTokens"]:
        """The model's, or None for a text-only model (no ``vision_config`` in its config.json)."""
        path = Path(model_path)
        config = json.loads((path / "config.json").read_text())
        vision = config.get("vision_config")
        if vision is None:
            return None
        pixels = {}
        processor_file = path / "preprocessor_config.json"
        if processor_file.is_file():
            processor = json.loads(processor_file.read_text())
            size = processor.get("size") or {}
            pixels = {"min_pixels": processor.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_PIXELS,
                      "max_pixels": processor.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS}
        try:
            return cls(image_pad_id=int(config["image_token_id"]), vision_start_id=int(config["vision_start_token_id"]),
                       vision_end_id=int(config["vision_end_token_id"]), patch_size=int(vision["patch_size"]),
                       merge_size=int(vision["spatial_merge_size"]),
                       temporal_patch_size=int(vision["temporal_patch_size"]), **pixels)
        except KeyError as missing:
            raise ValueError(f"{path / 'config.json'}: a vision-language config without {missing}") from None

    def image_processor(self):
        """transformers' Qwen2-VL image processor with this geometry."""
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor(patch_size=self.patch_size, merge_size=self.merge_size,
                                     temporal_patch_size=self.temporal_patch_size,
                                     size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels})


def resized(height: int, width: int, tokens: VisionTokens) -> tuple[int, int]:
    """The size an image is resized to: sides multiples of ``patch * merge``, area within the pixel bounds."""
    factor = tokens.patch_size * tokens.merge_size
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {width} x {height} pixels: aspect ratio over 200")
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > tokens.max_pixels:
        scale = math.sqrt(height * width / tokens.max_pixels)
        h, w = max(factor, math.floor(height / scale / factor) * factor), max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < tokens.min_pixels:
        scale = math.sqrt(tokens.min_pixels / (height * width))
        h, w = math.ceil(height * scale / factor) * factor, math.ceil(width * scale / factor) * factor
    return h, w


def image_grid(height: int, width: int, tokens: VisionTokens) -> tuple[int, int, int]:
    """``(frames, rows, columns)`` of patches of one image (a still image is one frame)."""
    h, w = resized(height, width, tokens)
    return 1, h // tokens.patch_size, w // tokens.patch_size


def grid_tokens(grid: Sequence[int], merge_size: int) -> int:
    """How many image tokens a patch grid (frames x rows x columns) becomes: the merger folds each
    ``merge_size x merge_size`` block of patches into one token."""
    return int(grid[0]) * int(grid[1]) * int(grid[2]) // merge_size ** 2


def tokens_of(grid: Sequence[int], tokens: VisionTokens) -> int:
    return grid_tokens(grid, tokens.merge_size)


def expand_image_pads(input_ids: Sequence[int], grids: Sequence[Sequence[int]], tokens: VisionTokens,
                      where: str) -> list[int]:
    """``input_ids`` with its i-th ``<|image_pad|>`` repeated as often as image i has tokens."""
    pads = sum(1 for t in input_ids if t == tokens.image_pad_id)
    if pads != len(grids):
        raise ValueError(f"{where}: {pads} image tokens in the tokenized prompt for {len(grids)} image(s): does the "
                         f"tokenizer know {IMAGE_PAD!r} as one token?")
    out: list[int] = []
    image = 0
    for token in input_ids:
        if token == tokens.image_pad_id:
            out.extend([token] * tokens_of(grids[image], tokens))
            image += 1
        else:
            out.append(token)
    return out


def image_runs(input_ids: Sequence[int], grids: Sequence[Sequence[int]], *, image_token_id: int, merge_size: int,
               where: str = "a sequence") -> list[tuple[int, int]]:
    """``(start, length)`` of each image's tokens in one unpadded sequence, in the order of ``grids`` (patch grids,
    frames x rows x columns): image i is the next ``tokens_of(grids[i])`` consecutive image tokens after image i-1's
    (images may follow each other directly). The one statement of the rule every engine and the trainer follow:
    image tokens after the last image's run are text (a policy may sample the token; vLLM embeds it as text)."""
    ids = list(input_ids)
    runs: list[tuple[int, int]] = []
    index = 0
    for image, grid in enumerate(grids):
        needed = grid_tokens(grid, merge_size)
        while index < len(ids) and ids[index] != image_token_id:
            index += 1
        if index == len(ids):
            raise ValueError(f"{where}: {len(grids)} images in image_grid_thw, {image} runs of image tokens")
        start = index
        while index < len(ids) and index - start < needed and ids[index] == image_token_id:
            index += 1
        if index - start != needed:
            raise ValueError(f"{where}: token {start}: image {image + 1} has {index - start} placeholder tokens, its "
                             f"grid {tuple(int(v) for v in grid)} merged by {merge_size} needs {needed}")
        runs.append((start, needed))
    return runs


def collapse_image_pads(input_ids: Sequence[int], grids: Sequence[Sequence[int]], tokens: VisionTokens,
                        where: str) -> list[int]:
    """:func:`expand_image_pads` undone: each image's run of ``<|image_pad|>`` tokens (:func:`image_runs`) back to
    one, as a rollout engine that expands prompts itself (vLLM) takes them; a sampled image token stays."""
    ids = list(input_ids)
    out, end = [], 0
    for start, length in image_runs(ids, grids, image_token_id=tokens.image_pad_id, merge_size=tokens.merge_size,
                                    where=where):
        out += ids[end:start + 1]
        end = start + length
    return out + ids[end:]


def images_of_pixels(pixel_values: Any, image_grid_thw: Any, tokens: VisionTokens, processor=None) -> list:
    """The 8-bit RGB images :func:`pixel_inputs` made ``pixel_values`` of, as the processor resized them: its
    normalisation and patch layout undone (exact: the rounding error of its float32 arithmetic is ~1e-5 of a grey
    level). A rollout engine that runs the image processor itself (vLLM takes images, not pixels) gets the same
    pixels back from these: their sides are already what the processor resizes to."""
    import numpy as np
    import torch
    from PIL import Image

    processor = processor or _processor(tokens)
    mean = np.asarray(processor.image_mean, dtype=np.float64)[:, None, None]
    std = np.asarray(processor.image_std, dtype=np.float64)[:, None, None]
    merge, patch, frames = tokens.merge_size, tokens.patch_size, tokens.temporal_patch_size
    flat = torch.as_tensor(pixel_values).double().numpy()
    grids = torch.as_tensor(image_grid_thw).tolist()
    if flat.shape[0] != sum(t * h * w for t, h, w in grids):
        raise ValueError(f"images_of_pixels: {flat.shape[0]} patch rows for grids {grids}, which hold "
                         f"{sum(t * h * w for t, h, w in grids)}")
    images, start = [], 0
    for t, h, w in grids:
        if t != 1:
            raise ValueError(f"images_of_pixels: a grid of {t} frames is a video, not an image")
        rows = flat[start:start + h * w]
        start += h * w
        # rows: (h/m, w/m, m, m) patches; each (channel, frame, patch_y, patch_x); the frames are copies of the image
        grid = rows.reshape(h // merge, w // merge, merge, merge, 3, frames, patch, patch)[:, :, :, :, :, 0]
        chw = grid.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, h * patch, w * patch)
        levels = np.rint((chw * std + mean) / processor.rescale_factor)
        images.append(Image.fromarray(np.clip(levels, 0, 255).astype(np.uint8).transpose(1, 2, 0)))
    return images


def pixel_inputs(images: Sequence[Any], tokens: VisionTokens, processor=None) -> dict:
    """``{"pixel_values", "image_grid_thw"}`` of PIL images, by transformers' image processor, whose grids must
    be :func:`image_grid`'s (the token counts the prompt was expanded with)."""
    import torch

    processor = processor or _processor(tokens)
    out = processor(images=list(images), return_tensors="pt")
    grids = out["image_grid_thw"].to(torch.long)
    expected = torch.tensor([image_grid(image.height, image.width, tokens) for image in images], dtype=torch.long)
    if not torch.equal(grids, expected):
        raise ValueError(f"the image processor made grids {grids.tolist()}, the prompt's tokens were counted for "
                         f"{expected.tolist()}")
    return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": grids}


def prompt_pixel_inputs(images: Sequence[Sequence[dict]], tokens: VisionTokens) -> list[Optional[dict]]:
    """Per prompt, :func:`pixel_inputs` of its image entries (``{bytes, path}``, paths absolute: the dataset made
    them so), or None for a prompt without images."""
    from megarl.data.images import open_image

    return [pixel_inputs([open_image(entry, f"prompt {row} images[{i}]") for i, entry in enumerate(entries)], tokens)
            if entries else None for row, entries in enumerate(images)]


@functools.lru_cache(maxsize=4)
def _processor(tokens: VisionTokens):
    """One image processor per geometry (building one reads transformers' defaults each time)."""
    return tokens.image_processor()
