"""The currency between stages of the RL loop.

``RolloutBatch`` is what generation produces: one row per sampled response (``n`` rows per prompt),
prompts left-padded and responses right-padded so that ``cat(prompt, response)`` is one contiguous
sequence per row. ``TrainBatch`` is the same rows plus everything the update needs (old/ref log-probs,
values, rewards, advantages). Both are plain dataclasses of tensors and lists, so the controller can
split them by data-parallel rank and concatenate results generically
(:mod:`megarl.controller.batch_split`). Nothing here computes losses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


# routed_experts' entry where no routing is known (padding, a row's last token, a prefix an engine cached)
UNKNOWN_EXPERT = -1

# The fields a model's forward pass reads (the tokens, which of them are real, and the rows' images): what every
# engine call takes
MODEL_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "multi_modal_inputs")


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # [B, P] int64, left-padded
    prompt_mask: torch.Tensor  # [B, P] 1 on real prompt tokens
    response_ids: torch.Tensor  # [B, R] int64, right-padded
    response_mask: torch.Tensor  # [B, R] 1 on real response tokens (eos included)
    group_ids: list[str]  # one id per prompt, repeated for its n responses (GRPO groups)
    data_sources: list[str] = field(default_factory=list)
    ground_truths: list[Any] = field(default_factory=list)
    extra_infos: list[Any] = field(default_factory=list)
    rollout_log_probs: Optional[torch.Tensor] = None  # [B, R] as computed by the rollout engine
    raw_prompts: list[Any] = field(default_factory=list)  # the dataset's prompt (chat messages or text) per row
    # [B, R] 1 on the response tokens the policy generated; None: every real one. Multi-turn responses hold
    # tool results and chat-template text between the model's turns: part of the sequence, not of the policy.
    generated_mask: Optional[torch.Tensor] = None
    # [B, P + R, L_moe, K] int16: an MoE rollout's expert ids per token and MoE layer, aligned with input_ids;
    # -1 where not known (padding, each row's last token). Replayed by the trainer's routers (router_replay R3),
    # or the old-log-prob pass's own choice (R2).
    routed_experts: Optional[torch.Tensor] = None
    # per row: None (text only) or its images as a vision-language model takes them (verl's multi_modal_inputs):
    # {"pixel_values": [patches, channels x patch pixels] float, "image_grid_thw": [images, 3] long}, images in
    # the order the row's image placeholder tokens show them. None: no row has images.
    multi_modal_inputs: Optional[list[Optional[dict]]] = None

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions count real tokens only, so left padding does not shift RoPE phases."""
        return (self.attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(dim=1)

    @property
    def policy_mask(self) -> torch.Tensor:
        """[B, R] the tokens the policy's statistics are about: advantages, log-prob and KL metrics, rollout
        correction (the generated tokens; ``response_mask`` when every response token was generated)."""
        return self.response_mask if self.generated_mask is None else self.generated_mask


@dataclass
class TrainBatch(RolloutBatch):
    old_log_probs: Optional[torch.Tensor] = None  # [B, R] actor log-probs before the update
    ref_log_probs: Optional[torch.Tensor] = None  # [B, R] frozen reference model
    values: Optional[torch.Tensor] = None  # [B, R] critic values
    token_level_scores: Optional[torch.Tensor] = None  # [B, R] reward-function scores
    token_level_rewards: Optional[torch.Tensor] = None  # [B, R] scores minus in-reward KL
    advantages: Optional[torch.Tensor] = None  # [B, R]
    returns: Optional[torch.Tensor] = None  # [B, R]
    rollout_is_weights: Optional[torch.Tensor] = None  # [B, R] rollout correction's importance weights
    loss_mask: Optional[torch.Tensor] = None  # [B, R] response tokens the policy loss counts (None: response_mask);
    # generated_mask less what the rollout correction rejected
    teacher_log_probs: Optional[torch.Tensor] = None  # [B, R] on-policy distillation: the teacher's, per row's teacher

    @classmethod
    def from_rollout(cls, rollout: RolloutBatch) -> "TrainBatch":
        batch = cls(**{f.name: getattr(rollout, f.name) for f in dataclasses.fields(RolloutBatch)})
        batch.loss_mask = rollout.generated_mask  # tool results and template text never enter the loss
        return batch


def select_rows(batch, index: torch.Tensor | list[int] | slice):
    """The same dataclass with only the chosen rows (tensors indexed on dim 0, lists picked)."""
    if isinstance(index, slice):
        rows = list(range(len(batch)))[index]
    else:
        rows = [int(i) for i in (index.tolist() if isinstance(index, torch.Tensor) else index)]
    picked = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            picked[f.name] = value[torch.as_tensor(rows, dtype=torch.long)]
        elif isinstance(value, list) and value:
            picked[f.name] = [value[i] for i in rows]
        else:
            picked[f.name] = value
    return type(batch)(**picked)


def concat_rows(batches: list):
    """Batches of one dataclass and width, stacked row-wise (tensors concatenated on dim 0, lists joined;
    a field that is None in every batch stays None; a list field None in some batches, per-row entries in
    others, takes a None per row of the first: ``multi_modal_inputs`` of text rows beside image rows)."""
    if not batches:
        raise ValueError("concat_rows needs at least one batch")
    joined = {}
    for f in dataclasses.fields(batches[0]):
        values = [getattr(b, f.name) for b in batches]
        if all(v is None for v in values):
            joined[f.name] = None
        elif all(isinstance(v, torch.Tensor) for v in values):
            joined[f.name] = torch.cat(values)
        elif all(isinstance(v, list) or v is None for v in values):
            joined[f.name] = [item for b, v in zip(batches, values) for item in (v if v is not None else [None] * len(b))]
        else:
            raise ValueError(f"field {f.name!r} is set in some batches and not in others")
    return type(batches[0])(**joined)
