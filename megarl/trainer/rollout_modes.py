"""Where each training step's scored batch comes from, and when the rollout engines get the new weights: one
strategy per ``async_training.mode``, chosen once at start-up (:func:`build_rollout_mode`).

- :class:`Synchronous` (``sync``): generate, score, train, push; with dynamic sampling
  (``algorithm.filter_groups``, DAPO) more generation rounds until enough groups with differing scores.
- :class:`OneStepOff` (``one_step_off``, separate placement): the next step's batch is generated on the rollout
  workers while this one trains, with the weights before this step's update (one update old); the push waits
  for that generation.
- :class:`FullyAsync` (``fully_async``): a producer thread keeps the rollout workers generating into a buffer
  (:mod:`megarl.trainer.rollout_producer`); each step takes the oldest finished groups; weights are pushed every
  ``trigger_parameter_sync_step`` steps, between two of the producer's calls.

Each owns its state in checkpoints (the in-flight batch, the producer's buffer), so the trainer's step runs
top to bottom the same way in every mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from megarl.algorithms.dynamic_sampling import first_groups, rows_of_informative_groups
from megarl.batch import TrainBatch, concat_rows, select_rows
from megarl.config.schema import MegarlConfig
from megarl.data.dataset import PromptBatch
from megarl.engines.rollout.base import RolloutOutput, SamplingConfig
from megarl.trainer.generation import Generation, Generator
from megarl.trainer.metrics import timed
from megarl.trainer.rollout_assembly import assemble_rollout_batch
from megarl.trainer.rollout_producer import RolloutProducer
from megarl.trainer.scoring import SampleScorer

ScoredBatch = tuple[TrainBatch, torch.Tensor, dict]  # the batch, its sequence scores, the reward metrics


class RolloutMode:
    """The synchronous contract every mode keeps; see the module docstring."""

    def __init__(self, cfg: MegarlConfig, *, generator: Generator, scorer: SampleScorer, train_loader,
                 sync_weights: Callable[[], dict], total_steps: int):
        self.cfg, self.generator, self.scorer, self.train_loader = cfg, generator, scorer, train_loader
        self.sync_weights = sync_weights  # the actor's weights into the rollout engines; the sync's metrics
        self.total_steps = total_steps

    def start(self) -> None:
        """Before the first step (after a resume)."""

    def stop(self) -> None:
        """After the last step, or on the way out of a failed one."""

    def next_batch(self, step: int, metrics: dict) -> ScoredBatch:
        raise NotImplementedError

    def while_training(self, step: int) -> None:
        """Step ``step``'s batch leaves for training (its generation phase is over)."""

    def weights_due(self, step: int) -> bool:
        """Whether step ``step`` ends with a weight push."""
        return True

    def push_weights(self, step: int, metrics: dict) -> None:
        """The weights after step ``step``'s update into the rollout engines."""
        with timed("weight_sync", metrics):
            metrics.update(self.sync_weights())
        self.generator.weights = step

    def save(self, staging: Path) -> None:
        """The mode's own state into a checkpoint being written."""

    def resume(self, root: Path, step: int) -> None:
        """After the roles resumed from checkpoint ``root`` of step ``step``: the rollout engines serve the
        restored policy, and the mode takes its saved state back."""
        self.sync_weights()
        self.generator.weights = step

    def score(self, batch: TrainBatch, metrics: dict) -> tuple[torch.Tensor, dict]:
        with timed("reward", metrics):
            return self.scorer.score_for_training(batch)


class Synchronous(RolloutMode):
    """Generate ``data.train_batch_size`` prompts' responses and score them. With dynamic sampling
    (``algorithm.filter_groups``) only groups whose scores differ are kept, and more prompts are generated
    until ``train_batch_size`` such groups are there (the first ones are used)."""

    def generation(self, step: int, round_index: int) -> Generation:
        return self.generator.start(self.train_loader.next_batch(), self.generator.train_sampling(step, round_index))

    def next_batch(self, step: int, metrics: dict) -> ScoredBatch:
        filtering = self.cfg.algorithm.filter_groups
        wanted = self.cfg.data.train_batch_size
        kept: list[tuple[TrainBatch, torch.Tensor]] = []
        reward_metrics: dict = {}
        generated_groups = kept_groups = 0
        for round_index in range(filtering.max_num_gen_batches or 2**31):
            with timed("gen", metrics):
                generation = self.generation(step, round_index)
                rollout = generation.wait()
            # how many updates the policy that trains on this batch is ahead of the one that generated it
            metrics["rollout/weight_lag"] = float(step - 1 - generation.weights)
            batch = TrainBatch.from_rollout(rollout)
            scores, round_metrics = self.score(batch, metrics)
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


IN_FLIGHT_FILE = "in_flight_rollout.pt"
PRODUCER_FILE = "rollout_buffer.pt"


