"""The RL loop, as the single controller runs it: prompts -> rollout -> rewards -> log-probs -> advantages
-> critic/actor update -> weight sync, with validation, checkpoints and metrics around it.

Everything heavy happens in the worker groups (Megatron engines, rollout engine); this file only decides
what happens in which order and moves small batches between them. One step at a time, synchronous; or, with
separate placement, ``async_training.mode=one_step_off`` (the next step's generation runs on the rollout
workers while this step trains, one update old) or ``fully_async`` (a producer thread keeps them generating
into a buffer, :mod:`megarl.trainer.rollout_producer`). With ``rollout.multi_turn`` each response is a
conversation with tools (:mod:`megarl.trainer.agent_rollout`), whose tool results the policy's statistics
leave out (``batch.policy_mask``). The actor group holds the reference and, colocated,
the rollout replicas (the hybrid engine), or a separate rollout group serves generation; optional critic and
reward model groups.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from megarl.agents.loop import conversation_metrics
from megarl.algorithms import AdaptiveKLController, FixedKLController, apply_kl_in_reward, get_advantage_estimator
from megarl.algorithms.dynamic_sampling import first_groups, overlong_penalty, rows_of_informative_groups
from megarl.algorithms.masked import masked_mean
from megarl.algorithms.rollout_correction import compute_rollout_correction, parse_bounds, rs_options, rs_thresholds
from megarl.batch import RolloutBatch, TrainBatch, concat_rows, select_rows
from megarl.config.loader import to_dict
from megarl.config.lora import model_lora
from megarl.config.schema import MegarlConfig
from megarl.controller.roles import ActorRolloutRef, Critic, Rollout, needs_reference
from megarl.data.dataset import collate_prompts
from megarl.engines.rollout.base import SamplingConfig
from megarl.rewards import mean_by_source, place_scores_on_last_token
from megarl.trainer.checkpoint import CheckpointManager
from megarl.trainer.metrics import MetricsLogger, timed
from megarl.trainer.resume_guard import read_trainer_state, resume_point
from megarl.trainer.rollout_assembly import assemble_rollout_batch, conversation_fields, unpadded_prompts
from megarl.trainer.rollout_producer import RolloutProducer
from megarl.trainer.scoring import SampleScorer


@dataclass
class TrainerState:
    step: int = 0


class Generation:
    """A generation in flight on the rollout ranks (or done: a resumed in-flight batch); ``weights`` is the step
    whose update generated it."""

    def __init__(self, *, weights: int, pending=None, assemble=None, batch: Optional[RolloutBatch] = None):
        self.weights, self._pending, self._assemble, self._batch = weights, pending, assemble, batch

    def wait(self) -> RolloutBatch:
        if self._batch is None:
            self._batch = self._assemble(self._pending.result())
            self._pending = self._assemble = None
        return self._batch


def build_kl_controller(cfg: MegarlConfig):
    ctrl = cfg.algorithm.kl_ctrl
    if ctrl.type == "adaptive":
        return AdaptiveKLController(ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
    return FixedKLController(ctrl.kl_coef)


class RLTrainer:
    def __init__(self, cfg: MegarlConfig, *, tokenizer, train_loader, val_dataset, scorer: SampleScorer,
                 actor: ActorRolloutRef, rollout: Rollout, critic: Optional[Critic] = None, logger: MetricsLogger,
                 checkpoints: CheckpointManager, total_steps: int, stop_requested: Callable[[], bool] = lambda: False):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.train_loader = train_loader
        self.val_dataset = val_dataset
        self.scorer = scorer  # every reward source, combined (rule/function, reward model, judge)
        self.actor = actor
        self.critic = critic
        self.rollout = rollout  # separate placement: the rollout workers; else the hybrid actor group
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
        # async_training.mode=one_step_off: the next step's generation, started before this step trains
        self.one_step_off = cfg.async_training.mode == "one_step_off"
        self.in_flight: Optional[Generation] = None
        self.rollout_weights = 0  # the step whose update the rollout engines' weights are (0: the initial ones)
        # async_training.mode=fully_async: the rollout generates into a buffer from a thread of this process
        self.producer = build_producer(cfg, rollout, self.train_loader) \
            if cfg.async_training.mode == "fully_async" else None

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict]:
        self._maybe_resume()
        if self.producer is None:
            return self._fit()
        self.producer.start()
        try:
            return self._fit()
        finally:
            self.producer.stop()

    def _fit(self) -> list[dict]:
        t = self.cfg.trainer
        if t.val_before_train and self.state.step == 0 and self.val_dataset is not None:
            self.logger.log(self.validate(), step=0)
        progress = _progress(t.progress_bar, self.total_steps, self.state.step)
        while self.state.step < self.total_steps:
            self.state.step += 1
            step = self.state.step
            metrics = self.train_step(step)
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
            batch, scores, reward_metrics = self.sample_batch(step, metrics)
            baseline = None
            if cfg.algorithm.adv_estimator == "remax":  # still a generation phase: before training takes the device
                with timed("gen_baseline", metrics):
                    baseline = self.greedy_baseline_scores(batch)
            if self.one_step_off and step < self.total_steps:
                # the rollout workers generate the next batch, with the weights they hold, while this one trains
                self.in_flight = self.start_generation(self.train_loader.next_batch(), self.train_sampling(step + 1))
            with timed("old_log_prob", metrics):
                self.actor.for_training()
                actor_out = self.actor.compute_log_probs(batch)
                batch.old_log_probs, entropy = actor_out.log_probs, actor_out.entropy
            if cfg.algorithm.rollout_correction.enabled:
                metrics.update(self.correct_for_rollout_mismatch(batch))
            if needs_reference(cfg):
                with timed("ref", metrics):
                    batch.ref_log_probs = self.actor.compute_ref_log_probs(batch)
            if self.critic is not None:
                with timed("values", metrics):
                    batch.values = self.critic.compute_values(batch)
            with timed("adv", metrics):
                metrics.update(self.compute_advantages(batch, scores, baseline))
            if self.critic is not None:
                with timed("update_critic", metrics):
                    metrics.update({f"critic/{k}": v for k, v in self.critic.update(batch).items()})
            with timed("update_actor", metrics):
                metrics.update({f"actor/{k}": v for k, v in self.actor.update(batch).items()})
            if self.weights_due(step):
                self.push_weights(step, metrics)
        metrics.update(reward_metrics)
        metrics.update(batch_metrics(batch, scores, entropy))
        tokens = float(batch.attention_mask.sum())
        metrics["perf/tokens"] = tokens
        metrics["perf/tokens_per_s"] = tokens / max(metrics["timing_s/step"], 1e-9)
        # verl's perf/throughput: prompt + response tokens per second per GPU (per worker process on CPU)
        metrics["perf/throughput"] = metrics["perf/tokens_per_s"] / self.num_devices
        return metrics

    # ------------------------------------------------------------------ stages
    def weights_due(self, step: int) -> bool:
        """Whether this step ends with a weight push (fully_async: every trigger_parameter_sync_step steps)."""
        every = self.cfg.async_training.trigger_parameter_sync_step if self.producer is not None else 1
        return step % every == 0 or step == self.total_steps

    def push_weights(self, step: int, metrics: dict) -> None:
        """The updated weights into the rollout engines; with asynchronous rollout, between two generations."""
        if self.in_flight is not None or self.producer is not None:
            with timed("wait_rollout", metrics):
                if self.in_flight is not None:
                    self.in_flight.wait()
                if self.producer is not None:
                    self.producer.pause()
        with timed("weight_sync", metrics):
            self.actor.for_weight_sync()
            metrics.update(self.actor.sync_weights())
        self.rollout_weights = step
        if self.producer is not None:
            self.producer.resume(version=step)

    def take_from_buffer(self, step: int, metrics: dict) -> tuple[TrainBatch, torch.Tensor, dict]:
        """fully_async: the oldest finished groups of the producer's buffer (stale ones dropped), scored."""
        a = self.cfg.async_training
        with timed("gen", metrics):  # only the wait for the buffer: generation runs all the time
            groups, async_metrics = self.producer.take(step - 1, max_staleness=a.max_staleness,
                                                       drop_stale=a.stale_policy == "drop")
        metrics.update(async_metrics)
        batch = TrainBatch.from_rollout(assemble_groups(groups, self.cfg, self.tokenizer.pad_token_id))
        with timed("reward", metrics):
            scores, reward_metrics = self.score_for_training(batch)
        return batch, scores, reward_metrics

    def sample_batch(self, step: int, metrics: dict) -> tuple[TrainBatch, torch.Tensor, dict]:
        """Generate and score ``data.train_batch_size`` prompts' responses. With dynamic sampling
        (``algorithm.filter_groups``) only groups whose scores differ are kept, and more prompts are
        generated until ``train_batch_size`` such groups are there (the first ones are used)."""
        if self.producer is not None:
            return self.take_from_buffer(step, metrics)
        filtering = self.cfg.algorithm.filter_groups
        wanted = self.cfg.data.train_batch_size
        kept: list[tuple[TrainBatch, torch.Tensor]] = []
        reward_metrics: dict = {}
        generated_groups = kept_groups = 0
        for round_index in range(filtering.max_num_gen_batches or 2**31):
            with timed("gen", metrics):
                if self.in_flight is not None:  # one-step-off: it ran while the previous step trained
                    generation, self.in_flight = self.in_flight, None
                else:
                    self.actor.for_generation()
                    generation = self.start_generation(self.train_loader.next_batch(),
                                                       self.train_sampling(step, round_index))
                rollout = generation.wait()
            # how many updates the policy that trains on this batch is ahead of the one that generated it
            metrics["rollout/weight_lag"] = float(step - 1 - generation.weights)
            batch = TrainBatch.from_rollout(rollout)
            with timed("reward", metrics):
                scores, round_metrics = self.score_for_training(batch)
            reward_metrics = reward_metrics or round_metrics  # the first round: the unfiltered distribution
            if not filtering.enable:
                return batch, scores, reward_metrics
            batch.group_ids = [f"{group}#{round_index}" for group in batch.group_ids]  # a prompt may recur
            rows = rows_of_informative_groups(batch.group_ids, scores)
            generated_groups += len(set(batch.group_ids))
            kept_groups += len({batch.group_ids[r] for r in rows})
            kept.append((select_rows(batch, rows), scores[rows]))
            if kept_groups >= wanted:
                break
        else:
            raise RuntimeError(
                f"algorithm.filter_groups: {filtering.max_num_gen_batches} generation rounds "
                f"(algorithm.filter_groups.max_num_gen_batches) gave {kept_groups} of the {wanted} groups with "
                f"differing scores that data.train_batch_size asks for: the prompts are too easy or too hard "
                f"for the policy; raise max_num_gen_batches (0 = no limit) or change the data")
        batch = concat_rows([b for b, _ in kept])
        scores = torch.cat([s for _, s in kept])
        rows = first_groups(batch.group_ids, wanted)
        metrics["filter_groups/gen_batches"] = float(round_index + 1)
        metrics["filter_groups/kept_group_fraction"] = kept_groups / max(generated_groups, 1)
        return select_rows(batch, rows), scores[rows], reward_metrics

    def score_for_training(self, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        """Sequence scores (with the overlong penalty when configured), also set as the batch's
        token-level scores."""
        batch.token_level_scores, scores, reward_metrics = self.scorer.score(batch)
        overlong = self.cfg.reward_model.overlong_buffer
        if overlong.enable:
            penalty = overlong_penalty(batch.response_lengths, max_response_length=self.cfg.data.max_response_length,
                                       buffer_length=overlong.len, penalty_factor=overlong.penalty_factor)
            scores = scores + penalty
            batch.token_level_scores = place_scores_on_last_token(scores, batch.policy_mask)
            reward_metrics = {**reward_metrics, "reward/overlong_penalty/mean": float(penalty.mean())}
        return scores, reward_metrics

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

    def generate(self, prompts, sampling: SamplingConfig) -> RolloutBatch:
        return self.start_generation(prompts, sampling).wait()

    def start_generation(self, prompts, sampling: SamplingConfig) -> "Generation":
        """Generation of ``prompts`` started on the rollout ranks; ``.wait()`` gives its :class:`RolloutBatch`."""
        prompt_ids = unpadded_prompts(prompts.input_ids, prompts.attention_mask)
        return Generation(pending=self.rollout.generate_async(prompt_ids, sampling), weights=self.rollout_weights,
                          assemble=lambda outputs: self.assemble(prompts, prompt_ids, outputs))

    def assemble(self, prompts, prompt_ids: list[list[int]], outputs) -> RolloutBatch:
        log_probs = [out.log_probs for out in outputs]
        have_log_probs = all(lp is not None for lp in log_probs)
        return assemble_rollout_batch(
            prompts=prompt_ids, responses=[out.token_ids for out in outputs],
            prompt_index=[out.prompt_index for out in outputs],
            group_ids=[f"p{index}" for index in prompts.indices],
            max_prompt_length=self.cfg.data.max_prompt_length, max_response_length=self.cfg.data.max_response_length,
            pad_token_id=self.tokenizer.pad_token_id, data_sources=prompts.data_sources,
            ground_truths=prompts.ground_truths, extra_infos=prompts.extra_infos,
            rollout_log_probs=log_probs if have_log_probs else None, raw_prompts=prompts.raw_prompts,
            **conversation_fields(outputs),
        )

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
        prompts = [batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist() for r in rows]
        outputs = self.rollout.generate(prompts, SamplingConfig.greedy(max_tokens=self.cfg.data.max_response_length))
        greedy_batch = assemble_rollout_batch(
            prompts=prompts, responses=[o.token_ids for o in outputs], prompt_index=[o.prompt_index for o in outputs],
            group_ids=[batch.group_ids[r] for r in rows], max_prompt_length=batch.prompt_ids.shape[1],
            max_response_length=batch.response_ids.shape[1], pad_token_id=self.tokenizer.pad_token_id,
            data_sources=[batch.data_sources[r] for r in rows], ground_truths=[batch.ground_truths[r] for r in rows],
            extra_infos=[batch.extra_infos[r] for r in rows],
            raw_prompts=[batch.raw_prompts[r] for r in rows] if batch.raw_prompts else (),
            **conversation_fields(outputs))
        _, greedy_scores, _ = self.scorer.score(greedy_batch)
        by_group = dict(zip(greedy_batch.group_ids, greedy_scores.tolist()))
        return torch.tensor([by_group[g] for g in batch.group_ids], dtype=torch.float32)

    def validate(self) -> dict[str, float]:
        """Greedy (by default) responses on the whole validation set; mean score overall and per source."""
        start = time.perf_counter()
        sources: list[str] = []
        every: list[float] = []
        self.actor.for_generation()
        for prompts in iter_in_order(self.val_dataset, self.cfg.data.val_batch_size, self.tokenizer.pad_token_id):
            rollout = self.generate(prompts, self.val_sampling())
            _, scores, _ = self.scorer.score(rollout)
            sources += rollout.data_sources
            every += scores.tolist()
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
            if self.in_flight is not None:  # one-step-off: the next step's batch, generated already
                torch.save({"batch": self.in_flight.wait(), "weights": self.in_flight.weights},
                           staging / IN_FLIGHT_FILE)
            if self.producer is not None:  # fully_async: the buffer and the unfinished responses, held still
                self.producer.pause()
                torch.save(self.producer.state_dict(), staging / PRODUCER_FILE)
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
        if self.producer is not None:
            self.producer.resume()

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
        self.actor.for_weight_sync()
        self.actor.sync_weights()  # the rollout engine must serve the restored policy
        self.rollout_weights = self.state.step
        if (root / IN_FLIGHT_FILE).is_file():  # the batch the interrupted run had generated for the next step
            saved = torch.load(root / IN_FLIGHT_FILE, weights_only=False)
            self.in_flight = Generation(weights=saved["weights"], batch=saved["batch"])
        if self.producer is not None and (root / PRODUCER_FILE).is_file():
            self.producer.load_state_dict(torch.load(root / PRODUCER_FILE, weights_only=False))
            self.producer.version = self.rollout_weights
        print(f"resumed from {root} at step {self.state.step}", flush=True)


IN_FLIGHT_FILE = "in_flight_rollout.pt"
PRODUCER_FILE = "rollout_buffer.pt"


def build_producer(cfg: MegarlConfig, rollout, train_loader) -> RolloutProducer:
    a, r = cfg.async_training, cfg.actor_rollout_ref.rollout
    return RolloutProducer(
        rollout=rollout, next_prompts=train_loader.next_batch,
        sampling=SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop=tuple(r.stop),
                                ignore_eos=r.ignore_eos),
        n=r.n, max_response_length=cfg.data.max_response_length, batch_groups=cfg.data.train_batch_size,
        max_staleness=a.max_staleness, partial_rollout=a.partial_rollout, chunk_tokens=a.partial_rollout_chunk,
        seed=cfg.trainer.seed)


def assemble_groups(groups: list, cfg: MegarlConfig, pad_token_id: int) -> RolloutBatch:
    """The producer's finished groups as a fixed-width rollout batch, a row per response."""
    return assemble_rollout_batch(
        prompts=[g.prompt_ids for g in groups], responses=[r.tokens for g in groups for r in g.requests],
        prompt_index=[i for i, g in enumerate(groups) for _ in g.requests], group_ids=[g.group_id for g in groups],
        max_prompt_length=cfg.data.max_prompt_length, max_response_length=cfg.data.max_response_length,
        pad_token_id=pad_token_id, data_sources=[g.data_source for g in groups],
        ground_truths=[g.ground_truth for g in groups], extra_infos=[g.extra_info for g in groups],
        rollout_log_probs=[r.log_probs for g in groups for r in g.requests],
        raw_prompts=[g.raw_prompt for g in groups])


def iter_in_order(dataset, batch_size: int, pad_token_id: int):
    """Every item of ``dataset`` once, in order, in batches (the last may be short): for validation."""
    for start in range(0, len(dataset), batch_size):
        items = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        yield collate_prompts(items, pad_token_id=pad_token_id)


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
