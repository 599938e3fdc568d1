"""LoRA keys as verl spells them: the Megatron block and the FSDP shorthand, target names, refusals."""

import pytest

from megarl.config import ConfigError
from megarl.config.lora import block_lora, model_lora, resolve_targets
from megarl.run_config import load_config
from tests.paths import REPO

TINY = str(REPO / "configs" / "grpo_tiny.yaml")


def test_targets_in_megatron_names_hf_names_or_all_linear():
    assert resolve_targets("all-linear") == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert resolve_targets(["linear_fc2", "linear_qkv"]) == ("linear_qkv", "linear_fc2")
    assert resolve_targets(["q_proj", "k_proj", "v_proj", "down_proj"]) == ("linear_qkv", "linear_fc2")
    with pytest.raises(ConfigError, match=r"names \['q_proj', 'v_proj'\] but not \['k_proj'\].*linear_qkv"):
        resolve_targets(["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="unknown module.*'lm_head'"):
        resolve_targets(["lm_head"])
    with pytest.raises(ConfigError, match="all-linear stands alone"):
        resolve_targets(["all-linear", "o_proj"])


def test_the_block_and_the_shorthand_give_one_lora():
    block = load_config(TINY, ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16"])
    lora = model_lora(block.actor_rollout_ref.model)
    assert (lora.rank, lora.alpha, lora.merge) == (8, 16.0, None)
    short = load_config(TINY, ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                               "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj]"])
    lora = model_lora(short.actor_rollout_ref.model)
    assert (lora.rank, lora.alpha, resolve_targets(lora.target_modules)) == (4, 8.0, ("linear_qkv",))
    assert model_lora(load_config(TINY).actor_rollout_ref.model) is None


def test_refusals_name_the_key():
    with pytest.raises(ConfigError, match="lora.rank=8 and .*lora_rank=4 both ask for LoRA"):
        load_config(TINY, ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora_rank=4"])
    with pytest.raises(ConfigError, match="lora.type='dora'"):
        load_config(TINY, ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.type=dora"])
    with pytest.raises(ConfigError, match="merge=false .* needs trainer.placement=colocate"):
        load_config(TINY, ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.merge=false",
                           "trainer.placement=separate", "trainer.n_gpus_per_node=2", "trainer.rollout_gpus=1"])
    with pytest.raises(ConfigError, match="critic.model.lora.rank must be >= 0"):
        block_lora(load_config(TINY, ["critic.model.lora.rank=-1"]).critic.model.lora, "critic.model.lora")
