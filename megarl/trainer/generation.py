"""Generations on the rollout ranks, from a prompt batch to a :class:`~megarl.batch.RolloutBatch`: the
sampling a training or validation generation uses, the weight version each one was generated with, and
the one place where the engines' answers become the fixed-width batch (:mod:`megarl.trainer.rollout_assembly`).
The prompts stay in one shape from the dataset to the engines (unpadded token ids, and a vision-language
model's pixels beside them) and are padded once, here.
"""

from __future__ import annotations

from typing import Optional

from megarl.batch import RolloutBatch
from megarl.config.schema import MegarlConfig
from megarl.data.dataset import PromptBatch
from megarl.engines.rollout.base import SamplingConfig
from megarl.trainer.rollout_assembly import RowWidths, assemble_rollout_batch


class Generation:
    """A generation in flight on the rollout ranks (or done: a resumed in-flight batch); ``weights`` is the step
    whose update generated it."""

    def __init__(self, *, weights: int, pending=None, prompts: Optional[PromptBatch] = None,
                 widths: Optional[RowWidths] = None, batch: Optional[RolloutBatch] = None):
        self.weights, self._pending, self._prompts, self._widths = weights, pending, prompts, widths
        self._batch = batch

    def wait(self) -> RolloutBatch:
        if self._batch is None:
            prompts = self._prompts
            self._batch = assemble_rollout_batch(prompts, self._pending.result(), widths=self._widths,
                                                 group_ids=[f"p{index}" for index in prompts.indices])
            self._pending = self._prompts = None
        return self._batch


class Generator:
    """Starts generations on ``rollout`` (the roles' :class:`~megarl.controller.roles.Rollout`, or the
    multi-turn :class:`~megarl.trainer.agent_rollout.AgentRollout` over it) and knows which weights the
    rollout engines hold (``weights``: the step whose update they are; 0 for the initial ones)."""

    def __init__(self, cfg: MegarlConfig, rollout, pad_token_id: int):
        self.cfg, self.rollout = cfg, rollout
        self.widths = RowWidths(cfg.data.max_prompt_length, cfg.data.max_response_length, pad_token_id)
        self.weights = 0

    def start(self, prompts: PromptBatch, sampling: SamplingConfig) -> Generation:
        """Generation of ``prompts`` started on the rollout ranks; ``.wait()`` gives its :class:`RolloutBatch`."""
        pending = self.rollout.generate_async(prompts.prompt_ids, sampling, prompts.multi_modal_inputs or None)
        return Generation(pending=pending, weights=self.weights, prompts=prompts, widths=self.widths)

    def generate(self, prompts: PromptBatch, sampling: SamplingConfig) -> RolloutBatch:
        return self.start(prompts, sampling).wait()

    def train_sampling(self, step: int, round_index: int = 0) -> SamplingConfig:
        r = self.cfg.actor_rollout_ref.rollout
        return SamplingConfig(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            max_tokens=self.cfg.data.max_response_length, stop=tuple(r.stop), ignore_eos=r.ignore_eos,
            # per step (and generation round), so a resumed run samples the same
            seed=self.cfg.trainer.seed * 1_000_003 + step + round_index * 1_000_000_007,
            logprobs=True,  # the sampled tokens' log-probs: checked against the trainer's (rollout/log_prob_diff_*)
        )

    def val_sampling(self) -> SamplingConfig:
        v = self.cfg.actor_rollout_ref.rollout.val_kwargs
        temperature = v.temperature if v.do_sample else 0.0
        return SamplingConfig(n=v.n, temperature=temperature, top_p=v.top_p if v.do_sample else 1.0,
                              max_tokens=self.cfg.data.max_response_length, seed=self.cfg.trainer.seed)