class OneStepOff(Synchronous):
    """The next step's generation runs while this step trains (separate placement), one update old."""

    def __init__(self, cfg: MegarlConfig, **parts):
        super().__init__(cfg, **parts)
        self.in_flight: Optional[Generation] = None

    def generation(self, step: int, round_index: int) -> Generation:
        if self.in_flight is not None:  # it ran while the previous step trained
            generation, self.in_flight = self.in_flight, None
            return generation
        return super().generation(step, round_index)

    def while_training(self, step: int) -> None:
        if step < self.total_steps:  # with the weights the rollout workers hold: this step's update is not in
            self.in_flight = super().generation(step + 1, 0)

    def push_weights(self, step: int, metrics: dict) -> None:
        if self.in_flight is not None:  # the weights reach the rollout workers between two generations
            with timed("wait_rollout", metrics):
                self.in_flight.wait()
        super().push_weights(step, metrics)

    def save(self, staging: Path) -> None:
        if self.in_flight is not None:  # the next step's batch, generated already
            torch.save({"batch": self.in_flight.wait(), "weights": self.in_flight.weights}, staging / IN_FLIGHT_FILE)

    def resume(self, root: Path, step: int) -> None:
        super().resume(root, step)
        if (root / IN_FLIGHT_FILE).is_file():  # the batch the interrupted run had generated for the next step
            saved = torch.load(root / IN_FLIGHT_FILE, weights_only=False)
            self.in_flight = Generation(weights=saved["weights"], batch=saved["batch"])


class FullyAsync(RolloutMode):
    """The rollout workers generate all the time into the producer's buffer; steps take from it."""

    def __init__(self, cfg: MegarlConfig, **parts):
        super().__init__(cfg, **parts)
        self.producer = build_producer(cfg, self.generator.rollout, self.train_loader)

    def start(self) -> None:
        self.producer.start()

    def stop(self) -> None:
        self.producer.stop()

    def next_batch(self, step: int, metrics: dict) -> ScoredBatch:
        """The oldest finished groups of the producer's buffer (stale ones dropped), scored."""
        a = self.cfg.async_training
        with timed("gen", metrics):  # only the wait for the buffer: generation runs all the time
            groups, async_metrics = self.producer.take(step - 1, max_staleness=a.max_staleness,
                                                       drop_stale=a.stale_policy == "drop")
        metrics.update(async_metrics)
        batch = TrainBatch.from_rollout(assemble_groups(groups, self.generator))
        scores, reward_metrics = self.score(batch, metrics)
        return batch, scores, reward_metrics

    def weights_due(self, step: int) -> bool:
        every = self.cfg.async_training.trigger_parameter_sync_step
        return step % every == 0 or step == self.total_steps

    def push_weights(self, step: int, metrics: dict) -> None:
        with timed("wait_rollout", metrics):  # the call in flight finishes with the weights it started with
            self.producer.pause()
        super().push_weights(step, metrics)
        self.producer.resume(version=step)

    def save(self, staging: Path) -> None:
        """The buffer and the unfinished responses, held still while they are written."""
        self.producer.pause()
        try:
            torch.save(self.producer.state_dict(), staging / PRODUCER_FILE)
        finally:
            self.producer.resume()

    def resume(self, root: Path, step: int) -> None:
        super().resume(root, step)
        if (root / PRODUCER_FILE).is_file():
            self.producer.load_state_dict(torch.load(root / PRODUCER_FILE, weights_only=False))
            self.producer.version = step


MODES = {"sync": Synchronous, "one_step_off": OneStepOff, "fully_async": FullyAsync}


def build_rollout_mode(cfg: MegarlConfig, **parts) -> RolloutMode:
    """The strategy of ``async_training.mode`` (the config's validation has checked the name)."""
    return MODES[cfg.async_training.mode](cfg, **parts)


def build_producer(cfg: MegarlConfig, rollout, train_loader) -> RolloutProducer:
    a, r = cfg.async_training, cfg.actor_rollout_ref.rollout
    return RolloutProducer(
        rollout=rollout, next_prompts=train_loader.next_batch,
        sampling=SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop=tuple(r.stop),
                                ignore_eos=r.ignore_eos),
        n=r.n, max_response_length=cfg.data.max_response_length, batch_groups=cfg.data.train_batch_size,
        max_staleness=a.max_staleness, partial_rollout=a.partial_rollout, chunk_tokens=a.partial_rollout_chunk,
        seed=cfg.trainer.seed)


def assemble_groups(groups: list, generator: Generator):
    """The producer's finished groups as a fixed-width rollout batch, a row per response."""
    prompts = PromptBatch(prompt_ids=[g.prompt_ids for g in groups], raw_prompts=[g.raw_prompt for g in groups],
                          ground_truths=[g.ground_truth for g in groups],
                          data_sources=[g.data_source for g in groups], extra_infos=[g.extra_info for g in groups],
                          indices=list(range(len(groups))),
                          multi_modal_inputs=[g.multi_modal_inputs for g in groups]
                          if any(g.multi_modal_inputs is not None for g in groups) else [])
    responses = [RolloutOutput(prompt_index=index, token_ids=r.tokens, log_probs=r.log_probs, finish_reason="stop")
                 for index, group in enumerate(groups) for r in group.requests]
    return assemble_rollout_batch(prompts, responses, group_ids=[g.group_id for g in groups],
                                  widths=generator.widths)
