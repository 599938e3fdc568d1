"""``RewardModelWorker``: one rank of the reward model group (``reward_model.enable``).

A frozen Megatron reward model (:mod:`megarl.engines.megatron.reward_model`) at its own layout
(``reward_model.megatron``), loaded from a HF ``*ForSequenceClassification`` checkpoint through the bridge.
It shares the actor's GPUs (a share of each bundle, like the critic) or has its own pool
(``reward_model.enable_resource_pool``). With ``reward_model.megatron.param_offload`` its weights leave the
device between scorings, so colocated it holds device memory only while it scores.
"""

from __future__ import annotations

import torch

from megarl.batch import MODEL_INPUTS, TrainBatch
from megarl.config.schema import MegarlConfig
from megarl.controller.dispatch import Collect, Dispatch, register
from megarl.controller.megatron_role import MegatronRole, fitting_micro_batch
from megarl.engines.megatron.micro_batches import MicroBatching


class RewardModelWorker(MegatronRole):
    def __init__(self, cfg: MegarlConfig):
        from megarl.engines.megatron.reward_model import RewardModelEngine

        rm = cfg.reward_model
        self._bring_up(cfg, rm.megatron, rm.model.path)
        if self.bridge.head != "score":
            raise ValueError(f"reward_model.model.path={rm.model.path!r} is a {self.bridge.hf_architecture}; a "
                             f"reward model is a *ForSequenceClassification with num_labels=1")
        config = self._new_transformer_config()
        self.engine = RewardModelEngine(
            model_provider=self._provider(config, tie_embeddings=False), config=config,
            micro_batch_size=rm.micro_batch_size_per_gpu,
            micro_batching=MicroBatching(rm.use_dynamic_bsz,
                                         rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None))
        self._load_hf(self.engine)
        self.offloaded = None
        if rm.megatron.param_offload:
            self._offload_engine()

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP_COLLECT, reads=MODEL_INPUTS)
    def compute_rm_scores(self, batch: TrainBatch) -> torch.Tensor:
        """One score per row of this DP shard (fp32, on the CPU for the driver)."""
        rm = self.cfg.reward_model
        with self._engine_on_device(offload_after=rm.megatron.param_offload):
            micro = fitting_micro_batch(len(batch), rm.micro_batch_size_per_gpu)
            return self.engine.compute_scores(batch, micro_batch_size=micro).cpu()
