"""Micro-batches for the megatron engines: which rows go together, and how they are laid out.

Two layouts, one contract (every micro-batch dict carries ``response_ids`` / ``response_mask`` and the
per-token fields as ``[b, R]`` tensors, so losses and aggregation never see the layout):

* **padded** (:func:`pad_rows`): ``[b, P + R]`` rows exactly as the batch holds them, with megatron's
  boolean ``[b, 1, S, S]`` mask. Every row costs ``P + R`` tokens whatever its real length.
* **packed** (:func:`pack_rows`): the real tokens of all rows concatenated into one ``[1, T]`` stream
  (megatron's ``thd`` format: ``PackedSeqParams`` with ``cu_seqlens``), positions restarting at 0 for each
  row, no padding inside. The core attention keeps the rows apart (block-diagonal causal); RoPE restarts
  per row. A padding segment at the end rounds ``T`` up (sequence parallelism needs ``T`` divisible by TP,
  pipeline stages need one ``T`` for all micro-batches of a step).

Whole-sequence fields (:data:`SEQUENCE_FIELDS`: MoE ``routed_experts`` and the ``token_codes`` that name each
token's row and position) follow the tokens instead: ``[b, S, ...]`` padded, ``[1, T, ...]`` packed, ``-1``
wherever no real token is.

Images (a vision-language model's, ``image_tokens`` given): the rows' ``multi_modal_inputs`` ride along as one
``images`` dict per micro-batch (``pixel_values`` and ``image_grid_thw`` of its rows, row after row, the order in
which the layout shows their image tokens, and ``image_slots``, the tokens that take them: an image token the policy
sampled in a response is text, as the rollout engines read it), and ``position_ids`` are M-RoPE's ``[3, b, S]``
(packed: ``[3, 1, T]``).

Context parallelism (:func:`shard_for_context_parallel`): either layout, with every sequence (packed: every
segment) padded to a multiple of ``2 * cp``, is cut into this CP rank's share of tokens, positions and
next-token labels; the per-token results are gathered back into the full layout before the loss.

Which rows form a micro-batch: a fixed number of consecutive rows (:func:`plan_fixed_rows`), or, with a
token budget, balanced bins whose real-token totals stay within it (:func:`plan_token_budget`): few
micro-batches of similar cost however skewed the response lengths are. The per-row results are put back
in the batch's row order by :func:`restore_row_order`.
"""

from __future__ import annotations

import heapq
import math
from typing import Iterable, Optional, Sequence

import torch

from megarl.batch import UNKNOWN_EXPERT, TrainBatch
from megarl.models.context_parallel import local_positions
from megarl.models.vision_language import ImageTokens, image_slots, mrope_position_ids

# Fields laid out like the tokens (not like the responses): the MoE routing a batch replays
# (:mod:`megarl.engines.megatron.routing_replay`), and ``token_codes`` (row * S + position of each token in
# the batch shard) that lets what the routers record be put back into rows.
SEQUENCE_FIELDS = ("routed_experts", "token_codes")
NO_TOKEN = UNKNOWN_EXPERT  # the routers read any entry < 0 as "nothing here", a code and an expert alike


