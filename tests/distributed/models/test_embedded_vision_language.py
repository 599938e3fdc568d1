"""The embedded tiny Qwen2.5-VL (embedded:tiny-qwen2-vl): the text model's decoder and tokenizer with the image
tokens added after the alphabet, a vision tower, and a processor config; transformers loads and runs it on a
picture of the shapes task as the dataset prepares it. (Here, not in tests/unit: building it imports transformers'
vision-language model and image processor, seconds the unit tier does not have.)"""

from __future__ import annotations

import json

import torch

from megarl.data.dataset import RLDataset
from megarl.data.shapes_task import write_shapes_dataset
from megarl.data.tokenizer import ALPHABET, VISION_TOKENS, build_char_tokenizer
from megarl.data.vision_inputs import VisionTokens
from megarl.models.embedded import ensure_embedded_model
from megarl.plan import count_parameters


def test_the_tiny_vision_language_model_reads_a_picture_as_the_dataset_prepares_it(tmp_path):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    model_dir = ensure_embedded_model("tiny-qwen2-vl", root=tmp_path / "embedded")
    config = json.loads((model_dir / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert (text["hidden_size"], text["head_dim"], text["vocab_size"]) == (128, 64, 128)
    assert text["rope_parameters"]["mrope_section"] == [8, 12, 12]  # 32 frequencies of the 64-wide head
    # the text model's ids are kept; the image tokens come after the alphabet
    start, end, pad, video_pad = (3 + len(ALPHABET) + i for i in range(4))
    assert [config[f"{name}_token_id"] for name in ("vision_start", "vision_end", "image", "video")] == [
        start, end, pad, video_pad]
    assert build_char_tokenizer(vision=True).encode("ab").ids == build_char_tokenizer().encode("ab").ids
    vision = VisionTokens.of_model(model_dir)
    assert (vision.image_pad_id, vision.min_pixels, vision.max_pixels) == (pad, 56 * 56, 112 * 112)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)) == [start, end, pad, video_pad]
    train, _ = write_shapes_dataset(tmp_path / "data", n_train=2, n_val=1, seed=3, kinds=("count",))
    batch = RLDataset(train, tokenizer, max_prompt_length=128, vision=vision).batch([0, 1])
    ids = torch.tensor(batch.prompt_ids)
    assert (ids == pad).sum(dim=1).tolist() == [4, 4]  # 64 px -> 56 px: 4 x 4 patches, merged 2 x 2
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    counted = count_parameters(config)  # the planner's count, vision tower included
    assert counted.total == sum(p.numel() for p in model.parameters())
    assert counted.vision_tower == sum(p.numel() for p in model.model.visual.parameters())
    with torch.no_grad():
        logits = [model(input_ids=row[None], mm_token_type_ids=(row[None] == pad).int(), **inputs).logits
                  for row, inputs in zip(ids, batch.multi_modal_inputs)]
    assert all(torch.isfinite(out).all() and out.shape == (1, ids.shape[1], 128) for out in logits)
    # the two prompts differ only in their pictures: the answers' distributions differ too
    assert not torch.allclose(logits[0][0, -1], logits[1][0, -1])
