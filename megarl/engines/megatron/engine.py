"""The Megatron training engine core: optimizer, micro-batched fwd/bwd, the PPO epoch loop.

``MegatronEngine`` owns what every megatron-backed role shares:

* model chunks (:mod:`megarl.engines.megatron.model_chunks`) built by a
  ``model_provider(pre_process, post_process, vp_stage)`` callable, one per virtual pipeline stage, wrapped
  in megatron's ``DistributedDataParallel`` when trainable;
* ``get_megatron_optimizer`` (Adam/SGD, fp32 or bf16 with fp32 main params, distributed optimizer,
  weight decay, gradient clipping, all from a megatron ``OptimizerConfig``) and the LR schedule
  (:mod:`megarl.engines.megatron.lr_schedule`);
* :meth:`MegatronEngine.make_micro_batches`: a ``TrainBatch`` shard as micro-batches, padded rows or
  packed ``thd`` streams (optionally grouped by a token budget; :mod:`megarl.engines.megatron.micro_batches`);
* :meth:`MegatronEngine.train_epochs`: the PPO epoch x mini-batch loop the actor and the critic share (one
  optimizer step per mini-batch, the loss normalised by a role-chosen token count over DP);
* :meth:`MegatronEngine.run_micro_batches`: those micro-batches driven by ``get_forward_backward_func()``
  with megatron's ``forward_step_func(data_iterator, model) -> (output, loss_func)`` contract, for any
  PP/VPP (with VPP the micro-batch count must suit megatron's interleaved grouping, by default a multiple
  of PP; checked up front). Only the last pipeline stage
  computes a loss, from its vocab-sharded logits; what the loss reports is broadcast to every rank of the
  model-parallel replica.

Loss normalisation: every micro-batch loss is its share of the full (mini-)batch loss, i.e. it is divided
by the token/sequence count of the whole optimizer step over all micro-batches and DP ranks. The schedule
divides each micro-batch loss by the number of micro-batches and megatron's DDP averages gradients over
DP; both are undone (the loss fed to backward is multiplied by ``num_microbatches * dp_size``), so the
accumulated gradient is exactly the gradient of the full-batch loss.

Batches: each DP rank receives its own shard (the controller splits by ``dp_rank``); all TP/PP ranks of
one replica receive the same shard; with a token budget the number of micro-batches may differ between DP
ranks (gradients are reduced once, after the last one).

Context parallelism: the CP ranks of a replica receive the same shard; each runs its share of every
sequence (:func:`~megarl.engines.megatron.packing.shard_for_context_parallel`) and the per-token results
(log-probs, entropy, values) are gathered back into whole rows before the loss, so losses and metrics are
those of CP=1. A packed micro-batch's token budget is per GPU: one micro-batch holds ``cp`` times as many
tokens (each row rounded up to a multiple of ``2 * cp``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from functools import partial
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from megarl.batch import TrainBatch, select_rows
from megarl.engines.megatron.lr_schedule import LRScheduleConfig, build_lr_scheduler
from megarl.engines.megatron.micro_batches import MicroBatching, check_mini_batches, make_micro_batches
from megarl.engines.megatron.model_chunks import ModelProvider, build_model_chunks
from megarl.engines.megatron.parallel import current_rank_info, device_for_this_process
from megarl.engines.megatron.routing_replay import RoutingReplay
from megarl.models.cpu_compat import cuda_tensors_on_cpu
from megarl.models.vision_language import image_tokens_of
# loss(micro_batch, output_of_last_stage) -> (scalar share of the step loss, {name: detached tensor})
MicroBatchLoss = Callable[[dict, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class MegatronEngine:
    """Model chunks + (optionally) optimizer and LR schedule on one rank; see the module docstring.

    Constructed on every rank of the world after :func:`initialize_megatron_parallel`. ``optimizer_config``
    None means a frozen engine (no DDP, no optimizer, parameters do not require grad). ``lora``: LoRA adapters
    (:mod:`megarl.models.lora`) on a frozen base; DDP, the optimizer and checkpoints then hold the adapters only.
    ``routing_replay``: an MoE model's routers can replay, record and compare routing
    (:mod:`megarl.engines.megatron.routing_replay`; ``self.routing``).
    """

    def __init__(
        self,
        *,
        model_provider: ModelProvider,
        config,
        optimizer_config=None,
        lr_schedule: Optional[LRScheduleConfig] = None,
        ddp_config=None,
        micro_batch_size: int = 1,
        temperature: float = 1.0,
        chunk_hook: Optional[Callable[[torch.nn.Module, bool], None]] = None,
        vocab_size: Optional[int] = None,
        micro_batching: MicroBatching = MicroBatching(),
        lora=None,
        routing_replay: bool = False,
    ):
        from megatron.core import parallel_state as mpu

        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.config = config
        self.micro_batch_size = micro_batch_size
        self.micro_batching = micro_batching
        self.temperature = temperature
        self.vocab_size = vocab_size  # unpadded; None when the model has no vocabulary padding
        self.trainable = optimizer_config is not None
        self.lora = lora
        self.rank_info = current_rank_info()
        if mpu.get_pipeline_model_parallel_world_size() > 1 and config.pipeline_dtype is None:
            config.pipeline_dtype = config.params_dtype
        # Every weight in params_dtype, as megatron-LM's Float16Module (and Transformer Engine's norms), HF and
        # vLLM hold a bf16 model: the local spec's torch norms would otherwise make fp32 weights in a bf16
        # model, which megatron's optimizers mishandle (the plain bf16 optimizer's checkpoint maps optimizer
        # state to the wrong parameters; the CPU-offloaded one is handed non-leaf views of them).
        with cuda_tensors_on_cpu():
            self.model = build_model_chunks(
                model_provider=model_provider, config=config, ddp_config=ddp_config,
                wrap_with_ddp=self.trainable, chunk_hook=chunk_hook, one_dtype=config.params_dtype, lora=lora,
            )
        self.image_tokens = image_tokens_of(self.model[0])  # a vision-language model's, else None
        self.routing = None
        if routing_replay:
            if not getattr(config, "num_moe_experts", None):
                raise ValueError("router_replay needs an MoE model (mode R2 / R3); this one has no routed experts")
            self.routing = RoutingReplay(self.model, config)
        self.optimizer = None
        self.lr_scheduler = None
        if self.trainable:
            self._setup_optimizer(optimizer_config, lr_schedule or LRScheduleConfig())
        else:
            for chunk in self.model:
                chunk.requires_grad_(False)
                chunk.eval()

    def _setup_optimizer(self, optimizer_config, lr_schedule: LRScheduleConfig) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer

        if self.model[0].ddp_config.use_distributed_optimizer != optimizer_config.use_distributed_optimizer:
            raise ValueError(
                "ddp_config.use_distributed_optimizer must equal optimizer_config.use_distributed_optimizer"
            )
        # Megatron's param groups carry their own min_lr (read by the scheduler); keep one source of truth.
        optimizer_config = dataclasses.replace(optimizer_config, min_lr=lr_schedule.min_lr)
        self.optimizer_config = optimizer_config
        with cuda_tensors_on_cpu():
            self.optimizer = get_megatron_optimizer(optimizer_config, self.model)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, optimizer_config, lr_schedule)
        # The schedule calls these at the end of backward: DP grad all-reduce, tied-embedding and
        # sequence-parallel layernorm grad reductions.
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = [chunk.no_sync for chunk in self.model]
        if len(self.model) == 1:
            self.config.no_sync_func = self.config.no_sync_func[0]

    # ------------------------------------------------------------------ fwd/bwd

    @contextlib.contextmanager
    def routing_pass(self, *, replay: bool = False, record: bool = False):
        """The MoE routers' behaviour for the passes inside: ``replay`` the micro-batches' ``routed_experts``,
        ``record`` the routers' own choice (:class:`RoutingReplay`); yields ``self.routing``."""
        if self.routing is None:
            if replay or record:
                raise RuntimeError("routing replay was asked of an engine built without it (routing_replay=False)")
            yield None
            return
        self.routing.start(replay=replay, record=record)
        try:
            yield self.routing
        finally:
            self.routing.finish()

    def routing_fields(self, batch: TrainBatch, *, replay: bool = False, record: bool = False,
                       compare: bool = True) -> tuple[str, ...]:
        """The whole-sequence fields a pass needs: the batch's routing when replayed, or (``compare``, by an engine
        that can) to count how often the routers choose otherwise; the token codes when recorded."""
        if replay and batch.routed_experts is None:
            raise ValueError("routing replay needs batch.routed_experts (the rollout engine's routing, "
                             "actor_rollout_ref.rollout.enable_rollout_routing_replay, or R2's recorded one)")
        carried = replay or (compare and self.routing is not None and batch.routed_experts is not None)
        return (("routed_experts",) if carried else ()) + (("token_codes",) if record else ())

    @property
    def fixed_micro_batch_size(self) -> Optional[int]:
        """Rows per training micro-batch, or None when a token budget decides."""
        packing = self.micro_batching
        return None if packing.sequence_packing and packing.max_tokens_per_micro_batch else self.micro_batch_size

    def make_micro_batches(self, batch: TrainBatch, fields: Iterable[str] = (), *,
                           micro_batch_size: Optional[int] = None,
                           max_tokens: Optional[int] = None) -> list[dict]:
        """This rank's micro-batches of ``batch`` in the engine's layout (:func:`make_micro_batches`), by default
        with the engine's micro-batch size and token budget; the per-token ``fields`` ride along."""
        from megatron.core import parallel_state as mpu

        interleaved = len(self.model) > 1
        pp = mpu.get_pipeline_model_parallel_world_size()
        group = (self.config.microbatch_group_size_per_vp_stage or pp) if interleaved else 1
        return make_micro_batches(batch, fields, micro_batching=self.micro_batching,
                                  micro_batch_size=micro_batch_size or self.micro_batch_size, max_tokens=max_tokens,
                                  interleave_group=group, image_tokens=self.image_tokens)

    def run_micro_batches(
        self, micro_batches: list[dict], *, loss: MicroBatchLoss, forward_only: bool,
    ) -> list[dict[str, torch.Tensor]]:
        """Drive megatron's schedule over ``micro_batches``; returns ``loss``'s reported dicts per micro-batch
        on the last pipeline stage and an empty list elsewhere. ``loss`` returns the step-loss share."""
        from megatron.core import parallel_state as mpu
        from megatron.core.pipeline_parallel import get_forward_backward_func

        num_mb = len(micro_batches)
        dp_size = mpu.get_data_parallel_world_size()
        if len(self.model) > 1:
            self._check_interleaved_micro_batches(num_mb, micro_batches[0]["input_ids"].shape[0])

        def loss_func(mb, output):
            share, reported = loss(mb, output)
            # Undo the schedule's 1/num_microbatches and DDP's 1/dp averaging: grads must SUM shares.
            return share * (num_mb * dp_size), reported

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if self.routing is not None:
                self.routing.before_forward(model, mb)
            output = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"],
                           attention_mask=mb["attention_mask"], packed_seq_params=mb.get("packed_seq_params"),
                           **mb.get("images", {}))
            if self.routing is not None:
                self.routing.after_forward(model)
            return output, partial(loss_func, mb)

        # megatron's schedule wants the full sequence length and divides it by CP itself
        seq_length = micro_batches[0]["input_ids"].shape[1] * mpu.get_context_parallel_world_size()
        local_length = micro_batches[0]["input_ids"].shape[1]
        if self.config.sequence_parallel and local_length % mpu.get_tensor_model_parallel_world_size():
            raise ValueError(f"sequence_parallel needs the sequence length per CP rank ({local_length}) "
                             f"divisible by tensor_parallel")
        if (mpu.get_pipeline_model_parallel_world_size() > 1
                and len({mb["input_ids"].shape for mb in micro_batches}) > 1):
            raise ValueError("pipeline stages exchange one activation shape per step: every micro-batch "
                             "must have the same input shape")
        if self.routing is not None:
            self.routing.new_schedule()
        iterators = [iter(micro_batches) for _ in self.model]
        for chunk in self.model:
            chunk.train(not forward_only)
        grad_context = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad_context, cuda_tensors_on_cpu():
            reported = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=self.model if len(self.model) > 1 else self.model[0],
                num_microbatches=num_mb,
                seq_length=seq_length,
                micro_batch_size=micro_batches[0]["input_ids"].shape[0],
                forward_only=forward_only,
            )
        return list(reported) if mpu.is_pipeline_last_stage(ignore_virtual=True) else []

    def _check_interleaved_micro_batches(self, num_mb: int, micro_batch_size: int) -> None:
        """Megatron's interleaved schedule runs micro-batches in groups of
        ``microbatch_group_size_per_vp_stage`` (default: PP); refuse, naming our knobs, what it would
        refuse deep inside the schedule (and on every rank at once, so no rank is left in a collective)."""
        from megatron.core import parallel_state as mpu

        pp = mpu.get_pipeline_model_parallel_world_size()
        group = self.config.microbatch_group_size_per_vp_stage or pp
        remainder = num_mb % group
        if num_mb < group or 0 < remainder < pp:
            raise ValueError(
                f"virtual pipeline parallelism runs micro-batches in groups of {group} "
                f"(microbatch_group_size_per_vp_stage, pipeline_parallel={pp}); this batch gives {num_mb} "
                f"micro-batch(es) of micro_batch_size={micro_batch_size} rows: use at least {group} "
                f"micro-batches per step, a multiple of {group} (or leaving a remainder >= {pp})"
            )

    def train_epochs(self, batch: TrainBatch, *, ppo_epochs: int, mini_batch_size: Optional[int],
                     counted_mask: Callable[[TrainBatch], torch.Tensor], fields: Callable[[TrainBatch], tuple],
                     make_loss: Callable[[float, float], MicroBatchLoss], names: list[str]) -> list[dict[str, float]]:
        """The PPO loop every trainable role runs: ``ppo_epochs`` x mini-batches of ``mini_batch_size`` local rows
        (default: the whole shard), one optimizer step each, the LR schedule advanced once at the end. Per
        mini-batch: the tokens and sequences of ``counted_mask(mini)`` summed over DP (the loss's normaliser,
        handed to ``make_loss(num_tokens, num_seqs)``), the micro-batches with ``fields(mini)`` riding along, and
        the reported ``names`` reduced. Returns each step's metrics (with ``num_tokens``, the step's count)."""
        rows = len(batch)
        mini_batch_size = mini_batch_size or rows
        num_mini = check_mini_batches(rows, mini_batch_size, self.fixed_micro_batch_size)
        steps = []
        for _ in range(ppo_epochs):
            for index in range(num_mini):
                mini = select_rows(batch, slice(index * mini_batch_size, (index + 1) * mini_batch_size))
                num_tokens, num_seqs = self.global_counts(counted_mask(mini).float())
                self.zero_grad()
                micro_batches = self.make_micro_batches(mini, fields(mini))
                reported = self.run_micro_batches(micro_batches, loss=make_loss(num_tokens, num_seqs),
                                                  forward_only=False)
                metrics = self.reduce_step_metrics(reported, names)
                metrics.update(self.optimizer_step())
                metrics["num_tokens"] = num_tokens
                steps.append(metrics)
        self.advance_lr_schedule()
        return steps

    def zero_grad(self) -> None:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> dict[str, float]:
        """One optimizer step (one mini-batch); returns grad_norm (pre-clip, global), the lr used and the step's
        wall time (``optimizer_step_s``: with megatron's CPU-offloaded optimizer, the host's Adam and the copies
        both ways, which the update's MFU must be read beside). The LR schedule does not move here: see
        :meth:`advance_lr_schedule`."""
        lr = self.optimizer.param_groups[0]["lr"]
        on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if on_cuda:
            torch.cuda.synchronize()  # the backward's kernels are not the step's
        start = time.perf_counter()
        with cuda_tensors_on_cpu():
            success, grad_norm, _ = self.optimizer.step()
        if on_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if not success:
            raise FloatingPointError("megatron optimizer step was skipped (inf/nan gradients)")
        return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "lr": float(lr),
                "optimizer_step_s": seconds}

    def advance_lr_schedule(self) -> None:
        """One step of the LR schedule per training step (one ``update_*`` call), whatever its number of
        mini-batches and epochs: the unit verl uses, so ``optim.lr_warmup_steps``/``lr_decay_steps`` count
        training steps and a schedule over ``trainer.total_training_steps`` ends with the run."""
        self.lr_scheduler.step(increment=1)

    # ------------------------------------------------------------------ collectives over the replica

    def broadcast_from_last_stage(self, tensor: Optional[torch.Tensor], shape, dtype=torch.float32) -> torch.Tensor:
        """The last pipeline stage's ``tensor`` on every PP rank (TP ranks of that stage already agree)."""
        from megatron.core import parallel_state as mpu

        if mpu.get_pipeline_model_parallel_world_size() == 1:
            return tensor
        if not mpu.is_pipeline_last_stage(ignore_virtual=True):
            tensor = torch.empty(shape, dtype=dtype, device=device_for_this_process())
        tensor = tensor.contiguous()
        dist.broadcast(tensor, src=mpu.get_pipeline_model_parallel_last_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
        return tensor

    def global_counts(self, response_mask: torch.Tensor) -> tuple[float, float]:
        """(tokens, sequences with >= 1 token) of this step summed over the DP group."""
        from megatron.core import parallel_state as mpu

        counts = torch.tensor([response_mask.sum().item(), (response_mask.sum(-1) > 0).sum().item()],
                              dtype=torch.float64, device=device_for_this_process())
        dist.all_reduce(counts, group=mpu.get_data_parallel_group())
        return float(counts[0]), float(counts[1])

    def reduce_step_metrics(self, reported: list[dict[str, torch.Tensor]], names: list[str]) -> dict[str, float]:
        """Sum the per-micro-batch entries (shares or token-weighted sums) over micro-batches and DP, divide
        the ``*_wsum`` entries by the summed ``num_tokens`` and broadcast the result over PP."""
        from megatron.core import parallel_state as mpu

        keys = names + ["num_tokens"]
        local = torch.zeros(len(keys), dtype=torch.float64, device=device_for_this_process())
        for entry in reported:
            local += torch.stack([entry[k].double().reshape(()) for k in keys])
        local = self.broadcast_from_last_stage(local if reported else None, (len(keys),), torch.float64)
        dist.all_reduce(local, group=mpu.get_data_parallel_group())
        totals = dict(zip(keys, local.tolist()))
        out = {}
        for name in names:
            if name.endswith("_wsum"):
                out[name[: -len("_wsum")]] = totals[name] / max(totals["num_tokens"], 1.0)
            else:
                out[name] = totals[name]
        return out


def average_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """The steps' metrics averaged, but wall times (``*_s``, e.g. ``optimizer_step_s``) summed: the update's."""
    if not steps:
        return {}
    return {k: sum(s[k] for s in steps) / (1 if k.endswith("_s") else len(steps)) for k in steps[0]}
