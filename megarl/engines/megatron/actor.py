"""Actor (policy) and reference engines on megatron: log-probs of responses and the PPO/GRPO update.

``ActorEngine.compute_log_probs`` runs forward only; ``update_policy`` runs the PPO loop (epochs x
mini-batches, one optimizer step per mini-batch) with a policy loss looked up by name in
``megarl.algorithms`` plus optional entropy bonus and KL-to-reference loss. ``ReferenceEngine`` is a frozen
copy: same model, no DDP, no optimizer, ``compute_log_probs`` only.

Where results live: log-probs/entropy are computed on the last pipeline stage (every TP rank there holds
the same values after the vocab-parallel all-reduces) and broadcast over the pipeline group, so every rank
of a DP replica returns the full ``[B_local, R]`` tensors for its own DP shard. Update metrics are reduced
over DP and identical on all ranks. Micro-batches are padded rows or packed streams, by row count or token
budget (:class:`~megarl.engines.megatron.micro_batches.MicroBatching`). Leaves out: rollout-vs-train importance
correction (TIS).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch

from megarl.algorithms import aggregate_loss, get_policy_loss, kl_penalty
from megarl.algorithms.distillation import DistillationSpec, distillation_loss
from megarl.batch import TrainBatch
from megarl.engines.megatron.engine import MegatronEngine, average_metrics
from megarl.engines.megatron.micro_batches import MicroBatching
from megarl.engines.megatron.row_outputs import response_log_probs
from megarl.engines.megatron.packing import restore_row_order


@dataclass
class LogProbPass:
    """What a forward-only pass over a DP shard gives: ``log_probs`` / ``entropy`` ``[B, R]``; with routing
    replay (MoE), the routing the routers used when asked to record it (``[B, P + R, L_moe, K]``) and the
    fraction of (token, layer) routings that differ from the batch's ``routed_experts`` (when it has them)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    routed_experts: Optional[torch.Tensor] = None
    routing_mismatch: Optional[float] = None


class _LogProbMixin:
    def compute_log_probs(self, batch: TrainBatch, *, micro_batch_size: Optional[int] = None,
                          max_tokens: Optional[int] = None, replay_routing: bool = False):
        """``(log_probs [B, R], entropy [B, R])`` fp32 for this DP shard, on every rank of the replica.
        Padding positions hold whatever the model gives (zeros when packed); mask them with
        ``response_mask``. ``micro_batch_size`` / ``max_tokens`` override the engine's micro-batching."""
        result = self.log_prob_pass(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens,
                                    replay_routing=replay_routing)
        return result.log_probs, result.entropy

    def log_prob_pass(self, batch: TrainBatch, *, micro_batch_size: Optional[int] = None,
                      max_tokens: Optional[int] = None, replay_routing: bool = False,
                      record_routing: bool = False) -> LogProbPass:
        """:meth:`compute_log_probs` with the MoE routing options (an engine built with ``routing_replay``):
        ``replay_routing`` routes as ``batch.routed_experts`` says (R3, and the reference under R2/R3);
        ``record_routing`` returns the routers' choice (R2's old-log-prob pass)."""
        fields = self.routing_fields(batch, replay=replay_routing, record=record_routing)
        micro_batches = self.make_micro_batches(batch, fields, micro_batch_size=micro_batch_size,
                                                max_tokens=max_tokens)

        def loss(mb, output):
            log_probs, entropy = response_log_probs(output, mb, self.temperature, self.vocab_size)
            return output.new_zeros(()), {"log_probs": log_probs.detach(), "entropy": entropy.detach()}

        routed = mismatch = None
        with self.routing_pass(replay=replay_routing, record=record_routing) as routing:
            reported = self.run_micro_batches(micro_batches, loss=loss, forward_only=True)
            if record_routing:
                routed = routing.take_recorded(micro_batches, len(batch), batch.input_ids.shape[1],
                                               self.config.moe_router_topk)
            if "routed_experts" in fields:
                mismatch = routing.take_mismatch()
        shape = tuple(batch.response_ids.shape)
        log_probs = restore_row_order([r["log_probs"] for r in reported], micro_batches) if reported else None
        entropy = restore_row_order([r["entropy"] for r in reported], micro_batches) if reported else None
        return LogProbPass(self.broadcast_from_last_stage(log_probs, shape),
                           self.broadcast_from_last_stage(entropy, shape), routed, mismatch)


