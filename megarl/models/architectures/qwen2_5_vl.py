"""Qwen2.5-VL: a Qwen2 language model with multimodal RoPE, and a vision tower (:mod:`megarl.models.vision_language`).

The checkpoint keeps Qwen2's names for the language model (``model.layers.*``, ``model.embed_tokens``,
``model.norm``, ``lm_head``; transformers 5 renames them in memory, never on disk) and ``visual.*`` for the tower,
which megatron holds as ``vision_model.*`` with the same names below it, replicated over tensor parallelism.
M-RoPE's ``mrope_section`` (rotary frequencies per axis: temporal, height, width) goes to megatron's
``TransformerConfig``. Left out as the Qwen2 decoder leaves them out: sliding-window attention.
"""

from __future__ import annotations

from typing import Any

from megarl.models.architectures.base import Architecture
from megarl.models.architectures.llama import Qwen2Architecture, dense_transformer_kwargs
from megarl.models.hf_config import read_rope
from megarl.models.model_dims import ModelDims, VisionDims
from megarl.models.vision_language import VISION_PREFIX
from megarl.models.weight_mapping import ParamRule

HF_VISION_PREFIX = "visual."


def vision_tensor_names(vision: VisionDims) -> list[str]:
    """The tower's parameters below its prefix, in module order (what transformers' module holds)."""
    names = ["patch_embed.proj.weight"]
    for block in range(vision.depth):
        b = f"blocks.{block}."
        names += [b + "norm1.weight", b + "norm2.weight"]
        names += [b + f"attn.{linear}.{kind}" for linear in ("qkv", "proj") for kind in ("weight", "bias")]
        names += [b + f"mlp.{linear}.{kind}" for linear in ("gate_proj", "up_proj", "down_proj")
                  for kind in ("weight", "bias")]
    names += ["merger.ln_q.weight"] + [f"merger.mlp.{i}.{kind}" for i in (0, 2) for kind in ("weight", "bias")]
    return names


class Qwen2_5_VLArchitecture(Architecture):
    hf_architecture = "Qwen2_5_VLForConditionalGeneration"
    model_type = "qwen2_5_vl"

    @staticmethod
    def text_config(hf: Any) -> Any:
        """The language model's fields: ``text_config`` (transformers fills it from a flat config.json too), or
        the top level of a flat config.json read as it is (the converters' and planner's
        :class:`~megarl.models.hf_config.ConfigFields`)."""
        return getattr(hf, "text_config", None) or hf

    def refuse_unsupported(self, hf: Any) -> None:
        Qwen2Architecture().refuse_unsupported(self.text_config(hf))
        rope = read_rope(self.text_config(hf))
        if rope["rope_type"] not in ("default", "mrope") or not rope.get("mrope_section"):
            raise ValueError(f"Qwen2.5-VL text_config rope {rope!r}: megarl builds M-RoPE with an mrope_section")

    def transformer_config_kwargs(self, hf: Any) -> dict[str, Any]:
        dims = self.read_dims(hf)
        kwargs = dense_transformer_kwargs(self.text_config(hf), dims)
        kwargs["mrope_section"] = [int(v) for v in read_rope(self.text_config(hf))["mrope_section"]]
        return kwargs

    def gpt_model_kwargs(self, hf: Any) -> dict[str, Any]:
        text = self.text_config(hf)
        return dict(position_embedding_type="mrope", rotary_base=read_rope(text)["rope_theta"],
                    max_sequence_length=getattr(text, "max_position_embeddings", 4096))

    def extra_param_rules(self, dims: ModelDims) -> list[ParamRule]:
        return [ParamRule(VISION_PREFIX + name, (HF_VISION_PREFIX + name,))
                for name in vision_tensor_names(dims.vision)]

    def build_model(self, hf: Any, *, params_dtype, **gpt_kwargs):
        from megarl.models.vision_language import vision_language_gpt_model

        return vision_language_gpt_model(hf_config=hf, params_dtype=params_dtype, **gpt_kwargs)
