"""``TeacherWorker``: one rank of a teacher's group (on-policy distillation, ``distillation.enabled``).

A frozen Megatron engine of the teacher's own model and layout (``distillation.teacher_models.<name>.megatron``),
loaded from its HF checkpoint through the bridge, that scores the student's rollouts: the log-prob of every
sampled response token, at the rollout's temperature (the student's log-probs in the loss are taken at the
same one). It shares the actor's GPUs (a share of each bundle, like the critic) or the teachers' own pool
(``distillation.n_gpus_per_node`` > 0); with ``megatron.param_offload`` its weights leave the device between
scorings, so a teacher larger than the student only holds device memory while it scores.
"""

from __future__ import annotations

import torch

from megarl.batch import MODEL_INPUTS, TrainBatch
from megarl.config.schema import MegarlConfig
from megarl.controller.dispatch import Collect, Dispatch, register
from megarl.controller.megatron_role import MegatronRole, fitting_micro_batch
from megarl.engines.megatron.micro_batches import MicroBatching


class TeacherWorker(MegatronRole):
    def __init__(self, cfg: MegarlConfig, *, teacher: str):
        from megarl.engines.megatron.actor import ReferenceEngine

        spec = cfg.distillation.teacher_models[teacher]
        self.teacher = teacher
        self._bring_up(cfg, spec.megatron, spec.model_path)
        config = self._new_transformer_config()
        self.engine = ReferenceEngine(
            model_provider=self._provider(config), config=config, micro_batch_size=spec.micro_batch_size_per_gpu,
            temperature=cfg.actor_rollout_ref.rollout.temperature or 1.0, vocab_size=self.bridge.dims.vocab_size,
            micro_batching=MicroBatching(spec.use_sequence_packing, spec.log_prob_max_token_len_per_gpu))
        self._load_hf(self.engine)
        self.offloaded = None
        if spec.megatron.param_offload:
            self._offload_engine()

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP_COLLECT, reads=MODEL_INPUTS)
    def compute_teacher_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, R]`` fp32 log-probs of this DP shard's response tokens under the teacher (on the CPU)."""
        spec = self.cfg.distillation.teacher_models[self.teacher]
        with self._engine_on_device(offload_after=spec.megatron.param_offload):
            micro = fitting_micro_batch(len(batch), spec.micro_batch_size_per_gpu)
            log_probs, _ = self.engine.compute_log_probs(batch, micro_batch_size=micro)
        return log_probs.cpu()
