"""verl's config surface: every key of verl 0.9.1's ppo_trainer / ppo_megatron_trainer configs is megarl's own (with
verl's meaning) or refused with the reason and megarl's way; all of a command's bad keys are reported at once; every
key a reason points to exists; docs/verl_keys.md is the module's table and the README's rows are rows of it."""

import dataclasses
import re
import types
import typing

import pytest

from megarl.config import ConfigError, MegarlConfig
from megarl.config.verl_keys import FULL, LEAF, SEGMENT, explain, markdown_table
from megarl.run_config import load_config
from tests.paths import REPO

VERL_KEYS = [line for line in (REPO / "tests" / "unit" / "config" / "verl_0_9_1_keys.txt").read_text().splitlines()
             if line and not line.startswith("#")]


def megarl_has(key: str) -> bool:
    """The key is in megarl's schema: anything below a free dict-valued field (megatron's override_* ones) is
    taken, a dict of sections (distillation.teacher_models.<name>) takes any name and checks the rest, and
    nothing is taken below a plain value (``policy_loss.dro_beta`` when policy_loss was a string)."""
    cls, parts = MegarlConfig, key.split(".")
    index = 0
    while index < len(parts):
        if not dataclasses.is_dataclass(cls):
            if typing.get_origin(cls) is not dict:
                return False
            entry = (typing.get_args(cls) or (str, typing.Any))[1]
            if not dataclasses.is_dataclass(entry):
                return True
            cls, index = entry, index + 1  # the entry's name
            continue
        part = parts[index]
        if part not in {f.name for f in dataclasses.fields(cls)}:
            return False
        hint = typing.get_type_hints(cls)[part]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # Optional[X]: X
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        cls, index = hint, index + 1
    return True


OLDER_VERL = ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
              "trainer.use_v1", "trainer.validation_data_dir")


def test_every_verl_key_is_megarls_or_explained():
    assert len(VERL_KEYS) > 900
    unanswered = [key for key in VERL_KEYS if not megarl_has(key) and explain(key) is None]
    assert unanswered == []
    taken = [key for key in VERL_KEYS if megarl_has(key)]
    assert len(taken) > 150  # verl's names where megarl has the feature


def test_every_entry_answers_some_verl_key():
    refused = [key for key in VERL_KEYS if not megarl_has(key)]
    for prefix in FULL:
        # or a key of an older verl that users' scripts still carry
        assert any(k == prefix or k.startswith(prefix + ".") for k in refused) or prefix in OLDER_VERL, prefix
    for leaf in LEAF:
        assert any(k.rsplit(".", 1)[-1] == leaf for k in refused), leaf
    for segment in SEGMENT:
        assert any(f".{segment}." in f".{k}" for k in refused), segment


def test_a_command_of_refused_verl_keys_gets_every_reason_at_once():
    sample = ["custom_reward_function.path", "actor_rollout_ref.model.external_lib", "actor_rollout_ref.model.trust_remote_code",
              "actor_rollout_ref.actor.profiler.enable", "critic.optim.betas", "actor_rollout_ref.actor.optim.muon_momentum",
              "actor_rollout_ref.ref.megatron.tensor_model_parallel_size",
              "distillation.teacher_models.teacher_model.inference.name",
              "actor_rollout_ref.rollout.update_weights_bucket_megabytes"]
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"{key}=1" for key in sample] + ["actor_rollout_ref.rollout.tempreature=0.5"])
    text = str(caught.value)
    assert text.startswith(f"{len(sample) + 1} config keys refused on the command line")
    for key in sample:
        assert f"{key!r} is a verl key that megarl does not take: {explain(key)}" in text
    assert "'temperature'" in text


def test_the_keys_the_reasons_name_exist():
    reasons = list(FULL.values()) + list(LEAF.values()) + list(SEGMENT.values())
    named = {m for reason in reasons
             for m in re.findall(r"\b((?:actor_rollout_ref|reward_model|trainer|async_training|critic|data|algorithm)"
                                 r"\.[a-z_.0-9]+[a-z0-9])", reason)}
    assert len(named) > 20
    for key in named:
        node = MegarlConfig()
        for part in key.split("."):
            assert hasattr(node, part), f"a reason points to {key!r}, which megarl does not have"
            node = getattr(node, part)


def test_docs_table_is_this_table_and_the_readme_rows_are_its_rows():
    assert (REPO / "docs" / "verl_keys.md").read_text() == markdown_table()
    rows = set(markdown_table().splitlines())
    readme = (REPO / "README.md").read_text()
    start = readme.index("| verl key | in megarl |")
    readme_rows = [line for line in readme[start:].splitlines()[2:] if line.startswith("| `")]
    assert len(readme_rows) >= 10
    for line in readme_rows:
        assert line in rows, line


def test_override_transformer_config_is_verls_key_over_megarls_own():
    from megarl.controller.engine_specs import transformer_overrides

    prefix = "actor_rollout_ref.actor.megatron.override_transformer_config"
    cfg = load_config(None, [f"{prefix}.recompute_granularity=full", f"{prefix}.recompute_num_layers=2",
                             f"{prefix}.attention_backend=local"])
    overrides = transformer_overrides(cfg.actor_rollout_ref.actor.megatron)
    assert overrides["recompute_granularity"] == "full" and overrides["recompute_num_layers"] == 2
    assert overrides["recompute_method"] == "uniform"  # megarl's default for full recompute, under verl's keys
    assert overrides["attention_backend"].name == "local"
    with pytest.raises(ConfigError, match=r"override_transformer_config.recompute_granulrity: .* \(did you mean "
                                          r"'recompute_granularity'\?\)"):
        load_config(None, [f"{prefix}.recompute_granulrity=full"])
