"""Multimodal prompts in verl's parquet layout (images beside prompt, one <image> per image): the generated
shapes task and its exact answers, reading and checking image rows, geo3k preprocessing from a local copy."""

from __future__ import annotations

import io
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from megarl.data.dataset import RLDataset, collate_prompts
from megarl.data.images import IMAGE_TYPE, open_image
from megarl.data.preprocess import main as preprocess
from megarl.data.shapes_task import COLOURS, QUESTIONS, draw_shapes, make_shapes_example, write_shapes_dataset
from megarl.data.tokenizer import unsupported_characters, write_local_tokenizer
from megarl.rewards.routing import ScorerRouter


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_local_tokenizer(tmp_path_factory.mktemp("tok")))


def _measure(png: bytes) -> tuple[int, str, float]:
    """What a picture shows, read from its pixels: shapes (quadrants with colour), their colour, and the filled
    share of each shape's bounding box (circle pi/4, square 1, triangle 1/2)."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    size = image.width
    pixels = image.load()
    cell = size // 2
    shapes, colours, fills = 0, set(), []
    for quadrant in range(4):
        x0, y0 = (quadrant % 2) * cell, (quadrant // 2) * cell
        coloured = [(x, y) for x in range(x0, x0 + cell) for y in range(y0, y0 + cell) if pixels[x, y] != (255, 255, 255)]
        if not coloured:
            continue
        shapes += 1
        colours |= {pixels[x, y] for x, y in coloured}
        xs, ys = [x for x, _ in coloured], [y for _, y in coloured]
        fills.append(len(coloured) / ((max(xs) - min(xs) + 1) * (max(ys) - min(ys) + 1)))
    (rgb,) = colours
    return shapes, next(name for name, value in COLOURS.items() if value == rgb), sum(fills) / len(fills)


@pytest.mark.parametrize("shape,fill", [("circle", 3.14159 / 4), ("square", 1.0), ("triangle", 0.5)])
def test_a_picture_shows_what_its_answer_says(shape, fill):
    for count in range(1, 5):
        png = draw_shapes(random.Random(count), size=96, count=count, colour="green", shape=shape)
        shapes, colour, measured_fill = _measure(png)
        assert (shapes, colour) == (count, "green")
        assert measured_fill == pytest.approx(fill, abs=0.12)  # pixel rounding at radii of 12-22 pixels


def test_every_question_kind_is_answered_from_the_picture():
    rng = random.Random(3)
    seen = set()
    for _ in range(60):
        png, question, answer = make_shapes_example(rng)
        shapes, colour, _ = _measure(png)
        if question.startswith("how many"):
            assert answer == str(shapes)
        elif question.startswith("what colour"):
            assert answer == colour
        else:
            assert answer in ("circle", "square", "triangle")
        seen.add(question.split()[0])
        assert not unsupported_characters(question)  # the embedded tokenizer reads every character
    assert seen == {"how", "what", "which"}
    only_counts = {make_shapes_example(rng, kinds=("count",))[1] for _ in range(20)}
    assert only_counts == {QUESTIONS["count"]}
    with pytest.raises(ValueError, match="choose from"):
        make_shapes_example(rng, kinds=("size",))


def test_the_shapes_dataset_reads_back_with_its_images_and_scores_exactly(tmp_path, tokenizer):
    train, val = write_shapes_dataset(tmp_path, n_train=12, n_val=4, seed=5)
    again, _ = write_shapes_dataset(tmp_path / "again", n_train=12, n_val=4, seed=5)
    assert pq.read_table(train).equals(pq.read_table(again))  # same seed, same files
    dataset = RLDataset(train, tokenizer, max_prompt_length=512, allow_images=True)
    batch = collate_prompts(dataset.items[:3])
    assert [len(images) for images in batch.images] == [1, 1, 1]
    assert open_image(batch.images[0][0], "test").size == (64, 64)
    assert all(p[0]["content"].startswith("<image>") for p in batch.raw_prompts)
    router = ScorerRouter()
    for item in dataset.items:
        score = router.scorer_for(item.data_source)
        assert score(f"I see it. \\boxed{{{item.ground_truth}}}", item.ground_truth) == 1.0
        assert score(f" {item.ground_truth.upper()}<|im_end|>", item.ground_truth) == 1.0  # bare, any case
        assert score("\\boxed{7}", item.ground_truth) < 0.9
        assert score("zz", item.ground_truth) < 0.9


def _image_rows(path, prompts, images):
    pq.write_table(pa.table({
        "prompt": [[{"role": "user", "content": p}] for p in prompts],
        "reward_model": [{"ground_truth": "1", "style": "rule"} for _ in prompts],
        "images": pa.array(images, type=pa.list_(IMAGE_TYPE)),
    }), path)
    return path


def test_image_rows_are_checked_and_named(tmp_path, tokenizer):
    png = draw_shapes(random.Random(0), size=32, count=1, colour="red", shape="square")
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png)
    good = _image_rows(tmp_path / "good.parquet", ["<image>how many?"], [[{"bytes": None, "path": "pics/a.png"}]])
    item = RLDataset(good, tokenizer, max_prompt_length=512, allow_images=True)[0]
    assert item.images[0]["path"] == str(tmp_path / "pics" / "a.png")  # relative to the parquet file
    with pytest.raises(ValueError, match=r"good.parquet row 0: a multimodal prompt .*for a text-only model"):
        RLDataset(good, tokenizer, max_prompt_length=512)  # what the trainer asks for: no VLM is built yet
    text = tmp_path / "text.parquet"  # no images column: a literal <image> in a text prompt is just text
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "what does <image> mean in HTML?"}]],
                             "reward_model": [{"ground_truth": "1", "style": "rule"}]}), text)
    assert RLDataset(text, tokenizer, max_prompt_length=512)[0].images == []
    cases = {
        "count": (["ok <image>", "<image><image> two"], [[{"bytes": png, "path": None}]] * 2,
                  r"row 1: 1 image\(s\) but 2 '<image>' placeholder"),
        "broken": (["<image>x"], [[{"bytes": b"not a png", "path": None}]], r"row 0 images\[0\]: the image is not"),
        "missing": (["<image>x"], [[{"bytes": None, "path": "pics/none.png"}]], r"row 0 images\[0\]: cannot read"),
    }
    for name, (prompts, images, error) in cases.items():
        with pytest.raises(ValueError, match=error):
            RLDataset(_image_rows(tmp_path / f"{name}.parquet", prompts, images), tokenizer, max_prompt_length=512,
                      allow_images=True)


def test_geo3k_from_a_local_copy_keeps_its_images(tmp_path, tokenizer, capsys):
    pngs = [draw_shapes(random.Random(i), size=32, count=1, colour="blue", shape="triangle") for i in range(3)]
    source = tmp_path / "geometry3k_train.parquet"  # the Hugging Face dataset's columns
    pq.write_table(pa.table({
        "images": pa.array([[{"bytes": png, "path": f"{i}.png"}] for i, png in enumerate(pngs)],
                           type=pa.list_(IMAGE_TYPE)),
        "problem": [f"<image>Find x in triangle {i}." for i in range(3)],
        "answer": ["3", "4\\sqrt{2}", "60"],
    }), source)
    assert preprocess(["geo3k", "--input", str(source), "--output", str(tmp_path / "out")]) == 0
    dataset = RLDataset(tmp_path / "out" / "train.parquet", tokenizer, max_prompt_length=512, allow_images=True)
    assert [item.ground_truth for item in dataset.items] == ["3", "4\\sqrt{2}", "60"]
    assert [item.images[0]["bytes"] for item in dataset.items] == pngs
    assert dataset[1].data_source == "hiyouga/geometry3k"
    assert dataset[1].raw_prompt[0]["content"].startswith("<image>Find x in triangle 1. Reason step by step")
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"images": pa.array([[]], type=pa.list_(IMAGE_TYPE)), "problem": ["<image>Find y."],
                             "answer": ["2"]}), bad)
    assert preprocess(["geo3k", "--input", str(bad), "--output", str(tmp_path / "bad_out")]) == 2
    assert "bad.parquet row 0: 0 image(s) but 1 '<image>'" in capsys.readouterr().err
    assert not (tmp_path / "bad_out").exists()


def test_image_key_names_the_images_column(tmp_path, tokenizer):
    """verl's data.image_key: a dataset whose pictures live in another column reads them from there (and a
    broken one is named by that column)."""
    from megarl.run_config import load_config

    png = draw_shapes(random.Random(0), size=32, count=1, colour="red", shape="square")
    path = tmp_path / "pictures.parquet"
    pq.write_table(pa.table({
        "prompt": [[{"role": "user", "content": "<image>how many?"}]] * 2,
        "reward_model": [{"ground_truth": "1", "style": "rule"}] * 2,
        "pictures": pa.array([[{"bytes": png, "path": None}], [{"bytes": b"not a png", "path": None}]],
                             type=pa.list_(IMAGE_TYPE)),
    }), path)
    assert load_config(None, ["data.image_key=pictures"]).data.image_key == "pictures"
    with pytest.raises(ValueError, match=r"row 1 pictures\[0\]: the image is not"):
        RLDataset(path, tokenizer, max_prompt_length=512, allow_images=True, image_key="pictures")
    # under the default key the column is not the images: the rows are text, <image> and all
    assert RLDataset(path, tokenizer, max_prompt_length=512)[0].images == []