def plan_fixed_rows(num_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` rows (the batch must divide evenly)."""
    if num_rows == 0 or num_rows % micro_batch_size:
        raise ValueError(f"batch of {num_rows} rows is not a positive multiple of "
                         f"micro_batch_size={micro_batch_size}")
    return [list(range(start, start + micro_batch_size)) for start in range(0, num_rows, micro_batch_size)]


def plan_token_budget(lengths: Sequence[int], max_tokens: int, *, multiple_of: int = 1) -> list[list[int]]:
    """Rows grouped into the fewest bins (a multiple of ``multiple_of``) whose token totals are each at most
    ``max_tokens``, balanced by longest-first assignment to the lightest bin. Rows keep their order inside
    a bin; bins are ordered by their first row, so the plan depends on the lengths only."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    if not lengths:
        raise ValueError("cannot plan micro-batches for an empty batch")
    for row, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(f"row {row} has {length} tokens (prompt + response), more than "
                             f"max_tokens_per_micro_batch={max_tokens}: raise the budget to at least "
                             f"data.max_prompt_length + data.max_response_length")
    count = max(1, math.ceil(sum(lengths) / max_tokens))
    count = min(_round_up(count, multiple_of), max(len(lengths), multiple_of))
    while True:
        bins = _longest_first(lengths, count)
        if max(sum(lengths[r] for r in b) for b in bins) <= max_tokens or count >= len(lengths):
            break
        count += multiple_of
    return sorted((sorted(b) for b in bins if b), key=lambda b: b[0])


def _longest_first(lengths: Sequence[int], count: int) -> list[list[int]]:
    heap = [(0, index) for index in range(count)]  # (tokens so far, bin)
    bins: list[list[int]] = [[] for _ in range(count)]
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        load, index = heapq.heappop(heap)
        bins[index].append(row)
        heapq.heappush(heap, (load + lengths[row], index))
    return bins


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def row_token_counts(batch: TrainBatch, multiple_of: int = 1) -> list[int]:
    """Real tokens (prompt + response) per row, each rounded up to ``multiple_of``."""
    return [_round_up(n, multiple_of) for n in batch.attention_mask.sum(dim=1).tolist()]


def build_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean mask ``[B, 1, S, S]`` (True = masked): causal, and padding keys masked out."""
    seq = attention_mask.shape[1]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device), diagonal=1)
    pad_keys = ~attention_mask.bool()[:, None, None, :]
    return causal[None, None] | pad_keys


def _sequence_values(batch: TrainBatch, rows: torch.Tensor, name: str) -> torch.Tensor:
    """``[b, S, ...]`` of a :data:`SEQUENCE_FIELDS` entry for ``rows``, ``-1`` at padding."""
    real = batch.attention_mask[rows].bool()
    if name == "token_codes":
        seq = real.shape[1]
        codes = rows[:, None] * seq + torch.arange(seq)[None, :]
    else:
        codes = getattr(batch, name)
        if codes is None:
            raise ValueError(f"the batch has no {name}")
        codes = codes[rows]
    mask = real.view(*real.shape, *([1] * (codes.dim() - 2)))
    return codes.masked_fill(~mask, NO_TOKEN)


def _per_token_fields(batch: TrainBatch, rows: torch.Tensor, fields: Iterable[str], device) -> dict:
    out = {}
    for name in fields:
        if name in SEQUENCE_FIELDS:
            continue  # laid out by pad_rows / pack_rows
        value = getattr(batch, name)
        out[name] = None if value is None else value[rows].to(device).float()
    return out


def _row_images(batch: TrainBatch, rows: list[int],
                image_tokens: Optional[ImageTokens]) -> tuple[list[Optional[torch.Tensor]], dict]:
    """Each row's ``image_grid_thw`` (None: no image) and the micro-batch's ``images`` model inputs."""
    inputs = [batch.multi_modal_inputs[r] for r in rows] if batch.multi_modal_inputs else [None] * len(rows)
    grids = [None if row is None else row["image_grid_thw"] for row in inputs]
    if not any(g is not None for g in grids):
        return grids, {}
    if image_tokens is None:
        raise ValueError("the batch carries images (multi_modal_inputs) but the model is text-only: use a "
                         "vision-language model (Qwen2.5-VL) or a text dataset")
    with_images = [row for row in inputs if row is not None]
    return grids, {"pixel_values": torch.cat([row["pixel_values"] for row in with_images]),
                   "image_grid_thw": torch.cat([row["image_grid_thw"] for row in with_images])}


def _mrope_real_positions(batch: TrainBatch, index: torch.Tensor, grids: list,
                          image_tokens: ImageTokens) -> list[torch.Tensor]:
    """Each row's ``[3, real tokens]`` M-RoPE positions."""
    return [mrope_position_ids(ids, grid, image_token_id=image_tokens.image_token_id,
                               spatial_merge_size=image_tokens.spatial_merge_size)
            for ids, grid in zip(_real_ids(batch, index), grids)]


def _real_image_slots(batch: TrainBatch, index: torch.Tensor, grids: list,
                      image_tokens: ImageTokens) -> list[torch.Tensor]:
    """Each row's ``[real tokens]`` image slots (:func:`~megarl.models.vision_language.image_slots`: a sampled
    image token in a response is text)."""
    return [image_slots(ids, grid, image_token_id=image_tokens.image_token_id,
                        spatial_merge_size=image_tokens.spatial_merge_size)
            for ids, grid in zip(_real_ids(batch, index), grids)]


def _real_ids(batch: TrainBatch, index: torch.Tensor) -> list[torch.Tensor]:
    real = batch.attention_mask[index].bool()
    return [ids[mask] for ids, mask in zip(batch.input_ids[index], real)]


def _counting_on(n: int, start, width: int) -> torch.Tensor:
    """``[n, width]`` positions ``start, start + 1, ...`` on every axis (padding after a segment, or alone)."""
    return start + torch.arange(n, dtype=torch.long)[:, None].expand(n, width)


def pad_rows(batch: TrainBatch, rows: list[int], fields: Iterable[str], device, *,
             image_tokens: Optional[ImageTokens] = None) -> dict:
    """The padded layout of ``rows`` (see the module docstring)."""
    index = torch.as_tensor(rows, dtype=torch.long)
    grids, images = _row_images(batch, rows, image_tokens)
    if image_tokens is None:
        positions = batch.position_ids[index]
    else:  # [3, b, S]: each row's real tokens get their M-RoPE positions, padding 0
        positions = torch.zeros(3, len(rows), batch.attention_mask.shape[1], dtype=torch.long)
        real = batch.attention_mask[index].bool()
        for i, row_positions in enumerate(_mrope_real_positions(batch, index, grids, image_tokens)):
            positions[:, i, real[i]] = row_positions
    mb = {
        "rows": rows,
        "input_ids": batch.input_ids[index].to(device),
        "position_ids": positions.to(device),
        "attention_mask": build_attention_mask(batch.attention_mask[index]).to(device),
        "response_ids": batch.response_ids[index].to(device),
        "response_mask": batch.response_mask[index].to(device).float(),
        "prompt_len": batch.prompt_ids.shape[1],
        # each row's last real token: prompts end at P - 1 (left padding), responses run on from P
        "last_index": (batch.prompt_ids.shape[1] - 1 + batch.response_mask[index].sum(dim=1)).to(device),
    }
    if images:
        slots = torch.zeros(len(rows), batch.attention_mask.shape[1], dtype=torch.bool)
        real = batch.attention_mask[index].bool()
        for i, row_slots in enumerate(_real_image_slots(batch, index, grids, image_tokens)):
            slots[i, real[i]] = row_slots
        mb["images"] = {name: value.to(device) for name, value in {**images, "image_slots": slots}.items()}
    mb.update(_per_token_fields(batch, index, fields, device))
    for name in SEQUENCE_FIELDS:
        if name in fields:
            mb[name] = _sequence_values(batch, index, name).to(device)
    return mb


def packed_length(batch: TrainBatch, rows: list[int], multiple_of: int = 1, segment_multiple_of: int = 1) -> int:
    """``T`` of :func:`pack_rows` for these rows, before any common ``pad_to``."""
    lengths = batch.attention_mask[torch.as_tensor(rows)].sum(dim=1).tolist()
    return _round_up(sum(_round_up(n, segment_multiple_of) for n in lengths), multiple_of)


def _pad_segments(values: torch.Tensor, lengths: list[int], padded: list[int], fill) -> torch.Tensor:
    """Concatenated segments of ``lengths`` -> the same segments each extended to ``padded`` by ``fill(n)``."""
    if lengths == padded:
        return values
    parts = []
    for segment, length, target in zip(values.split(lengths), lengths, padded):
        parts.append(segment)
        if target > length:
            parts.append(fill(target - length, segment))
    return torch.cat(parts)


def pack_rows(batch: TrainBatch, rows: list[int], fields: Iterable[str], device, *,
              pad_to: Optional[int] = None, multiple_of: int = 1, segment_multiple_of: int = 1,
              image_tokens: Optional[ImageTokens] = None) -> dict:
    """The packed (``thd``) layout of ``rows``; ``T`` is ``pad_to`` if given, else the real token count
    rounded up to ``multiple_of``. ``segment_multiple_of`` pads each row at its end (context parallelism
    cuts every segment into ``2 * cp`` chunks); the padding follows the row's real tokens, so no real
    token attends to it. Adds ``packed_seq_params``, ``response_index`` (the stream position of the
    logit that predicts each real response token, in row-major order of ``response_mask``) and ``last_index``
    (the stream position of each row's last real token, where a reward model reads its score)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    index = torch.as_tensor(rows, dtype=torch.long)
    real = batch.attention_mask[index].bool()
    real_lens = real.sum(dim=1).tolist()
    seq_lens = [_round_up(n, segment_multiple_of) for n in real_lens]
    total = sum(seq_lens)
    length = pad_to if pad_to is not None else _round_up(total, multiple_of)
    if length < total or (length - total) % segment_multiple_of:
        raise ValueError(f"pad_to={pad_to} does not fit the {total} tokens of the micro-batch plus a padding "
                         f"segment of a multiple of {segment_multiple_of}")
    tokens = _pad_segments(batch.input_ids[index][real], real_lens, seq_lens,
                           lambda n, seg: seg.new_zeros(n))
    grids, images = _row_images(batch, rows, image_tokens)
    if image_tokens is None:
        real_positions = batch.position_ids[index][real][:, None]  # [tokens, 1]
    else:  # [tokens, 3]: M-RoPE's three positions per token
        real_positions = torch.cat(_mrope_real_positions(batch, index, grids, image_tokens), dim=1).T
    width = real_positions.shape[1]
    positions = _pad_segments(real_positions, real_lens, seq_lens,
                              lambda n, seg: _counting_on(n, seg[-1:] + 1, width))
    padding = length - total
    if padding:  # its own segment, so no real token attends to it
        tokens = torch.cat([tokens, tokens.new_zeros(padding)])
        positions = torch.cat([positions, _counting_on(padding, 0, width)])
        seq_lens.append(padding)
    positions = positions.T[:, None] if image_tokens is not None else positions.T  # [3, 1, T] or [1, T]
    cu_seqlens = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.as_tensor(seq_lens, dtype=torch.int32).cumsum(0)

    response_mask = batch.response_mask[index]
    prompt_real = batch.prompt_mask[index].sum(dim=1)
    if bool((prompt_real == 0).any()):
        raise ValueError("a row has an empty prompt: its first response token has no logit to come from")
    # logit predicting response token j of row i sits at cu_seqlens[i] + prompt_len_i - 1 + j
    offsets = cu_seqlens[:-1][: len(rows)].long() + prompt_real - 1
    grid = offsets[:, None] + torch.arange(response_mask.shape[1])[None, :]
    response_index = grid[response_mask.bool()]
    last_index = offsets + response_mask.sum(dim=1)  # each segment's last real token (before its padding)

    max_len = max(seq_lens)
    cu_seqlens = cu_seqlens.to(device)  # one tensor for q and kv: attention can tell they agree by identity
    mb = {
        "rows": rows,
        "input_ids": tokens[None].to(device),
        "position_ids": positions.to(device),
        "attention_mask": None,
        "packed_seq_params": PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=max_len, max_seqlen_kv=max_len,
        ),
        "response_index": response_index.to(device),
        "last_index": last_index.to(device),
        "response_ids": batch.response_ids[index].to(device),
        "response_mask": response_mask.to(device).float(),
        "prompt_len": batch.prompt_ids.shape[1],
    }
    if images:  # the stream's image slots: each segment's, its padding and the padding segment none
        slots = _pad_segments(torch.cat(_real_image_slots(batch, index, grids, image_tokens)), real_lens, seq_lens,
                              lambda n, seg: seg.new_zeros(n))
        slots = torch.cat([slots, slots.new_zeros(padding)])[None]
        mb["images"] = {name: value.to(device) for name, value in {**images, "image_slots": slots}.items()}
    mb.update(_per_token_fields(batch, index, fields, device))
    for name in SEQUENCE_FIELDS:
        if name in fields:
            values = _pad_segments(_sequence_values(batch, index, name)[real], real_lens, seq_lens,
                                   lambda n, seg: seg.new_full((n, *seg.shape[1:]), NO_TOKEN))
            if padding:
                values = torch.cat([values, values.new_full((padding, *values.shape[1:]), NO_TOKEN)])
            mb[name] = values[None].to(device)
    return mb


def response_positions_of(output: torch.Tensor, mb: dict) -> torch.Tensor:
    """The last-stage output at the positions that predict the response tokens.

    Padded: ``[b, R, ...]`` (every slot, padding included). Packed: ``[N, ...]`` for the N real response
    tokens only; :func:`scatter_to_rows` turns per-token results back into ``[b, R]``."""
    if mb.get("packed_seq_params") is not None:
        return output[0].index_select(0, mb["response_index"])
    start = mb["prompt_len"] - 1  # the output at position t predicts token t + 1
    return output[:, start:start + mb["response_ids"].shape[1]]


def shard_for_context_parallel(mb: dict, cp_size: int, cp_rank: int) -> dict:
    """This CP rank's share of a padded or packed micro-batch (:mod:`megarl.models.context_parallel`).

    ``input_ids`` / ``position_ids`` / ``labels`` (the next token of each position, taken before the split
    so no label lives on another rank) hold this rank's tokens; padded rows are first extended to a
    multiple of ``2 * cp`` (masked columns) and keep their mask's rows of this rank's queries. Packed
    segments must already be multiples of ``2 * cp`` (``pack_rows(segment_multiple_of=...)``); their
    ``packed_seq_params`` stay those of the full stream. ``cp_bounds`` (segment boundaries of the full
    sequence) lets the per-token results be gathered back."""
    ids, positions = mb["input_ids"], mb["position_ids"]
    if positions.dim() == 3 or "images" in mb:
        raise ValueError("context parallelism with a vision-language model is not supported: set "
                         "context_parallel_size=1")
    out = dict(mb)
    if mb.get("packed_seq_params") is not None:
        bounds = tuple(mb["packed_seq_params"].cu_seqlens_q.tolist())
    else:
        seq = ids.shape[1]
        full = _round_up(seq, 2 * cp_size)
        extra = full - seq
        bounds = (0, full)
        if extra:
            ids = torch.cat([ids, ids.new_zeros(ids.shape[0], extra)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(extra, device=ids.device)], 1)
        mask = torch.ones(ids.shape[0], 1, full, full, dtype=torch.bool, device=ids.device)
        mask[:, :, :seq, :seq] = mb["attention_mask"]
    local = local_positions(bounds, cp_size, cp_rank).to(ids.device)
    labels = torch.cat([ids[:, 1:], ids.new_zeros(ids.shape[0], 1)], dim=1)
    out.update(input_ids=ids[:, local], position_ids=positions[:, local], labels=labels[:, local],
               cp_bounds=bounds)
    for name in SEQUENCE_FIELDS:
        if name in mb:
            values = mb[name]
            if values.shape[1] < ids.shape[1]:
                extra = values.new_full((values.shape[0], ids.shape[1] - values.shape[1], *values.shape[2:]),
                                        NO_TOKEN)
                values = torch.cat([values, extra], dim=1)
            out[name] = values[:, local]
    if mb.get("packed_seq_params") is None:
        out["attention_mask"] = mask.index_select(2, local)
    return out


def last_token_values(per_position: torch.Tensor, mb: dict) -> torch.Tensor:
    """``[b, ...]``: each row's value at its last real token (prompt + response), from the last stage's
    per-position output of the whole sequence (``[b, S, ...]`` padded, ``[1, T, ...]`` packed)."""
    index = mb["last_index"]
    if mb.get("packed_seq_params") is not None:
        return per_position[0].index_select(0, index)
    return per_position[torch.arange(index.shape[0], device=index.device), index]


def scatter_to_rows(values: torch.Tensor, mb: dict) -> torch.Tensor:
    """Per-token values of :func:`response_positions_of` as ``[b, R]`` (zeros at padding when packed);
    differentiable."""
    if mb.get("packed_seq_params") is None:
        return values
    mask = mb["response_mask"].bool()
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


def restore_row_order(per_micro_batch: list[torch.Tensor], micro_batches: list[dict]) -> torch.Tensor:
    """Concatenate per-micro-batch ``[b, ...]`` results and put the rows back in batch order."""
    order = [row for mb in micro_batches for row in mb["rows"]]
    stacked = torch.cat(per_micro_batch)
    if order == sorted(order):
        return stacked
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.as_tensor(order)] = torch.arange(len(order))
    return stacked[inverse.to(stacked.device)]
