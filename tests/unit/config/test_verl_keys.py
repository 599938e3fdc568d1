"""verl keys megarl does not take are refused with verl's reason and megarl's way, all of a command's bad keys at
once; every key the reasons point to exists; the README's table is the module's table."""

import re

import pytest

from megarl.config import ConfigError, MegarlConfig
from megarl.config.verl_keys import FULL, LEAF
from megarl.run_config import load_config
from tests.paths import REPO

LEAF_EXAMPLES = {"enable_gradient_checkpointing": "actor_rollout_ref.model.enable_gradient_checkpointing",
                 "use_remove_padding": "actor_rollout_ref.model.use_remove_padding",
                 "use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
                 "trust_remote_code": "actor_rollout_ref.model.trust_remote_code",
                 "use_mbridge": "actor_rollout_ref.actor.megatron.use_mbridge"}


@pytest.mark.parametrize("key", sorted(FULL) + sorted(LEAF_EXAMPLES.values()))
def test_each_verl_key_is_refused_with_its_reason(key):
    reason = FULL.get(key) or LEAF[key.rsplit(".", 1)[-1]]
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"{key}=1"])
    assert f"{key!r} is a verl key that megarl does not take: {reason}" in str(caught.value)


def test_the_leaf_table_has_an_example_each():
    assert set(LEAF_EXAMPLES) == set(LEAF)


def test_the_keys_the_reasons_name_exist():
    named = {m for reason in list(FULL.values()) + list(LEAF.values())
             for m in re.findall(r"\b((?:actor_rollout_ref|reward_model|trainer|async_training|critic|data)\.[a-z_.]+[a-z])",
                                 reason)}
    assert named
    for key in named:
        node = MegarlConfig()
        for part in key.split("."):
            assert hasattr(node, part), f"a reason points to {key!r}, which megarl does not have"
            node = getattr(node, part)


def test_every_bad_key_of_a_command_is_reported_at_once():
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["custom_reward_function.path=r.py", "trainer.critic_warmup=0",
                           "actor_rollout_ref.rollout.tempreature=0.5"])
    text = str(caught.value)
    assert text.startswith("3 config keys refused on the command line")
    assert "custom_reward_function.path" in text and "trainer.critic_warmup" in text and "'temperature'" in text


def test_the_readme_table_is_this_table():
    readme = (REPO / "README.md").read_text()
    for key, reason in FULL.items():
        assert f"| `{key}` | {reason} |" in readme, key
    for leaf, reason in LEAF.items():
        assert f"| `*.{leaf}` | {reason} |" in readme, leaf
