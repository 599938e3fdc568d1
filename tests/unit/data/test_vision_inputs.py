"""A vision-language prompt's image tokens (megarl.data.vision_inputs), the dataset that writes them, and the
trainer's refusal of a VL policy for now. Against transformers' image processor (4 s to import, so not in this
tier): tests/distributed/data/test_vision_processor.py."""

from __future__ import annotations

import json

import pytest
from megarl.data.vision_inputs import VisionTokens, expand_image_pads, image_grid

TOKENS = VisionTokens(image_pad_id=7, vision_start_id=5, vision_end_id=6)


@pytest.mark.parametrize("width,height,grid", [(64, 64, (1, 4, 4)), (100, 60, (1, 4, 8)), (300, 300, (1, 22, 22)),
                                             (20, 900, (1, 64, 2)), (3000, 2000, (1, 58, 86))])
def test_an_images_grid_follows_from_its_size(width, height, grid):
    # transformers' processor agrees on these and many more: tests/distributed/data/test_vision_processor.py
    assert image_grid(height, width, TOKENS) == grid


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
    train, _ = write_shapes_dataset(tmp_path, n_train=2, n_val=1, seed=1)
    dataset = RLDataset(train, tokenizer, max_prompt_length=512, vision=vision)
    batch = collate_prompts(dataset.items)
    assert batch.image_grids == [[(1, 4, 4)]] * 2  # 64 x 64 pictures: 56 x 56 pixels, 4 x 4 patches, 4 tokens
    for ids, messages in zip(batch.prompt_ids, batch.raw_prompts):
        start = ids.index(vision.vision_start_id)
        assert ids[start:start + 6] == [vision.vision_start_id] + [vision.image_pad_id] * 4 + [vision.vision_end_id]
        question = tokenizer(messages[0]["content"].replace("<image>", ""), add_special_tokens=False)["input_ids"]
        assert ids[start + 6:start + 6 + len(question)] == question  # then the question's own tokens
    tight = min(len(ids) for ids in batch.prompt_ids) - 1  # one token short of the shortest: its image counts
    with pytest.raises(ValueError, match=f"all 2 rows are longer than max_prompt_length={tight}"):
        RLDataset(train, tokenizer, max_prompt_length=tight, vision=vision)


def test_the_trainer_refuses_what_it_does_not_run_with_images_naming_the_keys(tmp_path):
    from megarl.config import ConfigError
    from megarl.run_config import load_config
    from megarl.trainer.main import vision_language_policy

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2_5_vl", "image_token_id": 9, "vision_start_token_id": 7, "vision_end_token_id": 8,
        "vision_config": {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}))
    for engine in ("hf", "vllm"):
        runs = load_config(None, [f"actor_rollout_ref.rollout.name={engine}"])
        assert vision_language_policy(runs, tmp_path).image_pad_id == 9
    runs = load_config(None, ["async_training.mode=fully_async", "trainer.placement=separate",
                              "trainer.rollout_gpus=1", "algorithm.adv_estimator=gae", "trainer.n_gpus_per_node=3"])
    assert vision_language_policy(runs, tmp_path).image_pad_id == 9  # a critic and fully async rollouts run
    refused = load_config(None, ["actor_rollout_ref.actor.megatron.context_parallel_size=2",
                                 "trainer.n_gpus_per_node=2"])
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path=.* is a vision-language model") as error:
        vision_language_policy(refused, tmp_path)
    assert "actor_rollout_ref.actor.megatron.context_parallel_size=2" in str(error.value)
    refused = load_config(None, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                 "actor_rollout_ref.actor.megatron.sequence_parallel=true",
                                 "critic.megatron.tensor_model_parallel_size=2", "critic.megatron.sequence_parallel=true",
                                 "algorithm.adv_estimator=gae", "trainer.n_gpus_per_node=2"])
    with pytest.raises(ConfigError, match="sequence_parallel=true; critic.megatron.sequence_parallel=true"):
        vision_language_policy(refused, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert vision_language_policy(refused, tmp_path) is None  # a text model: nothing refused here
