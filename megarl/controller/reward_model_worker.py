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
from megarl.controller.megatron_role import MegatronRole
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
            self._offload()

    def _offload(self) -> None:
        from megarl.engines.megatron.offload import offload_engine

        self.offloaded = offload_engine(self.engine, params=True, grads=False, optimizer=False)

    @register(dispatch=Dispatch.DP_SPLIT, collect=Collect.DP_COLLECT, reads=MODEL_INPUTS)
    def compute_rm_scores(self, batch: TrainBatch) -> torch.Tensor:
        """One score per row of this DP shard (fp32, on the CPU for the driver)."""
        from megarl.engines.megatron.offload import reload_engine

        if self.offloaded is not None:
            reload_engine(self.offloaded)
            self.offloaded = None
        rows = len(batch)
        micro = self.cfg.reward_model.micro_batch_size_per_gpu
        # fixed-row micro-batches must divide the shard: the largest size up to the configured one that does
        micro = next(size for size in range(min(micro, rows), 0, -1) if rows % size == 0)
        scores = self.engine.compute_scores(batch, micro_batch_size=micro).cpu()
        if self.cfg.reward_model.megatron.param_offload:
            self._offload()
        return scores
