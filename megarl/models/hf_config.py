"""Turn what a caller hands us (a transformers config, a dict, or a model directory) into one
``transformers.PretrainedConfig``, and read its RoPE settings across transformers versions.

:class:`ConfigFields` is the other way in: config.json's own fields, without transformers (whose config
classes cost seconds to import: 4-10 s on the GPU machine, docs/benchmarks.md). The converters use it to plan
a checkpoint's keys and shapes, which the weights then confirm.

transformers 5 keeps RoPE in ``config.rope_parameters`` (``rope_theta`` + ``rope_type`` + type
fields); transformers 4 keeps ``rope_theta`` and ``rope_scaling``. :func:`read_rope` returns one dict
for both. Left out: downloading configs from the hub (local paths only).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Mapping, Union

if TYPE_CHECKING:
    import transformers

# Fields transformers renamed in a config.json (its config classes' ``attribute_map``): either name may appear.
FIELD_ALIASES = {"num_experts": "num_local_experts"}  # Qwen3-MoE: transformers 5 writes num_local_experts
_ABSENT = object()


def config_field(data: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """``data[name]`` (or its renamed twin) when set, else ``default``."""
    for key in (name, FIELD_ALIASES.get(name)):
        if key is not None and data.get(key) is not None:
            return data[key]
    return default


class ConfigFields:
    """A config.json's fields as attributes (``getattr(fields, key, default)``), with no defaults of its own.

    transformers fills a field a config leaves out with its class default; here it stays absent, so a reader's
    own default applies. That can change a shape (DeepSeek-V3's ``q_lora_rank``) or a value (Qwen3-MoE's
    ``norm_topk_prob``): fine for planning a checkpoint's keys and shapes, which the converters check against
    every tensor they read ("config and weights do not match"), never for a model that computes."""

    def __init__(self, data: dict):
        self._data = dict(data)

    def to_dict(self) -> dict:
        """The fields as config.json holds them (transformers' configs have the same method)."""
        return dict(self._data)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = config_field(self._data, name, _ABSENT)
        if value is _ABSENT:
            raise AttributeError(f"config.json has no {name!r}")
        if name.endswith("_config") and isinstance(value, dict):  # a section (text_config, vision_config)
            return ConfigFields(value)
        return value


HFConfigLike = Union["transformers.PretrainedConfig", ConfigFields, dict, str, os.PathLike]


def load_hf_config(source: HFConfigLike) -> "transformers.PretrainedConfig | ConfigFields":
    """``source`` as a transformers config; a :class:`ConfigFields` is returned as it is."""
    if isinstance(source, ConfigFields):
        return source
    # imported here, not above: transformers costs seconds to import, and a process that only moves tensors
    # (a conversion worker) reaches this module without needing it
    import transformers

    if isinstance(source, transformers.PretrainedConfig):
        return source
    if isinstance(source, dict):
        data = dict(source)
        model_type = data.pop("model_type", None)
        if not model_type:
            raise ValueError("HF config dict has no 'model_type'")
        return transformers.AutoConfig.for_model(model_type, **data)
    path = os.fspath(source)
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"no HF config at {config_file}")
    with open(config_file) as handle:
        data = json.load(handle)
    return load_hf_config(data)


def architecture_name(hf: "transformers.PretrainedConfig") -> str:
    archs = getattr(hf, "architectures", None) or []
    if len(archs) != 1:
        raise ValueError(f"HF config must name exactly one entry in 'architectures', got {archs!r}")
    return archs[0]


def read_rope(hf: Any) -> dict[str, Any]:
    """``{"rope_theta": float, "rope_type": str, ...type-specific fields}``; rope_type 'default' if unscaled."""
    params = getattr(hf, "rope_parameters", None)
    if params:
        rope = dict(params)
    else:
        rope = dict(getattr(hf, "rope_scaling", None) or {})
        rope["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
    rope_type = rope.pop("type", None) or rope.get("rope_type") or "default"
    rope["rope_type"] = rope_type
    if "rope_theta" not in rope:
        rope["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
    return rope


def as_checkpoint_names(model, tensors: dict) -> dict:
    """``tensors`` (``model``'s, by their in-memory names) by the names a checkpoint gives them: transformers 5
    renames some in memory (Qwen2.5-VL's ``model.language_model.*`` is ``model.*`` on disk) and fuses others (MoE
    experts), and reverting gives the checkpoint's; transformers 4 keeps them as on disk."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    return revert_weight_conversion(model, tensors)


def is_vision_language(hf: Any) -> bool:
    """Whether a config describes a vision-language model (a ``vision_config`` beside its text model)."""
    return getattr(hf, "vision_config", None) is not None


def auto_model_class(hf: Any):
    """transformers' auto class that builds ``hf``'s generating model: image-text-to-text for a vision-language
    config (``AutoModelForCausalLM`` refuses those), causal LM otherwise."""
    import transformers

    return transformers.AutoModelForImageTextToText if is_vision_language(hf) else transformers.AutoModelForCausalLM
