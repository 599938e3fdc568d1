"""Reward-model engine: a frozen GPTModel with a scalar ``score`` head, read at each sequence's last token.

The model is the decoder of a Hugging Face ``*ForSequenceClassification`` reward model (one label) with its
``score`` projection as a bias-free :class:`~megarl.engines.megatron.critic.ValueHead` (loaded through the
bridge's ``head="score"`` mapping). :meth:`RewardModelEngine.compute_scores` returns one score per row: the
head's output at the row's last real token (prompt + response, whatever the padding), which is where
``transformers`` pools a sequence classifier whose padding token does not occur inside the sequence. Forward
only, micro-batched like the other engines (fixed rows or packed token budgets), any TP/PP/CP.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from megarl.batch import TrainBatch
from megarl.engines.megatron.critic import attach_value_head
from megarl.engines.megatron.engine import MegatronEngine
from megarl.engines.megatron.row_outputs import whole_sequence
from megarl.engines.megatron.packing import last_token_values, restore_row_order


class RewardModelEngine(MegatronEngine):
    """Constructor arguments are :class:`MegatronEngine`'s, without an optimizer (the model is frozen)."""

    def __init__(self, **kwargs):
        for own in ("chunk_hook", "optimizer_config"):
            if own in kwargs:
                raise TypeError(f"RewardModelEngine sets its own {own}")
        super().__init__(chunk_hook=partial(attach_value_head, bias=False), optimizer_config=None, **kwargs)

    def compute_scores(self, batch: TrainBatch, *, micro_batch_size: Optional[int] = None,
                       max_tokens: Optional[int] = None) -> torch.Tensor:
        """Scores ``[B]`` (fp32) for this DP shard, on every rank of the replica."""
        micro_batches = self.make_micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)

        def loss(mb, output):
            scores = last_token_values(whole_sequence(output, mb), mb)[..., 0].float()
            return output.new_zeros(()), {"scores": scores.detach()}

        reported = self.run_micro_batches(micro_batches, loss=loss, forward_only=True)
        scores = restore_row_order([r["scores"] for r in reported], micro_batches) if reported else None
        return self.broadcast_from_last_stage(scores, (len(batch),))
