"""actor_rollout_ref.rollout.multi_turn config checks name the key and what it needs; a bad tools file or
parser is named when the run builds them."""

from pathlib import Path

import pytest

from megarl.config import ConfigError
from megarl.run_config import load_config
from megarl.config.paths import with_absolute_paths
from tests.paths import REPO

KEY = "actor_rollout_ref.rollout.multi_turn"
ON = [f"{KEY}.enable=true", f"{KEY}.tool_config_path=configs/tools/calculator_python.yaml"]


@pytest.mark.parametrize("overrides, message", [
    ([f"{KEY}.enable=true"], rf"{KEY}.enable=true needs {KEY}.tool_config_path"),
    (ON + [f"{KEY}.format=qwen"], r"format='qwen' is neither 'hermes' nor a module.Class"),
    (ON + [f"{KEY}.tool_response_truncate_side=top"], r"tool_response_truncate_side='top' is not one of"),
    (ON + [f"{KEY}.max_parallel_calls=0"], rf"{KEY}.max_parallel_calls must be > 0"),
    (ON + [f"{KEY}.max_assistant_turns=0"], rf"{KEY}.max_assistant_turns must be > 0"),
    (ON + [f"{KEY}.max_tokens_per_turn=-1"], rf"{KEY}.max_tokens_per_turn must be > 0"),
    (ON + ["data.apply_chat_template=false"], r"needs data.apply_chat_template=true"),
    (ON + ["actor_rollout_ref.rollout.ignore_eos=true"], r"ignore_eos=true would never end one"),
    (ON + ["trainer.placement=separate", "trainer.n_gpus_per_node=2", "trainer.rollout_gpus=1",
           "async_training.mode=fully_async"], r"fully_async is not supported"),
    ([f"{KEY}.max_turns=3"], r"max_turns"),  # not a key (verl's are max_assistant_turns / max_user_turns)
])
def test_multi_turn_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs" / "grpo_tiny.yaml", overrides)


def test_multi_turn_defaults_and_relative_tools_file():
    cfg = load_config(REPO / "configs" / "grpo_tiny.yaml", ON)
    m = cfg.actor_rollout_ref.rollout.multi_turn
    assert (m.format, m.max_parallel_calls, m.max_tool_response_length, m.max_assistant_turns) == ("hermes", 1, 256, None)
    absolute = with_absolute_paths(cfg, REPO).actor_rollout_ref.rollout.multi_turn.tool_config_path
    assert absolute == str(REPO / "configs" / "tools" / "calculator_python.yaml")


def test_the_tool_recipe_validates():
    cfg = load_config(REPO / "configs" / "qwen2_5_7b_gsm8k_tools_grpo.yaml")
    m = cfg.actor_rollout_ref.rollout.multi_turn
    assert m.enable and m.format == "hermes" and m.max_assistant_turns == 5
    assert Path(REPO / m.tool_config_path).is_file()
