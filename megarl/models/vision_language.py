"""Qwen2.5-VL in megatron: the language model is a megatron ``GPTModel`` with multimodal RoPE (M-RoPE), and the
vision tower is transformers' own module, held by the first pipeline stage and replicated over tensor parallelism.

Why transformers' vision tower: it is ~0.7B of a 7B model, frozen by default in RL (verl's
``freeze_vision_tower``), and runs once per image, not once per token; megatron-core ships no Qwen2.5-VL vision
encoder (window attention, 2-D rotary patches, the patch merger). Replicated over TP it computes the same
features on every TP rank, and a trainable tower gets the same gradient on every TP rank (the language model's
first linear all-reduces its input gradient over TP), like a norm's weight. Megatron-Bridge and ms-swift make the
same choice.

:class:`VisionLanguageGPTModel` keeps every language-model parameter under the name a text-only ``GPTModel`` uses
(``embedding.*``, ``decoder.*``, ``output_layer.*``) and adds the tower as ``vision_model.*``, so the bridge's
tables, the weight sync, LoRA and checkpoints treat the language model as any Qwen2 decoder.

:func:`mrope_position_ids` gives each token its three rotary positions (temporal, height, width): text tokens
count up on all three; the tokens of one image sit on its grid (row, column) after the text before it, and the
text after the image resumes at the largest position of the image + 1. Text-only rows get the 1-D positions on all
three axes, which is plain RoPE.

Left out: videos (``pixel_values_videos``), context parallelism and sequence parallelism with images (refused by
the forward), images in pipeline stages other than the first (the tower is on the first stage, where the
embedding is).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from megarl.data.vision_inputs import image_runs

VISION_PREFIX = "vision_model."  # the tower's parameters in the megatron model (its attribute below)


@dataclass(frozen=True)
class ImageTokens:
    """What the batch layout needs of a vision-language model to place images: its image placeholder token and
    how many patches (per side) its merger folds into one token."""

    image_token_id: int
    spatial_merge_size: int

    @classmethod
    def of_config(cls, hf: Any) -> "ImageTokens":
        """A vision-language HF config's (``image_token_id``, ``vision_config.spatial_merge_size``)."""
        return cls(int(hf.image_token_id), int(hf.vision_config.spatial_merge_size))


def image_tokens_of(model: torch.nn.Module) -> Optional[ImageTokens]:
    """The :class:`ImageTokens` of a (wrapped) megatron model chunk, or None for a text-only model."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return getattr(model, "image_tokens", None)


def vision_tower_of(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """A model chunk's vision tower: a vision-language model's first pipeline stage has one, else None."""
    return getattr(model, "vision_model", None)


def mrope_position_ids(input_ids: Sequence[int] | torch.Tensor, image_grid_thw: Optional[torch.Tensor], *,
                       image_token_id: int, spatial_merge_size: int) -> torch.Tensor:
    """``[3, len(input_ids)]`` M-RoPE positions of one unpadded sequence. ``image_grid_thw`` ``[images, 3]``: the
    patch grid (frames, rows, columns) of each image in the order the sequence shows them; each image is a run of
    ``frames * rows * columns / spatial_merge_size**2`` consecutive ``image_token_id`` tokens
    (:func:`~megarl.data.vision_inputs.image_runs`: later image tokens are text)."""
    ids = torch.as_tensor(input_ids).tolist()
    grids = [] if image_grid_thw is None else [tuple(int(v) for v in g) for g in torch.as_tensor(image_grid_thw)]
    runs = image_runs(ids, grids, image_token_id=image_token_id, merge_size=spatial_merge_size, where="sequence")
    columns: list[torch.Tensor] = []
    next_position, index = 0, 0
    for (start, length), (frames, rows, cols) in zip(runs + [(len(ids), 0)], grids + [(0, 0, 0)]):
        columns.append(torch.arange(next_position, next_position + start - index).expand(3, -1))  # text before it
        next_position += start - index
        if length:
            rows, cols = rows // spatial_merge_size, cols // spatial_merge_size
            t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(cols), indexing="ij")
            columns.append(torch.stack([t, h, w]).reshape(3, -1) + next_position)
            next_position += max(frames, rows, cols)
        index = start + length
    return torch.cat(columns, dim=1).long()


def image_slots(input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor], *, image_token_id: int,
                spatial_merge_size: int) -> torch.Tensor:
    """Which tokens of one unpadded sequence take its images' embeddings: each image's run of ``image_token_id``
    tokens (:func:`~megarl.data.vision_inputs.image_runs`; any later one, sampled by the policy, is text)."""
    ids = torch.as_tensor(input_ids)
    slots = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    grids = [] if image_grid_thw is None else torch.as_tensor(image_grid_thw).tolist()
    for start, length in image_runs(ids.tolist(), grids, image_token_id=image_token_id,
                                    merge_size=spatial_merge_size, where="sequence"):
        slots[start:start + length] = True
    return slots


def batch_mrope_position_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             image_grid_thw: Optional[torch.Tensor], images_per_row: Sequence[int], *,
                             image_token_id: int, spatial_merge_size: int) -> torch.Tensor:
    """``[3, rows, seq]`` positions of a padded batch (``attention_mask`` ``[rows, seq]``, 1 on real tokens, which may
    sit anywhere in the row); padding gets position 0. ``images_per_row``: how many rows of ``image_grid_thw``
    each batch row owns, in order."""
    positions = torch.zeros(3, *input_ids.shape, dtype=torch.long)
    offsets = [0]
    for count in images_per_row:
        offsets.append(offsets[-1] + count)
    if len(images_per_row) != input_ids.shape[0]:
        raise ValueError(f"images_per_row has {len(images_per_row)} entries for {input_ids.shape[0]} rows")
    for row in range(input_ids.shape[0]):
        real = attention_mask[row].bool().cpu()
        grids = None if image_grid_thw is None else image_grid_thw[offsets[row]:offsets[row + 1]]
        positions[:, row, real] = mrope_position_ids(input_ids[row].cpu()[real], grids, image_token_id=image_token_id,
                                                     spatial_merge_size=spatial_merge_size)
    return positions.to(input_ids.device)


def build_vision_tower(vision_config: Any) -> torch.nn.Module:
    """transformers' Qwen2.5-VL vision tower (patch embedding, blocks, merger) for ``vision_config`` (a transformers
    config, or config.json's section as the converters read it)."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = vision_config
    if not hasattr(config, "sub_configs"):  # config.json's fields: transformers' class fills its defaults
        config = Qwen2_5_VLConfig(vision_config=config.to_dict()).vision_config
    if getattr(config, "_attn_implementation", None) is None:
        config._attn_implementation = "sdpa"
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config)


