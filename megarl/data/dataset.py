"""Parquet prompt datasets for RL: read, validate, apply the chat template, tokenize, filter overlong prompts.

Columns (one row per prompt):

    prompt        list of chat messages {role, content} (a plain string when apply_chat_template=False)
    reward_model  struct with `ground_truth` (required) and optional `style`
    data_source   optional str, selects the reward function
    extra_info    optional struct, map or JSON string; passed through to the reward function
    images        optional list of {bytes, path} per row (megarl.data.images; verl's multimodal layout), one
                  `<image>` placeholder in the prompt per image; read only with allow_images=True; another
                  column name with image_key (verl's data.image_key), as prompt_key names the prompt's

`RLDataset` tokenizes everything up front so overlong prompts are found (and reported) before training starts.
`RLDataset.batch` / `collate_prompts` gather items into a batch (unpadded token ids: what the rollout engines take;
the rollout batch pads prompt and response once, to the configured widths). Sampling order and resume live in
`sampler.py`.

With ``tools`` (function schemas; multi-turn rollouts) the chat template renders them into each prompt.

With ``vision`` (a vision-language model's :class:`~megarl.data.vision_inputs.VisionTokens`) each `<image>` becomes
the model's image tokens, as many as the image's size gives (:mod:`megarl.data.vision_inputs`), so a prompt's
length counts its images; the pixels are made when a batch is drawn (``RLDataset.batch``: the batch's
``multi_modal_inputs``, what every engine takes). Without it, image rows are read and checked only with
``allow_images`` (the data tools), and refused otherwise.

Left out: lazy/streaming reading of datasets larger than memory.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pyarrow.parquet as pq

from megarl.data.images import (IMAGE_PLACEHOLDER, check_one_placeholder_per_image, count_placeholders, open_image,
                                read_image_entries)
from megarl.data.vision_inputs import IMAGE_IN_TEXT, expand_image_pads, image_grid, prompt_pixel_inputs

REQUIRED_COLUMNS = ("reward_model",)
TRUNCATION_MODES = ("error", "left", "right")
DEFAULT_DATA_SOURCE = "unknown"
_REPORTED_ROWS = 5  # rows named in the overlong-prompt warning; the full list is on the dataset


@dataclass
class PromptItem:
    """One tokenized prompt. `index` is its position in the dataset (what the sampler draws)."""

    input_ids: list[int]
    raw_prompt: Any  # the chat messages (list of {role, content}) or the raw string
    ground_truth: Any
    data_source: str
    extra_info: dict[str, Any]
    index: int
    reward_style: str | None = None
    source_file: str = ""
    source_row: int = -1
    images: list[dict[str, Any]] = field(default_factory=list)  # {bytes, path} entries, in placeholder order
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)  # with `vision`: each image's patch grid


@dataclass
class PromptBatch:
    """Prompts' token ids (unpadded, as the rollout engines take them) plus the per-prompt fields the reward
    side needs, in the same order."""

    prompt_ids: list[list[int]]
    raw_prompts: list[Any]
    ground_truths: list[Any]
    data_sources: list[str]
    extra_infos: list[dict[str, Any]]
    indices: list[int]
    reward_styles: list[str | None] = field(default_factory=list)
    images: list[list[dict[str, Any]]] = field(default_factory=list)
    image_grids: list[list[tuple[int, int, int]]] = field(default_factory=list)
    # per prompt, with a vision-language model: None (text) or its pixels as the engines take them
    # (megarl.data.vision_inputs.pixel_inputs); empty for text-only batches
    multi_modal_inputs: list[dict[str, Any] | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_ids)


class RLDataset:
    """Prompts from one or more parquet files, tokenized with `tokenizer` (a transformers tokenizer)."""

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        image_key: str = "images",
        max_prompt_length: int,
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
        apply_chat_template: bool = True,
        default_data_source: str = DEFAULT_DATA_SOURCE,
        tools: list[dict] | None = None,
        allow_images: bool = False,
        vision: Any = None,
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        self.files = [Path(f) for f in ([files] if isinstance(files, (str, Path)) else files)]
        if not self.files:
            raise ValueError("RLDataset needs at least one parquet file")
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.image_key = image_key
        self.max_prompt_length = max_prompt_length
        self.filter_overlong_prompts = filter_overlong_prompts
        self.truncation = truncation
        self.apply_chat_template = apply_chat_template
        self.default_data_source = default_data_source
        self.tools = tools  # function schemas the chat template renders into the prompt (multi-turn rollouts)
        self.vision = vision  # VisionTokens of a vision-language model: image rows get its image tokens
        self.allow_images = allow_images or vision is not None
        self.items: list[PromptItem] = []
        self.filtered_rows: list[tuple[str, int, int]] = []  # (file, row, token length) of each dropped prompt
        for path in self.files:
            self._load_file(path)
        if not self.items and not self.filtered_rows:
            raise ValueError(f"no rows in {[str(f) for f in self.files]}: the parquet file(s) are empty")
        if not self.items:
            raise ValueError(
                f"no prompts left in {[str(f) for f in self.files]}: all {self.num_filtered} rows are longer than "
                f"max_prompt_length={max_prompt_length} tokens"
            )

    @property
    def num_filtered(self) -> int:
        return len(self.filtered_rows)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    def batch(self, indices: Sequence[int]) -> PromptBatch:
        """The items at ``indices`` as one batch, with their pixels for a vision-language model."""
        return collate_prompts([self.items[i] for i in indices], vision=self.vision)

    def _load_file(self, path: Path) -> None:
        if not path.is_file():
            raise FileNotFoundError(f"data file {str(path)!r} does not exist")
        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises several types for a non-parquet file
            raise ValueError(f"cannot read {str(path)!r} as parquet: {err}") from err
        present = table.column_names
        for column in (self.prompt_key, *REQUIRED_COLUMNS):
            if column not in present:
                raise ValueError(f"{path}: missing column {column!r} (columns present: {present})")
        prompts = table.column(self.prompt_key).to_pylist()
        reward_models = table.column("reward_model").to_pylist()
        sources = table.column("data_source").to_pylist() if "data_source" in present else [None] * len(prompts)
        extras = table.column("extra_info").to_pylist() if "extra_info" in present else [None] * len(prompts)
        images = (table.column(self.image_key).to_pylist() if self.image_key in present
                  else [None] * len(prompts))
        file_filtered: list[int] = []
        for row, (prompt, reward_model, source, extra, row_images) in enumerate(
                zip(prompts, reward_models, sources, extras, images)):
            where = f"{path} row {row}"
            ground_truth, style = _read_reward_model(reward_model, where)
            image_entries, grids = self._read_images(row_images, prompt, where, path.parent)
            input_ids = self._tokenize(prompt, where, grids)
            if len(input_ids) > self.max_prompt_length:
                if self.filter_overlong_prompts:
                    self.filtered_rows.append((str(path), row, len(input_ids)))
                    file_filtered.append(row)
                    continue
                input_ids = self._truncate(input_ids, where)
            self.items.append(
                PromptItem(
                    input_ids=input_ids,
                    raw_prompt=prompt,
                    ground_truth=ground_truth,
                    data_source=source if source is not None else self.default_data_source,
                    extra_info=_read_extra_info(extra, where),
                    index=len(self.items),
                    reward_style=style,
                    source_file=str(path),
                    source_row=row,
                    images=image_entries,
                    image_grids=grids,
                )
            )
        if file_filtered:
            shown = file_filtered[:_REPORTED_ROWS]
            more = f" and {len(file_filtered) - len(shown)} more" if len(file_filtered) > len(shown) else ""
            warnings.warn(
                f"{path}: filtered {len(file_filtered)} of {len(prompts)} prompts longer than "
                f"max_prompt_length={self.max_prompt_length} tokens (rows {shown}{more})",
                stacklevel=3,
            )

    def _read_images(self, value: Any, prompt: Any, where: str,
                     base_dir: Path) -> tuple[list[dict[str, Any]], list[tuple[int, int, int]]]:
        """The row's images, each decoded once here so a broken one is named before training starts, and (with
        ``vision``) their patch grids. Without an images column (or with a null cell) a row is text, whatever its
        prompt says."""
        if value is None:
            return [], []
        entries = read_image_entries(value, where, self.image_key)
        placeholders = count_placeholders(prompt)
        if not entries and not placeholders:
            return [], []
        if not self.allow_images:
            raise ValueError(f"{where}: a multimodal prompt ({len(entries)} image(s), {placeholders} '<image>' "
                             f"placeholder(s)) for a text-only model: use a vision-language model "
                             f"(Qwen2.5-VL) or a text dataset")
        check_one_placeholder_per_image(entries, prompt, where)
        grids = []
        for i, entry in enumerate(entries):
            image = open_image(entry, f"{where} {self.image_key}[{i}]", base_dir=base_dir)
            if self.vision is not None:
                grids.append(image_grid(image.height, image.width, self.vision))
            if entry["bytes"] is None and not Path(entry["path"]).is_absolute():  # relative to the parquet file
                entry["path"] = str(base_dir / entry["path"])
        return entries, grids

    def _tokenize(self, prompt: Any, where: str, grids: Sequence[tuple[int, int, int]] = ()) -> list[int]:
        if grids:  # each <image> becomes the model's image tokens, one pad per image to grow below
            prompt = _with_image_tokens(prompt)
        if self.apply_chat_template:
            messages = _check_messages(prompt, self.prompt_key, where)
            # Render to text, then tokenize without extra special tokens: the template already placed them,
            # and tokenize=True returns different types across transformers versions.
            extra = {"tools": self.tools} if self.tools else {}
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        else:
            if not isinstance(prompt, str):
                raise ValueError(
                    f"{where}: column {self.prompt_key!r} must be a string when apply_chat_template=False, "
                    f"got {type(prompt).__name__}"
                )
            text = prompt
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return expand_image_pads(ids, grids, self.vision, where) if grids else ids

    def _truncate(self, input_ids: list[int], where: str) -> list[int]:
        if self.truncation == "error":
            raise ValueError(
                f"{where}: prompt has {len(input_ids)} tokens > max_prompt_length={self.max_prompt_length} "
                f"(set filter_overlong_prompts or truncation='left'/'right')"
            )
        if self.truncation == "left":
            return input_ids[-self.max_prompt_length:]
        return input_ids[: self.max_prompt_length]


def collate_prompts(items: Sequence[PromptItem], vision: Any = None) -> PromptBatch:
    """The items as one batch, in order; with ``vision`` (a vision-language model's
    :class:`~megarl.data.vision_inputs.VisionTokens`) their images' pixels too."""
    if not items:
        raise ValueError("cannot collate an empty list of prompts")
    for item in items:
        if not item.input_ids:
            raise ValueError(f"prompt at dataset index {item.index} has no tokens")
    return PromptBatch(
        prompt_ids=[list(item.input_ids) for item in items],
        raw_prompts=[item.raw_prompt for item in items],
        ground_truths=[item.ground_truth for item in items],
        data_sources=[item.data_source for item in items],
        extra_infos=[item.extra_info for item in items],
        indices=[item.index for item in items],
        reward_styles=[item.reward_style for item in items],
        images=[list(item.images) for item in items],
        image_grids=[list(item.image_grids) for item in items],
        multi_modal_inputs=(prompt_pixel_inputs([item.images for item in items], vision)
                            if vision is not None and any(item.images for item in items) else []),
    )


