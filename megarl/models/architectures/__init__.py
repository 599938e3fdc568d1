"""Registry of supported HF architectures (the config's ``architectures[0]``) -> :class:`Architecture`."""

from megarl.models.architectures.base import Architecture
from megarl.models.architectures.deepseek_v3 import DeepseekV3Architecture
from megarl.models.architectures.llama import LlamaArchitecture, Qwen2Architecture, Qwen3Architecture
from megarl.models.architectures.qwen2_5_vl import Qwen2_5_VLArchitecture
from megarl.models.architectures.qwen3_moe import Qwen3MoeArchitecture

ARCHITECTURES: dict[str, type[Architecture]] = {
    cls.hf_architecture: cls
    for cls in (LlamaArchitecture, Qwen2Architecture, Qwen3Architecture, Qwen3MoeArchitecture, DeepseekV3Architecture,
                Qwen2_5_VLArchitecture)
}


def architecture_for(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported HF architecture {name!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]()


__all__ = ["ARCHITECTURES", "Architecture", "architecture_for"]