class ReferenceEngine(_LogProbMixin, MegatronEngine):
    """Frozen policy copy for KL: ``ReferenceEngine(model_provider=..., config=..., micro_batch_size=...)``."""

    def __init__(self, *, model_provider, config, micro_batch_size: int = 1, temperature: float = 1.0,
                 vocab_size: Optional[int] = None, micro_batching: MicroBatching = MicroBatching(),
                 routing_replay: bool = False):
        super().__init__(model_provider=model_provider, config=config, optimizer_config=None,
                         micro_batch_size=micro_batch_size, temperature=temperature, vocab_size=vocab_size,
                         micro_batching=micro_batching, routing_replay=routing_replay)


class ActorEngine(_LogProbMixin, MegatronEngine):
    """The trainable policy; constructor arguments are :class:`MegatronEngine`'s."""

    def update_policy(
        self,
        batch: TrainBatch,
        *,
        ppo_epochs: int = 1,
        mini_batch_size: Optional[int] = None,
        policy_loss_name: str = "ppo_clip",
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = 0.2,
        clip_ratio_c: Optional[float] = None,
        policy_loss_options: Optional[dict] = None,
        distillation: Optional[DistillationSpec] = None,
        entropy_coeff: float = 0.0,
        use_kl_loss: bool = False,
        kl_loss_coef: float = 0.0,
        kl_loss_type: str = "low_var_kl",
        loss_agg_mode: str = "token-mean",
        norm_length: Optional[int] = None,
        replay_routing: bool = False,
    ) -> dict[str, float]:
        """PPO loop over this DP shard. ``mini_batch_size`` is in local rows (default: the whole shard);
        each mini-batch is one optimizer step whose loss is normalised over all DP ranks' rows of that
        mini-batch. ``policy_loss_options``: the named loss's own settings (e.g. KL-Cov's ``kl_cov_ratio``).
        ``distillation``: on-policy distillation toward ``batch.teacher_log_probs``
        (:mod:`megarl.algorithms.distillation`), beside the task's policy loss or alone. ``replay_routing``
        (MoE, R2/R3): the routers take ``batch.routed_experts`` in every forward and recomputation.
        Returns metrics averaged over the steps: pg_loss, pg_clipfrac, pg_clipfrac_lower (dual clip
        active), ppo_kl, entropy, (kl_loss), loss, grad_norm, lr, and loss_tokens (the tokens the loss counted in one
        epoch over every DP rank's rows: what the loss mask let through)."""
        if not self.trainable:
            raise RuntimeError("update_policy needs an engine built with an optimizer_config")
        for name in ("old_log_probs", "advantages"):
            if getattr(batch, name) is None:
                raise ValueError(f"update_policy: batch.{name} is required")
        if use_kl_loss and batch.ref_log_probs is None:
            raise ValueError("update_policy: use_kl_loss=True needs batch.ref_log_probs")
        if distillation is not None and batch.teacher_log_probs is None:
            raise ValueError("update_policy: distillation needs batch.teacher_log_probs (the teachers' scores)")
        policy_loss = get_policy_loss(policy_loss_name)
        # a loss that compares with the reference itself (DPO) is handed its log-probs
        loss_reads_reference = "ref_log_probs" in inspect.signature(policy_loss).parameters
        if loss_reads_reference and batch.ref_log_probs is None:
            raise ValueError(f"update_policy: policy loss {policy_loss_name!r} needs batch.ref_log_probs")
        norm_length = norm_length or batch.response_ids.shape[1]
        fields = ("old_log_probs", "advantages") + (("ref_log_probs",) if use_kl_loss or loss_reads_reference else ())
        # rollout correction (megarl.algorithms.rollout_correction): importance weights on the policy loss, and
        # the tokens it rejected out of the loss and out of its token counts
        fields += tuple(name for name in ("rollout_is_weights", "loss_mask") if getattr(batch, name) is not None)
        fields += ("teacher_log_probs",) if distillation is not None else ()
        fields += self.routing_fields(batch, replay=replay_routing, compare=False)

        names = ["pg_loss", "entropy", "loss", "pg_clipfrac_wsum", "pg_clipfrac_lower_wsum", "ppo_kl_wsum"]
        if use_kl_loss:
            names.append("kl_loss")
        if distillation is not None:
            names += ["distillation_loss", "distillation_abs_wsum"]

        def make_loss(num_tokens, num_seqs):
            counts = dict(global_num_tokens=num_tokens, global_num_seqs=num_seqs, norm_length=norm_length)

            def loss(mb, output):
                log_probs, entropy = response_log_probs(output, mb, self.temperature, self.vocab_size)
                mask = mb["loss_mask"] if mb.get("loss_mask") is not None else mb["response_mask"]
                if mb.get("loss_mask") is not None and not bool(mask.any()):
                    # every token here was rejected: no loss, but a backward pass like its neighbours'
                    zero = log_probs.sum() * 0.0
                    return zero, {name: zero.detach() for name in names} | {"num_tokens": mask.sum()}
                pg_loss, pg_metrics = policy_loss(
                    log_probs=log_probs, old_log_probs=mb["old_log_probs"], advantages=mb["advantages"],
                    response_mask=mask, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                    clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                    rollout_is_weights=mb.get("rollout_is_weights"), **counts, **(policy_loss_options or {}),
                    **({"ref_log_probs": mb["ref_log_probs"]} if loss_reads_reference else {}),
                )
                entropy_share = aggregate_loss(entropy, mask, loss_agg_mode, **counts)
                total = pg_loss
                n_tok = mask.sum()
                distilled = {}
                if distillation is not None:
                    d_loss, d_metrics = distillation_loss(
                        log_probs=log_probs, teacher_log_probs=mb["teacher_log_probs"],
                        old_log_probs=mb["old_log_probs"], response_mask=mask, spec=distillation,
                        loss_agg_mode=loss_agg_mode, rollout_is_weights=mb.get("rollout_is_weights"), **counts)
                    total = distillation.task_weight * pg_loss + distillation.weight * d_loss
                    distilled = {"distillation_loss": d_loss.detach(),
                                 "distillation_abs_wsum": n_tok * d_metrics["distillation/abs_loss"]}
                if entropy_coeff:
                    total = total - entropy_coeff * entropy_share
                reported = {
                    "pg_loss": pg_loss.detach(), "entropy": entropy_share.detach(),
                    "pg_clipfrac_wsum": n_tok * pg_metrics["pg_clipfrac"],
                    "pg_clipfrac_lower_wsum": n_tok * pg_metrics["pg_clipfrac_lower"],
                    "ppo_kl_wsum": n_tok * pg_metrics["ppo_kl"], "num_tokens": n_tok, **distilled,
                }
                if use_kl_loss:
                    kl = kl_penalty(log_probs, mb["ref_log_probs"], kl_loss_type)
                    kl_share = aggregate_loss(kl, mask, loss_agg_mode, **counts)
                    total = total + kl_loss_coef * kl_share
                    reported["kl_loss"] = kl_share.detach()
                reported["loss"] = total.detach()
                return total, reported
            return loss

        with self.routing_pass(replay=replay_routing):
            steps = self.train_epochs(
                batch, ppo_epochs=ppo_epochs, mini_batch_size=mini_batch_size,
                counted_mask=lambda mini: mini.response_mask if mini.loss_mask is None else mini.loss_mask,
                fields=lambda mini: fields, make_loss=make_loss, names=names)
        # the tokens the loss counted over the whole batch (all DP ranks) in one epoch: what the loss mask let in
        per_epoch = len(steps) // ppo_epochs
        loss_tokens = float(sum(step["num_tokens"] for step in steps[:per_epoch]))
        for step in steps:
            step["loss_tokens"] = step.pop("num_tokens")
        result = average_metrics(steps)
        result["loss_tokens"] = loss_tokens
        return result
