"""How an engine cuts a batch shard: mini-batches per optimizer step and micro-batches per schedule step
(padded rows or packed ``thd`` streams, grouped by a row count or a token budget; context-parallel shares)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

from megarl.batch import TrainBatch
from megarl.engines.megatron.packing import (
    pack_rows,
    packed_length,
    pad_rows,
    plan_fixed_rows,
    plan_token_budget,
    row_token_counts,
    shard_for_context_parallel,
)
from megarl.engines.megatron.parallel import device_for_this_process
from megarl.models.vision_language import ImageTokens


@dataclass(frozen=True)
class MicroBatching:
    """How a batch becomes micro-batches (see :mod:`megarl.engines.megatron.packing`).

    ``sequence_packing``: rows' real tokens packed into one ``thd`` stream per micro-batch instead of rows
    padded to P + R. ``max_tokens_per_micro_batch``: group rows by a real-token budget (needs packing)
    instead of a fixed row count."""

    sequence_packing: bool = False
    max_tokens_per_micro_batch: Optional[int] = None

    def __post_init__(self):
        if self.max_tokens_per_micro_batch is not None and not self.sequence_packing:
            raise ValueError("max_tokens_per_micro_batch needs sequence_packing=True (padded micro-batches "
                             "cost P + R tokens per row whatever the budget says)")


def make_micro_batches(batch: TrainBatch, fields: Iterable[str], *, micro_batching: MicroBatching,
                       micro_batch_size: int, max_tokens: Optional[int] = None,
                       interleave_group: int = 1, image_tokens: Optional[ImageTokens] = None) -> list[dict]:
    """This rank's micro-batches of ``batch``; the per-token ``fields`` ride along.

    Rows are grouped by ``max_tokens`` real tokens (default: ``micro_batching``'s budget) when packing with a
    budget, in a multiple of ``interleave_group`` micro-batches (megatron's interleaved schedule wants whole
    groups), else ``micro_batch_size`` consecutive rows. Packed streams are padded to a multiple of TP
    (sequence parallelism splits them) and, with pipeline stages, to the longest stream of the step (one
    activation shape per step). With context parallelism each CP rank gets its share of every micro-batch
    (each row rounded up to a multiple of ``2 * cp``; a micro-batch holds ``cp`` times the per-GPU budget).
    ``image_tokens``: a vision-language model's, so the rows' images ride along with M-RoPE positions."""
    from megatron.core import parallel_state as mpu

    device = device_for_this_process()
    fields = tuple(fields)
    budget = max_tokens or micro_batching.max_tokens_per_micro_batch
    pp = mpu.get_pipeline_model_parallel_world_size()
    cp = mpu.get_context_parallel_world_size()
    segment_multiple = 2 * cp if cp > 1 else 1
    if micro_batching.sequence_packing and budget is not None:
        plan = plan_token_budget(row_token_counts(batch, segment_multiple), budget * cp, multiple_of=interleave_group)
    else:
        plan = plan_fixed_rows(len(batch), micro_batch_size)
    if not micro_batching.sequence_packing:
        micro_batches = [pad_rows(batch, rows, fields, device, image_tokens=image_tokens) for rows in plan]
    else:
        multiple = mpu.get_tensor_model_parallel_world_size() * segment_multiple
        pad_to = (max(packed_length(batch, rows, multiple, segment_multiple) for rows in plan) if pp > 1 else None)
        micro_batches = [pack_rows(batch, rows, fields, device, pad_to=pad_to, multiple_of=multiple,
                                   segment_multiple_of=segment_multiple, image_tokens=image_tokens)
                         for rows in plan]
    if cp > 1:
        rank = mpu.get_context_parallel_rank()
        micro_batches = [shard_for_context_parallel(mb, cp, rank) for mb in micro_batches]
    return micro_batches


def check_mini_batches(rows: int, mini_batch_size: int, micro_batch_size: Optional[int]) -> int:
    """Number of mini-batches (optimizer steps per epoch); sizes are local to this DP rank.
    ``micro_batch_size`` None: micro-batches by token budget, any mini-batch size goes."""
    if mini_batch_size < 1 or rows % mini_batch_size:
        raise ValueError(f"mini_batch_size={mini_batch_size} must divide the {rows} local rows")
    if micro_batch_size is not None and mini_batch_size % micro_batch_size:
        raise ValueError(f"micro_batch_size={micro_batch_size} must divide mini_batch_size={mini_batch_size}")
    return math.ceil(rows / mini_batch_size)
