"""Every reward source of a run, combined into one sequence score per sample.

The sources: the reward functions (rule scorers, a custom function or a remote service, all through the
:class:`~megarl.rewards.RewardManager`), the reward model group (``reward_model.enable``) and an LLM judge
answering through the policy's rollout engine (``reward_model.judge.enable``). With neither model-based source
on, the functions' score is the score, as it always was; with one on, the score is
``rm_weight * RM + function_weight * functions + judge.weight * judge`` (a source with weight 0 is not asked),
see :func:`megarl.rewards.model_inputs.combine_scores`. The judge generates, so the trainer scores while the
rollout engine has the device (before the log-prob pass takes it back).
"""

from __future__ import annotations

from typing import Optional

import torch

from megarl.algorithms.dynamic_sampling import overlong_penalty
from megarl.batch import RolloutBatch, TrainBatch
from megarl.config.schema import MegarlConfig
from megarl.engines.rollout.base import SamplingConfig
from megarl.rewards import RewardManager, mean_by_source, place_scores_on_last_token
from megarl.rewards.judge import judge_prompt_ids, parse_judgements, question_of
from megarl.rewards.model_inputs import RewardModelInputs, combine_scores
from megarl.trainer.rollout_assembly import decode_rows


class SampleScorer:
    def __init__(self, cfg: MegarlConfig, *, tokenizer, reward_manager: RewardManager, rollout,
                 reward_model=None, rm_inputs: Optional[RewardModelInputs] = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.reward_manager = reward_manager
        self.rollout = rollout  # the judge's engine
        self.reward_model = reward_model
        self.rm_inputs = rm_inputs
        rm = cfg.reward_model
        if rm.enable and (reward_model is None or rm_inputs is None):
            raise ValueError("reward_model.enable=true but no reward model group was started")
        self.model_based = rm.enable or rm.judge.enable
        self.use_functions = not self.model_based or rm.function_weight != 0

    def score(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """``(token_level_scores [B, R], sequence scores [B], metrics)``."""
        metrics: dict[str, float] = {}
        responses = decode_rows(self.tokenizer, batch.response_ids, batch.response_mask)
        function_scores = None
        if self.use_functions:
            prompts = None
            if self.reward_manager.remote is not None:  # the service gets each prompt with its response
                prompts = decode_rows(self.tokenizer, batch.prompt_ids, batch.prompt_mask)
            result = self.reward_manager.score_batch(batch.data_sources, responses, batch.ground_truths,
                                                     batch.extra_infos, prompt_strs=prompts)
            function_scores = result.scores
            metrics.update(result.metrics)
        if not self.model_based:
            scores = function_scores
        else:
            rm = self.cfg.reward_model
            rm_scores = judge_scores = None
            if rm.enable:
                rm_batch, input_metrics = self.rm_inputs.build(batch)
                rm_scores = self.reward_model.score(rm_batch)
                metrics.update(input_metrics)
            if rm.judge.enable:
                judge_scores, judge_metrics = self.judge(batch, responses)
                metrics.update(judge_metrics)
            scores, combined_metrics = combine_scores(
                rm_scores=rm_scores, function_scores=function_scores, judge_scores=judge_scores,
                rm_weight=rm.rm_weight, function_weight=rm.function_weight, judge_weight=rm.judge.weight,
                normalize=rm.normalize_scores, clip=rm.score_clip)
            metrics.update(combined_metrics)
            metrics.update({f"reward/{source}/combined_mean": mean
                            for source, mean in mean_by_source(batch.data_sources, scores.tolist()).items()})
        return place_scores_on_last_token(scores, batch.policy_mask), scores, metrics

    def score_for_training(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Sequence scores (with the overlong penalty when configured), also set as the batch's token-level
        scores."""
        batch.token_level_scores, scores, metrics = self.score(batch)
        overlong = self.cfg.reward_model.overlong_buffer
        if overlong.enable:
            penalty = overlong_penalty(batch.response_lengths, max_response_length=self.cfg.data.max_response_length,
                                       buffer_length=overlong.len, penalty_factor=overlong.penalty_factor)
            scores = scores + penalty
            batch.token_level_scores = place_scores_on_last_token(scores, batch.policy_mask)
            metrics = {**metrics, "reward/overlong_penalty/mean": float(penalty.mean())}
        return scores, metrics

    def judge(self, batch: RolloutBatch, responses: list[str]) -> tuple[torch.Tensor, dict[str, float]]:
        """One greedy (by default) judgement per sample from the policy's rollout engine."""
        judge, data = self.cfg.reward_model.judge, self.cfg.data
        if batch.raw_prompts:
            questions = [question_of(p) for p in batch.raw_prompts]
        else:
            questions = decode_rows(self.tokenizer, batch.prompt_ids, batch.prompt_mask)
        prompts, cut = judge_prompt_ids(
            self.tokenizer, judge.prompt_template, questions=questions, responses=responses,
            references=batch.ground_truths or [None] * len(batch),
            # the engines are sized for a prompt plus a response of the configured lengths
            max_prompt_tokens=data.max_prompt_length + data.max_response_length - judge.max_tokens)
        sampling = SamplingConfig(n=1, temperature=judge.temperature, max_tokens=judge.max_tokens,
                                  seed=self.cfg.trainer.seed)
        outputs = sorted(self.rollout.generate(prompts, sampling), key=lambda out: out.prompt_index)
        judgements = [self.tokenizer.decode(out.token_ids, skip_special_tokens=True) for out in outputs]
        scores, metrics = parse_judgements(judgements, pattern=judge.score_pattern, scale=judge.score_scale,
                                           on_unparsable=judge.on_unparsable)
        metrics["reward/judge/prompts_cut"] = float(cut)
        return scores, metrics