def _with_image_tokens(prompt: Any) -> Any:
    """The prompt (text or chat messages) with each ``<image>`` written as the model's image tokens."""
    if isinstance(prompt, str):
        return prompt.replace(IMAGE_PLACEHOLDER, IMAGE_IN_TEXT)
    return [{**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, IMAGE_IN_TEXT)}
            if isinstance(m, dict) and isinstance(m.get("content"), str) else m for m in prompt]


def _check_messages(prompt: Any, key: str, where: str) -> list[dict[str, str]]:
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: column {key!r} must be a non-empty list of chat messages, got {prompt!r:.200}")
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: {key}[{i}] must be a {{role, content}} message, got {message!r:.200}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"{where}: {key}[{i}] needs string 'role' and 'content', got {message!r:.200}")
        messages.append({"role": role, "content": content})
    return messages


def _read_reward_model(reward_model: Any, where: str) -> tuple[Any, str | None]:
    if not isinstance(reward_model, dict):
        raise ValueError(f"{where}: column 'reward_model' must be a struct with 'ground_truth', got {reward_model!r:.200}")
    if reward_model.get("ground_truth") is None:
        raise ValueError(f"{where}: reward_model.ground_truth is missing or null (fields: {sorted(reward_model)})")
    return reward_model["ground_truth"], reward_model.get("style")


def _read_extra_info(extra: Any, where: str) -> dict[str, Any]:
    if extra is None:
        return {}
    if isinstance(extra, dict):
        return extra
    if isinstance(extra, list):  # a parquet map column comes back as [(key, value), ...]
        try:
            return dict(extra)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: extra_info list is not a map of (key, value) pairs: {extra!r:.200}") from None
    if isinstance(extra, str):
        try:
            parsed = json.loads(extra) if extra.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: extra_info is a string but not valid JSON ({err})") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"{where}: extra_info JSON must be an object, got {type(parsed).__name__}")
        return parsed
    raise ValueError(f"{where}: extra_info must be a struct, map or JSON string, got {type(extra).__name__}")
