"""How a model is split over ranks (TP/PP/VPP/CP/EP/ETP): read by the bridge to shard weights and by the
engines to build megatron's process groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline_parallel: Optional[int] = None
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: Optional[int] = None

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    def data_parallel(self, world_size: int) -> int:
        if world_size % self.model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_parallel*pipeline_parallel*"
                f"context_parallel = {self.tensor_parallel}*{self.pipeline_parallel}*{self.context_parallel}"
            )
        return world_size // self.model_parallel