@functools.cache
def _gpt_model_class():
    from megatron.core.models.gpt import GPTModel

    class VisionLanguageGPTModel(GPTModel):
        """A GPTModel whose first stage also holds a vision tower; see the module docstring."""

        def __init__(self, *args, vision_tower: Optional[torch.nn.Module], image_tokens: ImageTokens, **kwargs):
            super().__init__(*args, **kwargs)
            self.image_tokens = image_tokens  # on every stage: each computes M-RoPE from the positions it is given
            self.vision_model = vision_tower if self.pre_process else None

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *,
                    pixel_values: Optional[torch.Tensor] = None, image_grid_thw: Optional[torch.Tensor] = None,
                    image_slots: Optional[torch.Tensor] = None, **kwargs):
            """``image_slots`` ``[rows, seq]``: the tokens that take the image embeddings (:func:`image_slots` per
            row); by default every ``image_token_id`` token."""
            if position_ids is not None and position_ids.dim() == 2:  # text only: 1-D positions on all three axes
                position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
            if self.pre_process and decoder_input is None and pixel_values is not None:
                decoder_input = self._embed_with_images(input_ids, pixel_values, image_grid_thw, image_slots)
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)

        def _embed_with_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                               image_grid_thw: torch.Tensor, slots: Optional[torch.Tensor]) -> torch.Tensor:
            if self.config.sequence_parallel or self.config.context_parallel_size > 1:
                raise ValueError("images with sequence_parallel or context_parallel_size > 1 are not supported: "
                                 "each rank would hold part of an image's tokens")
            if image_grid_thw is None:
                raise ValueError("pixel_values without image_grid_thw")
            embeddings = self.embedding(input_ids=input_ids, position_ids=None)  # [seq, rows, hidden]
            tower = self.vision_model
            features = tower(pixel_values.to(tower.dtype), grid_thw=image_grid_thw)
            features = getattr(features, "pooler_output", features)  # merged: one row per image token
            if slots is None:
                slots = input_ids == self.image_tokens.image_token_id  # [rows, seq]
            if int(slots.sum()) != features.shape[0]:
                raise ValueError(f"{int(slots.sum())} image tokens in input_ids, the vision tower made "
                                 f"{features.shape[0]} image embeddings from image_grid_thw")
            # the features come row after row, image after image: fill the slots in that order ([rows, seq]),
            # not in the embedding's [seq, rows] memory order, which would deal them out across rows
            filled = embeddings.transpose(0, 1).masked_scatter(slots.unsqueeze(-1), features.to(embeddings.dtype))
            return filled.transpose(0, 1).contiguous()

    return VisionLanguageGPTModel


def vision_language_gpt_model(*args, hf_config: Any, pre_process: bool,
                              freeze_vision_tower: bool = True, params_dtype: torch.dtype = torch.float32,
                              **kwargs) -> torch.nn.Module:
    """A :class:`VisionLanguageGPTModel`: ``GPTModel(*args, **kwargs)`` plus, on the first stage, the tower."""
    tower = None
    if pre_process:
        tower = build_vision_tower(hf_config.vision_config).to(params_dtype)
        for param in tower.parameters():
            param.requires_grad_(not freeze_vision_tower)
    return _gpt_model_class()(*args, pre_process=pre_process, vision_tower=tower,
                              image_tokens=ImageTokens.of_config(hf_config), **kwargs)
