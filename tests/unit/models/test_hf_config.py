"""config.json read without transformers (the converters' planning): the same parameters as through
transformers for every tiny architecture as transformers writes it, renamed fields found under either name."""

import json

import pytest

from megarl.models.bridge import ModelBridge
from megarl.models.hf_config import ConfigFields, config_field, load_hf_config
from megarl.models.tiny import TINY_ARCHS, tiny_hf_config
from megarl.models.model_dims import read_model_dims


def saved_config_json(arch: str) -> dict:
    """config.json as transformers writes it (to_json_string: its renamed fields, its RoPE layout)."""
    return json.loads(tiny_hf_config(arch).to_json_string())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_the_bridge_plans_the_same_parameters_from_config_json_as_from_transformers(arch):
    data = saved_config_json(arch)
    through_transformers = ModelBridge.from_hf_config(load_hf_config(dict(data)), spec="local")
    from_fields = ModelBridge.from_hf_config(ConfigFields(data), spec="local")
    assert from_fields.dims == through_transformers.dims
    names = list(through_transformers.iter_global_mcore_names())
    assert list(from_fields.iter_global_mcore_names()) == names
    assert [from_fields.hf_names_for(n) for n in names] == [through_transformers.hf_names_for(n) for n in names]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_the_bridge_and_the_planner_read_one_model(arch):
    """The planner reads config.json as a dict, the bridge through transformers: the same ModelDims."""
    data = saved_config_json(arch)
    bridge = ModelBridge.from_hf_config(load_hf_config(dict(data)), spec="local")
    assert bridge.dims == read_model_dims(data)
    assert bridge.dims.num_experts == (data.get("n_routed_experts") or data.get("num_local_experts") or 0)


def test_a_renamed_field_is_found_under_either_name():
    data = saved_config_json("qwen3_moe")
    assert "num_experts" not in data and data["num_local_experts"] > 0  # what transformers 5 writes
    assert ConfigFields(data).num_experts == data["num_local_experts"]
    assert config_field({"num_experts": 4}, "num_experts") == 4
    older = {key: value for key, value in data.items() if key != "num_local_experts"}
    older["num_experts"] = data["num_local_experts"]  # what transformers 4 wrote
    assert read_model_dims(older) == read_model_dims(data)


def test_absent_fields_take_the_readers_default():
    fields = ConfigFields({"hidden_size": 8, "q_lora_rank": None})
    assert fields.hidden_size == 8
    assert getattr(fields, "rms_norm_eps", 1e-5) == 1e-5
    assert getattr(fields, "q_lora_rank", "unset") == "unset"  # null in the file: absent, like transformers' None
    with pytest.raises(AttributeError, match="config.json has no 'vocab_size'"):
        fields.vocab_size
