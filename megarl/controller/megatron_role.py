"""What every Megatron worker class shares: joining torch.distributed and megatron's groups, the model bridge,
the transformer config and model provider for the role's layout, loading HF weights, tear-down."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from megarl.config.schema import MegarlConfig, MegatronConfig
from megarl.controller.dispatch import DPInfo
from megarl.controller.engine_specs import DTYPES, transformer_overrides
from megarl.controller.profiling import ProfiledWorker
from megarl.controller.debugging import collective_timeout_s
from megarl.controller.worker_env import init_torch_distributed
from megarl.engines.megatron.parallel import initialize_megatron_parallel
from megarl.models.bridge import unwrap_model
from megarl.models.parallel_layout import ParallelLayout


def fitting_micro_batch(rows: int, configured: int) -> int:
    """Fixed-row micro-batches must divide a shard: the largest size up to the configured one that does."""
    return next(size for size in range(min(configured, rows), 0, -1) if rows % size == 0)


class MegatronRole(ProfiledWorker):
    """Distributed + megatron bring-up shared by the worker classes."""

    def _bring_up(self, cfg: MegarlConfig, megatron: MegatronConfig, model_path: str, *, lora: bool = False) -> None:
        from megarl.models.bridge import ModelBridge
        from megarl.models.embedded import resolve_model_path

        self.cfg = cfg
        self.context = init_torch_distributed(timeout_s=collective_timeout_s(cfg.trainer.worker_timeout_s))
        self.layout = ParallelLayout.from_megatron_config(megatron)
        self.rank_info = initialize_megatron_parallel(layout=self.layout, seed=megatron.seed)
        self.model_path = str(resolve_model_path(model_path))
        spec = cfg.actor_rollout_ref.model.layer_spec
        if (megatron.context_parallel_size > 1 or lora) and spec == "auto":
            # context parallelism is megarl's SDPA attention, not Transformer Engine's; LoRA adapts megatron's
            # own parallel linears (TE fuses the layernorm into the linear the adapter would read)
            spec = "local"
        self.bridge = ModelBridge.from_hf_config(self.model_path, spec=spec)
        self.params_dtype = DTYPES[megatron.params_dtype]
        self.megatron = megatron

    def _new_transformer_config(self):
        return self.bridge.transformer_config(layout=self.layout, params_dtype=self.params_dtype,
                                              **transformer_overrides(self.megatron))

    def _provider(self, config, *, tie_embeddings: Optional[bool] = None, train_vision_tower: bool = False):
        """``train_vision_tower``: a vision-language model's tower trains with the rest (it is built frozen)."""
        def build(pre_process: bool, post_process: bool, vp_stage: Optional[int] = None):
            return self.bridge.build_model(config=config, pre_process=pre_process, post_process=post_process,
                                           vp_stage=vp_stage, tie_embeddings=tie_embeddings,
                                           train_vision_tower=train_vision_tower)
        return build

    def _load_hf(self, engine) -> None:
        """The initial weights: the HF checkpoint, or (``megatron.use_dist_checkpointing``) a torch_dist
        checkpoint at whatever layout it was written, resharded by megatron onto this one."""
        if self.megatron.use_dist_checkpointing:
            from megarl.engines.megatron.checkpoint import load_checkpoint

            load_checkpoint(engine, self.megatron.dist_checkpointing_path, load_optimizer=False, load_rng=False)
        else:
            from megarl.models.hf_checkpoint import load_hf_weights

            load_hf_weights([unwrap_model(chunk) for chunk in engine.model], self.model_path, self.bridge)
        if getattr(engine, "optimizer", None) is not None:  # fp32 main params must see the loaded weights
            engine.optimizer.reload_model_params()

    # ---------------------------------------------------------------- a frozen engine that scores (RM, teacher)
    def _offload_engine(self) -> None:
        """``self.engine``'s weights off the device until :meth:`_engine_on_device` needs them again."""
        from megarl.engines.megatron.offload import offload_engine

        self.offloaded = offload_engine(self.engine, params=True, grads=False, optimizer=False)

    @contextlib.contextmanager
    def _engine_on_device(self, *, offload_after: bool) -> Iterator[None]:
        """``self.engine`` on the device for the block; off it again afterwards with ``offload_after``, so a
        colocated scorer holds device memory only while it scores."""
        from megarl.engines.megatron.offload import reload_engine

        if getattr(self, "offloaded", None) is not None:
            reload_engine(self.offloaded)
            self.offloaded = None
        yield
        if offload_after:
            self._offload_engine()

    def close(self) -> None:
        """Tear down megatron's groups and the process group (a Ray worker just exits instead)."""
        from megarl.engines.megatron.parallel import destroy_megatron_parallel

        rollout = getattr(self, "rollout", None)
        if rollout is not None:
            rollout.shutdown()
        destroy_megatron_parallel()

    def get_dp_info(self) -> DPInfo:
        return DPInfo(self.rank_info.dp_rank, self.rank_info.dp_size, self.rank_info.is_collect_rank)
