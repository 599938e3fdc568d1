"""The RL loop, as the single controller runs it: prompts -> rollout -> rewards -> log-probs -> advantages
-> critic/actor update -> weight sync, with validation, checkpoints and metrics around it.

Everything heavy happens in the worker groups (Megatron engines, rollout engine); this file only decides
what happens in which order and moves small batches between them. Where a step's batch comes from and when
the weights go back to the rollout is the rollout mode's (:mod:`megarl.trainer.rollout_modes`: synchronous,
or with separate placement one-step-off or fully asynchronous), chosen once; a step runs the same way in all
of them. Which device phase a rank is in (the hybrid engine's sleep and wake-up) is the worker's business:
each worker method enters the phase it needs. With ``rollout.multi_turn`` each response is a
conversation with tools (:mod:`megarl.trainer.agent_rollout`), whose tool results the policy's statistics
leave out (``batch.policy_mask``). The actor group holds the reference and, colocated,
the rollout replicas (the hybrid engine), or a separate rollout group serves generation; optional critic and
reward model groups.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Optional

import torch

from megarl.agents.loop import conversation_metrics
from megarl.algorithms import AdaptiveKLController, FixedKLController, apply_kl_in_reward, get_advantage_estimator
from megarl.algorithms.masked import masked_mean
from megarl.algorithms.rollout_correction import compute_rollout_correction, parse_bounds, rs_options, rs_thresholds
from megarl.algorithms.preference import preference_pair_rows
from megarl.batch import TrainBatch, select_rows
from megarl.config.loader import to_dict
from megarl.config.lora import model_lora
from megarl.config.schema import MegarlConfig
from megarl.controller.roles import ActorRolloutRef, Critic, Teachers, needs_reference
from megarl.engines.rollout.base import SamplingConfig
from megarl.rewards import mean_by_source
from megarl.trainer.checkpoint import CheckpointManager
from megarl.trainer.rollout_traces import rows_to_show, trace_rows, write_rows
from megarl.trainer.generation import Generator
from megarl.trainer.metrics import MetricsLogger, timed
from megarl.trainer.resume_guard import read_trainer_state, resume_point
from megarl.trainer.rollout_assembly import assemble_rollout_batch, prompts_of_rows
from megarl.trainer.rollout_modes import build_rollout_mode
from megarl.trainer.scoring import SampleScorer


@dataclass
class TrainerState:
    step: int = 0


def build_kl_controller(cfg: MegarlConfig):
    ctrl = cfg.algorithm.kl_ctrl
    if ctrl.type == "adaptive":
        return AdaptiveKLController(ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
    return FixedKLController(ctrl.kl_coef)


class RLTrainer:
    def __init__(self, cfg: MegarlConfig, *, tokenizer, train_loader, val_dataset, scorer: SampleScorer,
                 actor: ActorRolloutRef, rollout, critic: Optional[Critic] = None,
                 teachers: Optional[Teachers] = None, logger: MetricsLogger,
                 checkpoints: CheckpointManager, total_steps: int, stop_requested: Callable[[], bool] = lambda: False,
                 profiled_step: Callable[[int], ContextManager[list[str]]] = lambda step: contextlib.nullcontext([])):
        self.profiled_step = profiled_step
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.train_loader = train_loader
        self.val_dataset = val_dataset
        self.scorer = scorer  # every reward source, combined (rule/function, reward model, judge)
        self.actor = actor
        self.critic = critic
        self.teachers = teachers  # on-policy distillation (distillation.enabled)
        # rollout: the roles' Rollout (separate placement: the rollout workers; else the hybrid actor group), or
        # the multi-turn AgentRollout over it
        self.generator = Generator(cfg, rollout, tokenizer.pad_token_id)
        self.num_devices = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
        self.logger = logger
        self.checkpoints = checkpoints
        self.total_steps = total_steps
        self.stop_requested = stop_requested  # a scheduler's stop signal: checkpoint after this step and end
        self.kl_ctrl = build_kl_controller(cfg)
        rc = cfg.algorithm.rollout_correction
        if rc.rollout_is is not None:  # bad thresholds fail here, naming the key, not after the first rollout
            parse_bounds(rc.rollout_is_threshold, name="algorithm.rollout_correction.rollout_is_threshold")
        rs_thresholds(rs_options(rc.rollout_rs), rc.rollout_rs_threshold)
        self.state = TrainerState()
        self.history: list[dict] = []
        self.rollout_mode = build_rollout_mode(cfg, generator=self.generator, scorer=scorer, train_loader=train_loader,
                                               sync_weights=actor.sync_weights, total_steps=total_steps)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict]:
        self._maybe_resume()
        self.rollout_mode.start()
        try:
            return self._fit()
        finally:
            self.rollout_mode.stop()

    def _fit(self) -> list[dict]:
        t = self.cfg.trainer
        if t.val_before_train and self.state.step == 0 and self.val_dataset is not None:
            self.logger.log(self.validate(), step=0)
        progress = _progress(t.progress_bar, self.total_steps, self.state.step)
        while self.state.step < self.total_steps:
            self.state.step += 1
            step = self.state.step
            with self.profiled_step(step) as traces:  # global_profiler: this step's capture on every worker
                metrics = self.train_step(step)
            if traces:
                print(f"[megarl] step {step} profiled: {len(traces)} trace(s) under {os.path.dirname(traces[0])}",
                      flush=True)
            if self.val_dataset is not None and t.test_freq > 0 and (step % t.test_freq == 0 or step == self.total_steps):
                metrics.update(self.validate())
            staging = None
            stopping = self.stop_requested()
            if stopping or (t.save_freq > 0 and (step % t.save_freq == 0 or step == self.total_steps)):
                with timed("save_checkpoint", metrics):
                    staging = self.write_checkpoint()
            # Logged before the checkpoint commits: a run killed in between redoes this step on resume (whose
            # rows past the checkpoint are dropped first), instead of resuming after a step it never logged.
            self.logger.log(metrics, step=step)
            if staging is not None:
                self.commit_checkpoint(staging)
            self.history.append({"step": step, **metrics})
            if stopping:
                print(f"[megarl] stopped after step {step} of {self.total_steps} with its checkpoint "
                      f"({self.checkpoints.step_dir(step)}); the same command resumes", flush=True)
                break
            if progress is not None:
                progress.update(1)
                progress.set_postfix(score=f"{metrics.get('critic/score/mean', float('nan')):.3f}")
        if progress is not None:
            progress.close()
        return self.history

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        metrics: dict[str, float] = {}
        with timed("step", metrics):
            batch, scores, reward_metrics = self.rollout_mode.next_batch(step, metrics)
            if cfg.algorithm.adv_estimator == "spin":  # SPIN trains on each prompt's chosen / rejected pair
                rows = preference_pair_rows(batch.group_ids, scores)
                batch, scores = select_rows(batch, rows), scores[rows]
            baseline = None
            if cfg.algorithm.adv_estimator == "remax":  # still a generation phase: before training takes the device
                with timed("gen_baseline", metrics):
                    baseline = self.greedy_baseline_scores(batch)
            self.rollout_mode.while_training(step)
            with timed("old_log_prob", metrics):
                actor_out = self.actor.compute_log_probs(batch)
                batch.old_log_probs, entropy = actor_out.log_probs, actor_out.entropy
            if actor_out.routed_experts is not None:  # router_replay R2: the update replays this pass's routing
                batch.routed_experts = actor_out.routed_experts
            if actor_out.routing_mismatch is not None:
                metrics["routing/rollout_mismatch_frac"] = actor_out.routing_mismatch
            if cfg.algorithm.rollout_correction.enabled:
                metrics.update(self.correct_for_rollout_mismatch(batch))
            if needs_reference(cfg):
                with timed("ref", metrics):
                    batch.ref_log_probs = self.actor.compute_ref_log_probs(batch)
            if self.teachers is not None:
                with timed("teacher", metrics):
                    batch.teacher_log_probs = self.teachers.log_probs(batch)
            if self.critic is not None:
                with timed("values", metrics):
                    batch.values = self.critic.compute_values(batch)
            with timed("adv", metrics):
                metrics.update(self.compute_advantages(batch, scores, baseline))
            if self.critic is not None:
                with timed("update_critic", metrics):
                    metrics.update({f"critic/{k}": v for k, v in self.critic.update(batch).items()})
            if step >= cfg.trainer.critic_warmup:  # verl's condition: before it, the critic trains alone
                with timed("update_actor", metrics):
                    metrics.update({f"actor/{k}": v for k, v in self.actor.update(batch).items()})
            if self.rollout_mode.weights_due(step):
                self.rollout_mode.push_weights(step, metrics)
            if cfg.trainer.ref_update_freq > 0 and step % cfg.trainer.ref_update_freq == 0:
                self.actor.update_reference()  # SPIN: the next iteration plays against this policy
                metrics["actor/reference_updated"] = 1.0
        metrics.update(reward_metrics)
        metrics.update(batch_metrics(batch, scores, entropy))
        if cfg.trainer.rollout_data_dir:
            write_rows(cfg.trainer.rollout_data_dir, step, trace_rows(self.tokenizer, batch, scores, step))
        tokens = float(batch.attention_mask.sum())
        metrics["perf/tokens"] = tokens
        metrics["perf/tokens_per_s"] = tokens / max(metrics["timing_s/step"], 1e-9)
        # verl's perf/throughput: prompt + response tokens per second per GPU (per worker process on CPU)
        metrics["perf/throughput"] = metrics["perf/tokens_per_s"] / self.num_devices
        return metrics

    # ------------------------------------------------------------------ stages
    def correct_for_rollout_mismatch(self, batch: TrainBatch) -> dict[str, float]:
        """``algorithm.rollout_correction``: importance weights and rejected tokens from the rollout engine's
        log-probs against the trainer's (megarl.algorithms.rollout_correction), onto the batch."""
        rc = self.cfg.algorithm.rollout_correction
        if batch.rollout_log_probs is None:
            raise RuntimeError("algorithm.rollout_correction needs the rollout engine's log-probs of the sampled "
                               "tokens, and this rollout engine returned none")
        correction = compute_rollout_correction(
            old_log_probs=batch.old_log_probs, rollout_log_probs=batch.rollout_log_probs,
            response_mask=batch.policy_mask, rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
            rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=rc.rollout_rs,
            rollout_rs_threshold=rc.rollout_rs_threshold)
        batch.rollout_is_weights = correction.is_weights
        batch.loss_mask = correction.loss_mask if rc.rollout_rs else batch.generated_mask
        return correction.metrics

    def compute_advantages(self, batch: TrainBatch, scores: torch.Tensor,
                           baseline: Optional[torch.Tensor] = None) -> dict[str, float]:
        """``baseline``: ReMax's greedy-response scores per row (:meth:`greedy_baseline_scores`)."""
        alg = self.cfg.algorithm
        metrics: dict[str, float] = {}
        if alg.use_kl_in_reward:
            batch.token_level_rewards, kl_metrics = apply_kl_in_reward(
                batch.token_level_scores, batch.old_log_probs, batch.ref_log_probs, batch.policy_mask.float(),
                self.kl_ctrl, kind=alg.kl_penalty)
            metrics.update(kl_metrics)
        else:
            batch.token_level_rewards = batch.token_level_scores
        estimator = get_advantage_estimator(alg.adv_estimator)
        batch.advantages, batch.returns = estimator(
            token_level_rewards=batch.token_level_rewards, response_mask=batch.policy_mask.float(),
            group_ids=batch.group_ids, values=batch.values, gamma=alg.gamma, lam=alg.lam,
            norm_by_std=alg.norm_adv_by_std_in_grpo, baseline_scores=baseline,
        )
        return metrics

    def greedy_baseline_scores(self, batch: TrainBatch) -> torch.Tensor:
        """ReMax: the reward of the greedy response to the same prompt, per row."""
        first_rows: dict[str, int] = {}
        for row, gid in enumerate(batch.group_ids):
            first_rows.setdefault(gid, row)
        rows = list(first_rows.values())
        prompts = prompts_of_rows(batch, rows)
        outputs = self.generator.rollout.generate(prompts.prompt_ids,
                                                  SamplingConfig.greedy(max_tokens=self.cfg.data.max_response_length),
                                                  prompts.multi_modal_inputs or None)
        greedy_batch = assemble_rollout_batch(prompts, outputs, group_ids=[batch.group_ids[r] for r in rows],
                                              widths=self.generator.widths)
        _, greedy_scores, _ = self.scorer.score(greedy_batch)
        by_group = dict(zip(greedy_batch.group_ids, greedy_scores.tolist()))
        return torch.tensor([by_group[g] for g in batch.group_ids], dtype=torch.float32)

    def validate(self) -> dict[str, float]:
        """Greedy (by default) responses on the whole validation set; mean score overall and per source."""
        start = time.perf_counter()
        t, step = self.cfg.trainer, self.state.step
        sources: list[str] = []
        every: list[float] = []
        traced: list[dict] = []  # trainer.validation_data_dir / log_val_generations
        for prompts in iter_in_order(self.val_dataset, self.cfg.data.val_batch_size):
            rollout = self.generator.generate(prompts, self.generator.val_sampling())
            _, scores, _ = self.scorer.score(rollout)
            sources += rollout.data_sources
            every += scores.tolist()
            if t.validation_data_dir or t.log_val_generations:
                traced += trace_rows(self.tokenizer, rollout, scores, step)
        if t.validation_data_dir:
            write_rows(t.validation_data_dir, step, traced)
        if t.log_val_generations:
            shown = [{k: row[k] for k in ("input", "output", "score")} for row in rows_to_show(traced, t.log_val_generations)]
            self.logger.log_table("val_generations", shown, step)
        metrics = {"val/score/mean": sum(every) / max(len(every), 1)}
        for source, mean in mean_by_source(sources, every).items():
            metrics[f"val/{source}/score/mean"] = mean
        metrics["timing_s/validate"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def write_checkpoint(self) -> Path:
        """Every role's state into the staging directory of this step (not yet a checkpoint)."""
        staging = self.checkpoints.begin(self.state.step)
        try:
            self.actor.save(str(staging / "actor"), self.state.step)
            if self.cfg.trainer.save_hf:  # inside the staging dir: it becomes visible with the checkpoint
                self.actor.save_hf(str(staging / "actor_hf"))  # with LoRA: the merged model
                if model_lora(self.cfg.actor_rollout_ref.model) is not None:
                    self.actor.save_hf_adapter(str(staging / "actor_hf_adapter"))  # and the adapter alone
            if self.critic is not None:
                self.critic.save(str(staging / "critic"), self.state.step)
            self.rollout_mode.save(staging)
        except BaseException as error:  # torch's CheckpointException derives from BaseException
            if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            reason = self.checkpoints.failed_write(self.state.step, staging, error)
            if reason is error:
                raise
            raise reason from error
        return staging

    def commit_checkpoint(self, staging: Path) -> None:
        step = self.state.step
        self.checkpoints.commit(step, staging, {
            "step": step, "train_loader": self.train_loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
            "config": to_dict(self.cfg),  # what wrote it: a later run resumes it only as the same run (resume_guard)
        }, roles=("actor",) + (("critic",) if self.critic is not None else ()))

    def _maybe_resume(self) -> None:
        root = resume_point(self.cfg, self.checkpoints)
        if root is None:
            return
        state = read_trainer_state(root)
        self.actor.load(str(root / "actor"))
        if self.critic is not None:
            self.critic.load(str(root / "critic"))
        self.train_loader.load_state_dict(state["train_loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.state.step = state["step"]
        self.logger.forget_after(self.state.step)  # steps past the checkpoint are trained (and logged) again
        self.rollout_mode.resume(root, self.state.step)  # the rollout serves the restored policy from here
        print(f"resumed from {root} at step {self.state.step}", flush=True)


def iter_in_order(dataset, batch_size: int):
    """Every item of ``dataset`` once, in order, in batches (the last may be short): for validation."""
    for start in range(0, len(dataset), batch_size):
        yield dataset.batch(range(start, min(start + batch_size, len(dataset))))


def batch_metrics(batch: TrainBatch, scores: torch.Tensor, entropy: Optional[torch.Tensor]) -> dict[str, float]:
    mask = batch.policy_mask.float()  # multi-turn: the generated tokens, not the tool results between them
    lengths = batch.response_mask.float().sum(dim=1)
    max_len = batch.response_ids.shape[1]
    metrics = {
        "critic/score/mean": float(scores.mean()), "critic/score/max": float(scores.max()),
        "critic/score/min": float(scores.min()),
        "critic/rewards/mean": float(batch.token_level_rewards.sum(dim=1).mean()),
        "critic/advantages/mean": float(masked_mean(batch.advantages, mask)),
        "critic/advantages/max": float(batch.advantages[mask.bool()].max()),
        "critic/advantages/min": float(batch.advantages[mask.bool()].min()),
        "critic/returns/mean": float(masked_mean(batch.returns, mask)),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= max_len).float().mean()),
        "prompt_length/mean": float(batch.prompt_mask.float().sum(dim=1).mean()),
    }
    if entropy is not None:
        metrics["actor/rollout_entropy"] = float(masked_mean(entropy, mask))
    if batch.values is not None:
        metrics["critic/values/mean"] = float(masked_mean(batch.values, mask))
    if batch.ref_log_probs is not None:
        metrics["actor/ref_kl"] = float(masked_mean(batch.old_log_probs - batch.ref_log_probs, mask))
    if batch.rollout_log_probs is not None and batch.old_log_probs is not None:
        # rollout engine vs trainer on the same tokens: weight sync and numerics in one number
        gap = (batch.rollout_log_probs - batch.old_log_probs).abs()
        metrics["rollout/log_prob_diff_mean"] = float(masked_mean(gap, mask))
        metrics["rollout/log_prob_diff_max"] = float(gap[mask.bool()].max())
    conversations = [info["agent"] for info in batch.extra_infos if isinstance(info, dict) and "agent" in info]
    if conversations:
        metrics.update(conversation_metrics(conversations))
        metrics["agent/generated_token_fraction"] = float(mask.sum() / batch.response_mask.sum().clamp(min=1))
    return {k: v for k, v in metrics.items() if not math.isnan(v)}


def _progress(enabled: bool, total: int, initial: int):
    """A live bar only on a terminal: in a log file or under Slurm its carriage returns merge with the step
    lines, which carry the same information."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="training", unit="step", dynamic_ncols=True)
