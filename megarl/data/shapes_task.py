"""A generated image task with exact answers, for vision-language RL on CPU: small pictures of coloured shapes and
one question each, answered with one word or number, bare or in ``\\boxed{}`` (scored by
megarl.rewards.synthetic_task.score_shapes, route ``synthetic/shapes``).

    count   "how many shapes are in the image?"                          -> "3"
    colour  "what colour are the shapes in the image: red, green, ..."   -> "red"     (all shapes of a picture share it)
    shape   "which shape is drawn in the image: circle, square or ..."   -> "circle"  (all shapes of a picture share it)

The text keeps to the embedded character tokenizer's alphabet (lower case, no backslash), so the tiny embedded
vision-language model (``embedded:tiny-qwen2-vl``) reads it as a real model would.

``write_shapes_dataset`` writes train/val parquet files in verl's multimodal layout (megarl.data.images): the
picture as PNG bytes in ``images``, ``<image>`` in the user message. Pictures are drawn with Pillow from a seeded
generator: the same seed gives the same files. ``embedded:shapes`` (megarl.data.synthetic.resolve_data_files)
generates them into the cache.

Left out: several images per prompt and multi-turn image tasks.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Sequence

from megarl.data.images import IMAGE_PLACEHOLDER, image_entry
from megarl.data.rows import make_prompt_row, write_prompt_rows

DATA_SOURCE = "synthetic/shapes"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 20)}
SHAPES = ("circle", "square", "triangle")


def _one_of(words) -> str:
    """``a, b or c``"""
    words = list(words)
    return ", ".join(words[:-1]) + " or " + words[-1]


QUESTIONS = {
    "count": "how many shapes are in the image?",
    "colour": f"what colour are the shapes in the image: {_one_of(sorted(COLOURS))}?",
    "shape": f"which shape is drawn in the image: {_one_of(SHAPES)}?",
}
INSTRUCTION = "answer with one word or number."
MAX_SHAPES = 4


def draw_shapes(rng: random.Random, *, size: int, count: int, colour: str, shape: str) -> bytes:
    """PNG bytes of ``count`` non-overlapping shapes on a white square of ``size`` pixels."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    cell = size // 2  # one shape per quadrant: at most four, never overlapping
    for quadrant in rng.sample(range(4), count):
        radius = rng.randint(cell // 4, cell // 2 - 2)
        cx = (quadrant % 2) * cell + rng.randint(radius + 1, cell - radius - 1)
        cy = (quadrant // 2) * cell + rng.randint(radius + 1, cell - radius - 1)
        box = (cx - radius, cy - radius, cx + radius, cy + radius)
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=fill)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_shapes_example(rng: random.Random, *, size: int = 64,
                        kinds: Sequence[str] = tuple(QUESTIONS)) -> tuple[bytes, str, str]:
    """(PNG bytes, question, answer), the question one of ``kinds``."""
    unknown = sorted(set(kinds) - set(QUESTIONS))
    if unknown or not kinds:
        raise ValueError(f"shapes question kinds {list(kinds)}: choose from {sorted(QUESTIONS)}")
    count, colour, shape = rng.randint(1, MAX_SHAPES), rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
    kind = rng.choice(sorted(kinds))
    answer = {"count": str(count), "colour": colour, "shape": shape}[kind]
    return draw_shapes(rng, size=size, count=count, colour=colour, shape=shape), QUESTIONS[kind], answer


def write_shapes_dataset(out_dir: str | Path, *, n_train: int, n_val: int, seed: int = 0, size: int = 64,
                         kinds: Sequence[str] = tuple(QUESTIONS)) -> tuple[Path, Path]:
    """``out_dir/train.parquet`` and ``out_dir/val.parquet``; returns their paths."""
    rng = random.Random(seed)
    paths = []
    for split, n in (("train", n_train), ("val", n_val)):
        rows = []
        for index in range(n):
            png, question, answer = make_shapes_example(rng, size=size, kinds=kinds)
            rows.append(make_prompt_row(
                messages=[{"role": "user", "content": f"{IMAGE_PLACEHOLDER}{question} {INSTRUCTION}"}],
                ground_truth=answer, data_source=DATA_SOURCE, extra_info={"split": split, "index": index},
                images=[image_entry(png)]))
        paths.append(write_prompt_rows(rows, Path(out_dir) / f"{split}.parquet"))
    return paths[0], paths[1]
